// mobius_persistent_bench: what a persistent decode kernel could make of a batch-1 layer.
//
// A batch-1 decode step at release scale runs ~460 dependent kernels and takes ~2.4x its bytes
// bound (performance.md). Session 13 measured that a grid barrier inside a persistent kernel
// costs more than a PDL kernel boundary (mobius_chain_bench), so a persistent kernel can only win
// by what a kernel boundary forbids: streaming the next op's weights while the current op ends
// and the grid synchronises. This probe measures that directly, before any such kernel is
// written: one cooperative kernel walks `--layers` layers of `--ops` ops, each op streaming its
// weight bytes (every layer its own, so nothing is served from L2) through a ring of shared-memory
// stages filled by the bulk copy engine from one producer thread, eight consumer warps reading
// each stage (FMAs over the bf16 pieces, as a GEMV would), a warp reduction and a store at the
// op's end, a grid-wide barrier after every op (zero-byte ops are barriers only, like the norms
// and the top-k) and an L2 read of another block's output after it (the next op's input).
//
// The producer either waits for each op's barrier before requesting its weights (a kernel per op
// with free launches) or requests them as soon as ring slots free up, across the barriers; ops
// marked `:n` (the MoE gate-up, whose experts come from the top-k) always wait. The default op
// list is a DeltaNet layer at batch 1 (MB): input norm, in-projection 50.6, conv, delta rule,
// gated norm, out-projection 16.8, norm, shared expert + router 14.7, top-k, gate-up of 8 experts
// 33.5 (after the top-k), down 16.8. Reported per layer against bytes / bandwidth (a 2 GiB device
// copy measured in the same run), and against the same bytes as one op per layer (the stream
// alone).
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
#include "kernels/cuda/async_copy.cuh"

namespace {

using mobius::bench::CheckCudaOrExit;
using mobius::bench::Median;
using mobius::bench::ParseWholeNumber;

using mobius::bench::GridBarrier;
using mobius::bench::LoadAcquire;
using mobius::kernels::cuda::BarrierArrive;
using mobius::kernels::cuda::BarrierArriveExpect;
using mobius::kernels::cuda::BarrierInit;
using mobius::kernels::cuda::BarrierWait;
using mobius::kernels::cuda::BulkLoad;
using mobius::kernels::cuda::SharedAddress;

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = 32 * kConsumerWarps;
constexpr int kThreads = kConsumers + 32;  // one producer warp (one lane issues)
constexpr int kMaxStages = 16;
constexpr int kActWords = 1 << 16;

void Check(cudaError_t err, const char* what) {
  CheckCudaOrExit("mobius_persistent_bench", err, what);
}

struct Op {
  int64_t offset = 0;  // bytes into the layer's weights
  int64_t bytes = 0;   // a multiple of 16
  int prefetch = 1;    // its weights may be requested before the barrier that precedes it
};

struct Params {
  const char* pool;
  int64_t layer_stride;
  const Op* ops;
  int num_ops;
  int layers;
  int stages;
  int chunk;    // bytes per stage
  int cross;    // request prefetchable ops' weights across barriers
  int barrier;  // 1: counter + generation, 2: a flag per block, 0: none (timing only)
  unsigned* arrived;
  unsigned* generation;
  unsigned* flags;  // one word per block, 128 bytes apart (the flag barrier)
  float* act;       // each op's outputs, read by other blocks after the barrier
  float* sink;
};

// Warp 0 of each block: publish this block's arrival at barrier `n` (1, 2, ...) in its own line,
// then poll every block's line until all have reached n. No atomic, no word every block updates.
__device__ void FlagBarrier(unsigned* flags, unsigned n, int lane) {
  const int grid = static_cast<int>(gridDim.x);
  if (lane == 0) {
    __threadfence();
    asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(flags + blockIdx.x * 32), "r"(n) : "memory");
  }
  for (int b = lane; b < grid; b += 32) {
    while (LoadAcquire(flags + b * 32) < n) {
    }
  }
  __syncwarp();
}

__device__ __forceinline__ void ConsumerSync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}

__device__ __forceinline__ int64_t ChunkBytes(const Op& op, int64_t c, int chunk) {
  const int64_t left = op.bytes - c * chunk;
  return left < chunk ? left : chunk;
}

__global__ void __launch_bounds__(kThreads) PersistentLayerKernel(const Params p) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  __shared__ __align__(8) uint64_t empty[kMaxStages];
  __shared__ volatile int epoch;  // grid barriers the consumers have passed
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grid = static_cast<int>(gridDim.x), block = static_cast<int>(blockIdx.x);
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      BarrierInit(SharedAddress(&full[s]), 1);
      BarrierInit(SharedAddress(&empty[s]), kConsumerWarps);
    }
    epoch = 0;
    // The barriers are initialised before the copy engine signals them.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // the producer
    if (lane != 0) return;
    int slot = 0;
    uint32_t phase = 0;
    int barriers = 0;  // grid barriers before the current op
    for (int l = 0; l < p.layers; ++l) {
      for (int o = 0; o < p.num_ops; ++o, ++barriers) {
        const Op op = p.ops[o];
        if (!(p.cross && op.prefetch)) {
          while (epoch < barriers) {
          }
        }
        const char* base = p.pool + l * p.layer_stride + op.offset;
        const int64_t chunks = (op.bytes + p.chunk - 1) / p.chunk;
        for (int64_t c = block; c < chunks; c += grid) {
          BarrierWait(SharedAddress(&empty[slot]), phase ^ 1);
          const auto bytes = static_cast<uint32_t>(ChunkBytes(op, c, p.chunk));
          BarrierArriveExpect(SharedAddress(&full[slot]), bytes);
          BulkLoad(SharedAddress(ring + static_cast<int64_t>(slot) * p.chunk), base + c * p.chunk,
                   bytes, SharedAddress(&full[slot]));
          if (++slot == p.stages) {
            slot = 0;
            phase ^= 1;
          }
        }
      }
    }
    return;
  }

  int slot = 0;
  uint32_t phase = 0;
  float acc = 0.0f, x = 1.0f;
  int64_t op_index = 0;
  for (int l = 0; l < p.layers; ++l) {
    for (int o = 0; o < p.num_ops; ++o, ++op_index) {
      const Op op = p.ops[o];
      const int64_t chunks = (op.bytes + p.chunk - 1) / p.chunk;
      float part = 0.0f;
      for (int64_t c = block; c < chunks; c += grid) {
        BarrierWait(SharedAddress(&full[slot]), phase);
        const int64_t pieces = ChunkBytes(op, c, p.chunk) / 16;
        const uint4* data =
            reinterpret_cast<const uint4*>(ring + static_cast<int64_t>(slot) * p.chunk);
        for (int64_t i = threadIdx.x; i < pieces; i += kConsumers) {
          const uint4 v = data[i];
          const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            part = fmaf(__uint_as_float(w[j] << 16), x, part);
            part = fmaf(__uint_as_float(w[j] & 0xffff0000u), x, part);
          }
        }
        __syncwarp();
        if (lane == 0) BarrierArrive(SharedAddress(&empty[slot]));
        if (++slot == p.stages) {
          slot = 0;
          phase ^= 1;
        }
      }
      // The op's end as a GEMV's: reduce, store, then every block waits for every other.
      for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
      const int64_t word = (op_index * grid + block) * kConsumerWarps + warp;
      if (lane == 0) p.act[word % kActWords] = part;
      acc += part;
      ConsumerSync();
      if (p.barrier == 2 && warp == 0) {
        FlagBarrier(p.flags, static_cast<unsigned>(op_index + 1), lane);
      } else if (p.barrier == 1 && threadIdx.x == 0) {
        GridBarrier(p.arrived, p.generation);
      }
      if (threadIdx.x == 0) epoch = epoch + 1;
      ConsumerSync();
      // The next op's input: what another block wrote before the barrier.
      const int64_t other = (op_index * grid + (block + 1) % grid) * kConsumerWarps + warp;
      x = 1.0f + 1e-30f * __ldcg(p.act + other % kActWords);
    }
  }
  if (acc == 1.2345f) p.sink[block] = acc;
}

struct Options {
  int layers = 40;
  int blocks_per_sm = 1;
  int stages = 8;
  int chunk_kb = 16;
  int repeats = 5;
  std::string ops = "0,50.6,0,0,0,16.8,0,14.7,0,33.5:n,16.8";
};

void Usage() {
  std::printf(
      "usage: mobius_persistent_bench [--ops LIST] [--layers N] [--blocks-per-sm N]\n"
      "                               [--stages N] [--chunk-kb N] [--repeats N]\n"
      "  --ops            weight MB of each op of a layer, comma-separated; `:n` marks an op\n"
      "                   whose weights cannot be requested before the barrier before it\n"
      "                   (default: a DeltaNet layer at batch 1, %s)\n"
      "  --layers         layers per run, each with its own weights (default 40)\n"
      "  --blocks-per-sm  co-resident blocks per SM of the cooperative grid (default 1)\n"
      "  --stages         shared-memory ring stages per block, at most %d (default 8)\n"
      "  --chunk-kb       KB per stage (a multiple of 1; default 16)\n"
      "  --repeats        timed runs per case, the median reported (default 5)\n",
      Options().ops.c_str(), kMaxStages);
}

bool ParseInt(std::string_view text, int lo, int hi, int* out) {
  const std::optional<long> v = ParseWholeNumber(text, lo, hi);
  if (v) *out = static_cast<int>(*v);
  return v.has_value();
}

// "0,50.6,33.5:n" -> ops with offsets; false on a malformed entry.
bool ParseOps(const std::string& list, std::vector<Op>* ops, int64_t* layer_bytes) {
  int64_t offset = 0;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    std::string item = list.substr(start, comma - start);
    Op op;
    if (item.size() > 2 && item.compare(item.size() - 2, 2, ":n") == 0) {
      op.prefetch = 0;
      item.resize(item.size() - 2);
    }
    char* end = nullptr;
    const double mb = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !(mb >= 0) || mb > 4096) return false;
    op.bytes = (static_cast<int64_t>(mb * 1e6) + 15) / 16 * 16;
    op.offset = offset;
    offset += (op.bytes + 127) / 128 * 128;
    ops->push_back(op);
    start = comma + 1;
  }
  *layer_bytes = offset;
  return !ops->empty();
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      Usage();
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "mobius_persistent_bench: %s needs a value (see --help)\n", argv[i]);
      return 2;
    }
    const std::string_view value = argv[++i];
    bool ok = true;
    if (arg == "--ops") {
      o.ops = std::string(value);
    } else if (arg == "--layers") {
      ok = ParseInt(value, 1, 1000, &o.layers);
    } else if (arg == "--blocks-per-sm") {
      ok = ParseInt(value, 1, 4, &o.blocks_per_sm);
    } else if (arg == "--stages") {
      ok = ParseInt(value, 2, kMaxStages, &o.stages);
    } else if (arg == "--chunk-kb") {
      ok = ParseInt(value, 1, 64, &o.chunk_kb);
    } else if (arg == "--repeats") {
      ok = ParseInt(value, 1, 100, &o.repeats);
    } else {
      std::fprintf(stderr, "mobius_persistent_bench: unknown flag %s (see --help)\n", argv[i - 1]);
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "mobius_persistent_bench: %s %s is out of range (see --help)\n",
                   argv[i - 1], argv[i]);
      return 2;
    }
  }
  std::vector<Op> ops;
  int64_t layer_bytes = 0;
  if (!ParseOps(o.ops, &ops, &layer_bytes)) {
    std::fprintf(stderr, "mobius_persistent_bench: --ops \"%s\": expected MB[:n],MB[:n],...\n",
                 o.ops.c_str());
    return 2;
  }
  int64_t weight_bytes = 0;
  for (const Op& op : ops) weight_bytes += op.bytes;
  const std::vector<Op> single = {Op{0, weight_bytes, 1}};

  int device = 0, sms = 0;
  Check(cudaGetDevice(&device), "cudaGetDevice");
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  const int chunk = o.chunk_kb * 1024;
  const size_t smem = static_cast<size_t>(o.stages) * chunk;
  Check(cudaFuncSetAttribute(PersistentLayerKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)),
        "shared memory attribute (fewer --stages or a smaller --chunk-kb)");
  int per_sm = 0;
  Check(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, PersistentLayerKernel, kThreads, smem),
      "occupancy");
  if (per_sm < o.blocks_per_sm) {
    std::fprintf(stderr,
                 "mobius_persistent_bench: only %d blocks of %zu KB shared memory fit an SM "
                 "(--blocks-per-sm %d)\n",
                 per_sm, smem / 1024, o.blocks_per_sm);
    return 2;
  }
  const int grid = sms * o.blocks_per_sm;

  char* pool = nullptr;
  const int64_t pool_bytes = layer_bytes * o.layers;
  Check(cudaMalloc(&pool, pool_bytes), "weights");
  Check(cudaMemset(pool, 0x3c, pool_bytes), "weights");
  Op* dev_ops = nullptr;
  Check(cudaMalloc(&dev_ops, sizeof(Op) * std::max(ops.size(), single.size())), "ops");
  unsigned* words = nullptr;
  Check(cudaMalloc(&words, 2 * sizeof(unsigned)), "barrier words");
  Check(cudaMemset(words, 0, 2 * sizeof(unsigned)), "barrier words");
  unsigned* flags = nullptr;
  Check(cudaMalloc(&flags, size_t{128} * grid), "barrier flags");
  float *act = nullptr, *sink = nullptr;
  Check(cudaMalloc(&act, kActWords * sizeof(float)), "act");
  Check(cudaMemset(act, 0, kActWords * sizeof(float)), "act");
  Check(cudaMalloc(&sink, grid * sizeof(float)), "sink");
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "event");
  Check(cudaEventCreate(&stop), "event");

  // Bandwidth as the engine bench measures it: bytes read + written by a 2 GiB device copy.
  const int64_t copy_bytes = std::min<int64_t>(int64_t{1} << 30, pool_bytes / 2);
  std::vector<float> copy_ms;
  for (int r = 0; r < 5; ++r) {
    Check(cudaEventRecord(start), "record");
    Check(cudaMemcpyAsync(pool + copy_bytes, pool, copy_bytes, cudaMemcpyDeviceToDevice), "copy");
    Check(cudaEventRecord(stop), "record");
    Check(cudaEventSynchronize(stop), "copy");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    copy_ms.push_back(ms);
  }
  const double bandwidth = 2.0 * copy_bytes / (Median(copy_ms) * 1e-3);
  const double bound_us = weight_bytes / bandwidth * 1e6;

  auto run = [&](const std::vector<Op>& list, int cross, int barrier = 1) {
    Check(cudaMemcpy(dev_ops, list.data(), sizeof(Op) * list.size(), cudaMemcpyHostToDevice),
          "ops");
    Params p{pool,     layer_bytes, dev_ops,   static_cast<int>(list.size()),
             o.layers, o.stages,    chunk,     cross,
             barrier,  words,       words + 1, flags,
             act,      sink};
    void* args[] = {&p};
    std::vector<float> times;
    for (int r = 0; r < o.repeats + 1; ++r) {
      Check(cudaMemset(flags, 0, size_t{128} * grid), "barrier flags");
      Check(cudaEventRecord(start), "record");
      Check(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(PersistentLayerKernel), dim3(grid),
                                        dim3(kThreads), args, smem, nullptr),
            "cooperative launch");
      Check(cudaEventRecord(stop), "record");
      Check(cudaEventSynchronize(stop), "PersistentLayerKernel");
      float ms = 0;
      Check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      if (r > 0) times.push_back(ms);  // the first run warms up
    }
    return Median(times) * 1e3f / o.layers;
  };

  std::printf(
      "mobius_persistent_bench: %zu ops, %.1f MB a layer, %d layers, %d blocks x %d threads, %d x "
      "%d KB stages\n",
      ops.size(), weight_bytes / 1e6, o.layers, grid, kThreads, o.stages, o.chunk_kb);
  std::printf("bandwidth %.2f TB/s (device copy), bytes bound %.2f us a layer\n", bandwidth / 1e12,
              bound_us);
  std::printf("%-44s %10s %8s\n", "case", "us/layer", "x bound");
  const float alone = run(single, 1);
  std::printf("%-44s %10.2f %8.2f\n", "one op a layer (the stream alone)", alone, alone / bound_us);
  const float waits = run(ops, 0);
  std::printf("%-44s %10.2f %8.2f\n", "ops, each requested after its barrier", waits,
              waits / bound_us);
  const float early = run(ops, 1);
  std::printf("%-44s %10.2f %8.2f\n", "ops, requested across barriers (not :n)", early,
              early / bound_us);
  const float flag_early = run(ops, 1, 2);
  std::printf("%-44s %10.2f %8.2f\n", "the same, a flag per block as the barrier", flag_early,
              flag_early / bound_us);
  // Without the grid barrier (results meaningless, each block races ahead): what the op
  // boundaries' own work (reduce, store, read the next input) costs.
  const float free_run = run(ops, 1, 0);
  std::printf("%-44s %10.2f %8.2f\n", "ops, no grid barrier (timing only)", free_run,
              free_run / bound_us);
  return 0;
}
