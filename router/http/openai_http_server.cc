// The HTTP transport: Asio I/O threads accept connections and read requests; each request is
// answered by OpenAiApi on a thread of its own (InferenceService::Generate blocks for the life
// of the request), which hands its bytes back to the connection's strand and waits for them to
// be written. While a request runs, one read stays pending on its socket so that a client that
// goes away (EOF or reset) cancels the request even when no bytes are being written.
#include "router/http/openai_http_server.h"

#include <array>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "router/http/openai_handlers.h"
#include "router/http/openai_response.h"

namespace mobius::router {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

// Idle keep-alive connections, and clients that send a request too slowly, are dropped after this.
constexpr auto kReadTimeout = std::chrono::seconds(60);
// A write that makes no progress for this long (a client that stopped reading) ends the
// connection, which cancels its request.
constexpr auto kWriteTimeout = std::chrono::seconds(60);
// After a response that closes the connection, unread input is drained this long so that the
// client sees the response rather than a reset (413 before the body arrived, for example).
constexpr auto kLingerTimeout = std::chrono::seconds(2);
// Input a client pipelines while its request runs is buffered up to this size; beyond it the
// connection is no longer watched for EOF until the request ends.
constexpr size_t kMaxBufferedInput = 64 << 10;
constexpr size_t kWatchReadSize = 4096;

class ServerImpl;
class Connection;

using WriteDone = std::function<void(beast::error_code)>;

// One request's ResponseSink: the handler thread's view of the connection.
class Exchange : public openai::ResponseSink {
 public:
  Exchange(std::shared_ptr<Connection> connection, unsigned version, bool keep_alive)
      : connection_(std::move(connection)), version_(version), keep_alive_(keep_alive) {}

  void Send(openai::HttpResponse response) override;
  bool StartStream(openai::HttpResponseHeader header) override;
  bool Write(std::string data) override;
  void EndStream(bool close) override;
  [[nodiscard]] const std::atomic<bool>& cancelled() const override { return cancelled_; }

  void Cancel() { cancelled_.store(true); }

 private:
  std::shared_ptr<Connection> connection_;
  const unsigned version_;
  const bool keep_alive_;
  bool chunked_ = false;  // HTTP/1.1 streams are chunked; HTTP/1.0 ones end with the connection
  std::atomic<bool> cancelled_{false};
};

class ServerImpl final : public OpenAiHttpServer {
 public:
  ServerImpl(InferenceService& service, const HttpServerOptions& options)
      : options_(options),
        api_(service, options),
        acceptor_(net::make_strand(ioc_)),
        work_(net::make_work_guard(ioc_)) {}
  ~ServerImpl() override { Shutdown(absl::ZeroDuration()); }

  absl::Status Listen();
  void Run();

  [[nodiscard]] int port() const override { return port_; }
  void Shutdown(absl::Duration grace) override;

  [[nodiscard]] const HttpServerOptions& options() const { return options_; }
  [[nodiscard]] bool stopping() const { return stopping_.load(); }
  // Runs `request` through the API on a thread of its own; UNAVAILABLE (nothing run) when
  // stopping or out of threads.
  absl::Status Dispatch(std::shared_ptr<Exchange> exchange, openai::HttpRequest request);
  void Unregister(Connection* connection);

 private:
  void Accept();
  void OnAccept(beast::error_code ec, tcp::socket socket);
  void ForEachConnection(const std::function<void(Connection&)>& fn);

  const HttpServerOptions options_;
  openai::OpenAiApi api_;

  absl::Mutex mu_;
  std::unordered_map<Connection*, std::weak_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  int handlers_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopping_{false};

  // Declared after the state above: destroying the io_context destroys the connections, which
  // unregister themselves.
  net::io_context ioc_;
  tcp::acceptor acceptor_;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work_;
  std::vector<std::thread> threads_;
  int port_ = 0;
};

// One client connection. Everything but the constructor and WriteAndWait runs on its strand.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, ServerImpl& server)
      : stream_(std::move(socket)), server_(server) {}
  ~Connection() { server_.Unregister(this); }

  void Start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->ReadRequest(); });
  }

  // From another thread: runs `op` (which starts a write and calls `done`) on the strand and
  // blocks until the write completes. False when it failed.
  bool WriteAndWait(std::function<void(beast::tcp_stream&, WriteDone)> op) {
    auto promise = std::make_shared<std::promise<beast::error_code>>();
    std::future<beast::error_code> written = promise->get_future();
    net::post(stream_.get_executor(), [self = shared_from_this(), op = std::move(op), promise] {
      if (self->closed_) return promise->set_value(net::error::not_connected);
      self->stream_.expires_after(kWriteTimeout);
      op(self->stream_, [promise](beast::error_code ec) { promise->set_value(ec); });
    });
    return !written.get();
  }

  // From the handler thread: the exchange's last bytes.
  void PostResponse(std::shared_ptr<openai::HttpResponse> response) {
    net::post(stream_.get_executor(), [self = shared_from_this(), response = std::move(response)] {
      self->WriteResponse(response);
    });
  }
  void PostEndStream(bool chunked, bool close) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), chunked, close] { self->EndStream(chunked, close); });
  }

  // Shutdown: drop connections between requests now, and the others when the grace is over.
  void PostCloseIfIdle() {
    net::post(stream_.get_executor(), [self = shared_from_this()] {
      if (self->exchange_ == nullptr) self->Close();
    });
  }
  void PostAbort() {
    net::post(stream_.get_executor(), [self = shared_from_this()] {
      if (self->exchange_ != nullptr) self->exchange_->Cancel();
      self->Close();
    });
  }

 private:
  void ReadRequest() {
    if (closed_) return;
    if (server_.stopping()) return Close();
    parser_.emplace();
    parser_->body_limit(server_.options().max_body_bytes);
    stream_.expires_after(kReadTimeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            beast::bind_front_handler(&Connection::OnHeader, shared_from_this()));
  }

  void OnHeader(beast::error_code ec, size_t /*bytes*/) {
    if (ec) return OnReadError(ec);
    const openai::HttpRequest& request = parser_->get();
    const beast::string_view expect = request[http::field::expect];
    if (!parser_->is_done() && beast::iequals(expect, "100-continue")) {
      // curl asks before sending bodies over 1 KiB and otherwise waits a second.
      auto interim = std::make_shared<http::response<http::empty_body>>(http::status::continue_,
                                                                        request.version());
      http::async_write(stream_, *interim,
                        [self = shared_from_this(), interim](beast::error_code ec, size_t) {
                          if (ec) return self->Close();
                          self->ReadBody();
                        });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    stream_.expires_after(kReadTimeout);
    http::async_read(stream_, buffer_, *parser_,
                     beast::bind_front_handler(&Connection::OnRequest, shared_from_this()));
  }

  void OnReadError(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      return RefuseRequest(
          http::status::payload_too_large,
          absl::StrCat("request body exceeds ", server_.options().max_body_bytes, " bytes"));
    }
    if (ec == http::error::header_limit) {
      return RefuseRequest(http::status::request_header_fields_too_large,
                           "request header fields too large");
    }
    if (ec.category() == beast::error_code(http::error::end_of_stream).category() &&
        ec != http::error::end_of_stream && ec != http::error::partial_message) {
      return RefuseRequest(http::status::bad_request,
                           absl::StrCat("malformed HTTP request: ", ec.message()));
    }
    Close();  // EOF, reset, timeout, or the server is closing it
  }

  // Answers a request that could not be read whole, then closes.
  void RefuseRequest(http::status status, absl::string_view message) {
    auto response = std::make_shared<openai::HttpResponse>(status, 11);
    response->set(http::field::content_type, "application/json");
    response->body() = openai::ErrorBody(message, "invalid_request_error");
    response->keep_alive(false);
    response->prepare_payload();
    stream_.expires_after(kWriteTimeout);
    http::async_write(stream_, *response,
                      [self = shared_from_this(), response](beast::error_code ec, size_t) {
                        if (ec) return self->Close();
                        self->LingeringClose();
                      });
  }

  void OnRequest(beast::error_code ec, size_t /*bytes*/) {
    if (ec) return OnReadError(ec);
    openai::HttpRequest request = parser_->release();
    parser_.reset();
    auto exchange =
        std::make_shared<Exchange>(shared_from_this(), request.version(), request.keep_alive());
    exchange_ = exchange;
    stream_.expires_never();
    Watch();
    const unsigned version = request.version();
    if (absl::Status status = server_.Dispatch(exchange, std::move(request)); !status.ok()) {
      auto response =
          std::make_shared<openai::HttpResponse>(http::status::service_unavailable, version);
      response->set(http::field::content_type, "application/json");
      response->body() = openai::ErrorBody(status.message(), "service_unavailable_error");
      response->keep_alive(false);
      response->prepare_payload();
      WriteResponse(response);
    }
  }

  // Keeps one read pending while a request runs: EOF or an error means the client is gone.
  void Watch() {
    if (watching_ || closed_ || buffer_.size() >= kMaxBufferedInput) return;
    watching_ = true;
    stream_.socket().async_read_some(
        buffer_.prepare(kWatchReadSize),
        beast::bind_front_handler(&Connection::OnWatch, shared_from_this()));
  }

  void OnWatch(beast::error_code ec, size_t bytes) {
    watching_ = false;
    if (!ec) buffer_.commit(bytes);  // a pipelined request, read once this one is answered
    if (exchange_ != nullptr) {
      if (!ec) return Watch();
      peer_gone_ = true;
      exchange_->Cancel();
      return;
    }
    if (ec && ec != net::error::operation_aborted) peer_gone_ = true;
    std::function<void()> next = std::move(after_watch_);
    after_watch_ = nullptr;
    if (next) next();
  }

  // Ends the watch read (if any), then runs `next`.
  void StopWatchThen(std::function<void()> next) {
    if (!watching_) return next();
    after_watch_ = std::move(next);
    beast::error_code ignored;
    stream_.socket().cancel(ignored);
  }

  void WriteResponse(std::shared_ptr<openai::HttpResponse> response) {
    if (closed_) return Finished();
    response->keep_alive(response->keep_alive() && !peer_gone_ && !server_.stopping());
    stream_.expires_after(kWriteTimeout);
    http::async_write(stream_, *response,
                      [self = shared_from_this(), response](beast::error_code ec, size_t) {
                        self->AfterExchange(ec, !response->keep_alive());
                      });
  }

  void EndStream(bool chunked, bool close) {
    if (closed_) return Finished();
    if (!chunked) return AfterExchange({}, /*close=*/true);
    auto last = std::make_shared<http::chunk_last<http::chunk_crlf>>(http::make_chunk_last());
    stream_.expires_after(kWriteTimeout);
    net::async_write(stream_, *last,
                     [self = shared_from_this(), last, close](beast::error_code ec, size_t) {
                       self->AfterExchange(ec, close);
                     });
  }

  // The exchange is over (its handler has returned or is returning).
  void Finished() { exchange_.reset(); }

  void AfterExchange(beast::error_code ec, bool close) {
    Finished();
    if (ec) return Close();
    if (close || peer_gone_ || server_.stopping()) {
      return StopWatchThen([self = shared_from_this()] { self->LingeringClose(); });
    }
    StopWatchThen([self = shared_from_this()] {
      if (self->peer_gone_) return self->Close();
      self->ReadRequest();
    });
  }

  // Half-closes, then drains the client's input for a while before closing.
  void LingeringClose() {
    if (closed_) return;
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(kLingerTimeout);
    Drain();
  }
  void Drain() {
    stream_.async_read_some(net::buffer(drain_),
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                              if (ec) return self->Close();
                              self->Drain();
                            });
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    if (exchange_ != nullptr) exchange_->Cancel();
    stream_.close();
  }

  beast::tcp_stream stream_;
  ServerImpl& server_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::shared_ptr<Exchange> exchange_;  // the request being answered
  bool watching_ = false;
  std::function<void()> after_watch_;
  bool peer_gone_ = false;
  bool closed_ = false;
  std::array<char, 4096> drain_;
};

void Exchange::Send(openai::HttpResponse response) {
  connection_->PostResponse(std::make_shared<openai::HttpResponse>(std::move(response)));
}

bool Exchange::StartStream(openai::HttpResponseHeader header) {
  chunked_ = version_ >= 11;
  auto message = std::make_shared<http::response<http::empty_body>>(std::move(header));
  message->version(version_);
  message->keep_alive(chunked_ && keep_alive_);
  if (chunked_) message->chunked(true);
  const bool ok = connection_->WriteAndWait([message](beast::tcp_stream& stream, WriteDone done) {
    auto serializer = std::make_shared<http::response_serializer<http::empty_body>>(*message);
    http::async_write_header(
        stream, *serializer,
        [message, serializer, done](beast::error_code ec, size_t) { done(ec); });
  });
  if (!ok) Cancel();
  return ok;
}

bool Exchange::Write(std::string data) {
  auto bytes = std::make_shared<std::string>(std::move(data));
  const bool chunked = chunked_;
  const bool ok =
      connection_->WriteAndWait([bytes, chunked](beast::tcp_stream& stream, WriteDone done) {
        auto on_written = [bytes, done](beast::error_code ec, size_t) { done(ec); };
        if (chunked) {
          net::async_write(stream, http::make_chunk(net::buffer(*bytes)), on_written);
        } else {
          net::async_write(stream, net::buffer(*bytes), on_written);
        }
      });
  if (!ok) Cancel();
  return ok;
}

void Exchange::EndStream(bool close) {
  connection_->PostEndStream(chunked_, close || !keep_alive_);
}

absl::Status ServerImpl::Listen() {
  beast::error_code ec;
  tcp::resolver resolver(ioc_);
  const tcp::resolver::results_type endpoints =
      resolver.resolve(options_.host, std::to_string(options_.port), tcp::resolver::passive, ec);
  if (ec || endpoints.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve host \"", options_.host, "\": ", ec.message()));
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  const std::string where = absl::StrCat(options_.host, ":", options_.port);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot bind ", where, ": ", ec.message()));
  acceptor_.listen(net::socket_base::max_listen_connections, ec);
  if (ec)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", where, ": ", ec.message()));
  port_ = acceptor_.local_endpoint(ec).port();
  return absl::OkStatus();
}

void ServerImpl::Run() {
  Accept();
  const int threads = std::max(options_.num_threads, 1);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { ioc_.run(); });
}

void ServerImpl::Accept() {
  acceptor_.async_accept(net::make_strand(ioc_),
                         beast::bind_front_handler(&ServerImpl::OnAccept, this));
}

void ServerImpl::OnAccept(beast::error_code ec, tcp::socket socket) {
  if (!acceptor_.is_open()) return;
  if (!ec) {
    beast::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);  // streamed tokens go out at once
    auto connection = std::make_shared<Connection>(std::move(socket), *this);
    bool accepted = false;
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_.load()) {
        connections_.emplace(connection.get(), connection);
        accepted = true;
      }
    }
    if (accepted) connection->Start();
  }
  Accept();  // after an error too (EMFILE and the like pass)
}

void ServerImpl::Unregister(Connection* connection) {
  absl::MutexLock lock(&mu_);
  connections_.erase(connection);
}

absl::Status ServerImpl::Dispatch(std::shared_ptr<Exchange> exchange, openai::HttpRequest request) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_.load()) return absl::UnavailableError("the server is shutting down");
    ++handlers_in_flight_;
  }
  auto handle = [this, exchange = std::move(exchange), request = std::move(request)]() mutable {
    api_.Handle(request, *exchange);
    // Nothing that refers to the server may outlive the count below: Shutdown waits for it.
    exchange.reset();
    absl::MutexLock lock(&mu_);
    --handlers_in_flight_;
  };
  // std::thread reports a failure to start one (a thread limit reached) only by throwing.
  try {
    std::thread(std::move(handle)).detach();
  } catch (const std::system_error& e) {
    absl::MutexLock lock(&mu_);
    --handlers_in_flight_;
    return absl::UnavailableError(
        absl::StrCat("cannot start a thread for the request: ", e.what()));
  }
  return absl::OkStatus();
}

void ServerImpl::ForEachConnection(const std::function<void(Connection&)>& fn) {
  std::vector<std::shared_ptr<Connection>> live;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [raw, weak] : connections_) {
      if (std::shared_ptr<Connection> connection = weak.lock()) live.push_back(connection);
    }
  }
  for (const std::shared_ptr<Connection>& connection : live) fn(*connection);
}

void ServerImpl::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    stopping_.store(true);
  }
  net::post(acceptor_.get_executor(), [this] {
    beast::error_code ignored;
    acceptor_.close(ignored);
  });
  ForEachConnection([](Connection& connection) { connection.PostCloseIfIdle(); });

  auto none_in_flight = [this]()
                            ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return handlers_in_flight_ == 0; };
  bool drained = false;
  {
    absl::MutexLock lock(&mu_);
    drained = mu_.AwaitWithTimeout(absl::Condition(&none_in_flight), grace);
  }
  if (!drained) {
    // Cancelled requests end within one engine step; their handlers then find the socket closed.
    ForEachConnection([](Connection& connection) { connection.PostAbort(); });
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&none_in_flight));
  }
  // Responses already handed over get kLingerTimeout to leave.
  {
    absl::MutexLock lock(&mu_);
    auto no_connections = [this]()
                              ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return connections_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&no_connections),
                         absl::FromChrono(kLingerTimeout) + absl::Milliseconds(100));
  }
  work_.reset();
  ioc_.stop();
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
}

}  // namespace

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    InferenceService& service, const HttpServerOptions& options) {
  auto server = std::make_unique<ServerImpl>(service, options);
  if (absl::Status status = server->Listen(); !status.ok()) return status;
  server->Run();
  return server;
}

}  // namespace mobius::router
