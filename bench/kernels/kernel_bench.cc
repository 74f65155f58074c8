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
#include "bench/kernels/kernel_bench.h"
#include "bench/kernels/probe_util.h"
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

void Die(const std::string& msg) {
  std::fprintf(stderr, "mobius_kernel_bench: %s\n", msg.c_str());
  std::exit(1);
}

void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Die(absl::StrFormat("%s: %s", what, cudaGetErrorString(err)));
}

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

namespace {

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

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

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
  absl::StatusOr<double> per_call = ReplayMedianUs(**step, calls, /*replays=*/6);
  if (!per_call.ok()) {
    std::fprintf(stderr, "graph timing skipped: %s\n",
                 std::string(per_call.status().message()).c_str());
    return;
  }
  r.graph_us = *per_call;
}

absl::StatusOr<double> Bench::ReplayMedianUs(kernels::CapturedStep& step, int calls, int replays) {
  std::vector<double> per_call;
  for (int rep = 0; rep < replays; ++rep) {
    CheckCuda(cudaEventRecord(events_[0], stream_), "cudaEventRecord");
    if (absl::Status replayed = be_->Replay(step); !replayed.ok()) return replayed;
    CheckCuda(cudaEventRecord(events_[1], stream_), "cudaEventRecord");
    be_->Synchronize();
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, events_[0], events_[1]), "cudaEventElapsedTime");
    if (rep > 0) per_call.push_back(ms * 1e3 / calls);  // the first replay uploads the graph
  }
  return Median(per_call);
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
  absl::StatusOr<double> per_round = ReplayMedianUs(**step, rounds, /*replays=*/8);
  if (!per_round.ok()) Die("--chain " + label + ": " + std::string(per_round.status().message()));
  be_->ClearStep();
  double bytes = 0;
  for (const Case& c : cases) bytes += c.bytes;
  const double bound = bandwidth_ > 0 ? bytes / bandwidth_ * 1e6 : 0;
  std::printf("chain %s: %.2f us per round (%d rounds in one graph; bytes bound %.2f us)\n",
              label.c_str(), *per_round, rounds, bound);
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
