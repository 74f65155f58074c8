// mobius_step_timeline: where a recorded decode step's time goes, kernel by kernel, from the
// GPU timestamps CUPTI records for every node of the replayed graph.
//
// ncu replays each kernel alone (its per-kernel times run 1.5-2 us above what the kernel costs in
// a PDL chain, docs/cuda-backend.md), and the engine benchmark gives only the step. Here the
// step runs as in `mobius bench engine` (release config, dummy weights, the step recorded and
// replayed), and every kernel's start and end on the GPU are kept. For kernel i of a step, in
// start order:
//   gap      = how long the GPU had no kernel running before it started (start_i minus the
//              latest end so far, when positive): launch latency the chain did not hide;
//   advance  = how far it moved the latest end (end_i minus max(start_i, latest end so far)):
//              its share of the step once overlaps with its predecessors are taken out;
// so a step's span is the sum of its gaps and advances. The report sums both per kernel name,
// and --csv-out writes every kernel position of the step (mean over the timed steps).
//
//   mobius_step_timeline --config 35b.json --batch 1 --context 1024 --steps 10 --csv-out t.csv
//   mobius_step_timeline --config 35b.json --batch 1 --tokens 5 ...   # a verify of 4 drafts
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/flag_spelling.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/model/hybrid_model.h"
#include "worker/model/model_factory.h"

ABSL_FLAG(std::string, config, "",
          "config.json of the model (dummy weights; e.g. the release config "
          "../shared/configs/intern-s2-mobius-35b/config.json). Required.");
ABSL_FLAG(int, batch, 1, "Sequences per decode step (one token each).");
ABSL_FLAG(int, tokens, 1,
          "Tokens per sequence and step: 1 a decode step; 2-8 a speculative verify step of "
          "tokens - 1 drafts, as the engine runs it (every token's logits reduced to its argmax "
          "on the device, every token's hidden row, the DeltaNet state inputs kept).");
ABSL_FLAG(int, context, 1024, "Tokens already cached per sequence.");
ABSL_FLAG(int, steps, 10, "Timed (traced) decode steps, after 3 untraced warm-up steps.");
ABSL_FLAG(int, top, 30, "Kernel names listed in the report, by their summed advance.");
ABSL_FLAG(std::string, csv_out, "",
          "Also write every kernel position of the step (index, name, grid, start offset, "
          "duration, gap, advance; means over the timed steps) to this CSV file.");

namespace mobius::bench {
namespace {

// One GPU activity (a kernel or a memset) as CUPTI reports it.
struct Activity {
  uint64_t start = 0, end = 0;  // ns, GPU clock
  uint32_t correlation = 0;     // the API call that launched it: one graph launch per step
  uint64_t node = 0;            // its graph node (the same in every replay), 0 if none
  std::string name;
  int64_t blocks = 0;
};

std::mutex activities_mutex;
std::vector<Activity> activities;
size_t dropped_records = 0, unreadable_buffers = 0;

std::string ShortName(const char* mangled) {
  if (mangled == nullptr) return "?";
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> demangled(
      abi::__cxa_demangle(mangled, nullptr, nullptr, &status), &std::free);
  std::string name = status == 0 && demangled ? demangled.get() : mangled;
  // Drop the namespaces (first: "(anonymous namespace)" holds a parenthesis), the return type
  // and the parameter list; keep template arguments (they tell the instantiations apart),
  // shortened.
  for (const std::string ns : {"mobius::kernels::cuda::", "(anonymous namespace)::"}) {
    for (size_t at = name.find(ns); at != std::string::npos; at = name.find(ns)) {
      name.erase(at, ns.size());
    }
  }
  if (name.starts_with("void ")) name.erase(0, 5);
  int depth = 0;  // the parameter list opens at the first '(' outside template arguments
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (name[i] == '(' && depth == 0) {
      name.resize(i);
      break;
    }
  }
  if (name.size() > 72) name = name.substr(0, 69) + "...";
  return name;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{16} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext context, uint32_t stream, uint8_t* buffer, size_t,
                              size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(activities_mutex);
  CUptiResult result;
  while ((result = cuptiActivityGetNextRecord(buffer, valid, &record)) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      activities.push_back({k->start, k->end, k->correlationId, k->graphNodeId, ShortName(k->name),
                            int64_t{k->gridX} * k->gridY * k->gridZ});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      activities.push_back({m->start, m->end, m->correlationId, m->graphNodeId, "(memset)", 0});
    }
  }
  // The end of the buffer reads as MAX_LIMIT_REACHED; anything else cut the buffer short.
  if (result != CUPTI_ERROR_MAX_LIMIT_REACHED) ++unreadable_buffers;
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(context, stream, &dropped) == CUPTI_SUCCESS) {
    dropped_records += dropped;
  }
  std::free(buffer);
}

absl::Status Check(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return absl::OkStatus();
  const char* message = nullptr;
  cuptiGetResultString(result, &message);
  return absl::InternalError(absl::StrFormat("%s: %s", what, message ? message : "?"));
}

// Mean per kernel position over the steps.
struct Position {
  std::string name;
  int64_t blocks = 0;
  double offset = 0, duration = 0, gap = 0, advance = 0;
};

absl::Status Run() {
  const std::string config = absl::GetFlag(FLAGS_config);
  const int batch = absl::GetFlag(FLAGS_batch), context = absl::GetFlag(FLAGS_context);
  const int steps = absl::GetFlag(FLAGS_steps), per_seq = absl::GetFlag(FLAGS_tokens);
  if (config.empty()) return absl::InvalidArgumentError("--config is required (see --help)");
  if (batch < 1 || context < 0 || steps < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--batch %d, --context %d, --steps %d: batch and steps must be >= 1, context >= 0", batch,
        context, steps));
  }
  if (per_seq < 1 || per_seq > 8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--tokens %d: a recorded step takes 1 (decode) to 8 (verify of 7 drafts) tokens a "
        "sequence",
        per_seq));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateCudaBackend(0));
  worker::ModelSource source;
  source.config_path = config;
  source.load_format = worker::LoadFormat::kDummy;
  std::fprintf(stderr, "timeline: loading %s with dummy weights on %s...\n", config.c_str(),
               backend->name().c_str());
  ASSIGN_OR_RETURN(std::unique_ptr<worker::HybridModel> model,
                   worker::LoadHybridModel(source, *backend));
  model->SetDecodeCapture(batch);
  RETURN_IF_ERROR(model->CreateCaches(batch, context + steps * per_seq + 8));
  // As `mobius bench engine`: the sequences start with `context` positions reserved.
  std::vector<worker::SequenceCache> seqs(batch);
  for (auto& s : seqs) {
    RETURN_IF_ERROR(model->StartSequence(s));
    RETURN_IF_ERROR(model->kv_cache()->Reserve(s, context));
    s.num_tokens = context;
  }
  const int vocab = model->config().vocab_size;
  std::vector<int32_t> tokens(static_cast<size_t>(batch) * per_seq);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((int64_t(i) * 7919 + 13) % vocab);  // as the bench's
  }
  std::vector<worker::SequenceStep> step;
  for (int i = 0; i < batch; ++i) {
    step.push_back(
        {std::span(tokens).subspan(static_cast<size_t>(i) * per_seq, per_seq), &seqs[i]});
  }
  worker::ForwardOptions options;
  std::vector<float> logits, hidden;
  std::vector<int32_t> argmax;
  if (per_seq == 1) {
    options.copy_logits = false;
  } else {  // as `mobius bench engine --spec-tokens` times a greedy verify step
    options.logits_rows.assign(batch, per_seq);
    options.greedy_tokens = &argmax;
    options.hidden_out = &hidden;
    options.hidden_all_tokens = true;
    options.keep_state_inputs = true;
  }
  // Verify steps start from the same positions every time (as the bench times them); decode
  // steps advance one position a step, as before the flag existed.
  auto forward = [&]() -> absl::Status {
    RETURN_IF_ERROR(model->Forward(step, options, logits));
    if (per_seq > 1) {
      for (auto& s : seqs) s.num_tokens = context;
    }
    return absl::OkStatus();
  };
  // Tracing starts before the warm-up steps, so that the graph is instantiated with CUPTI
  // attached (node-level records); what the warm-ups record is dropped.
  RETURN_IF_ERROR(Check(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted),
                        "cuptiActivityRegisterCallbacks"));
  RETURN_IF_ERROR(Check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
                        "cuptiActivityEnable(CONCURRENT_KERNEL)"));
  RETURN_IF_ERROR(
      Check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "cuptiActivityEnable(MEMSET)"));
  for (int w = 0; w < 3; ++w) RETURN_IF_ERROR(forward());
  if (model->num_decode_graphs() == 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the step was not recorded (%s): this tool reads one graph launch per step",
                        model->capture_error().ToString()));
  }
  backend->Synchronize();
  RETURN_IF_ERROR(
      Check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll"));
  {
    std::lock_guard<std::mutex> lock(activities_mutex);
    activities.clear();
  }
  for (int s = 0; s < steps; ++s) RETURN_IF_ERROR(forward());
  backend->Synchronize();
  RETURN_IF_ERROR(
      Check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll"));
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET);

  {
    std::lock_guard<std::mutex> lock(activities_mutex);
    if (dropped_records > 0 || unreadable_buffers > 0) {
      return absl::InternalError(absl::StrFormat(
          "CUPTI dropped %d records and could not read %d buffers: the trace is incomplete",
          dropped_records, unreadable_buffers));
    }
  }
  // One graph launch (correlation id) per step; steps in launch order.
  std::map<uint32_t, std::vector<Activity>> by_launch;
  {
    std::lock_guard<std::mutex> lock(activities_mutex);
    for (Activity& a : activities) by_launch[a.correlation].push_back(std::move(a));
  }
  auto by_start = [](const Activity& a, const Activity& b) { return a.start < b.start; };
  std::vector<std::vector<Activity>> launches;
  for (auto& [id, list] : by_launch) {
    std::sort(list.begin(), list.end(), by_start);
    launches.push_back(std::move(list));
  }
  if (launches.size() != static_cast<size_t>(steps)) {
    // The records do not name one launch per step: cut the traced window into `steps` equal
    // parts instead (every step replays the same graph).
    std::vector<Activity> all;
    for (auto& l : launches) all.insert(all.end(), l.begin(), l.end());
    std::sort(all.begin(), all.end(), by_start);
    if (all.empty() || all.size() % steps != 0) {
      return absl::InternalError(absl::StrFormat(
          "%d activities in %d launch ids for %d steps: cannot tell the steps apart", all.size(),
          launches.size(), steps));
    }
    std::fprintf(stderr, "timeline: %zu launch ids for %d steps; cut into equal steps\n",
                 launches.size(), steps);
    launches.clear();
    const size_t per_step = all.size() / steps;
    for (int s = 0; s < steps; ++s) {
      launches.emplace_back(all.begin() + s * per_step, all.begin() + (s + 1) * per_step);
    }
  }
  // A kernel position is its graph node (the same in every replay; CUPTI names it), or, without
  // node ids, its index in start order.
  const size_t nodes = launches.front().size();
  std::map<uint64_t, Position> by_node;
  double span = 0;
  for (const auto& l : launches) {
    if (l.size() != nodes) {
      return absl::InternalError(absl::StrFormat(
          "steps of %d and %d activities: not the same graph every step", nodes, l.size()));
    }
    uint64_t frontier = l.front().start;
    for (size_t i = 0; i < l.size(); ++i) {
      const Activity& a = l[i];
      Position& p = by_node[a.node != 0 ? a.node : i];
      p.name = a.name;
      p.blocks = a.blocks;
      const uint64_t from = std::max(a.start, frontier);
      p.offset += double(a.start - l.front().start);
      p.duration += double(a.end - a.start);
      p.gap += a.start > frontier ? double(a.start - frontier) : 0.0;
      p.advance += a.end > from ? double(a.end - from) : 0.0;
      frontier = std::max(frontier, a.end);
    }
    span += double(frontier - l.front().start);
  }
  const double counted = static_cast<double>(launches.size());
  std::vector<Position> positions;
  for (auto& [node, p] : by_node) {
    p.offset /= counted;
    p.duration /= counted;
    p.gap /= counted;
    p.advance /= counted;
    positions.push_back(p);
  }
  std::sort(positions.begin(), positions.end(),
            [](const Position& a, const Position& b) { return a.offset < b.offset; });
  span /= counted;

  struct Sum {
    int count = 0;
    double duration = 0, gap = 0, advance = 0;
  };
  std::map<std::string, Sum> by_name;
  double total_gap = 0, total_advance = 0, total_duration = 0;
  for (const Position& p : positions) {
    Sum& s = by_name[p.name];
    ++s.count;
    s.duration += p.duration;
    s.gap += p.gap;
    s.advance += p.advance;
    total_gap += p.gap;
    total_advance += p.advance;
    total_duration += p.duration;
  }
  std::vector<std::pair<std::string, Sum>> ranked(by_name.begin(), by_name.end());
  std::sort(ranked.begin(), ranked.end(),
            [](const auto& a, const auto& b) { return a.second.advance > b.second.advance; });
  std::printf(
      "step: batch %d x %d tokens, context %d, %zu traced steps of %zu nodes: span %.1f us = "
      "advance %.1f + gaps %.1f us; kernel durations sum to %.1f us (overlap %.1f us)\n",
      batch, per_seq, context, launches.size(), nodes, span / 1e3, total_advance / 1e3,
      total_gap / 1e3, total_duration / 1e3, (total_duration - total_advance) / 1e3);
  std::printf("%-72s %6s %11s %11s %11s %7s\n", "kernel", "count", "advance us", "gap us",
              "duration us", "share");
  const int top = std::max(0, absl::GetFlag(FLAGS_top));
  for (int i = 0; i < static_cast<int>(ranked.size()) && i < top; ++i) {
    const auto& [name, s] = ranked[i];
    std::printf("%-72s %6d %11.1f %11.1f %11.1f %6.1f%%\n", name.c_str(), s.count, s.advance / 1e3,
                s.gap / 1e3, s.duration / 1e3, 100.0 * (s.advance + s.gap) / span);
  }
  const std::string csv = absl::GetFlag(FLAGS_csv_out);
  if (!csv.empty()) {
    FILE* f = std::fopen(csv.c_str(), "w");
    if (f == nullptr) return absl::InvalidArgumentError("--csv-out: cannot write " + csv);
    std::fprintf(f, "index,name,blocks,start_us,duration_us,gap_us,advance_us\n");
    for (size_t i = 0; i < positions.size(); ++i) {
      const Position& p = positions[i];
      std::fprintf(f, "%zu,\"%s\",%lld,%.3f,%.3f,%.3f,%.3f\n", i, p.name.c_str(),
                   static_cast<long long>(p.blocks), p.offset / 1e3, p.duration / 1e3, p.gap / 1e3,
                   p.advance / 1e3);
    }
    std::fclose(f);
    std::fprintf(stderr, "timeline: wrote %zu kernel positions to %s\n", positions.size(),
                 csv.c_str());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace mobius::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "where a recorded decode step's time goes, kernel by kernel (CUPTI GPU timestamps of the "
      "replayed graph): mobius_step_timeline --config CONFIG [--batch N] [--tokens N] [--context "
      "N] "
      "[--steps N]");
  mobius::ListFlagsOfFilesInHelp({"step_timeline.cc"});
  // Flags may be spelled with dashes or underscores, as for the other binaries.
  const std::vector<std::string> positional =
      mobius::ParseFlags(argv[0], mobius::NormalizeFlagSpelling(argc, argv, 1));
  if (!positional.empty()) {
    std::fprintf(stderr, "mobius_step_timeline: unexpected argument \"%s\"\n",
                 positional[0].c_str());
    return 2;
  }
  const absl::Status status = mobius::bench::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "mobius_step_timeline: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
