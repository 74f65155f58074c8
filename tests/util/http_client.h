// A blocking HTTP/1.1 client for process tests (Boost.Beast over loopback): whole requests, and
// server-sent event streams read event by event, which a test may abandon mid-stream by closing
// the connection (a client disconnect).
#ifndef MOBIUS_TESTS_UTIL_HTTP_CLIENT_H_
#define MOBIUS_TESTS_UTIL_HTTP_CLIENT_H_

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace mobius::testing {

struct HttpReply {
  int status = 0;  // 0: no response (connection failed)
  std::string body;
  boost::beast::http::fields headers;
  [[nodiscard]] std::string header(boost::beast::http::field name) const {
    return std::string(headers[name]);
  }
};

// One request on a connection of its own. `content_type` empty: no Content-Type header.
inline HttpReply HttpCall(int port, boost::beast::http::verb method, const std::string& target,
                          const std::string& body = "",
                          const std::string& content_type = "application/json") {
  namespace http = boost::beast::http;
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::socket socket(ioc);
  boost::beast::error_code ec;
  socket.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)},
                 ec);
  HttpReply reply;
  if (ec) return reply;
  http::request<http::string_body> request(method, target, 11);
  request.set(http::field::host, "127.0.0.1");
  if (!content_type.empty()) request.set(http::field::content_type, content_type);
  request.keep_alive(false);
  request.body() = body;
  request.prepare_payload();
  http::write(socket, request, ec);
  if (ec) return reply;
  boost::beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64 << 20);
  http::read(socket, buffer, parser, ec);
  if (ec && ec != http::error::end_of_stream) return reply;
  reply.status = parser.get().result_int();
  reply.body = parser.get().body();
  reply.headers = parser.get().base();
  return reply;
}

inline HttpReply HttpGet(int port, const std::string& target) {
  return HttpCall(port, boost::beast::http::verb::get, target, "", "");
}

// A POST whose response is read incrementally: the status and headers first, then one SSE
// `data:` payload at a time.
class SseStream {
 public:
  SseStream(int port, const std::string& target, const std::string& json_body) : socket_(ioc_) {
    namespace http = boost::beast::http;
    boost::beast::error_code ec;
    socket_.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)},
                    ec);
    if (ec) return;
    http::request<http::string_body> request(http::verb::post, target, 11);
    request.set(http::field::host, "127.0.0.1");
    request.set(http::field::content_type, "application/json");
    request.body() = json_body;
    request.prepare_payload();
    http::write(socket_, request, ec);
    if (ec) return;
    parser_.body_limit(64 << 20);
    http::read_header(socket_, buffer_, parser_, ec);
    if (ec) return;
    status_ = parser_.get().result_int();
  }

  // The response status; 0 when the request failed.
  [[nodiscard]] int status() const { return status_; }
  [[nodiscard]] const boost::beast::http::fields& headers() const { return parser_.get().base(); }

  // The next event's data, or nullopt at the end of the response (or on a connection error).
  std::optional<std::string> Next() {
    namespace http = boost::beast::http;
    while (true) {
      std::string& body = parser_.get().body();
      const size_t end = body.find("\n\n", consumed_);
      if (end != std::string::npos) {
        std::string event = body.substr(consumed_, end - consumed_);
        consumed_ = end + 2;
        if (event.rfind("data: ", 0) == 0) event.erase(0, 6);
        return event;
      }
      if (status_ == 0 || parser_.is_done()) return std::nullopt;
      boost::beast::error_code ec;
      http::read_some(socket_, buffer_, parser_, ec);
      if (ec) return std::nullopt;
    }
  }

  // The whole body after the header (for responses that are not streams, e.g. errors).
  std::string ReadAll() {
    boost::beast::error_code ec;
    if (status_ != 0 && !parser_.is_done()) {
      boost::beast::http::read(socket_, buffer_, parser_, ec);
    }
    return parser_.get().body();
  }

  // Disconnects at once, as a client that goes away.
  void Close() {
    boost::beast::error_code ec;
    socket_.shutdown(boost::asio::ip::tcp::socket::shutdown_both, ec);
    socket_.close(ec);
  }

 private:
  boost::asio::io_context ioc_;
  boost::asio::ip::tcp::socket socket_;
  boost::beast::flat_buffer buffer_;
  boost::beast::http::response_parser<boost::beast::http::string_body> parser_;
  size_t consumed_ = 0;
  int status_ = 0;
};

}  // namespace mobius::testing

#endif  // MOBIUS_TESTS_UTIL_HTTP_CLIENT_H_
