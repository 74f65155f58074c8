// The runner with a fake backend: the concurrency limit holds, outcomes keep request order,
// arrivals follow the schedule, and thousands of short requests do not exhaust threads.
#include "bench/serve/load_runner.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "bench/serve/arrival_schedule.h"
#include "gtest/gtest.h"

namespace mobius::bench {
namespace {

class FakeBackend : public RequestBackend {
 public:
  explicit FakeBackend(std::chrono::milliseconds work) : work_(work) {}
  RequestOutcome Send(const BenchRequest& request) override {
    const int now = ++in_flight_;
    int seen = max_in_flight_.load();
    while (now > seen && !max_in_flight_.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(work_);
    --in_flight_;
    RequestOutcome o;
    o.success = request.output_len % 2 == 0;  // odd lengths fail, to check the ordering
    if (!o.success) o.error = "odd";
    o.output_tokens = request.output_len;
    return o;
  }
  int max_in_flight() const { return max_in_flight_.load(); }

 private:
  std::chrono::milliseconds work_;
  std::atomic<int> in_flight_{0};
  std::atomic<int> max_in_flight_{0};
};

std::vector<BenchRequest> Requests(int n) {
  std::vector<BenchRequest> requests(n);
  for (int i = 0; i < n; ++i) requests[i].output_len = i;
  return requests;
}

TEST(LoadRunnerTest, ConcurrencyLimitAndRequestOrder) {
  FakeBackend backend(std::chrono::milliseconds(20));
  LoadOptions options;
  options.max_concurrency = 3;
  options.progress = nullptr;
  auto result = RunLoad(backend, Requests(12), options);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(backend.max_in_flight(), 3);
  ASSERT_EQ(result->outcomes.size(), 12u);
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(result->outcomes[i].output_tokens, i);
    EXPECT_EQ(result->outcomes[i].success, i % 2 == 0);
  }
  // Four waves of three 20 ms requests.
  EXPECT_GE(result->duration_s, 0.08);
}

TEST(LoadRunnerTest, ArrivalsFollowTheRate) {
  FakeBackend backend(std::chrono::milliseconds(1));
  LoadOptions options;
  options.request_rate = 100;
  options.seed = 5;
  options.progress = nullptr;
  auto result = RunLoad(backend, Requests(30), options);
  ASSERT_TRUE(result.ok());
  auto offsets = ArrivalOffsets(30, 100, 1, 5);
  // The run lasts until the last arrival plus its request, not much longer.
  EXPECT_GE(result->duration_s, offsets->back());
  EXPECT_LT(result->duration_s, offsets->back() + 0.5);
}

TEST(LoadRunnerTest, ManyRequestsWithoutALimit) {
  FakeBackend backend(std::chrono::milliseconds(0));
  LoadOptions options;
  options.progress = nullptr;
  auto result = RunLoad(backend, Requests(5000), options);
  ASSERT_TRUE(result.ok());
  int failed = 0;
  for (const RequestOutcome& o : result->outcomes) failed += !o.success;
  EXPECT_EQ(failed, 2500);
}

TEST(LoadRunnerTest, BadConcurrencyNamesTheFlag) {
  FakeBackend backend(std::chrono::milliseconds(0));
  LoadOptions options;
  options.max_concurrency = -1;
  auto result = RunLoad(backend, Requests(1), options);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("--max-concurrency"), absl::string_view::npos);
}

}  // namespace
}  // namespace mobius::bench
