// One rank of a replica, for the process tests: joins the group through the rendezvous, then runs
// a scenario. Exit codes: 0 passed, 1 wrong values, 2 the rendezvous failed, 3 the group failed
// after it formed (on_failure ran), 4 a collective failed without on_failure.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kernels/dtype.h"
#include "worker/distributed/rendezvous.h"

ABSL_FLAG(int, rank, 0, "This process's rank.");
ABSL_FLAG(int, world_size, 2, "Ranks in the replica.");
ABSL_FLAG(std::string, leader, "127.0.0.1:0", "HOST:PORT of rank 0's rendezvous service.");
ABSL_FLAG(uint64_t, generation, 1, "Generation of the group.");
ABSL_FLAG(std::string, scenario, "collectives",
          "collectives: every collective on F32 and BF16 tensors of odd sizes, checked; "
          "loop: all-reduce until the group fails (the test kills or stops a rank).");
ABSL_FLAG(int, join_timeout_ms, 20000, "Rendezvous deadline.");

namespace mobius::worker {
namespace {

using kernels::DType;
using kernels::Tensor;

Tensor HostTensor(DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::shared_ptr<void> storage(std::calloc(std::max<int64_t>(n, 1), 4), std::free);
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

int failures = 0;
void Expect(bool ok, const std::string& what) {
  if (!ok && ++failures <= 10) std::fprintf(stderr, "MISMATCH %s\n", what.c_str());
}
#define CHECK_OK(expr)                                                       \
  do {                                                                       \
    absl::Status _s = (expr);                                                \
    if (!_s.ok()) {                                                          \
      std::fprintf(stderr, "%s failed: %s\n", #expr, _s.ToString().c_str()); \
      return 4;                                                              \
    }                                                                        \
  } while (0)

int Collectives(Communicator& c) {
  const int r = c.rank(), n = c.world_size();
  const float ranks_sum = n * (n + 1) / 2.0f;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::string d(kernels::DTypeName(dtype));
    // Odd sizes, and one smaller than the world (empty ring chunks).
    for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{301}}) {
      Tensor t = HostTensor(dtype, {rows, 3});
      Fill(t, [r](int64_t i) { return Value(r, i); });
      CHECK_OK(c.AllReduceSum(t));
      for (int64_t i = 0; i < t.numel(); ++i) {
        Expect(At(t, i) == ranks_sum * ((i % 13) - 6), absl::StrFormat("AllReduce %s %d", d, i));
      }
    }
    Tensor in = HostTensor(dtype, {3, 5});
    Fill(in, [r](int64_t i) { return Value(r, i); });
    Tensor out = HostTensor(dtype, {3 * n, 5});
    CHECK_OK(c.AllGather(in, out));
    for (int64_t i = 0; i < out.numel(); ++i) {
      Expect(At(out, i) == Value(i / 15, i % 15), absl::StrFormat("AllGather %s %d", d, i));
    }
    Tensor rs_in = HostTensor(dtype, {5 * n, 3});
    Fill(rs_in, [r](int64_t i) { return Value(r, i); });
    Tensor rs_out = HostTensor(dtype, {5, 3});
    CHECK_OK(c.ReduceScatterSum(rs_in, rs_out));
    for (int64_t i = 0; i < rs_out.numel(); ++i) {
      Expect(At(rs_out, i) == ranks_sum * (((r * 15 + i) % 13) - 6),
             absl::StrFormat("ReduceScatter %s %d", d, i));
    }
    for (int root = 0; root < n; ++root) {
      Tensor b = HostTensor(dtype, {11});
      Fill(b, [r](int64_t i) { return Value(r, i); });
      CHECK_OK(c.Broadcast(b, root));
      for (int64_t i = 0; i < b.numel(); ++i) {
        Expect(At(b, i) == Value(root, i), absl::StrFormat("Broadcast %s root %d", d, root));
      }
    }
  }
  // bf16 sums run in fp32 and round once: 1 + (n-1) * 2^-8 rounds to 1 when each partial sum is
  // rounded to bf16 (ties to even), but not for n >= 3 when summed in fp32.
  Tensor t = HostTensor(DType::kBF16, {1});
  Fill(t, [r](int64_t) { return r == 0 ? 1.0f : 1.0f / 256; });
  CHECK_OK(c.AllReduceSum(t));
  const float want = kernels::BF16ToFloat(kernels::FloatToBF16(1.0f + (n - 1) / 256.0f));
  Expect(At(t, 0) == want, absl::StrFormat("bf16 fp32 sum %g != %g", At(t, 0), want));

  std::string plan = r == 0 ? std::string("plan\0of the leader", 18) : "stale";
  CHECK_OK(c.BroadcastBytes(plan, 0));
  Expect(plan == std::string("plan\0of the leader", 18), "BroadcastBytes");
  std::string big = r == 1 % n ? std::string(100003, 'x') : "";
  CHECK_OK(c.BroadcastBytes(big, 1 % n));
  Expect(big == std::string(100003, 'x'), "BroadcastBytes big");
  if (failures > 0) return 1;
  std::printf("rank %d: every collective matched\n", r);
  return 0;
}

std::atomic<bool> group_failed{false};

int Loop(Communicator& c) {
  Tensor t = HostTensor(DType::kF32, {64});
  std::printf("rank %d: ready\n", c.rank());
  std::fflush(stdout);
  while (true) {
    Fill(t, [](int64_t) { return 1.0f; });
    absl::Status s = c.AllReduceSum(t);
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: all-reduce failed: %s\n", c.rank(), s.ToString().c_str());
      return group_failed ? 3 : 4;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

int Main() {
  RendezvousOptions options;
  options.rank = absl::GetFlag(FLAGS_rank);
  options.world_size = absl::GetFlag(FLAGS_world_size);
  options.leader = absl::GetFlag(FLAGS_leader);
  options.generation = absl::GetFlag(FLAGS_generation);
  options.join_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_join_timeout_ms));
  options.collective_timeout = absl::Seconds(20);
  options.on_failure = [rank = options.rank](const absl::Status& s) {
    std::fprintf(stderr, "rank %d: on_failure: %s\n", rank, s.ToString().c_str());
    group_failed = true;
  };
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Communicator>> comm = JoinReplica(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: JoinReplica: %s\n", options.rank,
                 comm.status().ToString().c_str());
    return 2;
  }
  std::printf("rank %d: joined in %s\n", options.rank,
              absl::FormatDuration(absl::Now() - start).c_str());
  const std::string scenario = absl::GetFlag(FLAGS_scenario);
  int rc = scenario == "loop" ? Loop(**comm) : Collectives(**comm);
  if (rc == 0) {
    // Every rank finishes its checks before any leaves, so that no heartbeat watch fires.
    Tensor done = HostTensor(DType::kF32, {1});
    CHECK_OK((*comm)->AllReduceSum(done));
  }
  std::fflush(stdout);
  if (rc == 3) _exit(3);  // a failed group: exit at once, as the worker would
  return rc;
}

}  // namespace
}  // namespace mobius::worker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mobius::worker::Main();
}
