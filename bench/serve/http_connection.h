// One HTTP/1.1 client connection (Boost.Beast) with deadlines on every operation, read body
// piece by piece so that a streamed response can be timed as each piece arrives. Each connection
// runs its own io_context on the calling thread, so that a connection taken from a pool can be
// used by whichever request thread holds it.
#ifndef MOBIUS_BENCH_SERVE_HTTP_CONNECTION_H_
#define MOBIUS_BENCH_SERVE_HTTP_CONNECTION_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mobius::bench {

// http://HOST[:PORT][/PREFIX], as given to --base-url.
struct HttpUrl {
  std::string host;
  std::string port = "80";
  std::string path_prefix;  // without a trailing '/'
  [[nodiscard]] std::string HostHeader() const { return host + ":" + port; }
};

// InvalidArgument naming --base-url for anything but a plain http:// URL.
absl::StatusOr<HttpUrl> ParseBaseUrl(absl::string_view url);

class HttpConnection {
 public:
  using Deadline = std::chrono::steady_clock::time_point;

  // Resolves and connects; UNAVAILABLE ("connect HOST:PORT: <reason>") when that fails,
  // DEADLINE_EXCEEDED when it does not finish in time.
  static absl::StatusOr<std::unique_ptr<HttpConnection>> Connect(const HttpUrl& url,
                                                                 Deadline deadline);
  ~HttpConnection();

  // Writes one request (a JSON body when `body` is not empty).
  absl::Status Send(absl::string_view method, const std::string& target, const std::string& body,
                    Deadline deadline);
  // Reads the response header; the HTTP status code.
  absl::StatusOr<int> ReadHeader(Deadline deadline);
  [[nodiscard]] std::string ContentType() const;
  // Appends the next body bytes to `out` (possibly none); false once the body has ended.
  absl::StatusOr<bool> ReadBody(std::string& out, Deadline deadline);
  // The whole response was read and the server keeps the connection open.
  [[nodiscard]] bool Reusable() const;

 private:
  struct Impl;
  explicit HttpConnection(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string host_header_;
};

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_HTTP_CONNECTION_H_
