// The distributed-execution issue's acceptance on CPUs (issue 5): one model replica as several
// mobius-worker processes (ranks joined by the gRPC rendezvous, collectives over UCX, step plans
// from the leader), behind mobius-router, serving the intern-s2-mobius-tiny fixture with the
// same greedy tokens as one process; and a replica that loses a rank fails as a whole while the
// router routes around it. (Logits of the sharded forward against the fixture's reference are
// checked in-process by tests/distributed/sharded_model_test.cc, with load-aware placements too.)
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/e2e/serving_deployment.h"

namespace mobius::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::vector<int32_t>> Prompts(int n) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p;
    for (int k = 0; k < 2 + 5 * i; ++k) p.push_back((131 * i + 17 * k + 3) % 2048);
    prompts.push_back(std::move(p));
  }
  return prompts;
}

struct Layout {
  int ranks;
  std::vector<std::string> flags;
};

// A measured-load file for --expert-placement load-aware on the fixture (3 banks of 40 experts):
// the experts the contiguous placement gives rank 0 are the hot ones, so the balanced placement
// must move experts between ranks. One file per test process: ctest runs the layouts as
// separate processes in parallel, and a shared path let one truncate the file while another's
// worker read it (CI: "expected {"banks": ...}", the replica never came up).
std::string ExpertLoadFile() {
  static const std::string path = [] {
    const std::string p =
        absl::StrCat(::testing::TempDir(), "/mobius_replica_expert_load_", getpid(), ".json");
    std::string json = R"({"banks": [)";
    for (int b = 0; b < 3; ++b) {
      json += b ? ",[" : "[";
      for (int e = 0; e < 40; ++e) {
        if (e > 0) json += ",";
        json += std::to_string(e < 10 ? 500 - e : 1);
      }
      json += "]";
    }
    json += "]}";
    std::ofstream(p) << json;
    return p;
  }();
  return path;
}

// A draft vocabulary for --spec-token-map: the fixture's even ids (1024 of 2048), one file per
// test process as above.
std::string SpecTokenMapFile() {
  static const std::string path = [] {
    const std::string p =
        absl::StrCat(::testing::TempDir(), "/mobius_replica_spec_token_map_", getpid(), ".txt");
    std::ofstream out(p);
    for (int id = 0; id < 2048; id += 2) out << id << "\n";
    return p;
  }();
  return path;
}

class ReplicaLayoutTest : public ::testing::TestWithParam<Layout> {};

// Concurrent gRPC and HTTP streams through the router to one replica of several ranks: every
// output equals `mobius generate` (one process) token for token, and the replica is idle after.
TEST_P(ReplicaLayoutTest, ServesTheSameGreedyTokensAsOneProcess) {
  constexpr int kMaxTokens = 6;
  const std::vector<std::vector<int32_t>> prompts = Prompts(4);
  std::vector<std::vector<int32_t>> expected;
  for (const auto& p : prompts) expected.push_back(MobiusGenerate(p, kMaxTokens));

  Deployment d({.workers = 1,
                .worker_flags = {"--max-model-len=256", "--max-num-seqs=4"},
                .router_flags = {},
                .ranks = GetParam().ranks,
                .rank_flags = GetParam().flags});
  ASSERT_TRUE(d.ready());
  std::vector<GrpcOutcome> grpc_out(prompts.size());
  std::vector<HttpOutcome> http_out(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] {
      grpc_out[i] = GrpcGenerate(d.inference(), GreedyRequest(prompts[i], kMaxTokens));
    });
    clients.emplace_back([&, i] {
      http_out[i] = HttpStreamCompletion(d.http_port(), CompletionBody(prompts[i], kMaxTokens));
    });
  }
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_TRUE(grpc_out[i].status.ok()) << i << ": " << grpc_out[i].status.error_message();
    EXPECT_EQ(grpc_out[i].tokens, expected[i]) << "grpc prompt " << i;
    EXPECT_EQ(http_out[i].status, 200) << i;
    EXPECT_EQ(http_out[i].tokens, expected[i]) << "http prompt " << i;
  }
  // A second wave reuses the state slots and KV blocks the first one released (each rank must
  // start a recycled slot from zero, as the leader does).
  for (size_t i = 0; i < prompts.size(); ++i) {
    const GrpcOutcome again = GrpcGenerate(d.inference(), GreedyRequest(prompts[i], kMaxTokens));
    EXPECT_EQ(again.tokens, expected[i]) << "second wave, prompt " << i;
  }
  EXPECT_TRUE(d.WaitWorkerIdle(0, 5000));
  // Every rank is still up (none failed on a plan).
  for (int r = 0; r < GetParam().ranks; ++r) EXPECT_EQ(d.RankExitStatus(0, r), -1) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ReplicaLayoutTest,
    ::testing::Values(
        Layout{2, {"--tp=2"}}, Layout{2, {"--ep=2"}}, Layout{2, {"--tp=2", "--sequence-parallel"}},
        Layout{2, {"--tp=2", "--ep=2"}}, Layout{4, {"--tp=4"}}, Layout{4, {"--ep=4"}},
        Layout{2, {"--ep=2", "--expert-placement=load-aware", "--expert-load=" + ExpertLoadFile()}},
        Layout{4, {"--ep=4", "--expert-placement=load-aware", "--expert-load=" + ExpertLoadFile()}},
        // MTP speculation (the fixture's random head: nearly every draft is rejected, so every
        // rank restores and replays its shard of the state nearly every step).
        Layout{2, {"--tp=2", "--spec-tokens=2"}}, Layout{2, {"--ep=2", "--spec-tokens=3"}},
        Layout{2, {"--tp=2", "--sequence-parallel", "--spec-tokens=2"}},
        // The leader's head drafting over a draft vocabulary (its lm_head rows gathered from
        // the whole lm_head every rank holds): outputs stay those of one process.
        Layout{2, {"--tp=2", "--spec-tokens=2", "--spec-token-map=" + SpecTokenMapFile()}}),
    [](const ::testing::TestParamInfo<Layout>& info) {
      std::string name = "ranks" + std::to_string(info.param.ranks);
      for (std::string f : info.param.flags) {
        if (f.rfind("--expert-load=", 0) == 0) continue;  // a path
        if (f.rfind("--spec-token-map=", 0) == 0) {
          name += "_spectokenmap";  // a path
          continue;
        }
        std::string clean;
        for (char c : f) {
          if (std::isalnum(static_cast<unsigned char>(c))) clean += c;
        }
        name += "_" + clean;
      }
      return name;
    });

// The loop the issue asks for: a replica measures its per-expert load (/expert_load on the
// metrics port, in the --expert-load format), and a load-aware expert-parallel replica started
// from that file serves the same greedy tokens and measures the same load (its ranks' counts
// summed, in checkpoint expert ids).
TEST(ExpertLoadTest, MeasuredLoadDrivesALoadAwareReplica) {
  constexpr int kMaxTokens = 6;
  const std::vector<std::vector<int32_t>> prompts = Prompts(4);
  std::vector<std::vector<int32_t>> expected;
  for (const auto& p : prompts) expected.push_back(MobiusGenerate(p, kMaxTokens));
  const std::string load_file = ::testing::TempDir() + "/mobius_measured_expert_load.json";
  nlohmann::json measured;
  {
    Deployment measure({.workers = 1, .worker_flags = {"--max-model-len=256"}});
    ASSERT_TRUE(measure.ready());
    for (const auto& p : prompts) {
      EXPECT_TRUE(GrpcGenerate(measure.inference(), GreedyRequest(p, kMaxTokens)).status.ok());
    }
    const nlohmann::json loads =
        nlohmann::json::parse(measure.WorkerHttp(0, "/expert_load"), nullptr, false);
    ASSERT_TRUE(loads.is_object() && loads.contains("banks")) << loads.dump();
    ASSERT_EQ(loads["banks"].size(), 3u);  // the fixture's banks
    int64_t total = 0;
    for (const auto& bank : loads["banks"]) {
      ASSERT_EQ(bank.size(), 40u);
      for (const auto& n : bank) total += n.get<int64_t>();
    }
    EXPECT_GT(total, 0) << "no expert load sampled";
    EXPECT_GE(loads["sampled_steps"].get<int64_t>(), 1);
    std::ofstream(load_file) << loads.dump();
    measured = loads["banks"];
    // One process holds every expert: nothing to place.
    const auto [status, body] = measure.WorkerHttpPost(0, "/expert_placement");
    EXPECT_EQ(status, 409) << body;
    EXPECT_NE(body.find("expert parallelism"), std::string::npos) << body;
  }
  Deployment placed(
      {.workers = 1,
       .worker_flags = {"--max-model-len=256"},
       .router_flags = {},
       .ranks = 2,
       .rank_flags = {"--ep=2", "--expert-placement=load-aware", "--expert-load=" + load_file}});
  ASSERT_TRUE(placed.ready());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const GrpcOutcome out = GrpcGenerate(placed.inference(), GreedyRequest(prompts[i], kMaxTokens));
    EXPECT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_EQ(out.tokens, expected[i]) << "prompt " << i;
  }
  // The same requests one at a time make the same steps: the EP replica's counts, summed over its
  // ranks and mapped back from its placement to checkpoint ids, equal the one-process ones.
  const nlohmann::json placed_loads =
      nlohmann::json::parse(placed.WorkerHttp(0, "/expert_load"), nullptr, false);
  ASSERT_TRUE(placed_loads.is_object() && placed_loads.contains("banks")) << placed_loads.dump();
  EXPECT_EQ(placed_loads["banks"], measured);
}

// A serving EP replica moves to a load-aware placement on request, without a restart: every rank
// reloads its experts between two steps, a stream in flight finishes with exact tokens, and
// later requests give the same tokens as before.
TEST(ExpertLoadTest, PlacementAppliedOnRequestWithoutRestart) {
  constexpr int kMaxTokens = 6, kLongTokens = 40;
  const std::vector<std::vector<int32_t>> prompts = Prompts(4);
  std::vector<std::vector<int32_t>> expected;
  for (const auto& p : prompts) expected.push_back(MobiusGenerate(p, kMaxTokens));
  const std::vector<int32_t> long_expected = MobiusGenerate(prompts[1], kLongTokens);
  Deployment d({.workers = 1,
                .worker_flags = {"--max-model-len=256"},
                .router_flags = {},
                .step_delay_ms = 20,
                .ranks = 2,
                .rank_flags = {"--ep=2"}});
  ASSERT_TRUE(d.ready());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const GrpcOutcome out = GrpcGenerate(d.inference(), GreedyRequest(prompts[i], kMaxTokens));
    EXPECT_EQ(out.tokens, expected[i]) << "prompt " << i << " before";
  }
  // A stream of ~40 steps of >= 20 ms is in flight while the placement changes.
  GrpcOutcome in_flight;
  std::thread client(
      [&] { in_flight = GrpcGenerate(d.inference(), GreedyRequest(prompts[1], kLongTokens)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto [status, body] = d.WorkerHttpPost(0, "/expert_placement");
  client.join();
  ASSERT_EQ(status, 200) << body;
  const nlohmann::json report = nlohmann::json::parse(body, nullptr, false);
  ASSERT_TRUE(report.is_object()) << body;
  EXPECT_EQ(report["ranks"], 2);
  EXPECT_GT(report["experts_moved"].get<int64_t>(), 0) << body;
  EXPECT_LE(report["imbalance_after"].get<double>(), report["imbalance_before"].get<double>())
      << body;
  EXPECT_TRUE(in_flight.status.ok()) << in_flight.status.error_message();
  EXPECT_EQ(in_flight.tokens, long_expected) << "the stream across the placement change";
  for (size_t i = 0; i < prompts.size(); ++i) {
    const GrpcOutcome out = GrpcGenerate(d.inference(), GreedyRequest(prompts[i], kMaxTokens));
    EXPECT_EQ(out.tokens, expected[i]) << "prompt " << i << " after";
  }
  // Then replicate hot experts (up to 2 more per rank and bank, where a copy lowers the peak):
  // the same tokens.
  EXPECT_EQ(d.WorkerHttpPost(0, "/expert_placement", R"({"replicas_per_rank": -1})").first, 400);
  EXPECT_EQ(d.WorkerHttpPost(0, "/expert_placement", "not json").first, 400);
  const auto [status2, body2] =
      d.WorkerHttpPost(0, "/expert_placement", R"({"replicas_per_rank": 2})");
  ASSERT_EQ(status2, 200) << body2;
  const nlohmann::json replicated = nlohmann::json::parse(body2, nullptr, false);
  ASSERT_TRUE(replicated.is_object()) << body2;
  EXPECT_LE(replicated["replicas_per_rank"].get<int>(), 2) << body2;
  std::printf("[placement] with replicas: %s\n", body2.c_str());
  EXPECT_LE(replicated["imbalance_after"].get<double>(),
            replicated["imbalance_before"].get<double>())
      << body2;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const GrpcOutcome out = GrpcGenerate(d.inference(), GreedyRequest(prompts[i], kMaxTokens));
    EXPECT_EQ(out.tokens, expected[i]) << "prompt " << i << " with replicated experts";
  }
}

// SIGKILL of a follower rank of a serving replica: the leader fails the replica and exits
// non-zero within 10 s, the router stops routing to it, no request hangs (each completes or ends
// UNAVAILABLE), and new requests complete on the other replica.
TEST(ReplicaFailureTest, KilledRankFailsTheReplicaAndTheRouterRoutesAround) {
  constexpr int kMaxTokens = 40;
  const std::vector<int32_t> prompt = Prompts(2)[1];
  const std::vector<int32_t> expected = MobiusGenerate(prompt, 6);
  Deployment d({.workers = 2,
                .worker_flags = {"--max-model-len=256"},
                .router_flags = {},
                .step_delay_ms = 50,
                .ranks = 2,
                .rank_flags = {"--tp=2"}});
  ASSERT_TRUE(d.ready());
  // Streams in flight on both replicas.
  std::vector<GrpcOutcome> out(6);
  std::vector<std::thread> clients;
  for (size_t i = 0; i < out.size(); ++i) {
    clients.emplace_back([&, i] {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      out[i] = GrpcGenerate(d.inference(), GreedyRequest(prompt, kMaxTokens), &context);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto killed = Clock::now();
  d.KillRank(0, 1);
  // The leader of replica 0 notices and exits non-zero.
  int leader_exit = -1;
  while (Clock::now() - killed < std::chrono::seconds(10)) {
    leader_exit = d.RankExitStatus(0, 0);
    if (leader_exit != -1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(leader_exit, -1) << "the leader of the broken replica is still running after 10 s";
  EXPECT_NE(leader_exit, 0);
  EXPECT_TRUE(d.WaitReplicaHealth(0, false, 10000)) << "the router still trusts replica 0";
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_TRUE(out[i].status.ok() || out[i].status.error_code() == grpc::StatusCode::UNAVAILABLE)
        << i << ": " << out[i].status.error_code() << " " << out[i].status.error_message();
  }
  // New requests go to the surviving replica.
  for (int i = 0; i < 3; ++i) {
    GrpcOutcome after = GrpcGenerate(d.inference(), GreedyRequest(prompt, 6));
    EXPECT_TRUE(after.status.ok()) << after.status.error_message();
    EXPECT_EQ(after.tokens, expected);
  }
  EXPECT_EQ(d.RankExitStatus(1, 0), -1);
  EXPECT_EQ(d.RankExitStatus(1, 1), -1);
}

}  // namespace
}  // namespace mobius::testing
