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
// Every step carries a real dependency: one block reads the word the previous step wrote and
// writes it + 1 (block 0 in the chains, a different block at each barrier step), and the final
// value is checked, so an ordering that lets a step start early shows as lost increments. Times are
// per step: the median over `--repeats` timed replays (or launches) divided by the steps.
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cuda/common.cuh"

namespace {

using mobius::kernels::cuda::PdlTrigger;
using mobius::kernels::cuda::PdlWait;

constexpr int kThreads = 256;

void Die(const std::string& what, cudaError_t err) {
  std::fprintf(stderr, "mobius_chain_bench: %s: %s\n", what.c_str(), cudaGetErrorString(err));
  std::exit(1);
}
void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Die(what, err);
}

// One step of a chain: block 0 advances the word after the previous kernel finished.
__global__ void StepKernel(unsigned* word) {
  PdlWait();
  PdlTrigger();
  if (blockIdx.x == 0 && threadIdx.x == 0) *word = *word + 1;
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

// `steps` grid-wide barriers in one kernel of co-resident blocks; step s advances the word from
// block s % gridDim.x, so each step reads what another SM wrote before the barrier. Barrier:
// thread 0 of each block adds to `arrived`; the last arrival resets it and bumps `generation`,
// which the others poll with acquire loads.
__global__ void BarrierKernel(unsigned* word, unsigned* arrived, unsigned* generation, int steps) {
  for (int s = 0; s < steps; ++s) {
    if (blockIdx.x == static_cast<unsigned>(s) % gridDim.x && threadIdx.x == 0) {
      volatile unsigned* w = word;
      *w = *w + 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned gen = 0;
      asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(gen) : "l"(generation) : "memory");
      __threadfence();
      if (atomicAdd(arrived, 1u) == gridDim.x - 1) {
        *arrived = 0;
        __threadfence();
        atomicAdd(generation, 1u);
      } else {
        unsigned now = gen;
        while (now == gen) {
          asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(generation) : "memory");
        }
      }
    }
    __syncthreads();
  }
}

struct Options {
  int steps = 512;
  int repeats = 20;
  std::vector<int> grids = {1, 132, 528, 1544};
};

void Usage() {
  std::printf(
      "mobius_chain_bench: the per-step cost of ordering dependent GPU work (chain of kernels\n"
      "with and without programmatic dependent launch, a grid-end ticket, a grid barrier)\n\n"
      "  --steps N      dependent steps per timed run (default 512)\n"
      "  --repeats N    timed runs per case; the median is reported (default 20)\n"
      "  --grids LIST   comma-separated blocks per kernel for the chains (default\n"
      "                 1,132,528,1544; the barrier uses the SM count and twice it)\n"
      "  --help         this text\n");
}

// A flag's value: a whole positive number up to kMaxValue, or exit 2 naming the flag.
constexpr long kMaxValue = 1 << 20;
int PositiveInt(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v <= 0 || v > kMaxValue) {
    std::fprintf(stderr, "mobius_chain_bench: %s: '%s' is not a whole number in 1..%ld\n",
                 flag.c_str(), text.c_str(), kMaxValue);
    std::exit(2);
  }
  return static_cast<int>(v);
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
    } else if (a == "--grids") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mobius_chain_bench: --grids needs a value\n");
        std::exit(2);
      }
      o.grids.clear();
      std::string list = argv[++i];
      for (size_t pos = 0; pos <= list.size();) {
        const size_t comma = std::min(list.find(',', pos), list.size());
        o.grids.push_back(PositiveInt("--grids", list.substr(pos, comma - pos)));
        pos = comma + 1;
      }
    } else {
      std::fprintf(stderr, "mobius_chain_bench: unknown option %s (see --help)\n", argv[i]);
      std::exit(2);
    }
  }
  return o;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs `run` (one timed run of o.steps steps on `stream`) o.repeats + 1 times, the first untimed
// (it uploads a graph, warms caches), and returns the median microseconds per step; exits when
// `word` did not advance once per step of every run.
template <typename Run>
float TimedRuns(const Options& o, cudaStream_t stream, unsigned* word, const std::string& what,
                Run&& run) {
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
  const unsigned expected = static_cast<unsigned>(o.steps) * static_cast<unsigned>(o.repeats + 1);
  if (value != expected) {
    std::fprintf(stderr, "mobius_chain_bench: %s advanced %u steps, not %u\n", what.c_str(), value,
                 expected);
    std::exit(1);
  }
  return Median(per_step);
}

// Records `steps` launches of the chain into a graph, replays it `repeats` times and returns the
// median microseconds per step; checks the word advanced by steps on every replay.
float TimeChain(int grid, bool pdl, bool ticket, const Options& o, cudaStream_t stream,
                unsigned* word, unsigned* counter) {
  // On the timing stream: a non-blocking stream is not ordered after the legacy default one.
  Check(cudaMemsetAsync(word, 0, sizeof(unsigned), stream), "memset");
  Check(cudaMemsetAsync(counter, 0, sizeof(unsigned), stream), "memset");
  cudaGraph_t graph = nullptr;
  Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  for (int s = 0; s < o.steps; ++s) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(grid));
    config.blockDim = dim3(kThreads);
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = pdl ? 1 : 0;
    const cudaError_t err = ticket ? cudaLaunchKernelEx(&config, TicketStepKernel, word, counter)
                                   : cudaLaunchKernelEx(&config, StepKernel, word);
    Check(err, "launch into the graph");
  }
  Check(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec = nullptr;
  Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const float us = TimedRuns(o, stream, word, "chain of " + std::to_string(grid) + " blocks",
                             [&] { Check(cudaGraphLaunch(exec, stream), "graph launch"); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return us;
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
  Check(cudaMalloc(&words, 3 * sizeof(unsigned)), "allocation");
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
  int per_sm = 0;
  Check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, BarrierKernel, kThreads, 0),
        "occupancy");
  for (const int factor : {1, 2}) {
    if (factor > per_sm) break;
    const int g = factor * prop.multiProcessorCount;
    std::printf("%-34s %8.2f\n", ("grid barrier, " + std::to_string(g) + " blocks").c_str(),
                TimeBarrier(g, o, stream, words, words + 1, words + 2));
  }
  cudaFree(words);
  cudaStreamDestroy(stream);
  return 0;
}
