// The `mobius` binary end to end: its JSON output and its errors on bad input.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/run_command.h"

namespace {

using ::testing::HasSubstr;

using Result = mobius::testing::CommandResult;  // stdout and stderr together

Result RunMobius(const std::string& args) {
  return mobius::testing::RunCommand(std::string(MOBIUS_BINARY) + " " + args + " 2>&1");
}

std::string Fixture(const std::string& name) {
  return std::string(MOBIUS_FIXTURES_DIR) + "/" + name;
}

TEST(CliTest, GenerateMatchesReferenceGreedy) {
  for (const char* model : {"qwen3next-tiny", "intern-s2-mobius-tiny"}) {
    std::ifstream in(Fixture(model) + "/reference.json");
    ASSERT_TRUE(in) << model;
    nlohmann::json ref = nlohmann::json::parse(in);
    const auto& g = ref["greedy"][1];
    std::string ids;
    for (int id : ref["prompts"][g["prompt_index"].get<int>()]) {
      ids += (ids.empty() ? "" : ",") + std::to_string(id);
    }
    Result r =
        RunMobius("generate --model " + Fixture(model) + " --prompt-ids " + ids + " --max-tokens " +
                  std::to_string(g["tokens"].size()) + " --prefill-chunk 5 --threads 1");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    nlohmann::json out = nlohmann::json::parse(r.out);
    EXPECT_EQ(out["token_ids"], g["tokens"]) << model;
  }
}

TEST(CliTest, DumpLogitsWritesPromptByVocab) {
  const std::string path = ::testing::TempDir() + "/cli_logits.safetensors";
  Result r = RunMobius("generate --model " + Fixture("qwen3next-tiny") +
                       " --prompt-ids 5,6,7 --max-tokens 0 --dump-logits " + path);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), n);
  nlohmann::json h = nlohmann::json::parse(header);
  EXPECT_EQ(h["logits"]["dtype"], "F32");
  EXPECT_EQ(h["logits"]["shape"], nlohmann::json({3, 2048}));
}

TEST(CliTest, PromptIdOutsideVocabularyIsAClearError) {
  Result r = RunMobius("generate --model " + Fixture("qwen3next-tiny") +
                       " --prompt-ids 1,2048 --max-tokens 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("2048"));
  EXPECT_THAT(r.out, HasSubstr("vocabulary"));
}

// Configurations past the model's positions are skipped with the reason, the others still timed
// (a 300000-token prefill once overflowed the synthetic prompt's ids instead).
TEST(CliTest, BenchEngineSkipsConfigurationsPastMaxPositions) {
  Result r = RunMobius("bench engine --config " + Fixture("qwen3next-tiny") +
                       "/config.json --load-format dummy --batches 1 --contexts 5000,8 "
                       "--prefill-lengths 5000,16 --steps 1");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("5000   skipped: context + 9 positions of the warm-up and timed "
                               "steps exceeds max_position_embeddings (4096)"));
  EXPECT_THAT(r.out, HasSubstr("5000   skipped: exceeds max_position_embeddings (4096)"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex("decode +1 +8 +[0-9.]+ ms"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex("prefill +1 +16 +[0-9.]+ ms"));
}

// Each row prints its bytes, FLOP and serial bounds from the given ceilings, and the JSON carries
// them with each result; without ceilings the CPU backend bounds its rows as an H200 would (its
// copy bandwidth cannot be measured, so neither ceiling is); a negative ceiling is an error.
TEST(CliTest, BenchEnginePrintsBytesAndFlopBounds) {
  const std::string json = ::testing::TempDir() + "/bench_bounds.json";
  Result r = RunMobius("bench engine --config " + Fixture("qwen3next-tiny") +
                       "/config.json --load-format dummy --batches 2 --contexts 8 "
                       "--prefill-lengths 32 --steps 1 --matrix-rate-override 2e12 "
                       "--hbm-bandwidth-override 1e12 --json-out " +
                       json);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("matrix rate 2.0 TFLOP/s given"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex("bytes bound +FLOP bound +serial bound"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex(
                         "prefill +1 +32 +[0-9.]+ ms +[0-9.]+ ms +[0-9.]+ ms +[0-9.]+ ms"));
  std::ifstream in(json);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << "unreadable " << json;
  EXPECT_DOUBLE_EQ(j["matrix_rate"].get<double>(), 2e12);
  ASSERT_EQ(j["results"].size(), 2u);
  for (const nlohmann::json& result : j["results"]) {
    const double bytes = result["bytes_bound_ms"], flops = result["flops_bound_ms"],
                 serial = result["serial_bound_ms"], bound = result["bound_ms"];
    EXPECT_DOUBLE_EQ(bytes, result["bytes"].get<double>() / 1e12 * 1e3) << result;
    EXPECT_DOUBLE_EQ(flops, result["flops"].get<double>() / 2e12 * 1e3) << result;
    EXPECT_DOUBLE_EQ(bound, std::max(bytes, flops)) << result;
    EXPECT_GT(serial, 0) << result;
  }

  Result measured = RunMobius("bench engine --config " + Fixture("qwen3next-tiny") +
                              "/config.json --load-format dummy --batches 1 --contexts 8 "
                              "--prefill-lengths '' --steps 1");
  EXPECT_EQ(measured.exit_code, 0) << measured.out;
  EXPECT_THAT(measured.out, HasSubstr("memory bandwidth 4.27 TB/s assumed (H200)"));
  EXPECT_THAT(measured.out,
              HasSubstr("matrix rate 799.0 TFLOP/s assumed (H200 bf16, as the bandwidth)"));

  Result negative = RunMobius("bench engine --config " + Fixture("qwen3next-tiny") +
                              "/config.json --load-format dummy --matrix-rate-override -1");
  EXPECT_NE(negative.exit_code, 0);
  EXPECT_THAT(negative.out, HasSubstr("--matrix-rate-override is -1; each must be positive"));
}

// --spec-tokens times speculative decoding with the MTP head: the table for greedy requests (a
// row per k and acceptance length) and the verify step of sampled requests per k.
TEST(CliTest, BenchEngineTimesSpeculation) {
  Result r = RunMobius("bench engine --config " + Fixture("intern-s2-mobius-tiny") +
                       "/config.json --load-format dummy --batches 2 --contexts 8 "
                       "--prefill-lengths '' --steps 1 --spec-tokens 2");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(
      r.out,
      ::testing::ContainsRegex(
          "verify of sampled requests .*: k=1 [0-9.]+ / [0-9.]+ ms, k=2 [0-9.]+ / [0-9.]+ ms"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex(" +2 +[0-9.]+ ms +[0-9.]+ ms +[0-9.]+x +3 "));
}

// --spec-token-map: the head drafts over the listed tokens only. The bench says so; generate's
// greedy tokens stay those without the map; a bad map fails before the weights load, naming the
// flag, the file, the entry and the reason.
TEST(CliTest, SpecTokenMapRestrictsDraftsAndIsChecked) {
  const std::string map = ::testing::TempDir() + "/cli_spec_token_map.txt";
  {
    std::ofstream out(map);
    out << "# even ids\n";
    for (int i = 0; i < 2048; i += 2) out << i << (i % 20 == 18 ? "\n" : " ");
  }
  Result bench = RunMobius("bench engine --config " + Fixture("intern-s2-mobius-tiny") +
                           "/config.json --load-format dummy --batches 1 --contexts 8 "
                           "--prefill-lengths '' --steps 1 --spec-tokens 2 --spec-token-map " +
                           map);
  EXPECT_EQ(bench.exit_code, 0) << bench.out;
  EXPECT_THAT(bench.out, HasSubstr("drafting over 1024 tokens, --spec-token-map"));
  // The observe steps of 2 and 3 committed tokens are timed (they run op by op).
  EXPECT_THAT(bench.out,
              ::testing::ContainsRegex("observe step of 2\\.\\.3 committed tokens a sequence "
                                       "[0-9]+\\.[0-9]+ / [0-9]+\\.[0-9]+ ms"));

  const std::string generate = "generate --model " + Fixture("intern-s2-mobius-tiny") +
                               " --prompt-ids 1,2,3,4,5,6,7 --max-tokens 12 --spec-tokens 3";
  // The JSON line (stderr, with the acceptance statistics, is in the output too).
  auto tokens_of = [](const Result& r) {
    const size_t at = r.out.find("{\"prompt_ids\"");
    EXPECT_NE(at, std::string::npos) << r.out;
    if (at == std::string::npos) return nlohmann::json();
    return nlohmann::json::parse(r.out.substr(at, r.out.find('\n', at) - at))["token_ids"];
  };
  Result whole = RunMobius(generate);
  Result mapped = RunMobius(generate + " --spec-token-map " + map);
  ASSERT_EQ(whole.exit_code, 0) << whole.out;
  ASSERT_EQ(mapped.exit_code, 0) << mapped.out;
  EXPECT_EQ(tokens_of(mapped), tokens_of(whole));
  EXPECT_EQ(tokens_of(whole).size(), 12u);
  EXPECT_THAT(whole.out, HasSubstr("the head drafts over the whole vocabulary"));
  EXPECT_THAT(mapped.out, HasSubstr("the head drafts over 1024 tokens (--spec-token-map)"));

  const std::string bad = ::testing::TempDir() + "/cli_spec_token_map_bad.txt";
  {
    std::ofstream out(bad);
    out << "1 2\n3 2048\n";
  }
  Result out_of_range = RunMobius(generate + " --spec-token-map " + bad);
  EXPECT_NE(out_of_range.exit_code, 0);
  EXPECT_THAT(out_of_range.out,
              HasSubstr("--spec-token-map: " + bad +
                        ": entry 4 (line 2) is token 2048, outside the model's vocabulary "
                        "[0, 2048)"));
  Result without_drafts = RunMobius("generate --model " + Fixture("intern-s2-mobius-tiny") +
                                    " --prompt-ids 1 --spec-token-map " + map);
  EXPECT_NE(without_drafts.exit_code, 0);
  EXPECT_THAT(without_drafts.out, HasSubstr("--spec-token-map is set but --spec-tokens is 0"));
  Result too_many = RunMobius("generate --model " + Fixture("intern-s2-mobius-tiny") +
                              " --prompt-ids 1 --spec-tokens 33");
  EXPECT_NE(too_many.exit_code, 0);
  EXPECT_THAT(too_many.out, HasSubstr("--spec-tokens is 33; it must be in [0, 32]"));
}

// --draw times the step again with its tokens drawn (greedy, on the device, on the host, with
// penalties on either, with top-n logprobs, under a structured-output mask), one line per mode;
// an unknown mode is named.
TEST(CliTest, BenchEngineTimesTokenDraws) {
  Result r = RunMobius("bench engine --config " + Fixture("qwen3next-tiny") +
                       "/config.json --load-format dummy --batches 2 --contexts 8 "
                       "--prefill-lengths '' --steps 1 "
                       "--draw greedy,device,host,penalized,penalized-host,logprobs,masked");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  for (const char* mode :
       {"greedy", "device", "host", "penalized", "penalized-host", "logprobs", "masked"}) {
    EXPECT_THAT(r.out, ::testing::ContainsRegex(std::string("\\+") + mode + " +2 +8 +[0-9.]+ ms"))
        << mode;
  }
  Result bad = RunMobius("bench engine --config " + Fixture("qwen3next-tiny") +
                         "/config.json --load-format dummy --draw top");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.out, HasSubstr("--draw: \"top\" is not a draw mode"));
}

TEST(CliTest, BadUsageIsReported) {
  Result missing = RunMobius("generate --model /nonexistent --prompt-ids 1");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_THAT(missing.out, HasSubstr("/nonexistent"));
  Result bad_ids = RunMobius("generate --model " + Fixture("qwen3next-tiny") + " --prompt-ids 1,x");
  EXPECT_NE(bad_ids.exit_code, 0);
  EXPECT_THAT(bad_ids.out, HasSubstr("\"x\""));
  Result foreign = RunMobius("tokenize --max-tokens 3");
  EXPECT_EQ(foreign.exit_code, 2);
  EXPECT_THAT(foreign.out, HasSubstr("max_tokens"));
  Result unknown = RunMobius("frobnicate");
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.out, HasSubstr("frobnicate"));
}

TEST(CliTest, HelpListsTheFlagsOfTheCommand) {
  Result r = RunMobius("generate --help");
  EXPECT_THAT(r.out, HasSubstr("--prompt_ids"));
  EXPECT_THAT(r.out, HasSubstr("--dump_logits"));
  EXPECT_THAT(r.out, HasSubstr("--load_format"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("--tokenizer ")));
}

TEST(CliTest, InspectReleaseConfigReportsAbout36BParameters) {
  Result r = RunMobius("inspect --config " + std::string(MOBIUS_CONFIGS_DIR) +
                       "/intern-s2-mobius-35b/config.json --notensors");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("parameters: 35.5"));
  EXPECT_THAT(r.out, HasSubstr("4 banks x 2560 experts"));
}

// The prefill table: an 8K prompt reads every expert of every bank, and its dense projections
// and attention are compute-bound, so the serial bound exceeds the bytes bound.
TEST(CliTest, InspectBoundsPrefillByBytesAndFlops) {
  Result r = RunMobius("inspect --config " + std::string(MOBIUS_CONFIGS_DIR) +
                       "/intern-s2-mobius-35b/config.json --notensors --prefill-tokens 8192 "
                       "--matrix-rate 1e15 --hbm-bandwidth 4e12");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("bounds at 4.00 TB/s and 1000 TFLOP/s"));
  std::smatch m;
  const std::regex row(" +8192 +([0-9.]+) GB .* ([0-9.]+) ms +([0-9.]+) ms +([0-9.]+) ms");
  ASSERT_TRUE(std::regex_search(r.out, m, row)) << r.out;
  const double gb = std::stod(m[1]), bytes_ms = std::stod(m[2]), flops_ms = std::stod(m[3]),
               serial_ms = std::stod(m[4]);
  EXPECT_NEAR(bytes_ms, gb / 4e12 * 1e9 * 1e3, 0.01);
  EXPECT_GT(flops_ms, 0);
  EXPECT_GT(serial_ms, bytes_ms + 0.2 * flops_ms);
  // Decode: at batch 256 the dense projections (2 x 256 tokens x 1.62 G weights: 0.83 TFLOP,
  // 0.83 ms at this rate) outlast their 3.24 GB (0.81 ms), so the serial bound is above the bytes
  // bound there, and equal to it at batch 1.
  const std::regex decode_row(" +(1|256) +[0-9.]+ GB .* ([0-9.]+) ms +([0-9.]+) ms\n");
  int decode_rows = 0;
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), decode_row);
       it != std::sregex_iterator(); ++it) {
    ++decode_rows;
    const double bytes_bound = std::stod((*it)[2]), serial = std::stod((*it)[3]);
    if ((*it)[1] == "1") {
      EXPECT_NEAR(serial, bytes_bound, 1e-3);
    } else {
      EXPECT_GT(serial, bytes_bound + 0.01);
    }
  }
  EXPECT_EQ(decode_rows, 2) << r.out;

  Result bad = RunMobius("inspect --config " + std::string(MOBIUS_CONFIGS_DIR) +
                         "/intern-s2-mobius-35b/config.json --notensors --prefill-tokens 8,x");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.out, HasSubstr("--prefill-tokens: \"x\" is not a positive integer"));
  Result no_rate = RunMobius("inspect --config " + std::string(MOBIUS_CONFIGS_DIR) +
                             "/intern-s2-mobius-35b/config.json --notensors --matrix-rate 0");
  EXPECT_NE(no_rate.exit_code, 0);
  EXPECT_THAT(no_rate.out, HasSubstr("--matrix-rate is 0; it must be a positive rate"));
  Result no_table = RunMobius("inspect --config " + std::string(MOBIUS_CONFIGS_DIR) +
                              "/intern-s2-mobius-35b/config.json --notensors --prefill-tokens ''");
  EXPECT_EQ(no_table.exit_code, 0) << no_table.out;
  EXPECT_THAT(no_table.out, ::testing::Not(HasSubstr("prefill of one sequence")));
}

TEST(CliTest, TokenizeAndDecode) {
  const std::string dir = Fixture("tokenizer-qwen3");
  Result enc = RunMobius("tokenize --tokenizer " + dir + " --text 'Hello world'");
  ASSERT_EQ(enc.exit_code, 0) << enc.out;
  nlohmann::json ids = nlohmann::json::parse(enc.out)["ids"];
  ASSERT_FALSE(ids.empty());
  std::string list;
  for (int id : ids) list += (list.empty() ? "" : ",") + std::to_string(id);
  Result dec = RunMobius("tokenize --tokenizer " + dir + " --decode " + list);
  ASSERT_EQ(dec.exit_code, 0) << dec.out;
  EXPECT_EQ(nlohmann::json::parse(dec.out)["text"], "Hello world");
}

// --hot-tokens N: the N most frequent ids of the input as a JSON array that --spec-token-map
// reads, most frequent first.
TEST(CliTest, TokenizeHotTokensRanksByFrequency) {
  const std::string dir = Fixture("tokenizer-qwen3");
  Result once = RunMobius("tokenize --tokenizer " + dir + " --text ' the cat the dog the'");
  ASSERT_EQ(once.exit_code, 0) << once.out;
  const nlohmann::json ids = nlohmann::json::parse(once.out)["ids"];
  ASSERT_EQ(ids.size(), 5u) << ids;
  Result hot =
      RunMobius("tokenize --tokenizer " + dir + " --text ' the cat the dog the' --hot-tokens 2");
  ASSERT_EQ(hot.exit_code, 0) << hot.out;
  // The array on stdout; the coverage line (stderr) is in the output too.
  EXPECT_THAT(hot.out, HasSubstr("2 hot tokens (of 3 distinct) cover 80.00% of the input's 5"));
  const size_t at = hot.out.find('[');
  ASSERT_NE(at, std::string::npos) << hot.out;
  const nlohmann::json ranked =
      nlohmann::json::parse(hot.out.substr(at, hot.out.find('\n', at) - at));
  ASSERT_EQ(ranked.size(), 2u) << ranked;
  EXPECT_EQ(ranked[0], ids[0]) << "' the' (three times) first";
  EXPECT_EQ(ranked[1], std::min(ids[1].get<int>(), ids[3].get<int>()))
      << "then the lower id of ' cat' and ' dog' (once each)";
  Result bad = RunMobius("tokenize --tokenizer " + dir + " --decode 1 --hot-tokens 3");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.out, HasSubstr("--hot-tokens is 3"));
}

}  // namespace
