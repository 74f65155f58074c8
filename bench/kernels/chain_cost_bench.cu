// mobius_chain_bench: what one dependent step costs between the ops of a decode step, by the
// mechanism that orders them. A batch-1 decode step is ~460 dependent kernels (performance.md,
// thirteenth version), and fusions that replaced a launch with a grid-end ticket lost
// (fourteenth version); a persistent decode kernel would replace launches with grid barriers.
// This measures the three orderings with no work in between, so the per-step overhead each adds
// to a step is known before such a kernel is written:
//
//   chain      a CUDA graph of `steps` kernels of G blocks, each waiting on the previous one
//              (programmatic dependent launch as the backend launches them, or plain launches);
//   ticket     the same chain, every block ending with a fence and a ticket from a counter and
//              the last block writing the step's result (the norm-tail pattern);
//   barrier    one cooperative kernel of G co-resident blocks taking `steps` grid-wide barriers
//              (an arrive counter and a generation word).
//
//   flag       the chain of one-block kernels handing off through a flag instead of the PDL wait:
//              each kernel polls (acquire) the word its predecessor published (release) with the
//              graph replay's epoch, then lets its successor launch; the overlap pairs' streaming
//              kernel the same way after the one-block kernel (`pair early, flag`). Whether a
//              software hand-off from a one-block kernel (a norm, the top-k) reaches the next grid
//              sooner than the hardware's grid completion does.
//
//   overlap    pairs of (a weight-streaming kernel shaped like the skinny GEMV: every thread
//              issues its loads before its PDL wait; a one-block norm-like kernel): whether the
//              next streaming kernel's loads go out while the small kernel runs (small kernel
//              triggering its successor before or after its own wait) or the pair costs the sum
//              of its kernels, as ncu's per-kernel sum of a batch-1 decode step suggests
//              (performance.md, thirteenth and fifteenth versions).
//
// Every step carries a real dependency: one block reads the word the previous step wrote and
// writes it + 1 (block 0 in the chains, a different block at each barrier step), and the final
// value is checked, so an ordering that lets a step start early shows as lost increments. Times are
// per step: the median over `--repeats` timed replays (or launches) divided by the steps.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/kernels/grid_barrier.cuh"
#include "bench/kernels/probe_util.h"
#include "kernels/cuda/common.cuh"

namespace {

using mobius::bench::CheckCudaOrExit;
using mobius::bench::Median;
using mobius::bench::ParseWholeNumber;

using mobius::kernels::cuda::PdlTrigger;
using mobius::kernels::cuda::PdlWait;

constexpr int kThreads = 256;

void Check(cudaError_t err, const char* what) { CheckCudaOrExit("mobius_chain_bench", err, what); }

// One step of a chain: block 0 advances the word after the previous kernel finished.
__global__ void StepKernel(unsigned* word) {
  PdlWait();
  PdlTrigger();
  if (blockIdx.x == 0 && threadIdx.x == 0) *word = *word + 1;
}

__device__ __forceinline__ void StoreRelease(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Every block: returns once `flag` holds `epoch` (thread 0 polls with acquire loads; the block
// barrier passes the ordering on to the other threads).
__device__ __forceinline__ void WaitFlag(const unsigned* flag, unsigned epoch) {
  if (threadIdx.x == 0) {
    while (mobius::bench::LoadAcquire(flag) != epoch) {
    }
  }
  __syncthreads();
}

// Bumps the replay's epoch: the first node of a recorded flag chain, launched without PDL, so
// every later kernel starts after it completed and reads the new value.
__global__ void EpochKernel(unsigned* epoch) { *epoch = *epoch + 1; }

// One step of the flag chain (one block): waits for the previous step's flag (the first step has
// none), lets its successor launch, advances the word and publishes its own flag.
__global__ void FlagStepKernel(unsigned* word, unsigned* flags, const unsigned* epoch, int step) {
  const unsigned e = *epoch;
  if (step > 0) WaitFlag(flags + step - 1, e);
  PdlTrigger();
  if (threadIdx.x == 0) {
    *word = *word + 1;
    StoreRelease(flags + step, e);
  }
}

// One step ending with a ticket: every block publishes (a fence) and takes a ticket; the last
// one advances the word and rearms the counter.
__global__ void TicketStepKernel(unsigned* word, unsigned* counter) {
  __shared__ bool last;
  PdlWait();
  PdlTrigger();
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) {
    *word = *word + 1;
    *counter = 0;
  }
}

// `steps` grid-wide barriers in one kernel of co-resident blocks (GridBarrier); step s advances
// the word from block s % gridDim.x, so each step reads what another SM wrote before the barrier.
__global__ void BarrierKernel(unsigned* word, unsigned* arrived, unsigned* generation, int steps) {
  for (int s = 0; s < steps; ++s) {
    if (blockIdx.x == static_cast<unsigned>(s) % gridDim.x && threadIdx.x == 0) {
      volatile unsigned* w = word;
      *w = *w + 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) mobius::bench::GridBarrier(arrived, generation);
    __syncthreads();
  }
}

// The streaming kernel of the overlap pairs: kStreamPieces 16-byte loads per thread (32 KB a
// block), all issued before the PDL wait as the skinny GEMV issues its first weight loads; a
// value-dependent store keeps them. Block 0 advances the word after the wait.
constexpr int kStreamPieces = 8;
constexpr int64_t kStreamBlockPieces = int64_t{kThreads} * kStreamPieces;

// With a flag (non-null) it waits for the small kernel's published epoch instead of PdlWait.
__global__ void __launch_bounds__(kThreads)
    StreamStepKernel(const uint4* pool, int64_t offset, unsigned* sink, unsigned* word,
                     const unsigned* flag, const unsigned* epoch) {
  const uint4* src = pool + offset + blockIdx.x * kStreamBlockPieces + threadIdx.x;
  uint4 v[kStreamPieces];
#pragma unroll
  for (int i = 0; i < kStreamPieces; ++i) v[i] = __ldg(src + i * kThreads);
  if (flag != nullptr) {
    WaitFlag(flag, *epoch);
  } else {
    PdlWait();
  }
  PdlTrigger();
  unsigned x = 0;
#pragma unroll
  for (int i = 0; i < kStreamPieces; ++i) x ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  if (x == 0x9e3779b9u) sink[blockIdx.x] = x;
  if (blockIdx.x == 0 && threadIdx.x == 0) *word = *word + 1;
}

// The small kernel of the overlap pairs, shaped like the one-block RmsNorm1p between a
// projection and the next fan-out: read a row, reduce it over the block, write it back scaled.
// kEarly lets its successor launch before its own wait (the successor's PdlWait still waits for
// this kernel, which waits for its predecessor).
// With a flag (non-null) it publishes the replay's epoch there when done.
template <bool kEarly>
__global__ void __launch_bounds__(kThreads)
    SmallStepKernel(float* row, int n, unsigned* word, unsigned* flag, const unsigned* epoch) {
  __shared__ float partial[kThreads / 32];
  if (kEarly) PdlTrigger();
  PdlWait();
  if (!kEarly) PdlTrigger();
  float sum = 0.0f;
  for (int i = threadIdx.x; i < n; i += kThreads) sum += row[i] * row[i];
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  const float scale = rsqrtf(total / static_cast<float>(n) + 1e-6f);
  for (int i = threadIdx.x; i < n; i += kThreads) row[i] = 0.5f + 0.5f * row[i] * scale;
  if (threadIdx.x == 0) *word = *word + 1;
  if (flag != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) StoreRelease(flag, *epoch);
  }
}

struct Options {
  int steps = 512;
  int repeats = 20;
  std::vector<int> grids = {1, 132, 528, 1544};
  std::vector<int> stream_mb = {16, 50};  // bytes of each streaming kernel of the overlap pairs
  // Streaming blocks resident per SM, capped through dynamic shared memory (0: no cap).
  int stream_blocks_per_sm = 0;
};

void Usage() {
  std::printf(
      "mobius_chain_bench: the per-step cost of ordering dependent GPU work (chain of kernels\n"
      "with and without programmatic dependent launch, a grid-end ticket, a grid barrier), and\n"
      "whether a weight-streaming kernel's loads overlap the one-block kernel before it\n\n"
      "  --steps N      dependent steps per timed run (default 512)\n"
      "  --repeats N    timed runs per case; the median is reported (default 20)\n"
      "  --grids LIST   comma-separated blocks per kernel for the chains (default\n"
      "                 1,132,528,1544; the barrier uses the SM count and twice it)\n"
      "  --stream-mb LIST  comma-separated MB read by each streaming kernel of the overlap\n"
      "                 pairs (default 16,50: an out-projection and a DeltaNet in-projection)\n"
      "  --stream-blocks-per-sm N  cap the streaming blocks resident per SM at N (unused\n"
      "                 dynamic shared memory sized to allow no more; default: as many as fit)\n"
      "  --help         this text\n");
}

// A flag's value: a whole positive number up to kMaxValue, or exit 2 naming the flag.
constexpr long kMaxValue = 1 << 20;
int PositiveInt(const std::string& flag, const std::string& text) {
  const std::optional<long> v = ParseWholeNumber(text, 1, kMaxValue);
  if (!v) {
    std::fprintf(stderr, "mobius_chain_bench: %s: '%s' is not a whole number in 1..%ld\n",
                 flag.c_str(), text.c_str(), kMaxValue);
    std::exit(2);
  }
  return static_cast<int>(*v);
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> int {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mobius_chain_bench: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      ++i;
      return PositiveInt(argv[i - 1], argv[i]);
    };
    if (a == "--help" || a == "-h") {
      Usage();
      std::exit(0);
    } else if (a == "--steps") {
      o.steps = value();
    } else if (a == "--repeats") {
      o.repeats = value();
    } else if (a == "--stream-blocks-per-sm") {
      o.stream_blocks_per_sm = value();
    } else if (a == "--grids" || a == "--stream-mb") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mobius_chain_bench: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      std::vector<int>& out = a == "--grids" ? o.grids : o.stream_mb;
      out.clear();
      const std::string flag = argv[i];
      std::string list = argv[++i];
      for (size_t pos = 0; pos <= list.size();) {
        const size_t comma = std::min(list.find(',', pos), list.size());
        out.push_back(PositiveInt(flag, list.substr(pos, comma - pos)));
        pos = comma + 1;
      }
    } else {
      std::fprintf(stderr, "mobius_chain_bench: unknown option %s (see --help)\n", argv[i]);
      std::exit(2);
    }
  }
  for (const int mb : o.stream_mb) {
    if (mb > 4096) {
      std::fprintf(stderr, "mobius_chain_bench: --stream-mb: %d is over 4096 (MB per kernel)\n",
                   mb);
      std::exit(2);
    }
  }
  return o;
}

// Runs `run` (one timed run of o.steps steps on `stream`, advancing `word` by
// `increments_per_step` a step) o.repeats + 1 times, the first untimed (it uploads a graph,
// warms caches), and returns the median microseconds per step; exits when `word` did not
// advance by that much in every run.
template <typename Run>
float TimedRuns(const Options& o, cudaStream_t stream, unsigned* word, const std::string& what,
                Run&& run, unsigned increments_per_step = 1) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "event");
  Check(cudaEventCreate(&stop), "event");
  std::vector<float> per_step;
  for (int r = 0; r <= o.repeats; ++r) {
    Check(cudaEventRecord(start, stream), "record");
    run();
    Check(cudaEventRecord(stop, stream), "record");
    Check(cudaEventSynchronize(stop), "synchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    if (r > 0) per_step.push_back(ms * 1e3f / static_cast<float>(o.steps));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  unsigned value = 0;
  Check(cudaMemcpy(&value, word, sizeof(value), cudaMemcpyDeviceToHost), "read back");
  const unsigned expected =
      static_cast<unsigned>(o.steps) * increments_per_step * static_cast<unsigned>(o.repeats + 1);
  if (value != expected) {
    std::fprintf(stderr, "mobius_chain_bench: %s advanced %u steps, not %u\n", what.c_str(), value,
                 expected);
    std::exit(1);
  }
  return Median(per_step);
}

// The programmatic-serialization attribute the backend launches with (LaunchPdl).
const cudaLaunchAttribute kPdlAttribute = [] {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}();

// A launch of `grid` blocks of kThreads on `stream`, with programmatic dependent launch or not.
cudaLaunchConfig_t StepConfig(int64_t grid, bool pdl, cudaStream_t stream) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(static_cast<unsigned>(grid));
  c.blockDim = dim3(kThreads);
  c.stream = stream;
  c.attrs = const_cast<cudaLaunchAttribute*>(&kPdlAttribute);
  c.numAttrs = pdl ? 1 : 0;
  return c;
}

// Records `record(s)` for o.steps steps into a CUDA graph, replays it (TimedRuns) and returns the
// median microseconds per step; each step advances `word` by `increments_per_step`.
template <typename Record>
float RecordAndTime(const Options& o, cudaStream_t stream, unsigned* word, const std::string& what,
                    unsigned increments_per_step, Record&& record) {
  cudaGraph_t graph = nullptr;
  Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  for (int s = 0; s < o.steps; ++s) record(s);
  Check(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec = nullptr;
  Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const float us = TimedRuns(
      o, stream, word, what, [&] { Check(cudaGraphLaunch(exec, stream), "graph launch"); },
      increments_per_step);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return us;
}

// The chain: o.steps launches of StepKernel (or TicketStepKernel) of `grid` blocks.
float TimeChain(int grid, bool pdl, bool ticket, const Options& o, cudaStream_t stream,
                unsigned* word, unsigned* counter) {
  // On the timing stream: a non-blocking stream is not ordered after the legacy default one.
  Check(cudaMemsetAsync(word, 0, sizeof(unsigned), stream), "memset");
  Check(cudaMemsetAsync(counter, 0, sizeof(unsigned), stream), "memset");
  return RecordAndTime(o, stream, word, "chain of " + std::to_string(grid) + " blocks", 1,
                       [&](int) {
                         const cudaLaunchConfig_t c = StepConfig(grid, pdl, stream);
                         Check(ticket ? cudaLaunchKernelEx(&c, TicketStepKernel, word, counter)
                                      : cudaLaunchKernelEx(&c, StepKernel, word),
                               "launch into the graph");
                       });
}

// The kernels of one overlap case, per step of the recorded chain.
// Dynamic shared memory (unused by the kernel) that leaves room for o.stream_blocks_per_sm
// streaming blocks per SM and no more, from the occupancy API (which knows the allocation unit
// and the per-block reserve); 0 without a cap. Computed once; exits when N cannot be met.
size_t StreamSmemBytes(const Options& o) {
  static const size_t bytes = [&o]() -> size_t {
    if (o.stream_blocks_per_sm <= 0) return 0;
    cudaDeviceProp prop{};
    Check(cudaGetDeviceProperties(&prop, 0), "device properties");
    if (o.stream_blocks_per_sm > prop.maxBlocksPerMultiProcessor) {
      std::fprintf(
          stderr,
          "mobius_chain_bench: --stream-blocks-per-sm: %d is over the %d blocks an SM holds\n",
          o.stream_blocks_per_sm, prop.maxBlocksPerMultiProcessor);
      std::exit(2);
    }
    // The largest shared-memory share, so that the cap is the only limit, and any block size up
    // to the opt-in maximum (without it the occupancy calculation admits no block over 48 KB).
    Check(cudaFuncSetAttribute(StreamStepKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared),
          "carveout attribute");
    Check(cudaFuncSetAttribute(StreamStepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(prop.sharedMemPerBlockOptin)),
          "shared memory attribute");
    size_t avail = 0;
    Check(cudaOccupancyAvailableDynamicSMemPerBlock(&avail, StreamStepKernel,
                                                    o.stream_blocks_per_sm, kThreads),
          "available shared memory");
    // The API's answer can still leave one block fewer (on the H200, 5 per SM: 46592 bytes gave
    // 4), so step down until the occupancy calculation admits N.
    size_t bytes = std::min(avail, prop.sharedMemPerBlockOptin);
    for (;;) {
      int per_sm = 0;
      Check(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, StreamStepKernel, kThreads, bytes),
          "occupancy");
      if (per_sm >= o.stream_blocks_per_sm || bytes < 128) return bytes;
      bytes -= 128;
    }
  }();
  return bytes;
}

enum class PairCase { kStreamOnly, kSmallOnly, kPairLate, kPairEarly, kPairEarlyFlag };

// The flag chain: an epoch bump, then o.steps one-block FlagStepKernels.
float TimeFlagChain(const Options& o, cudaStream_t stream, unsigned* word, unsigned* flags,
                    unsigned* epoch) {
  Check(cudaMemsetAsync(word, 0, sizeof(unsigned), stream), "memset");
  return RecordAndTime(o, stream, word, "flag chain", 1, [&](int s) {
    if (s == 0) {
      const cudaLaunchConfig_t c = StepConfig(1, false, stream);
      Check(cudaLaunchKernelEx(&c, EpochKernel, epoch), "launch into the graph");
    }
    const cudaLaunchConfig_t c = StepConfig(1, true, stream);
    Check(cudaLaunchKernelEx(&c, FlagStepKernel, word, flags, epoch, s), "launch into the graph");
  });
}

// Records o.steps steps of `which` (a streaming kernel of `stream_bytes` and/or a small kernel;
// PDL launches unless `plain`) into a graph and returns the median microseconds per step. The
// streaming kernels walk a pool of at least 1 GB, so no step finds its bytes in L2.
float TimeOverlap(PairCase which, int64_t stream_bytes, bool plain, const Options& o,
                  cudaStream_t stream, const uint4* pool, int64_t pool_pieces, unsigned* sink,
                  float* row, int row_n, unsigned* word, unsigned* flags, unsigned* epoch) {
  Check(cudaMemsetAsync(word, 0, sizeof(unsigned), stream), "memset");
  const int64_t blocks = std::max<int64_t>(1, stream_bytes / (kStreamBlockPieces * 16));
  const int64_t step_pieces = blocks * kStreamBlockPieces;
  const bool streams = which != PairCase::kSmallOnly, smalls = which != PairCase::kStreamOnly;
  const std::string what = "overlap case " + std::to_string(static_cast<int>(which)) + " of " +
                           std::to_string(stream_bytes >> 20) + " MB";
  const bool flag = which == PairCase::kPairEarlyFlag;
  return RecordAndTime(o, stream, word, what, (streams ? 1u : 0u) + (smalls ? 1u : 0u), [&](int s) {
    if (flag && s == 0) {
      const cudaLaunchConfig_t c = StepConfig(1, false, stream);
      Check(cudaLaunchKernelEx(&c, EpochKernel, epoch), "launch into the graph");
    }
    if (streams) {
      const int64_t offset = (s * step_pieces) % (pool_pieces - step_pieces + 1);
      cudaLaunchConfig_t c = StepConfig(blocks, !plain, stream);
      c.dynamicSmemBytes = StreamSmemBytes(o);
      // The first step's stream follows the epoch kernel (a plain launch): nothing to poll.
      const unsigned* wait_on = flag && s > 0 ? flags + s - 1 : nullptr;
      Check(cudaLaunchKernelEx(&c, StreamStepKernel, pool, offset, sink, word, wait_on, epoch),
            "launch into the graph");
    }
    if (smalls) {
      const cudaLaunchConfig_t c = StepConfig(1, !plain, stream);
      unsigned* publish = flag ? flags + s : nullptr;
      Check(which == PairCase::kPairLate
                ? cudaLaunchKernelEx(&c, SmallStepKernel<false>, row, row_n, word, publish, epoch)
                : cudaLaunchKernelEx(&c, SmallStepKernel<true>, row, row_n, word, publish, epoch),
            "launch into the graph");
    }
  });
}

// One cooperative launch of BarrierKernel per timed run; microseconds per barrier step.
float TimeBarrier(int grid, const Options& o, cudaStream_t stream, unsigned* word,
                  unsigned* arrived, unsigned* generation) {
  Check(cudaMemsetAsync(word, 0, sizeof(unsigned), stream), "memset");
  Check(cudaMemsetAsync(arrived, 0, sizeof(unsigned), stream), "memset");
  Check(cudaMemsetAsync(generation, 0, sizeof(unsigned), stream), "memset");
  int steps = o.steps;
  void* args[] = {&word, &arrived, &generation, &steps};
  return TimedRuns(o, stream, word, "barrier over " + std::to_string(grid) + " blocks", [&] {
    Check(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(BarrierKernel), dim3(grid),
                                      dim3(kThreads), args, 0, stream),
          "cooperative launch");
  });
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "mobius_chain_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "device properties");
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  unsigned* words = nullptr;
  Check(cudaMalloc(&words, 4 * sizeof(unsigned)), "allocation");
  Check(cudaMemset(words, 0, 4 * sizeof(unsigned)), "memset");
  unsigned* const epoch = words + 3;
  unsigned* flags = nullptr;  // one per step of the flag cases
  Check(cudaMalloc(&flags, static_cast<size_t>(o.steps) * sizeof(unsigned)), "flag allocation");
  Check(cudaMemset(flags, 0, static_cast<size_t>(o.steps) * sizeof(unsigned)), "memset");
  std::printf("%s, %d SMs; %d dependent steps, median of %d runs; us per step\n", prop.name,
              prop.multiProcessorCount, o.steps, o.repeats);
  std::printf("%-34s %8s\n", "case", "us/step");
  for (const int g : o.grids) {
    std::printf("%-34s %8.2f\n",
                ("chain, plain launches, " + std::to_string(g) + " blocks").c_str(),
                TimeChain(g, false, false, o, stream, words, words + 1));
    std::printf("%-34s %8.2f\n", ("chain, PDL, " + std::to_string(g) + " blocks").c_str(),
                TimeChain(g, true, false, o, stream, words, words + 1));
    std::printf("%-34s %8.2f\n", ("chain, PDL + ticket, " + std::to_string(g) + " blocks").c_str(),
                TimeChain(g, true, true, o, stream, words, words + 1));
  }
  std::printf("%-34s %8.2f\n", "chain, flag hand-off, 1 block",
              TimeFlagChain(o, stream, words, flags, epoch));
  int per_sm = 0;
  Check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, BarrierKernel, kThreads, 0),
        "occupancy");
  for (const int factor : {1, 2}) {
    if (factor > per_sm) break;
    const int g = factor * prop.multiProcessorCount;
    std::printf("%-34s %8.2f\n", ("grid barrier, " + std::to_string(g) + " blocks").c_str(),
                TimeBarrier(g, o, stream, words, words + 1, words + 2));
  }

  // Overlap pairs: a streaming kernel, then a one-block kernel, repeated.
  int64_t max_mb = 0;
  for (const int mb : o.stream_mb) max_mb = std::max<int64_t>(max_mb, mb);
  const int64_t pool_bytes = std::max<int64_t>(int64_t{1} << 30, 8 * (max_mb << 20));
  uint4* pool = nullptr;
  unsigned* sink = nullptr;
  float* row = nullptr;
  constexpr int kRowN = 2048;  // a hidden row, as the norm reads it
  Check(cudaMalloc(&pool, pool_bytes), "pool allocation");
  Check(cudaMemsetAsync(pool, 0x3c, pool_bytes, stream), "pool fill");
  // One word per streaming block: at most 4096 MB / 32 KB = 131072 blocks (Parse caps the MB).
  Check(cudaMalloc(&sink, 131072 * sizeof(unsigned)), "sink allocation");
  Check(cudaMalloc(&row, kRowN * sizeof(float)), "row allocation");
  Check(cudaMemsetAsync(row, 0x3f, kRowN * sizeof(float), stream), "row fill");
  const int64_t pool_pieces = pool_bytes / 16;
  const size_t stream_smem = StreamSmemBytes(o);
  Check(cudaFuncSetAttribute(StreamStepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(stream_smem)),
        "shared memory attribute");
  int stream_per_sm = 0;
  Check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&stream_per_sm, StreamStepKernel, kThreads,
                                                      stream_smem),
        "occupancy");
  if (o.stream_blocks_per_sm > 0 && stream_per_sm != o.stream_blocks_per_sm) {
    std::fprintf(stderr,
                 "mobius_chain_bench: --stream-blocks-per-sm %d: %zu bytes of shared memory a "
                 "block leave %d blocks per SM\n",
                 o.stream_blocks_per_sm, stream_smem, stream_per_sm);
    std::exit(2);
  }
  auto overlap = [&](PairCase which, int64_t bytes, bool plain) {
    return TimeOverlap(which, bytes, plain, o, stream, pool, pool_pieces, sink, row, kRowN, words,
                       flags, epoch);
  };
  std::printf(
      "\noverlap pairs (streaming kernel of N MB, 32 KB a block, loads before its PDL "
      "wait, %d blocks resident per SM;\none-block norm-like kernel); us per step\n",
      stream_per_sm);
  std::printf("%-10s %9s %9s %11s %11s %11s %11s %15s\n", "stream MB", "stream", "small",
              "pair plain", "pair late", "pair early", "early flag", "early overlap");
  for (const int mb : o.stream_mb) {
    const int64_t bytes = int64_t{mb} << 20;
    const float t_stream = overlap(PairCase::kStreamOnly, bytes, false);
    const float t_small = overlap(PairCase::kSmallOnly, bytes, false);
    const float t_plain = overlap(PairCase::kPairLate, bytes, true);
    const float t_late = overlap(PairCase::kPairLate, bytes, false);
    const float t_early = overlap(PairCase::kPairEarly, bytes, false);
    const float t_flag = overlap(PairCase::kPairEarlyFlag, bytes, false);
    std::printf("%-10d %9.2f %9.2f %11.2f %11.2f %11.2f %11.2f %15.2f\n", mb, t_stream, t_small,
                t_plain, t_late, t_early, t_flag, t_stream + t_small - t_early);
  }
  std::printf(
      "stream / small: chains of that kernel alone; pair: stream then small per step, plain\n"
      "launches or PDL with the small kernel letting its successor launch after (late) or\n"
      "before (early) its own wait; early flag: as early, the streaming kernel polling the\n"
      "small kernel's published flag instead of its PDL wait; overlap = stream + small - pair\n"
      "early. For scale: the engine bench measures ~4.26 TB/s of copy bandwidth on an H200\n"
      "(16 MB: 3.9 us).\n");
  cudaFree(pool);
  cudaFree(sink);
  cudaFree(row);
  cudaFree(words);
  cudaFree(flags);
  cudaStreamDestroy(stream);
  return 0;
}
