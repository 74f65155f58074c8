#include "common/metrics_http_server.h"

#include <sys/socket.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "boost/asio.hpp"
#include "boost/beast.hpp"
#include "prometheus/text_serializer.h"

namespace mobius {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

class BeastMetricsServer final : public MetricsHttpServer {
 public:
  BeastMetricsServer(std::shared_ptr<prometheus::Registry> registry, JsonRoutes json_routes,
                     PostRoutes post_routes)
      : registry_(std::move(registry)),
        json_routes_(std::move(json_routes)),
        post_routes_(std::move(post_routes)),
        acceptor_(io_) {}

  ~BeastMetricsServer() override {
    stopping_ = true;
    // Closing a socket does not wake a thread blocked in accept() on Linux; shutting the
    // listening socket down does (accept fails with EINVAL).
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
    boost::system::error_code ec;
    acceptor_.close(ec);
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Bind(const std::string& host, int port) {
    boost::system::error_code ec;
    const auto address = asio::ip::make_address(host, ec);
    if (ec)
      return absl::InvalidArgumentError(
          absl::StrCat("metrics host \"", host, "\": ", ec.message()));
    tcp::endpoint endpoint(address, static_cast<unsigned short>(port));
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve metrics on ", host, ":", port, ": ", ec.message()));
    }
    port_ = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] { Serve(); });
    return absl::OkStatus();
  }

  int port() const override { return port_; }

 private:
  void Serve() {
    while (!stopping_) {
      boost::system::error_code ec;
      tcp::socket socket(io_);
      acceptor_.accept(socket, ec);
      if (ec) {
        if (stopping_) return;
        continue;
      }
      Handle(socket);
    }
  }

  void Handle(tcp::socket& socket) {
    boost::system::error_code ec;
    beast::flat_buffer buffer;
    http::request<http::string_body> request;
    http::read(socket, buffer, request, ec);
    if (ec) return;
    http::response<http::string_body> response;
    response.version(request.version());
    response.keep_alive(false);
    if (auto post = post_routes_.find(std::string(request.target())); post != post_routes_.end()) {
      if (request.method() != http::verb::post) {
        response.result(http::status::method_not_allowed);
        response.set(http::field::allow, "POST");
      } else {
        const JsonResponse answer = post->second(request.body());
        response.result(static_cast<http::status>(answer.status));
        response.set(http::field::content_type, "application/json");
        response.body() = answer.body;
      }
    } else if (request.method() != http::verb::get) {
      response.result(http::status::method_not_allowed);
      response.set(http::field::allow, "GET");
    } else if (auto route = json_routes_.find(std::string(request.target()));
               route != json_routes_.end()) {
      response.result(http::status::ok);
      response.set(http::field::content_type, "application/json");
      response.body() = route->second();
    } else if (request.target() != "/metrics") {
      response.result(http::status::not_found);
      response.body() = "only /metrics is served here\n";
    } else {
      response.result(http::status::ok);
      response.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      response.body() = prometheus::TextSerializer().Serialize(registry_->Collect());
    }
    response.prepare_payload();
    http::write(socket, response, ec);
    socket.shutdown(tcp::socket::shutdown_send, ec);
  }

  std::shared_ptr<prometheus::Registry> registry_;
  const JsonRoutes json_routes_;
  const PostRoutes post_routes_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  int port_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, std::shared_ptr<prometheus::Registry> registry,
    JsonRoutes json_routes, PostRoutes post_routes) {
  auto server = std::make_unique<BeastMetricsServer>(std::move(registry), std::move(json_routes),
                                                     std::move(post_routes));
  if (absl::Status s = server->Bind(host, port); !s.ok()) return s;
  return server;
}

}  // namespace mobius
