// The OpenAI backend against canned servers that misbehave: a close-delimited stream, a stream
// cut mid-way, malformed events, error statuses, a non-SSE answer, garbage instead of HTTP, and
// a server that never answers. Each must come back as a counted failure with its reason, never
// a crash or a hang.
#include "bench/serve/openai_backend.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mobius::bench {
namespace {

using ::testing::HasSubstr;

// Answers every connection with `response` once the request (head and Content-Length body) has
// arrived, then closes it; with `hang`, holds the connection open after the response (none, when
// it is empty).
class CannedServer {
 public:
  explicit CannedServer(std::string response, bool hang = false)
      : response_(std::move(response)), hang_(hang) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(fd_, 16);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~CannedServer() {
    stop_ = true;
    thread_.join();
    close(fd_);
  }
  std::string url() const { return absl::StrCat("http://127.0.0.1:", port_); }

 private:
  bool Readable(int fd) {
    pollfd p{fd, POLLIN, 0};
    return poll(&p, 1, 20) > 0;
  }
  void Serve() {
    while (!stop_) {
      if (!Readable(fd_)) continue;
      const int client = accept(fd_, nullptr, nullptr);
      if (client < 0) continue;
      std::string request;
      char buffer[4096];
      size_t head_end = std::string::npos;
      size_t body_len = 0;
      while (!stop_) {
        if (head_end != std::string::npos && request.size() >= head_end + 4 + body_len) break;
        if (!Readable(client)) continue;
        const ssize_t n = read(client, buffer, sizeof(buffer));
        if (n <= 0) break;
        request.append(buffer, n);
        if (head_end == std::string::npos &&
            (head_end = request.find("\r\n\r\n")) != std::string::npos) {
          const size_t at = request.find("Content-Length: ");
          if (at != std::string::npos && at < head_end) {
            absl::SimpleAtoi(request.substr(at + 16, request.find("\r\n", at) - at - 16),
                             &body_len);
          }
        }
      }
      if (!response_.empty()) (void)!write(client, response_.data(), response_.size());
      while (hang_ && !stop_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      close(client);
    }
  }

  std::string response_;
  bool hang_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

const std::string kSseHead =
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n";
const std::string kChunk = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";

RequestOutcome SendOne(const std::string& url, absl::Duration timeout = absl::Seconds(10)) {
  OpenAiBackendOptions options;
  options.base_url = url;
  options.model = "m";
  options.request_timeout = timeout;
  auto backend = OpenAiBackend::Create(options);
  EXPECT_TRUE(backend.ok()) << backend.status();
  BenchRequest request;
  request.prompt_ids = {1, 2};
  request.prompt_len = 2;
  request.output_len = 2;
  return (*backend)->Send(request);
}

TEST(OpenAiBackendTest, CloseDelimitedStreamCompletes) {
  CannedServer server(kSseHead + kChunk + kChunk +
                      "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,"
                      "\"completion_tokens\":2}}\n\ndata: [DONE]\n\n");
  RequestOutcome o = SendOne(server.url());
  ASSERT_TRUE(o.success) << o.error;
  EXPECT_EQ(o.output_tokens, 2);
  EXPECT_EQ(o.itl_s.size(), 1u);
  EXPECT_GT(o.ttft_s, 0);
}

TEST(OpenAiBackendTest, ChunkedStreamCutMidwayFails) {
  const std::string event = kChunk;
  CannedServer server(
      "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
      absl::StrCat(absl::Hex(event.size())) + "\r\n" + event + "\r\n");
  RequestOutcome o = SendOne(server.url());
  EXPECT_FALSE(o.success);
  EXPECT_THAT(o.error, HasSubstr("read response body"));
}

TEST(OpenAiBackendTest, StreamWithoutDoneFails) {
  CannedServer server(kSseHead + kChunk);
  EXPECT_EQ(SendOne(server.url()).error, "stream ended without data: [DONE]");
}

TEST(OpenAiBackendTest, MalformedEventFails) {
  CannedServer server(kSseHead + kChunk + "data: {oops\n\ndata: [DONE]\n\n");
  EXPECT_THAT(SendOne(server.url()).error, HasSubstr("malformed SSE event: invalid JSON"));
}

TEST(OpenAiBackendTest, ErrorEventFails) {
  CannedServer server(kSseHead + kChunk +
                      "data: {\"error\":{\"message\":\"worker lost\"}}\n\ndata: [DONE]\n\n");
  EXPECT_EQ(SendOne(server.url()).error, "error event: worker lost");
}

TEST(OpenAiBackendTest, ErrorStatusCarriesTheServersMessage) {
  const std::string body = "{\"error\":{\"message\":\"boom\",\"type\":\"internal_server_error\"}}";
  CannedServer server(absl::StrCat(
      "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: ",
      body.size(), "\r\n\r\n", body));
  EXPECT_EQ(SendOne(server.url()).error, "HTTP 500: boom");
}

TEST(OpenAiBackendTest, NonStreamedAnswerFails) {
  CannedServer server(
      "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}");
  EXPECT_THAT(SendOne(server.url()).error, HasSubstr("expected a text/event-stream response"));
}

TEST(OpenAiBackendTest, GarbageInsteadOfHttpFails) {
  CannedServer server("SPDY/9 what\r\n\r\n");
  EXPECT_THAT(SendOne(server.url()).error, HasSubstr("read response header"));
}

TEST(OpenAiBackendTest, SilentServerTimesOut) {
  CannedServer server("", /*hang=*/true);
  const auto start = std::chrono::steady_clock::now();
  RequestOutcome o = SendOne(server.url(), absl::Milliseconds(300));
  EXPECT_FALSE(o.success);
  EXPECT_THAT(o.error, HasSubstr("read response header"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(OpenAiBackendTest, StreamHeldOpenAfterDoneStillCompletes) {
  CannedServer server(kSseHead + kChunk + kChunk + "data: [DONE]\n\n", /*hang=*/true);
  const auto start = std::chrono::steady_clock::now();
  RequestOutcome o = SendOne(server.url());
  EXPECT_TRUE(o.success) << o.error;
  EXPECT_EQ(o.output_tokens, 2);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(FetchFirstModelIdTest, FirstIdOrAnError) {
  const std::string models = R"({"object":"list","data":[{"id":"m1"},{"id":"m2"}]})";
  CannedServer ok(
      absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                   "Content-Length: ",
                   models.size(), "\r\n\r\n", models));
  auto id = FetchFirstModelId(ok.url(), absl::Seconds(5));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, "m1");
  CannedServer empty("HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"data\":[]}");
  EXPECT_THAT(std::string(FetchFirstModelId(empty.url(), absl::Seconds(5)).status().message()),
              HasSubstr("no data[0].id"));
}

}  // namespace
}  // namespace mobius::bench
