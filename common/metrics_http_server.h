// A minimal HTTP endpoint serving a Prometheus registry at GET /metrics (text format 0.0.4),
// for processes that have no HTTP server of their own (the worker). One connection at a time:
// scrapes are rare and small.
#ifndef MOBIUS_COMMON_METRICS_HTTP_SERVER_H_
#define MOBIUS_COMMON_METRICS_HTTP_SERVER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace mobius {

class MetricsHttpServer {
 public:
  // GET path -> a JSON document, served beside /metrics (e.g. the worker's /expert_load).
  using JsonRoutes = std::map<std::string, std::function<std::string()>>;
  // POST path -> (HTTP status, JSON document) for the request body: actions on request (e.g. the
  // worker's /expert_placement). The server answers one connection at a time, so a long action
  // delays scrapes until it is done.
  struct JsonResponse {
    int status = 200;
    std::string body;
  };
  using PostRoutes = std::map<std::string, std::function<JsonResponse(const std::string& body)>>;
  // Binds host:port (0 picks a free port) and serves until destroyed.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, std::shared_ptr<prometheus::Registry> registry,
      JsonRoutes json_routes = {}, PostRoutes post_routes = {});
  virtual ~MetricsHttpServer() = default;
  [[nodiscard]] virtual int port() const = 0;
};

}  // namespace mobius

#endif  // MOBIUS_COMMON_METRICS_HTTP_SERVER_H_
