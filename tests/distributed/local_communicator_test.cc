#include "worker/distributed/local_communicator.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#include "kernels/dtype.h"

namespace mobius::worker {
namespace {

using kernels::DType;
using kernels::Tensor;

Tensor HostTensor(DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::shared_ptr<void> storage(std::calloc(std::max<int64_t>(n, 1), kernels::DTypeSize(dtype)),
                                std::free);
  void* data = storage.get();
  return Tensor(std::move(storage), data, dtype, std::move(shape), kernels::Device::kCpu);
}

void Fill(Tensor& t, const std::function<float(int64_t)>& f) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (t.dtype() == DType::kF32) {
      t.data<float>()[i] = f(i);
    } else {
      t.data<uint16_t>()[i] = kernels::FloatToBF16(f(i));
    }
  }
}

float At(const Tensor& t, int64_t i) { return kernels::LoadAsFloat(t.raw(), t.dtype(), i); }

// Small integers: exact in bf16 and in any summation order.
float Value(int rank, int64_t i) { return static_cast<float>((rank + 1) * ((i % 13) - 6)); }

void RunRanks(std::vector<std::unique_ptr<Communicator>>& comms,
              const std::function<void(Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (auto& c : comms) threads.emplace_back([&body, &c] { body(*c); });
  for (auto& t : threads) t.join();
}

class LocalCommunicatorTest : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(LocalCommunicatorTest, EveryCollectiveGivesTheExpectedValues) {
  const auto [n, dtype] = GetParam();
  auto comms = CreateLocalCommunicators(n);
  RunRanks(comms, [&, n = n, dtype = dtype](Communicator& c) {
    const int r = c.rank();
    ASSERT_EQ(c.world_size(), n);

    Tensor t = HostTensor(dtype, {7, 3});
    Fill(t, [r](int64_t i) { return Value(r, i); });
    ASSERT_TRUE(c.AllReduceSum(t).ok());
    const float ranks_sum = n * (n + 1) / 2.0f;
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(At(t, i), ranks_sum * ((i % 13) - 6)) << i;

    Tensor in = HostTensor(dtype, {3, 5});
    Fill(in, [r](int64_t i) { return Value(r, i); });
    Tensor out = HostTensor(dtype, {3 * n, 5});
    ASSERT_TRUE(c.AllGather(in, out).ok());
    for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(At(out, i), Value(i / 15, i % 15)) << i;

    Tensor rs_in = HostTensor(dtype, {5 * n, 3});
    Fill(rs_in, [r](int64_t i) { return Value(r, i); });
    Tensor rs_out = HostTensor(dtype, {5, 3});
    ASSERT_TRUE(c.ReduceScatterSum(rs_in, rs_out).ok());
    for (int64_t i = 0; i < rs_out.numel(); ++i) {
      ASSERT_EQ(At(rs_out, i), ranks_sum * (((r * 15 + i) % 13) - 6)) << i;
    }

    const int root = n - 1;
    Tensor b = HostTensor(dtype, {11});
    Fill(b, [r](int64_t i) { return Value(r, i); });
    ASSERT_TRUE(c.Broadcast(b, root).ok());
    for (int64_t i = 0; i < b.numel(); ++i) ASSERT_EQ(At(b, i), Value(root, i));

    std::string plan = r == 0 ? std::string("plan\0with nul", 13) : "stale";
    ASSERT_TRUE(c.BroadcastBytes(plan, 0).ok());
    EXPECT_EQ(plan, std::string("plan\0with nul", 13));
  });
}

INSTANTIATE_TEST_SUITE_P(Sizes, LocalCommunicatorTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(DType::kF32, DType::kBF16)));

TEST(LocalCommunicator, Bf16SumsInF32AndRoundsOnce) {
  // 1 + 2^-8 + 2^-8 is 1 + 2^-7 (representable) when summed in fp32, but 1 when rounded to
  // bf16 after each addition (1 + 2^-8 is a tie that rounds to even, 1).
  auto comms = CreateLocalCommunicators(3);
  RunRanks(comms, [](Communicator& c) {
    Tensor t = HostTensor(DType::kBF16, {1});
    Fill(t, [&](int64_t) { return c.rank() == 0 ? 1.0f : 1.0f / 256; });
    ASSERT_TRUE(c.AllReduceSum(t).ok());
    EXPECT_EQ(At(t, 0), 1.0f + 1.0f / 128);
  });
}

TEST(LocalCommunicator, MismatchedCallsFailOnEveryRank) {
  auto comms = CreateLocalCommunicators(2);
  RunRanks(comms, [](Communicator& c) {
    Tensor t = HostTensor(DType::kF32, {c.rank() == 0 ? 4 : 5});
    absl::Status s = c.AllReduceSum(t);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  });
}

TEST(LocalCommunicator, BadArgumentsAreRefused) {
  auto comms = CreateLocalCommunicators(2);
  Tensor i32 = HostTensor(DType::kI32, {4});
  EXPECT_EQ(comms[0]->AllReduceSum(i32).code(), absl::StatusCode::kInvalidArgument);
  Tensor in = HostTensor(DType::kF32, {3, 2}), out = HostTensor(DType::kF32, {5, 2});
  EXPECT_EQ(comms[0]->AllGather(in, out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comms[0]->ReduceScatterSum(out, in).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comms[0]->Broadcast(in, 2).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LocalCommunicator, AMissingRankTimesOutInsteadOfHanging) {
  auto comms = CreateLocalCommunicators(3, absl::Milliseconds(200));
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Tensor t = HostTensor(DType::kF32, {3});
      status[r] = comms[r]->AllReduceSum(t);
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : status) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
  Tensor t = HostTensor(DType::kF32, {3});  // the group stays failed
  EXPECT_EQ(comms[2]->AllReduceSum(t).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(LocalCommunicator, AbortReleasesWaitingRanks) {
  auto comms = CreateLocalCommunicators(2, absl::Seconds(60));
  absl::Status waited;
  std::thread waiter([&] {
    Tensor t = HostTensor(DType::kF32, {3});
    waited = comms[0]->AllReduceSum(t);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  comms[1]->Abort(absl::UnavailableError("rank 1 died"));
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable) << waited;
}

}  // namespace
}  // namespace mobius::worker
