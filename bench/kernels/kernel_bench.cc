// mobius_kernel_bench: times every custom op of the CUDA backend through kernels::Backend at the
// release shapes of Intern-S2-Mobius 35B, next to its bound
//   bound = max(bytes / measured copy bandwidth, FLOPs / measured bf16 matrix rate),
// where bytes are the op's inputs read once plus its outputs written once (MoE: the weights of
// the experts the routing touches) and both ceilings are measured in the same run
// (Backend::MeasureCopyBandwidth; a large cuBLASLt bf16 GEMM through Backend::Linear).
//
// Timing: the backend queues every op on its own non-blocking stream, which the interface does
// not expose. This binary learns that stream by wrapping cudaStreamCreate* (below) while
// CreateCudaBackend runs. Per timed batch it queues a sleep kernel on that stream, then, while the
// device sleeps, queues `event, op, event` for up to 32 repetitions, so that the ops run back to
// back with no host gaps; the time of one op is the time between its two events (its kernels plus
// the small metadata upload the backend queues with it). The reported time is the median.
// Ops that take sequence segments (delta rule, conv, attention, ...) are timed as the engine runs
// them: the step's metadata is staged once (Backend::StageStep) before the timed calls, so a call
// reads the staged copy instead of uploading its own; all input sets share that one step (their
// per-sequence state and KV cache rotate by tensor, as layers do in the engine). The same calls
// without staging (each uploading its metadata) are timed too and reported as "unstaged us".
// Staged ops are also recorded as one CUDA graph of many calls (Backend::BeginCapture, the way
// the engine records a decode step) and replayed: "graph us" is the replay's time per call, with
// no event records between the calls and programmatic dependent launch overlapping each call's
// start with the previous one's tail. That is how the peers (bench/kernels/peers.py) are timed.
// Inputs are fresh random data (never zeros) in several sets, rotated so that one set of inputs
// is not still in the L2 when it is used again (sets * bytes >= 4 x L2). If the stream cannot be
// found (the backend changed how it creates it) the op is timed on the host around
// Backend::Synchronize() and the row says "host".
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/kernels/bench_device.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/dtype.h"
#include "nlohmann/json.hpp"

// ---- the backend's stream --------------------------------------------------------------------
// Streams created while g_watch_streams is set (only around CreateCudaBackend). The definitions
// below take precedence over libcudart's for every caller linked into this binary (the static
// mobius_kernels_cuda included) and forward to libcudart's through dlsym(RTLD_NEXT).
namespace {
bool g_watch_streams = false;
std::vector<cudaStream_t> g_streams;

template <typename Fn>
Fn Next(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}
}  // namespace

extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  static auto real =
      Next<cudaError_t (*)(cudaStream_t*, unsigned int)>("cudaStreamCreateWithFlags");
  const cudaError_t err = real(stream, flags);
  if (err == cudaSuccess && g_watch_streams) g_streams.push_back(*stream);
  return err;
}

extern "C" cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags,
                                                    int priority) {
  static auto real =
      Next<cudaError_t (*)(cudaStream_t*, unsigned int, int)>("cudaStreamCreateWithPriority");
  const cudaError_t err = real(stream, flags, priority);
  if (err == cudaSuccess && g_watch_streams) g_streams.push_back(*stream);
  return err;
}

extern "C" cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  static auto real = Next<cudaError_t (*)(cudaStream_t*)>("cudaStreamCreate");
  const cudaError_t err = real(stream);
  if (err == cudaSuccess && g_watch_streams) g_streams.push_back(*stream);
  return err;
}

namespace mobius::bench {
namespace {

using kernels::Backend;
using kernels::DeltaRuleAlgorithm;
using kernels::DeltaRuleDims;
using kernels::DType;
using kernels::RopeParams;
using kernels::SequenceSegment;
using kernels::Tensor;

void Die(const std::string& msg) {
  std::fprintf(stderr, "mobius_kernel_bench: %s\n", msg.c_str());
  std::exit(1);
}

void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Die(absl::StrFormat("%s: %s", what, cudaGetErrorString(err)));
}

// ---- options -----------------------------------------------------------------------------------
struct Options {
  std::string filter = ".*";
  std::string json;
  std::string device = "cuda";
  std::string note;
  int iters = 100;
  double max_case_ms = 1500;  // measuring budget per case (iterations shrink to fit, >= 5)
  double bandwidth = 0;       // bytes/s; 0 = measure
  double matrix_rate = 0;     // FLOP/s; 0 = measure
  bool list = false;
  bool smoke = false;
  bool unstaged = false;  // segment ops: time only without staging (no StageStep)
  bool no_graph = false;  // staged ops: skip the recorded (CUDA graph) timing
  // --chain: each entry names cases recorded one after another, round after round, in one graph.
  std::vector<std::vector<std::string>> chains;
};

void PrintHelp() {
  std::printf(
      "usage: mobius_kernel_bench [options]\n"
      "Times every custom op of the CUDA backend (through kernels::Backend) at the release shapes\n"
      "of Intern-S2-Mobius 35B and prints each next to its bound\n"
      "  max(bytes / copy bandwidth, FLOPs / bf16 matrix rate), both ceilings measured in the "
      "run.\n"
      "options:\n"
      "  --filter REGEX        run the cases whose name matches (std::regex search); default all\n"
      "  --iters N             timed repetitions per case (default 100; fewer when a case would\n"
      "                        exceed --max-case-ms, never under 5); the median is reported\n"
      "  --max-case-ms MS      measuring budget per case (default 1500)\n"
      "  --json FILE           also write the results as JSON\n"
      "  --list                print the case names and exit\n"
      "  --bandwidth GBPS      use this copy bandwidth (GB/s, read + write) instead of measuring\n"
      "  --matrix-tflops TF    use this bf16 matrix rate instead of measuring it\n"
      "  --note TEXT           stored in the JSON (for example the commit)\n"
      "  --device cuda|cpu     cpu runs the CPU reference backend (host-timed; with --smoke only\n"
      "                        useful to check that every case is well formed)\n"
      "  --smoke               small shapes (checks the cases, not a benchmark)\n"
      "  --unstaged            ops with segments: time them only without Backend::StageStep\n"
      "                        (each call uploads its metadata; by default both are timed and\n"
      "                        the staged median is the time)\n"
      "  --no-graph            staged ops: skip the timing of a recorded CUDA graph of calls\n"
      "                        (the \"graph us\" column)\n"
      "  --chain A,B,...       also record rounds of the named cases, one call of each in turn,\n"
      "                        as one CUDA graph (the engine's order of kernels) and print the\n"
      "                        time per round; a chain of one case times that case alone in a\n"
      "                        recording. At most one case with segments per chain; cases that\n"
      "                        upload host data (embedding, gather_rows) cannot be recorded.\n"
      "                        Repeatable\n"
      "  --help                this text\n");
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      PrintHelp();
      std::exit(0);
    } else if (a == "--filter") {
      o.filter = value();
    } else if (a == "--iters") {
      o.iters = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--max-case-ms") {
      o.max_case_ms = std::atof(value().c_str());
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--list") {
      o.list = true;
    } else if (a == "--bandwidth") {
      o.bandwidth = std::atof(value().c_str()) * 1e9;
    } else if (a == "--matrix-tflops") {
      o.matrix_rate = std::atof(value().c_str()) * 1e12;
    } else if (a == "--note") {
      o.note = value();
    } else if (a == "--device") {
      o.device = value();
    } else if (a == "--smoke") {
      o.smoke = true;
    } else if (a == "--unstaged") {
      o.unstaged = true;
    } else if (a == "--no-graph") {
      o.no_graph = true;
    } else if (a == "--chain") {
      std::vector<std::string> names = absl::StrSplit(value(), ',', absl::SkipEmpty());
      if (names.empty()) Die("--chain needs at least one case name");
      o.chains.push_back(std::move(names));
    } else {
      Die("unknown option " + a + " (see --help)");
    }
  }
  return o;
}

// ---- shapes ------------------------------------------------------------------------------------
// Release shapes (../shared/configs/intern-s2-mobius-35b/config.json); --smoke shrinks them.
struct Dims {
  int hidden = 2048;
  int hk = 16, hv = 32, dk = 128, dv = 128;  // gated DeltaNet
  int conv_k = 4;
  int nh = 16, nkv = 2, hd = 256, rotary = 64;  // gated attention (partial rotary 0.25)
  int block = 16;                               // paged-KV block size
  int experts = 2560, topk = 8, inter = 512, shared_inter = 512;
  int vocab = 248320;
  float rope_theta = 1e7f;
  float eps = 1e-6f;
  // Token counts.
  std::vector<int> decode_batches = {1, 8, 64, 256};
  std::vector<int> contexts = {1024, 8192};
  int prefill = 4096;  // 1 x 4096
  int multi_seqs = 8;  // 8 x 1024
  int multi_len = 1024;
  std::vector<int> rows = {64, 4096};  // elementwise ops: a decode batch and a prefill
  std::vector<int> moe_tokens = {1, 8, 64, 256, 4096, 8192};
  std::vector<int> topk_tokens = {1, 64, 256, 1024, 2048, 4096, 8192};
  int gemm = 8192;  // the matrix-rate probe: gemm x gemm x gemm
  [[nodiscard]] int conv_dim() const { return 2 * hk * dk + hv * dv; }
};

Dims SmokeDims() {
  Dims d;
  d.hidden = 256;
  d.experts = 64;
  d.inter = 64;
  d.shared_inter = 64;
  d.vocab = 1000;
  d.decode_batches = {1, 3};
  d.contexts = {40, 100};
  d.prefill = 70;
  d.multi_seqs = 3;
  d.multi_len = 20;
  d.rows = {5, 70};
  d.moe_tokens = {1, 9};
  d.topk_tokens = {1, 70};
  d.gemm = 256;
  return d;
}

// ---- results -----------------------------------------------------------------------------------
struct Result {
  std::string name, op, shape, timing;
  double time_us = 0, min_us = 0, host_us = 0;
  double unstaged_us = 0;  // segment ops: median without StageStep (0: not timed)
  double graph_us = 0;     // staged ops: per call in a replayed recording of many (0: not timed)
  double bytes = 0, flops = 0;
  double bound_us = 0;
  std::string bound_by;
  int sets = 1, iters = 0, gap_batches = 0;
  std::string note;
};

// A prepared case: `run(set)` queues the op on input set `set` (0 <= set < sets).
struct Case {
  std::string op, shape, note;
  double bytes = 0, flops = 0;
  int sets = 1;
  std::function<void(int)> run;
  // Ops with segments: stages the one step every set shares (Backend::StageStep); empty otherwise.
  std::function<void()> stage;
};

struct Spec {
  std::string name;
  std::function<Case()> make;
};

// A step's sequence segments and the block tables they point into.
struct SegmentSet {
  std::vector<SequenceSegment> segs;
  std::vector<std::vector<int32_t>> tables;
};

// ---- the bench ---------------------------------------------------------------------------------
class Bench {
 public:
  Bench(Options opt, std::unique_ptr<Backend> backend, cudaStream_t stream, bool cuda)
      : opt_(std::move(opt)),
        be_(std::move(backend)),
        stream_(stream),
        cuda_(cuda),
        d_(opt_.smoke ? SmokeDims() : Dims()) {
    act_ = be_->activation_dtype();
    if (cuda_) {
      cudaDeviceProp prop{};
      CheckCuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
      l2_bytes_ = prop.l2CacheSize;
      gpu_ = prop.name;
      events_.resize(2 * kBatch);
      for (auto& e : events_) CheckCuda(cudaEventCreate(&e), "cudaEventCreate");
    } else {
      gpu_ = "cpu";
    }
    rotate_bytes_ = 4.0 * static_cast<double>(l2_bytes_);
    BuildSpecs();
  }

  int Run();

 private:
  static constexpr int kBatch = 32;

  // ---- tensors ----
  Tensor Alloc(DType dtype, std::vector<int64_t> shape) {
    auto t = be_->Allocate(dtype, std::move(shape));
    if (!t.ok()) Die(std::string(t.status().message()));
    return *std::move(t);
  }
  Tensor Act(std::vector<int64_t> shape) { return Alloc(act_, std::move(shape)); }
  Tensor F32(std::vector<int64_t> shape) { return Alloc(DType::kF32, std::move(shape)); }
  // Fresh uniform random values in [lo, hi).
  void Fill(Tensor& t, float lo, float hi) {
    const uint64_t seed = ++seed_;
    if (cuda_) {
      be_->Synchronize();  // Allocate's memset is queued on the backend's stream
      CheckCuda(FillUniform(t.raw(), t.numel(), t.dtype() == DType::kBF16, lo, hi, seed, nullptr),
                "FillUniform");
      CheckCuda(cudaDeviceSynchronize(), "FillUniform");
      return;
    }
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> host(t.numel());
    for (float& v : host) v = u(rng);
    be_->CopyFromHost(host.data(), DType::kF32, t);
  }
  Tensor Rand(DType dtype, std::vector<int64_t> shape, float lo = -1.f, float hi = 1.f) {
    Tensor t = Alloc(dtype, std::move(shape));
    Fill(t, lo, hi);
    return t;
  }
  Tensor Ints(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
    Tensor t = Alloc(DType::kI32, std::move(shape));
    be_->CopyFromHost(v.data(), DType::kI32, t);
    return t;
  }
  [[nodiscard]] size_t ActSize() const { return kernels::DTypeSize(act_); }
  // Input sets so that sets * bytes_per_set covers 4 x L2 (at most 64; 2 for the CPU check).
  [[nodiscard]] int Sets(double bytes_per_set) const {
    if (!cuda_) return 2;
    const double n = std::ceil(rotate_bytes_ / std::max(bytes_per_set, 1.0));
    return static_cast<int>(std::clamp(n, 1.0, 64.0));
  }
  std::vector<int32_t> Permutation(int n) {
    std::vector<int32_t> p(n);
    std::iota(p.begin(), p.end(), 0);
    std::shuffle(p.begin(), p.end(), rng_);
    return p;
  }

  // ---- cases ----
  void BuildSpecs();
  void Add(std::string name, std::function<Case()> make) {
    specs_.push_back({std::move(name), std::move(make)});
  }
  Case DeltaRule(int seqs, int len, DeltaRuleAlgorithm algo);
  Case Conv(int seqs, int len);
  Case Attention(int seqs, int ctx, bool prefill);
  Case Moe(int tokens);
  // Stages `segs` (with `tokens` placeholder token ids) for the timed calls of a case.
  std::function<void()> Stager(std::shared_ptr<SegmentSet> segs, int64_t tokens, int max_positions);
  Case Linear(int m, int n, int k);
  Case LinearFanOut(int m, std::vector<int> ns, int k);

  // ---- timing ----
  Result Time(const std::string& name, Case& c);
  void TimeCalls(Case& c, Result& r);
  // Staged cases: records many calls as one CUDA graph and sets r.graph_us from its replays.
  void TimeRecorded(Case& c, Result& r);
  // --chain: rounds of the named cases (one call each) recorded as one graph; prints us per round.
  void TimeChain(const std::vector<std::string>& names);
  void MeasureCeilings();
  void Print(const std::vector<Result>& results) const;
  void WriteJson(const std::vector<Result>& results) const;

  Options opt_;
  std::unique_ptr<Backend> be_;
  cudaStream_t stream_;
  bool cuda_;
  Dims d_;
  DType act_ = DType::kBF16;
  std::string gpu_;
  int64_t l2_bytes_ = 64 << 20;
  double rotate_bytes_ = 0;
  double bandwidth_ = 0, matrix_rate_ = 0;
  std::string bandwidth_src_, matrix_src_;
  std::vector<cudaEvent_t> events_;
  std::vector<Spec> specs_;
  uint64_t seed_ = 1234;
  std::mt19937_64 rng_{42};
  std::shared_ptr<std::pair<Tensor, Tensor>> moe_bank_;  // gate_up, down; shared by the MoE cases
};

// Segments of `seqs` sequences of `len` new tokens after `cached` tokens, state slots from
// `slot0`, with `blocks_per_seq` blocks each taken from `table` starting at `table_off`.

SegmentSet MakeSegments(int seqs, int len, int cached, int slot0, int blocks_per_seq,
                        const std::vector<int32_t>* table, size_t table_off) {
  SegmentSet s;
  s.tables.resize(seqs);
  for (int i = 0; i < seqs; ++i) {
    if (table != nullptr) {
      s.tables[i].assign(table->begin() + table_off + static_cast<size_t>(i) * blocks_per_seq,
                         table->begin() + table_off + static_cast<size_t>(i + 1) * blocks_per_seq);
    }
  }
  for (int i = 0; i < seqs; ++i) {
    SequenceSegment g;
    g.token_begin = i * len;
    g.num_tokens = len;
    g.cached_tokens = cached;
    g.state_slot = slot0 + i;
    g.kv_blocks = s.tables[i];
    s.segs.push_back(g);
  }
  return s;
}

std::string AlgoName(DeltaRuleAlgorithm a) {
  switch (a) {
    case DeltaRuleAlgorithm::kAuto:
      return "auto";
    case DeltaRuleAlgorithm::kRecurrent:
      return "recurrent";
    case DeltaRuleAlgorithm::kChunked:
      return "chunked";
  }
  return "?";
}

std::string K(int n) {  // 1024 -> "1K", 4096 -> "4K"
  return n % 1024 == 0 ? absl::StrFormat("%dK", n / 1024) : absl::StrFormat("%d", n);
}

std::function<void()> Bench::Stager(std::shared_ptr<SegmentSet> segs, int64_t tokens,
                                    int max_positions) {
  auto ids = std::make_shared<std::vector<int32_t>>(static_cast<size_t>(tokens), 0);
  return [this, segs, ids, max_positions] { be_->StageStep(*ids, segs->segs, max_positions); };
}

Case Bench::DeltaRule(int seqs, int len, DeltaRuleAlgorithm algo) {
  const int64_t t = static_cast<int64_t>(seqs) * len;
  const int conv_dim = d_.conv_dim();
  const double state_bytes = 4.0 * d_.hv * d_.dk * d_.dv;
  Case c;
  c.op = "GatedDeltaRule";
  c.shape = absl::StrFormat("%d seq x %d tok, Hk %d Hv %d Dk %d Dv %d, %s", seqs, len, d_.hk, d_.hv,
                            d_.dk, d_.dv, AlgoName(algo));
  c.bytes = t * conv_dim * ActSize() + t * d_.hv * 8.0 + 2.0 * seqs * state_bytes +
            t * d_.hv * d_.dv * ActSize();
  // Recurrent form per token and value head: decay Dk*Dv, S^T k and the rank-1 update 2 Dk*Dv
  // each, o = S^T q 2 Dk*Dv (the chunked form does a little more, on tensor cores).
  c.flops = 7.0 * t * d_.hv * d_.dk * d_.dv;
  c.sets = Sets(c.bytes);
  // One step's segments for every set; each set has its own states (as each layer in the engine).
  struct Set {
    Tensor qkv, g, beta, states, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  const int cached = len == 1 ? 100 : 0;
  auto segs = std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, 0, 0, nullptr, 0));
  for (int s = 0; s < c.sets; ++s) {
    Set x;
    x.qkv = Rand(act_, {t, conv_dim});
    x.g = Rand(DType::kF32, {t, d_.hv}, -0.5f, -0.01f);  // log-space decay
    x.beta = Rand(DType::kF32, {t, d_.hv}, 0.05f, 0.95f);
    x.states = Rand(DType::kF32, {seqs, d_.hv, d_.dk, d_.dv}, -0.05f, 0.05f);
    x.out = Act({t, d_.hv * d_.dv});
    sets->push_back(std::move(x));
  }
  const DeltaRuleDims dims{d_.hk, d_.hv, d_.dk, d_.dv};
  c.run = [this, sets, segs, dims, algo](int s) {
    Set& x = (*sets)[s];
    be_->GatedDeltaRule(x.qkv, x.g, x.beta, dims, x.states, segs->segs, algo, x.out);
  };
  c.stage = Stager(segs, t, cached + len);
  return c;
}

Case Bench::Conv(int seqs, int len) {
  const int64_t t = static_cast<int64_t>(seqs) * len;
  const int cd = d_.conv_dim();
  Case c;
  c.op = "CausalConv1dSilu";
  c.shape = absl::StrFormat("%d seq x %d tok, C %d, K %d", seqs, len, cd, d_.conv_k);
  c.bytes = 2.0 * t * cd * ActSize() + cd * d_.conv_k * ActSize() +
            2.0 * seqs * cd * (d_.conv_k - 1) * 4.0;
  c.flops = 2.0 * t * cd * d_.conv_k;
  c.sets = Sets(c.bytes);
  struct Set {
    Tensor x, states, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  auto w = std::make_shared<Tensor>(Rand(act_, {cd, d_.conv_k}, -0.5f, 0.5f));
  const int cached = len == 1 ? 100 : 0;
  auto segs = std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, 0, 0, nullptr, 0));
  for (int s = 0; s < c.sets; ++s) {
    Set x;
    x.x = Rand(act_, {t, cd});
    x.states = Rand(DType::kF32, {seqs, cd, d_.conv_k - 1});
    x.out = Act({t, cd});
    sets->push_back(std::move(x));
  }
  c.run = [this, sets, segs, w](int s) {
    Set& x = (*sets)[s];
    be_->CausalConv1dSilu(x.x, *w, x.states, segs->segs, x.out);
  };
  c.stage = Stager(segs, t, cached + len);
  return c;
}

Case Bench::Attention(int seqs, int ctx, bool prefill) {
  // Decode: each sequence has ctx - 1 cached positions and one new token (attends ctx positions).
  // Prefill: one sequence of ctx new tokens, causal.
  const int len = prefill ? ctx : 1;
  const int cached = ctx - len;
  const int64_t t = static_cast<int64_t>(seqs) * len;
  const int blocks_per_seq = (ctx + d_.block - 1) / d_.block;
  const double kv_row = 2.0 * d_.nkv * d_.hd * ActSize();  // K and V of one position
  Case c;
  c.op = "PagedAttention";
  c.shape = absl::StrFormat("%d seq x %d tok, ctx %d, %d/%d heads, hd %d, block %d", seqs, len, ctx,
                            d_.nh, d_.nkv, d_.hd, d_.block);
  c.bytes = 2.0 * t * d_.nh * d_.hd * ActSize() + static_cast<double>(seqs) * ctx * kv_row;
  // QK^T and PV: 4 FLOPs per (query head, attended position, dim).
  const double attended =
      prefill ? static_cast<double>(ctx) * (ctx + 1) / 2.0 : static_cast<double>(seqs) * ctx;
  c.flops = 4.0 * d_.nh * d_.hd * attended;
  c.sets = Sets(c.bytes);
  // One step's block tables (a random permutation) for every set; each set has its own K/V cache
  // (as each attention layer in the engine).
  const int num_blocks = seqs * blocks_per_seq;
  const std::vector<int32_t> table = Permutation(num_blocks);
  auto segs =
      std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, -1, blocks_per_seq, &table, 0));
  struct Set {
    Tensor q, kc, vc, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  for (int s = 0; s < c.sets; ++s) {
    Set x;
    x.q = Rand(act_, {t, d_.nh, d_.hd});
    x.kc = Rand(act_, {num_blocks, d_.block, d_.nkv, d_.hd});
    x.vc = Rand(act_, {num_blocks, d_.block, d_.nkv, d_.hd});
    x.out = Act({t, d_.nh, d_.hd});
    sets->push_back(std::move(x));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d_.hd));
  c.run = [this, sets, segs, scale](int s) {
    Set& x = (*sets)[s];
    be_->PagedAttention(x.q, x.kc, x.vc, segs->segs, scale, x.out);
  };
  c.stage = Stager(segs, t, ctx);
  return c;
}

Case Bench::Moe(int tokens) {
  const int64_t h = d_.hidden, inter = d_.inter, e = d_.experts, k = d_.topk;
  if (!moe_bank_) {
    moe_bank_ = std::make_shared<std::pair<Tensor, Tensor>>(
        Rand(act_, {e, 2 * inter, h}, -0.03f, 0.03f), Rand(act_, {e, h, inter}, -0.03f, 0.03f));
  }
  const double expert_bytes = 3.0 * inter * h * ActSize();
  Case c;
  c.op = "MoeExperts";
  c.sets = 0;
  struct Set {
    Tensor x, ids, weights, out;
  };
  auto sets = std::make_shared<std::vector<Set>>();
  // Uniform routing: k distinct experts per token. Sets until 4 x L2 of touched weights.
  double touched_sum = 0;
  int touched_first = 0;
  std::vector<char> seen(e);
  while (c.sets == 0 || (c.sets < 64 && touched_sum < rotate_bytes_ && cuda_) ||
         (!cuda_ && c.sets < 2)) {
    std::vector<int32_t> ids(tokens * k);
    std::vector<float> w(tokens * k);
    std::fill(seen.begin(), seen.end(), 0);
    int touched = 0;
    for (int t = 0; t < tokens; ++t) {
      std::vector<int32_t> pick;
      while (static_cast<int64_t>(pick.size()) < k) {
        const int32_t id = static_cast<int32_t>(rng_() % e);
        if (std::find(pick.begin(), pick.end(), id) == pick.end()) pick.push_back(id);
      }
      float sum = 0;
      for (int j = 0; j < k; ++j) {
        ids[t * k + j] = pick[j];
        w[t * k + j] = 0.05f + static_cast<float>(rng_() % 1000) / 1000.f;
        sum += w[t * k + j];
        if (!seen[pick[j]]) ++touched;
        seen[pick[j]] = 1;
      }
      for (int j = 0; j < k; ++j) w[t * k + j] /= sum;
    }
    Set x;
    x.x = Rand(act_, {tokens, h});
    x.ids = Ints(ids, {tokens, k});
    x.weights = F32({tokens, k});
    be_->CopyFromHost(w.data(), DType::kF32, x.weights);
    x.out = Rand(act_, {tokens, h});
    sets->push_back(std::move(x));
    if (c.sets == 0) touched_first = touched;
    touched_sum += touched * expert_bytes;
    ++c.sets;
  }
  c.shape = absl::StrFormat("%d tok, top-%d of %d experts (%d touched), H %d, I %d", tokens, k, e,
                            touched_first, h, inter);
  c.note = absl::StrFormat("touched %d", touched_first);
  c.bytes = touched_sum / c.sets + tokens * h * ActSize() * 3.0 + tokens * k * 8.0;
  c.flops = 2.0 * tokens * k * 3.0 * inter * h;
  auto bank = moe_bank_;
  c.run = [this, sets, bank](int s) {
    Set& x = (*sets)[s];
    be_->MoeExperts(x.x, x.ids, x.weights, bank->first, bank->second, 0, x.out, {});
  };
  return c;
}

Case Bench::Linear(int m, int n, int k) {
  Case c;
  c.op = "Linear";
  c.shape = absl::StrFormat("[%d, %d] x [%d, %d]^T (cuBLASLt)", m, k, n, k);
  c.bytes = (static_cast<double>(m) * k + static_cast<double>(n) * k + static_cast<double>(m) * n) *
            ActSize();
  c.flops = 2.0 * m * static_cast<double>(n) * k;
  c.sets = Sets(c.bytes);
  auto w = std::make_shared<std::vector<Tensor>>();
  auto x = std::make_shared<std::vector<Tensor>>();
  auto y = std::make_shared<std::vector<Tensor>>();
  for (int s = 0; s < c.sets; ++s) {
    x->push_back(Rand(act_, {m, k}));
    w->push_back(Rand(act_, {n, k}, -0.05f, 0.05f));
    y->push_back(Act({m, n}));
  }
  c.run = [this, x, w, y](int s) { be_->Linear((*x)[s], (*w)[s], (*y)[s]); };
  return c;
}

// Several projections of one input through Backend::LinearFanOut (bf16 outputs).
Case Bench::LinearFanOut(int m, std::vector<int> ns, int k) {
  Case c;
  c.op = "LinearFanOut";
  double n_total = 0;
  for (int n : ns) n_total += n;
  c.shape = absl::StrFormat("[%d, %d] x %d weights [%s, %d]^T", m, k, ns.size(),
                            absl::StrJoin(ns, "|"), k);
  c.bytes = (static_cast<double>(m) * k + n_total * k + m * n_total) * ActSize();
  c.flops = 2.0 * m * n_total * k;
  c.sets = Sets(c.bytes);
  struct Set {
    Tensor x;
    std::vector<Tensor> w, y;
  };
  auto v = std::make_shared<std::vector<Set>>();
  for (int s = 0; s < c.sets; ++s) {
    Set set;
    set.x = Rand(act_, {m, k});
    for (int n : ns) {
      set.w.push_back(Rand(act_, {n, k}, -0.05f, 0.05f));
      set.y.push_back(Act({m, n}));
    }
    v->push_back(std::move(set));
  }
  c.run = [this, v](int s) {
    Set& set = (*v)[s];
    std::vector<const Tensor*> ws;
    std::vector<Tensor*> ys;
    for (size_t i = 0; i < set.w.size(); ++i) {
      ws.push_back(&set.w[i]);
      ys.push_back(&set.y[i]);
    }
    be_->LinearFanOut(set.x, ws, ys);
  };
  return c;
}

void Bench::BuildSpecs() {
  const Dims& d = d_;
  // Gated DeltaNet.
  for (int b : d.decode_batches) {
    Add(absl::StrFormat("gdr.decode.B%d", b),
        [=, this] { return DeltaRule(b, 1, DeltaRuleAlgorithm::kAuto); });
  }
  for (auto algo :
       {DeltaRuleAlgorithm::kAuto, DeltaRuleAlgorithm::kRecurrent, DeltaRuleAlgorithm::kChunked}) {
    Add(absl::StrFormat("gdr.prefill.1x%s.%s", K(d.prefill), AlgoName(algo)),
        [=, this] { return DeltaRule(1, d.prefill, algo); });
    Add(absl::StrFormat("gdr.prefill.%dx%s.%s", d.multi_seqs, K(d.multi_len), AlgoName(algo)),
        [=, this] { return DeltaRule(d.multi_seqs, d.multi_len, algo); });
  }
  std::vector<int> conv_batches = {d.decode_batches.front(),
                                   d.decode_batches[d.decode_batches.size() / 2],
                                   d.decode_batches.back()};
  conv_batches.erase(std::unique(conv_batches.begin(), conv_batches.end()), conv_batches.end());
  for (int b : conv_batches) {
    Add(absl::StrFormat("conv.decode.B%d", b), [=, this] { return Conv(b, 1); });
  }
  Add(absl::StrFormat("conv.prefill.1x%s", K(d.prefill)), [=, this] { return Conv(1, d.prefill); });
  Add(absl::StrFormat("conv.prefill.%dx%s", d.multi_seqs, K(d.multi_len)),
      [=, this] { return Conv(d.multi_seqs, d.multi_len); });
  for (int t : d.rows) {
    Add(absl::StrFormat("gates.T%d", t), [=, this] {
      Case c;
      c.op = "DeltaRuleGates";
      c.shape = absl::StrFormat("[%d, %d]", t, d.hv);
      c.bytes = 2.0 * t * d.hv * ActSize() + 2.0 * d.hv * ActSize() + 2.0 * t * d.hv * 4;
      c.flops = 10.0 * t * d.hv;
      c.sets = Sets(c.bytes);
      auto a_log = std::make_shared<Tensor>(Rand(act_, {d.hv}, -1.f, 1.f));
      auto dt_bias = std::make_shared<Tensor>(Rand(act_, {d.hv}, -1.f, 1.f));
      auto v = std::make_shared<std::vector<std::array<Tensor, 4>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back(
            {Rand(act_, {t, d.hv}), Rand(act_, {t, d.hv}), F32({t, d.hv}), F32({t, d.hv})});
      }
      c.run = [this, v, a_log, dt_bias](int s) {
        auto& x = (*v)[s];
        be_->DeltaRuleGates(x[0], x[1], *a_log, *dt_bias, x[2], x[3]);
      };
      return c;
    });
    Add(absl::StrFormat("gated_rmsnorm.T%d", t), [=, this] {
      const int64_t r = static_cast<int64_t>(t) * d.hv;
      Case c;
      c.op = "GatedRmsNorm";
      c.shape = absl::StrFormat("[%d, %d] (T %d x Hv %d)", r, d.dv, t, d.hv);
      c.bytes = 3.0 * r * d.dv * ActSize() + d.dv * ActSize();
      c.flops = 8.0 * r * d.dv;
      c.sets = Sets(c.bytes);
      auto w = std::make_shared<Tensor>(Rand(act_, {d.dv}, 0.5f, 1.5f));
      auto v = std::make_shared<std::vector<std::array<Tensor, 3>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {r, d.dv}), Rand(act_, {r, d.dv}), Act({r, d.dv})});
      }
      c.run = [this, v, w, d](int s) {
        auto& x = (*v)[s];
        be_->GatedRmsNorm(x[0], x[1], *w, d.eps, x[2]);
      };
      return c;
    });
  }
  // Gated attention.
  for (int t : d.rows) {
    const bool decode = t == d.rows.front();
    Add(absl::StrFormat("qknorm_rope.T%d", t), [=, this] {
      Case c;
      c.op = "QkNormRope";
      c.shape = absl::StrFormat("%s, q_gate [%d, %d, %d], k [%d, %d, %d], rotary %d",
                                decode ? "decode" : "prefill", t, d.nh, 2 * d.hd, t, d.nkv, d.hd,
                                d.rotary);
      c.bytes = (static_cast<double>(t) * d.nh * 2 * d.hd + 2.0 * t * d.nkv * d.hd +
                 2.0 * t * d.nh * d.hd + 2.0 * d.hd) *
                ActSize();
      c.flops = 10.0 * t * (d.nh + d.nkv) * d.hd;
      c.sets = Sets(c.bytes);
      struct Set {
        Tensor qg, k, q, gate;
      };
      auto v = std::make_shared<std::vector<Set>>();
      auto qn = std::make_shared<Tensor>(Rand(act_, {d.hd}, -0.1f, 0.1f));
      auto kn = std::make_shared<Tensor>(Rand(act_, {d.hd}, -0.1f, 0.1f));
      auto segs = std::make_shared<SegmentSet>(decode ? MakeSegments(t, 1, 1000, -1, 0, nullptr, 0)
                                                      : MakeSegments(1, t, 0, -1, 0, nullptr, 0));
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        x.qg = Rand(act_, {t, d.nh, 2 * d.hd});
        x.k = Rand(act_, {t, d.nkv, d.hd});
        x.q = Act({t, d.nh, d.hd});
        x.gate = Act({t, d.nh, d.hd});
        v->push_back(std::move(x));
      }
      const RopeParams rope{d.rotary, d.rope_theta};
      c.run = [this, v, segs, qn, kn, rope, d](int s) {
        Set& x = (*v)[s];
        be_->QkNormRope(x.qg, x.k, *qn, *kn, d.eps, rope, segs->segs, x.q, x.gate);
      };
      c.stage = Stager(segs, t, decode ? 1001 : t);
      return c;
    });
    Add(absl::StrFormat("write_kv.T%d", t), [=, this] {
      const int seqs = decode ? t : 1, len = decode ? 1 : t, cached = decode ? 1000 : 0;
      const int bps = (cached + len + d.block - 1) / d.block;
      Case c;
      c.op = "WriteKvCache";
      c.shape = absl::StrFormat("%s, k/v [%d, %d, %d], block %d", decode ? "decode" : "prefill", t,
                                d.nkv, d.hd, d.block);
      c.bytes = 4.0 * t * d.nkv * d.hd * ActSize();
      c.flops = 0;
      c.sets = Sets(c.bytes);
      // One step's block tables for every set, a K/V cache per set (as per layer in the engine).
      const int num_blocks = seqs * bps;
      const std::vector<int32_t> table = Permutation(num_blocks);
      auto segs = std::make_shared<SegmentSet>(MakeSegments(seqs, len, cached, -1, bps, &table, 0));
      struct Set {
        Tensor k, v, kc, vc;
      };
      auto v = std::make_shared<std::vector<Set>>();
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        x.k = Rand(act_, {t, d.nkv, d.hd});
        x.v = Rand(act_, {t, d.nkv, d.hd});
        x.kc = Act({num_blocks, d.block, d.nkv, d.hd});
        x.vc = Act({num_blocks, d.block, d.nkv, d.hd});
        v->push_back(std::move(x));
      }
      c.run = [this, v, segs](int s) {
        Set& x = (*v)[s];
        be_->WriteKvCache(x.k, x.v, segs->segs, x.kc, x.vc);
      };
      c.stage = Stager(segs, t, cached + len);
      return c;
    });
  }
  for (int b : d.decode_batches) {
    for (int ctx : d.contexts) {
      Add(absl::StrFormat("attn.decode.B%d.ctx%s", b, K(ctx)),
          [=, this] { return Attention(b, ctx, false); });
    }
  }
  Add(absl::StrFormat("attn.prefill.1x%s", K(d.prefill)),
      [=, this] { return Attention(1, d.prefill, true); });
  for (int t : d.rows) {
    Add(absl::StrFormat("mul_sigmoid.T%d", t), [=, this] {
      const int64_t n = static_cast<int64_t>(d.nh) * d.hd;
      Case c;
      c.op = "MulSigmoid";
      c.shape = absl::StrFormat("[%d, %d]", t, n);
      c.bytes = 3.0 * t * n * ActSize();
      c.flops = 4.0 * t * n;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s) v->push_back({Rand(act_, {t, n}), Rand(act_, {t, n})});
      c.run = [this, v](int s) { be_->MulSigmoid((*v)[s][0], (*v)[s][1]); };
      return c;
    });
  }
  // MoE. Top-k over fp32 logits, as the engine's router writes them, from one token to a long
  // prefill (the block- and warp-per-token kernels cross over in between; MOBIUS_TOPK).
  for (int t : d.topk_tokens) {
    Add(absl::StrFormat("topk_softmax.T%d", t), [=, this] {
      Case c;
      c.op = "TopKSoftmax";
      c.shape = absl::StrFormat("[%d, %d] fp32, k %d", t, d.experts, d.topk);
      c.bytes = static_cast<double>(t) * d.experts * 4.0 + 8.0 * t * d.topk;
      c.flops = 4.0 * t * d.experts;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 3>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(DType::kF32, {t, d.experts}, -4.f, 4.f), Alloc(DType::kI32, {t, d.topk}),
                      F32({t, d.topk})});
      }
      c.run = [this, v, d](int s) {
        auto& x = (*v)[s];
        be_->TopKSoftmax(x[0], d.topk, true, x[1], x[2]);
      };
      return c;
    });
  }
  for (int t : d.moe_tokens) {
    Add(absl::StrFormat("moe.T%d", t), [=, this] { return Moe(t); });
  }
  // Dense. The norms also at one row: the one-block kernel between a decode step's projections.
  std::vector<int> norm_rows = d.rows;
  norm_rows.insert(norm_rows.begin(), 1);
  for (int t : norm_rows) {
    Add(absl::StrFormat("rmsnorm1p.T%d", t), [=, this] {
      Case c;
      c.op = "RmsNorm1p";
      c.shape = absl::StrFormat("[%d, %d]", t, d.hidden);
      c.bytes = 2.0 * t * d.hidden * ActSize() + d.hidden * ActSize();
      c.flops = 4.0 * t * d.hidden;
      c.sets = Sets(c.bytes);
      auto w = std::make_shared<Tensor>(Rand(act_, {d.hidden}, -0.1f, 0.1f));
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s)
        v->push_back({Rand(act_, {t, d.hidden}), Act({t, d.hidden})});
      c.run = [this, v, w, d](int s) { be_->RmsNorm1p((*v)[s][0], *w, d.eps, (*v)[s][1]); };
      return c;
    });
    Add(absl::StrFormat("add_rmsnorm1p.T%d", t), [=, this] {
      Case c;
      c.op = "AddRmsNorm1p";
      c.shape = absl::StrFormat("[%d, %d]", t, d.hidden);
      c.bytes = 4.0 * t * d.hidden * ActSize() + d.hidden * ActSize();
      c.flops = 5.0 * t * d.hidden;
      c.sets = Sets(c.bytes);
      auto w = std::make_shared<Tensor>(Rand(act_, {d.hidden}, -0.1f, 0.1f));
      auto v = std::make_shared<std::vector<std::array<Tensor, 3>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {t, d.hidden}), Rand(act_, {t, d.hidden}), Act({t, d.hidden})});
      }
      c.run = [this, v, w, d](int s) {
        auto& x = (*v)[s];
        be_->AddRmsNorm1p(x[0], x[1], *w, d.eps, x[2]);
      };
      return c;
    });
    Add(absl::StrFormat("add.T%d", t), [=, this] {
      Case c;
      c.op = "Add";
      c.shape = absl::StrFormat("[%d, %d]", t, d.hidden);
      c.bytes = 3.0 * t * d.hidden * ActSize();
      c.flops = 1.0 * t * d.hidden;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {t, d.hidden}), Rand(act_, {t, d.hidden}, -1e-3f, 1e-3f)});
      }
      c.run = [this, v](int s) { be_->Add((*v)[s][0], (*v)[s][1]); };
      return c;
    });
    Add(absl::StrFormat("add_sigmoid_scaled.T%d", t), [=, this] {
      Case c;
      c.op = "AddSigmoidScaled";
      c.shape = absl::StrFormat("[%d, %d], gate [%d, 1]", t, d.hidden, t);
      c.bytes = 3.0 * t * d.hidden * ActSize() + t * ActSize();
      c.flops = 2.0 * t * d.hidden;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 3>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {t, d.hidden}), Rand(act_, {t, d.hidden}, -1e-3f, 1e-3f),
                      Rand(act_, {t, 1}, -2.f, 2.f)});
      }
      c.run = [this, v](int s) {
        auto& x = (*v)[s];
        be_->AddSigmoidScaled(x[0], x[1], x[2]);
      };
      return c;
    });
    Add(absl::StrFormat("silu_mul.T%d", t), [=, this] {
      Case c;
      c.op = "SiluAndMul";
      c.shape = absl::StrFormat("[%d, %d] -> [%d, %d]", t, 2 * d.shared_inter, t, d.shared_inter);
      c.bytes = 3.0 * t * d.shared_inter * ActSize();
      c.flops = 6.0 * t * d.shared_inter;
      c.sets = Sets(c.bytes);
      auto v = std::make_shared<std::vector<std::array<Tensor, 2>>>();
      for (int s = 0; s < c.sets; ++s) {
        v->push_back({Rand(act_, {t, 2 * d.shared_inter}), Act({t, d.shared_inter})});
      }
      c.run = [this, v](int s) { be_->SiluAndMul((*v)[s][0], (*v)[s][1]); };
      return c;
    });
    Add(absl::StrFormat("embedding.T%d", t), [=, this] {
      Case c;
      c.op = "EmbeddingLookup";
      c.shape = absl::StrFormat("%d ids, table [%d, %d]", t, d.vocab, d.hidden);
      c.bytes = 2.0 * t * d.hidden * ActSize() + 4.0 * t;
      c.flops = 0;
      c.sets = Sets(c.bytes);
      auto table = std::make_shared<Tensor>(Rand(act_, {d.vocab, d.hidden}));
      struct Set {
        std::vector<int32_t> ids;
        Tensor out;
      };
      auto v = std::make_shared<std::vector<Set>>();
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        for (int i = 0; i < t; ++i) x.ids.push_back(static_cast<int32_t>(rng_() % d.vocab));
        x.out = Act({t, d.hidden});
        v->push_back(std::move(x));
      }
      c.run = [this, v, table](int s) { be_->EmbeddingLookup((*v)[s].ids, *table, (*v)[s].out); };
      return c;
    });
    Add(absl::StrFormat("gather_rows.T%d", t), [=, this] {
      Case c;
      c.op = "GatherRows";
      c.shape = absl::StrFormat("%d of %d rows of %d", t, t, d.hidden);
      c.bytes = 2.0 * t * d.hidden * ActSize() + 4.0 * t;
      c.flops = 0;
      c.sets = Sets(c.bytes);
      struct Set {
        std::vector<int32_t> rows;
        Tensor x, out;
      };
      auto v = std::make_shared<std::vector<Set>>();
      for (int s = 0; s < c.sets; ++s) {
        Set x;
        x.rows = Permutation(t);
        x.x = Rand(act_, {t, d.hidden});
        x.out = Act({t, d.hidden});
        v->push_back(std::move(x));
      }
      c.run = [this, v](int s) { be_->GatherRows((*v)[s].x, (*v)[s].rows, (*v)[s].out); };
      return c;
    });
  }
  // Dense projections through cuBLASLt, for reference (the in-projection of a DeltaNet layer is
  // [T, 2048] -> 12352; 8192 is a round stand-in), the lm_head, and the matrix-rate probe.
  const int in_proj = 2 * d.hk * d.dk + 2 * d.hv * d.dv + 2 * d.hv;
  for (int t : {1, d.rows.front(), d.rows.back()}) {
    Add(absl::StrFormat("linear.%dx%dx%d", t, in_proj, d.hidden),
        [=, this] { return Linear(t, in_proj, d.hidden); });
  }
  // The DeltaNet out-projection at decode batches 1 and 8 (K = 4096: split K in the skinny
  // kernel) and the in-projection at batch 8.
  for (int t : {1, 8}) {
    Add(absl::StrFormat("linear.%dx%dx%d", t, d.hidden, d.hv * d.dv),
        [=, this] { return Linear(t, d.hidden, d.hv * d.dv); });
  }
  Add(absl::StrFormat("linear.%dx%dx%d", 8, in_proj, d.hidden),
      [=, this] { return Linear(8, in_proj, d.hidden); });
  // The fan-outs of a decode step (skinny kernel at 1 row, tensor-core GEMV at 2-8): a DeltaNet
  // layer's four in-projections, and the shared expert's gate_up + its gate + the router.
  for (int t : {1, 2, 4, 8}) {
    Add(absl::StrFormat("fanout.deltanet_in.T%d", t), [=, this] {
      return LinearFanOut(t, {2 * d.hk * d.dk + d.hv * d.dv, d.hv * d.dv, d.hv, d.hv}, d.hidden);
    });
    Add(absl::StrFormat("fanout.ffn_in.T%d", t), [=, this] {
      return LinearFanOut(t, {2 * d.shared_inter, 1, d.experts}, d.hidden);
    });
  }
  // Single projections through the skinny kernel (a fan-out of one), beside linear.* (cuBLASLt):
  // the DeltaNet out-projection and the shared expert's down projection at batch 1.
  for (int t : {1, 4, 8}) {
    Add(absl::StrFormat("fanout.single.%dx%dx%d", t, d.hidden, d.hv * d.dv),
        [=, this] { return LinearFanOut(t, {d.hidden}, d.hv * d.dv); });
  }
  Add("fanout.single.1x2048x512",
      [=, this] { return LinearFanOut(1, {d.hidden}, d.shared_inter); });
  Add("linear.1x2048x512", [=, this] { return Linear(1, d.hidden, d.shared_inter); });
  Add(absl::StrFormat("linear.lm_head.%dx%dx%d", 1, d.vocab, d.hidden),
      [=, this] { return Linear(1, d.vocab, d.hidden); });
  Add(absl::StrFormat("linear.%dx%dx%d", d.gemm, d.gemm, d.gemm),
      [=, this] { return Linear(d.gemm, d.gemm, d.gemm); });
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

Result Bench::Time(const std::string& name, Case& c) {
  Result r;
  r.name = name;
  r.op = c.op;
  r.shape = c.shape;
  r.bytes = c.bytes;
  r.flops = c.flops;
  r.sets = c.sets;
  r.note = c.note;
  // Ops with segments: first without staging (every call uploads its metadata), then with the
  // step staged once, as the engine runs them.
  if (c.stage && !opt_.unstaged) {
    Result unstaged = r;
    TimeCalls(c, unstaged);
    c.stage();
    TimeCalls(c, r);
    TimeRecorded(c, r);
    be_->ClearStep();
    r.unstaged_us = unstaged.time_us;
  } else {
    TimeCalls(c, r);
    if (c.stage) r.unstaged_us = r.time_us;
  }
  if (cuda_) CheckCuda(cudaGetLastError(), name.c_str());
  const double mem_us = bandwidth_ > 0 ? r.bytes / bandwidth_ * 1e6 : 0;
  const double mma_us = matrix_rate_ > 0 ? r.flops / matrix_rate_ * 1e6 : 0;
  r.bound_us = std::max(mem_us, mma_us);
  r.bound_by = mma_us > mem_us ? "mma" : "mem";
  return r;
}

void Bench::TimeRecorded(Case& c, Result& r) {
  if (stream_ == nullptr || !be_->SupportsCapture() || opt_.no_graph) return;
  // Enough calls per recording that the replay's own launch is a small share, every input set at
  // least once; replays are timed between two events, best of a few.
  const int calls = std::max(64, c.sets);
  if (absl::Status began = be_->BeginCapture(); !began.ok()) {
    std::fprintf(stderr, "graph timing skipped: %s\n", std::string(began.message()).c_str());
    return;
  }
  for (int i = 0; i < calls; ++i) c.run(i % c.sets);
  auto step = be_->EndCapture();
  if (!step.ok()) {
    std::fprintf(stderr, "graph timing skipped: %s\n",
                 std::string(step.status().message()).c_str());
    return;
  }
  std::vector<double> per_call;
  for (int rep = 0; rep < 6; ++rep) {
    CheckCuda(cudaEventRecord(events_[0], stream_), "cudaEventRecord");
    if (absl::Status replayed = be_->Replay(**step); !replayed.ok()) {
      std::fprintf(stderr, "graph timing skipped: %s\n", std::string(replayed.message()).c_str());
      return;
    }
    CheckCuda(cudaEventRecord(events_[1], stream_), "cudaEventRecord");
    be_->Synchronize();
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, events_[0], events_[1]), "cudaEventElapsedTime");
    if (rep > 0) per_call.push_back(ms * 1e3 / calls);  // the first replay uploads the graph
  }
  r.graph_us = Median(per_call);
}

void Bench::TimeChain(const std::vector<std::string>& names) {
  const std::string label = absl::StrJoin(names, " -> ");
  if (stream_ == nullptr || !be_->SupportsCapture()) {
    std::printf("chain %s: needs the CUDA backend's stream and graph capture\n", label.c_str());
    return;
  }
  std::vector<Case> cases;
  int staged = 0, rounds = 64;
  for (const std::string& name : names) {
    auto it =
        std::find_if(specs_.begin(), specs_.end(), [&](const Spec& s) { return s.name == name; });
    if (it == specs_.end()) Die("--chain: no case named " + name + " (see --list)");
    cases.push_back(it->make());
    if (cases.back().stage) ++staged;
    rounds = std::max(rounds, cases.back().sets);
  }
  if (staged > 1) Die("--chain " + label + ": more than one case with segments");
  // Capture needs a staged step even when no case reads one: a one-token step, kept alive until
  // ClearStep (the backend keeps the spans' addresses).
  std::function<void()> one_token_step;
  if (staged == 0) {
    one_token_step =
        Stager(std::make_shared<SegmentSet>(MakeSegments(1, 1, 0, 0, 0, nullptr, 0)), 1, 1);
    one_token_step();
  }
  for (Case& c : cases) {
    if (c.stage) c.stage();
    for (int s = 0; s < c.sets; ++s) c.run(s);  // warm-up: modules, heuristics, scratch
  }
  be_->Synchronize();
  if (absl::Status began = be_->BeginCapture(); !began.ok()) {
    Die("--chain " + label + ": " + std::string(began.message()));
  }
  for (int i = 0; i < rounds; ++i) {
    for (Case& c : cases) c.run(i % c.sets);
  }
  auto step = be_->EndCapture();
  if (!step.ok()) Die("--chain " + label + ": " + std::string(step.status().message()));
  std::vector<double> per_round;
  for (int rep = 0; rep < 8; ++rep) {
    CheckCuda(cudaEventRecord(events_[0], stream_), "cudaEventRecord");
    if (absl::Status replayed = be_->Replay(**step); !replayed.ok()) {
      Die("--chain " + label + ": " + std::string(replayed.message()));
    }
    CheckCuda(cudaEventRecord(events_[1], stream_), "cudaEventRecord");
    be_->Synchronize();
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, events_[0], events_[1]), "cudaEventElapsedTime");
    if (rep > 0) per_round.push_back(ms * 1e3 / rounds);  // the first replay uploads the graph
  }
  be_->ClearStep();
  double bytes = 0;
  for (const Case& c : cases) bytes += c.bytes;
  const double bound = bandwidth_ > 0 ? bytes / bandwidth_ * 1e6 : 0;
  std::printf("chain %s: %.2f us per round (%d rounds in one graph; bytes bound %.2f us)\n",
              label.c_str(), Median(per_round), rounds, bound);
  std::fflush(stdout);
}

void Bench::TimeCalls(Case& c, Result& r) {
  int next = 0;
  auto run_next = [&] {
    c.run(next);
    next = (next + 1) % c.sets;
  };
  // Warm-up: every set once (at least 3 calls): module loads, cuBLASLt heuristics, scratch growth.
  be_->Synchronize();
  Clock::time_point t0 = Clock::now();
  const int warm = std::max(3, c.sets);
  for (int i = 0; i < warm; ++i) run_next();
  const double warm_host_s = SecondsSince(t0);
  be_->Synchronize();
  const double warm_total_s = SecondsSince(t0);
  const double est_s = std::max(warm_total_s / warm, 1e-7);  // rough time per call
  const int iters = std::clamp(static_cast<int>(opt_.max_case_ms * 1e-3 / est_s), 5, opt_.iters);
  r.iters = iters;
  std::vector<double> times;
  std::vector<double> host;
  if (stream_ == nullptr) {
    r.timing = "host";
    for (int i = 0; i < iters; ++i) {
      be_->Synchronize();
      t0 = Clock::now();
      run_next();
      be_->Synchronize();
      times.push_back(SecondsSince(t0) * 1e6);
    }
    r.host_us = warm_host_s / warm * 1e6;
  } else {
    r.timing = "events";
    double host_per_call = warm_host_s / warm;
    for (int done = 0; done < iters;) {
      const int n = std::min(kBatch, iters - done);
      // Long enough for the host to queue the batch (twice the warm-up's enqueue time), >= 0.5 ms.
      const double sleep_s = std::clamp(2.0 * n * host_per_call + 2e-4, 5e-4, 0.2);
      CheckCuda(SleepOnStream(stream_, static_cast<uint64_t>(sleep_s * 1e9)), "sleep kernel");
      t0 = Clock::now();
      for (int i = 0; i < n; ++i) {
        CheckCuda(cudaEventRecord(events_[2 * i], stream_), "cudaEventRecord");
        run_next();
        CheckCuda(cudaEventRecord(events_[2 * i + 1], stream_), "cudaEventRecord");
      }
      const double queued_s = SecondsSince(t0);
      host.push_back(queued_s / n * 1e6);
      host_per_call = std::max(host_per_call, queued_s / n);
      be_->Synchronize();
      double busy_s = sleep_s;
      for (int i = 0; i < n; ++i) {
        float ms = 0;
        CheckCuda(cudaEventElapsedTime(&ms, events_[2 * i], events_[2 * i + 1]),
                  "cudaEventElapsedTime");
        times.push_back(ms * 1e3);
        busy_s += ms * 1e-3;
      }
      // The host took longer to queue the batch than the device took to run it: the device
      // waited for the host somewhere (an op that blocks the host, e.g. a large upload from
      // pageable memory, which waits for the device to reach it).
      if (queued_s > busy_s) ++r.gap_batches;
      done += n;
    }
    r.host_us = Median(host);
  }
  r.time_us = Median(times);
  r.min_us = *std::min_element(times.begin(), times.end());
}

void Bench::MeasureCeilings() {
  if (opt_.bandwidth > 0) {
    bandwidth_ = opt_.bandwidth;
    bandwidth_src_ = "given (--bandwidth)";
  } else {
    const size_t bytes = opt_.smoke ? (64u << 20) : (size_t{2} << 30);
    auto bw = be_->MeasureCopyBandwidth(bytes);
    if (bw.ok()) {
      bandwidth_ = *bw;
      bandwidth_src_ =
          absl::StrFormat("Backend::MeasureCopyBandwidth(%d MiB), read + write", bytes >> 20);
    } else {
      bandwidth_ = 50e9;
      bandwidth_src_ = "nominal 50 GB/s (" + std::string(bw.status().message()) + ")";
    }
  }
  if (opt_.matrix_rate > 0) {
    matrix_rate_ = opt_.matrix_rate;
    matrix_src_ = "given (--matrix-tflops)";
  } else {
    Case c = Linear(d_.gemm, d_.gemm, d_.gemm);
    Result r = Time("matrix-rate probe", c);
    matrix_rate_ = c.flops / (r.time_us * 1e-6);
    matrix_src_ = absl::StrFormat("Backend::Linear %dx%dx%d bf16 (cuBLASLt), median %.1f us",
                                  d_.gemm, d_.gemm, d_.gemm, r.time_us);
  }
}

std::string Bytes(double b) {
  if (b >= 1e9) return absl::StrFormat("%.2f GB", b / 1e9);
  if (b >= 1e6) return absl::StrFormat("%.2f MB", b / 1e6);
  return absl::StrFormat("%.1f KB", b / 1e3);
}

void Bench::Print(const std::vector<Result>& results) const {
  std::printf("\n%-32s %10s %10s %9s %11s %9s %10s %9s %10s %4s %8s %9s %8s\n", "case", "time us",
              "min us", "host us", "unstaged us", "graph us", "bytes", "GFLOP", "bound us", "by",
              "x bound", "GB/s", "TFLOP/s");
  for (const Result& r : results) {
    const std::string unstaged =
        r.unstaged_us > 0 ? absl::StrFormat("%.2f", r.unstaged_us) : std::string("-");
    const std::string graph =
        r.graph_us > 0 ? absl::StrFormat("%.2f", r.graph_us) : std::string("-");
    std::printf("%-32s %10.2f %10.2f %9.2f %11s %9s %10s %9.3f %10.2f %4s %8.2f %9.1f %8.2f%s\n",
                r.name.c_str(), r.time_us, r.min_us, r.host_us, unstaged.c_str(), graph.c_str(),
                Bytes(r.bytes).c_str(), r.flops / 1e9, r.bound_us, r.bound_by.c_str(),
                r.bound_us > 0 ? r.time_us / r.bound_us : 0.0, r.bytes / (r.time_us * 1e-6) / 1e9,
                r.flops / (r.time_us * 1e-6) / 1e12,
                r.timing == "host" ? "  (host-timed)" : (r.gap_batches ? "  (host gaps)" : ""));
  }
  std::printf(
      "\ntime: median per call (ops with segments: with the step staged once, StageStep); host: "
      "host time to queue one call; unstaged: median with every call uploading its metadata; "
      "graph: per call in a replayed CUDA graph of >= 64 calls (staged ops); "
      "bound: max(bytes / %.0f GB/s, FLOPs / %.1f TFLOP/s)\n",
      bandwidth_ / 1e9, matrix_rate_ / 1e12);
}

std::string Now() {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

void Bench::WriteJson(const std::vector<Result>& results) const {
  nlohmann::json j;
  j["tool"] = "mobius_kernel_bench";
  j["date"] = Now();
  j["device"] = be_->name();
  j["gpu"] = gpu_;
  j["note"] = opt_.note;
  j["l2_bytes"] = l2_bytes_;
  j["copy_bandwidth_bytes_per_s"] = bandwidth_;
  j["copy_bandwidth_source"] = bandwidth_src_;
  j["matrix_flops_per_s"] = matrix_rate_;
  j["matrix_source"] = matrix_src_;
  j["iters"] = opt_.iters;
  j["smoke"] = opt_.smoke;
  nlohmann::json cases = nlohmann::json::array();
  for (const Result& r : results) {
    cases.push_back({{"name", r.name},
                     {"impl", "mobius"},
                     {"op", r.op},
                     {"shape", r.shape},
                     {"timing", r.timing},
                     {"time_us", r.time_us},
                     {"min_us", r.min_us},
                     {"host_us", r.host_us},
                     {"unstaged_us", r.unstaged_us},
                     {"graph_us", r.graph_us},
                     {"bytes", r.bytes},
                     {"flops", r.flops},
                     {"bound_us", r.bound_us},
                     {"bound_by", r.bound_by},
                     {"ratio", r.bound_us > 0 ? r.time_us / r.bound_us : 0.0},
                     {"sets", r.sets},
                     {"iters", r.iters},
                     {"gap_batches", r.gap_batches},
                     {"note", r.note}});
  }
  j["cases"] = cases;
  std::ofstream f(opt_.json);
  if (!f) Die("cannot write " + opt_.json);
  f << j.dump(1) << "\n";
}

int Bench::Run() {
  std::regex re;
  try {
    re = std::regex(opt_.filter);
  } catch (const std::regex_error& e) {
    Die("bad --filter: " + std::string(e.what()));
  }
  if (opt_.list) {
    for (const Spec& s : specs_) std::printf("%s\n", s.name.c_str());
    return 0;
  }
  for (const auto& chain : opt_.chains) {  // names checked before any timing
    for (const std::string& name : chain) {
      if (std::none_of(specs_.begin(), specs_.end(),
                       [&](const Spec& sp) { return sp.name == name; }))
        Die("--chain: no case named " + name + " (see --list)");
    }
  }
  std::printf("mobius_kernel_bench on %s (%s), %s; L2 %.0f MB, input sets rotated over %.0f MB\n",
              be_->name().c_str(), gpu_.c_str(),
              stream_ != nullptr ? "CUDA events on the backend's stream" : "host-timed",
              l2_bytes_ / 1e6, rotate_bytes_ / 1e6);
  MeasureCeilings();
  std::printf("copy bandwidth %.1f GB/s  [%s]\nbf16 matrix rate %.1f TFLOP/s  [%s]\n",
              bandwidth_ / 1e9, bandwidth_src_.c_str(), matrix_rate_ / 1e12, matrix_src_.c_str());
  std::fflush(stdout);
  std::vector<Result> results;
  for (const Spec& s : specs_) {
    if (!std::regex_search(s.name, re)) continue;
    Clock::time_point t0 = Clock::now();
    Case c = s.make();
    const double setup_s = SecondsSince(t0);
    Result r = Time(s.name, c);
    c = Case{};  // frees this case's tensors
    be_->Synchronize();
    std::printf("  %-32s %10.2f us  (bound %.2f us, x%.2f; %d sets, %d iters, setup %.1f s)%s\n",
                r.name.c_str(), r.time_us, r.bound_us, r.bound_us > 0 ? r.time_us / r.bound_us : 0,
                r.sets, r.iters, setup_s, r.gap_batches ? " host gaps" : "");
    std::fflush(stdout);
    results.push_back(std::move(r));
    if (s.name.rfind("moe.", 0) == 0 &&
        (&s == &specs_.back() || (&s + 1)->name.rfind("moe.", 0) != 0)) {
      moe_bank_.reset();
    }
  }
  Print(results);
  if (!opt_.json.empty()) WriteJson(results);
  for (const auto& chain : opt_.chains) TimeChain(chain);
  return 0;
}

}  // namespace
}  // namespace mobius::bench

int main(int argc, char** argv) {
  using namespace mobius;
  bench::Options opt = bench::ParseOptions(argc, argv);
  std::unique_ptr<kernels::Backend> backend;
  cudaStream_t stream = nullptr;
  bool cuda = false;
  if (opt.device == "cuda") {
    g_watch_streams = true;
    auto b = kernels::CreateCudaBackend(0);
    g_watch_streams = false;
    if (!b.ok()) {
      if (!opt.list) bench::Die("no CUDA backend: " + std::string(b.status().message()));
      backend = kernels::CreateCpuBackend(1);
    } else {
      backend = *std::move(b);
      cuda = true;
      if (!g_streams.empty()) stream = g_streams.front();
      if (g_streams.size() != 1) {
        std::fprintf(stderr, "mobius_kernel_bench: CreateCudaBackend created %zu streams; %s\n",
                     g_streams.size(),
                     g_streams.empty() ? "timing on the host" : "timing on the first");
      }
    }
  } else if (opt.device == "cpu") {
    backend = kernels::CreateCpuBackend(0);
  } else {
    bench::Die("--device must be cuda or cpu");
  }
  bench::Bench b(opt, std::move(backend), stream, cuda);
  return b.Run();
}
