#include "bench/serve/http_connection.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <utility>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace mobius::bench {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

// Runs one asynchronous operation to completion on `io` (the calling thread); the stream's
// expiry turns a stall into beast::error::timeout.
template <typename Start>
boost::system::error_code RunOne(asio::io_context& io, Start start) {
  boost::system::error_code result = asio::error::would_block;
  start([&result](boost::system::error_code ec, auto&&...) { result = ec; });
  io.restart();
  io.run();
  return result;
}

absl::Status IoError(absl::string_view what, const boost::system::error_code& ec) {
  const std::string message = absl::StrCat(what, ": ", ec.message());
  if (ec == beast::error::timeout) return absl::DeadlineExceededError(message);
  return absl::UnavailableError(message);
}

}  // namespace

absl::StatusOr<HttpUrl> ParseBaseUrl(absl::string_view url) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--base-url \"", url, "\": ", why));
  };
  if (absl::StartsWith(url, "https://")) {
    return bad("https is not supported; use the server's plain HTTP port");
  }
  if (!absl::StartsWith(url, "http://")) return bad("expected http://HOST[:PORT]");
  absl::string_view rest = url.substr(7);
  const size_t slash = rest.find('/');
  absl::string_view authority = rest.substr(0, slash);
  HttpUrl parsed;
  if (slash != absl::string_view::npos) {
    absl::string_view prefix = rest.substr(slash);
    while (absl::EndsWith(prefix, "/")) prefix.remove_suffix(1);
    parsed.path_prefix = std::string(prefix);
  }
  absl::string_view port;
  if (absl::StartsWith(authority, "[")) {  // [IPv6]:port
    const size_t close = authority.find(']');
    if (close == absl::string_view::npos) return bad("unterminated [IPv6 address]");
    parsed.host = std::string(authority.substr(1, close - 1));
    absl::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (!absl::StartsWith(after, ":")) return bad("expected :PORT after ]");
      port = after.substr(1);
    }
  } else {
    const size_t colon = authority.rfind(':');
    parsed.host = std::string(authority.substr(0, colon));
    if (colon != absl::string_view::npos) port = authority.substr(colon + 1);
  }
  if (parsed.host.empty()) return bad("no host");
  if (!port.empty()) {
    int number = 0;
    if (!absl::SimpleAtoi(port, &number) || number < 1 || number > 65535) {
      return bad(absl::StrCat("port \"", port, "\" is not in 1..65535"));
    }
    parsed.port = std::string(port);
  }
  return parsed;
}

struct HttpConnection::Impl {
  asio::io_context io;
  beast::tcp_stream stream{io};
  beast::flat_buffer buffer;
  std::optional<http::response_parser<http::buffer_body>> parser;
  bool failed = false;
};

HttpConnection::HttpConnection(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpConnection::~HttpConnection() {
  boost::system::error_code ignored;
  impl_->stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
  impl_->stream.close();
}

absl::StatusOr<std::unique_ptr<HttpConnection>> HttpConnection::Connect(const HttpUrl& url,
                                                                        Deadline deadline) {
  auto impl = std::make_unique<Impl>();
  const std::string where = absl::StrCat("connect ", url.host, ":", url.port);
  boost::system::error_code ec;
  tcp::resolver resolver(impl->io);
  const tcp::resolver::results_type endpoints = resolver.resolve(url.host, url.port, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("resolve ", url.host, ": ", ec.message()));
  impl->stream.expires_at(deadline);
  ec = RunOne(impl->io, [&](auto handler) { impl->stream.async_connect(endpoints, handler); });
  if (ec) return IoError(where, ec);
  // Tokens are small writes; without this the kernel may hold a chunk back (Nagle) and the
  // measured inter-token gaps would include the delayed-ACK timer.
  impl->stream.socket().set_option(tcp::no_delay(true), ec);
  std::unique_ptr<HttpConnection> connection(new HttpConnection(std::move(impl)));
  connection->host_header_ = url.HostHeader();
  return connection;
}

absl::Status HttpConnection::Send(absl::string_view method, const std::string& target,
                                  const std::string& body, Deadline deadline) {
  http::request<http::string_body> request(
      http::string_to_verb(beast::string_view(method.data(), method.size())), target, 11);
  request.set(http::field::host, host_header_);
  request.set(http::field::user_agent, "mobius-bench-serve");
  if (!body.empty()) {
    request.set(http::field::content_type, "application/json");
    request.body() = body;
  }
  request.keep_alive(true);
  request.prepare_payload();
  impl_->stream.expires_at(deadline);
  const boost::system::error_code ec =
      RunOne(impl_->io, [&](auto handler) { http::async_write(impl_->stream, request, handler); });
  if (ec) {
    impl_->failed = true;
    return IoError("send request", ec);
  }
  impl_->parser.emplace();
  // A stream is as long as the server makes it. Not boost::none: Boost 1.74 compares a known
  // Content-Length against the empty optional and reports body_limit for every such response.
  impl_->parser->body_limit(std::numeric_limits<std::uint64_t>::max());
  return absl::OkStatus();
}

absl::StatusOr<int> HttpConnection::ReadHeader(Deadline deadline) {
  if (!impl_->parser) return absl::FailedPreconditionError("ReadHeader before Send");
  impl_->stream.expires_at(deadline);
  const boost::system::error_code ec = RunOne(impl_->io, [&](auto handler) {
    http::async_read_header(impl_->stream, impl_->buffer, *impl_->parser, handler);
  });
  if (ec) {
    impl_->failed = true;
    return IoError("read response header", ec);
  }
  return impl_->parser->get().result_int();
}

std::string HttpConnection::ContentType() const {
  if (!impl_->parser) return "";
  const beast::string_view type = impl_->parser->get()[http::field::content_type];
  return std::string(type.data(), type.size());
}

absl::StatusOr<bool> HttpConnection::ReadBody(std::string& out, Deadline deadline) {
  if (!impl_->parser) return absl::FailedPreconditionError("ReadBody before Send");
  if (impl_->parser->is_done()) return false;
  char piece[16384];
  impl_->parser->get().body().data = piece;
  impl_->parser->get().body().size = sizeof(piece);
  impl_->stream.expires_at(deadline);
  boost::system::error_code ec = RunOne(impl_->io, [&](auto handler) {
    http::async_read_some(impl_->stream, impl_->buffer, *impl_->parser, handler);
  });
  if (ec == http::error::need_buffer) ec = {};  // the piece is full; more comes next call
  const size_t got = sizeof(piece) - impl_->parser->get().body().size;
  impl_->parser->get().body().data = nullptr;
  out.append(piece, got);
  if (ec) {
    impl_->failed = true;
    return IoError("read response body", ec);
  }
  return !impl_->parser->is_done() || got > 0;
}

bool HttpConnection::Reusable() const {
  return !impl_->failed && impl_->parser && impl_->parser->is_done() &&
         impl_->parser->get().keep_alive();
}

}  // namespace mobius::bench
