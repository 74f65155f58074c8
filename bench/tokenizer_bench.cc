// Encode/decode throughput of mobius_tokenizer on generated English prose and on mixed
// Chinese/English text. Reports bytes/s (MB/s) of input text. The tokenizer is the Qwen3 fixture:
// $MOBIUS_TOKENIZER_DIR, else ../shared/fixtures/tokenizer-qwen3 beside the repository.
//
//   build/bin/tokenizer_bench --benchmark_filter=Encode
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace mobius::tokenizer {
namespace {

constexpr size_t kTextBytes = size_t{1} << 20;

std::filesystem::path TokenizerDir() {
  if (const char* dir = std::getenv("MOBIUS_TOKENIZER_DIR"); dir != nullptr) return dir;
  // bench/tokenizer_bench.cc -> repository root -> ../shared/fixtures.
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "shared" /
         "fixtures" / "tokenizer-qwen3";
}

const Tokenizer* GetTokenizer() {
  static const Tokenizer* const tokenizer = [] {
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = Tokenizer::FromDirectory(TokenizerDir());
    if (!loaded.ok()) {
      std::fprintf(stderr, "tokenizer_bench: %s\n", loaded.status().ToString().c_str());
      std::exit(1);
    }
    return loaded->release();
  }();
  return tokenizer;
}

// English-like prose: sentences of common words with capitals, punctuation, numbers and
// paragraph breaks, drawn from a fixed seed so that runs are comparable.
std::string EnglishProse() {
  static const std::vector<std::string> kWords = {"the",
                                                  "of",
                                                  "and",
                                                  "to",
                                                  "in",
                                                  "a",
                                                  "is",
                                                  "that",
                                                  "for",
                                                  "it",
                                                  "as",
                                                  "was",
                                                  "with",
                                                  "be",
                                                  "by",
                                                  "on",
                                                  "not",
                                                  "he",
                                                  "this",
                                                  "are",
                                                  "or",
                                                  "his",
                                                  "from",
                                                  "at",
                                                  "which",
                                                  "but",
                                                  "have",
                                                  "an",
                                                  "had",
                                                  "they",
                                                  "you",
                                                  "were",
                                                  "their",
                                                  "one",
                                                  "all",
                                                  "we",
                                                  "can",
                                                  "her",
                                                  "has",
                                                  "there",
                                                  "been",
                                                  "if",
                                                  "more",
                                                  "when",
                                                  "will",
                                                  "would",
                                                  "who",
                                                  "so",
                                                  "no",
                                                  "model",
                                                  "inference",
                                                  "server",
                                                  "request",
                                                  "latency",
                                                  "throughput",
                                                  "memory",
                                                  "attention",
                                                  "layer",
                                                  "token",
                                                  "sequence",
                                                  "batch",
                                                  "schedule",
                                                  "cache",
                                                  "expert",
                                                  "routing",
                                                  "gradient",
                                                  "parameter",
                                                  "hardware",
                                                  "software",
                                                  "network",
                                                  "however",
                                                  "therefore",
                                                  "although",
                                                  "important",
                                                  "different",
                                                  "following",
                                                  "between",
                                                  "question",
                                                  "government",
                                                  "development",
                                                  "experience",
                                                  "information",
                                                  "understanding",
                                                  "don't",
                                                  "it's",
                                                  "we've",
                                                  "they'll",
                                                  "I'm"};
  std::mt19937 rng(42);
  std::string text;
  text.reserve(kTextBytes + 256);
  while (text.size() < kTextBytes) {
    const int words = 6 + static_cast<int>(rng() % 18);
    for (int i = 0; i < words; ++i) {
      std::string word = kWords[rng() % kWords.size()];
      if (i == 0) word[0] = static_cast<char>(std::toupper(word[0]));
      if (rng() % 40 == 0) word = std::to_string(rng() % 10000);
      text += word;
      if (i + 1 < words) text += rng() % 12 == 0 ? ", " : " ";
    }
    text += rng() % 5 == 0 ? "? " : ". ";
    if (rng() % 8 == 0) text += "\n\n";
  }
  return text;
}

// Chinese sentences with full-width punctuation and occasional English words and numbers.
std::string MixedCjkText() {
  static const std::vector<std::string> kWords = {
      "我们", "模型", "推理", "服务", "请求", "延迟", "吞吐量", "内存", "注意力", "专家",
      "今天", "天气", "很好", "世界", "中国", "北京", "上海",   "技术", "发展",   "经济",
      "学习", "研究", "问题", "方法", "系统", "数据", "时间",   "因为", "所以",   "但是",
      "这个", "一个", "没有", "可以", "已经", "非常", "重要",   "进行", "需要",   "使用"};
  static const std::vector<std::string> kPunctuation = {"，", "。", "、", "；", "！", "？"};
  static const std::vector<std::string> kLatin = {" GPU ", " H200 ", " Qwen3 ", " API ", " 2025 "};
  std::mt19937 rng(43);
  std::string text;
  text.reserve(kTextBytes + 256);
  while (text.size() < kTextBytes) {
    const int words = 3 + static_cast<int>(rng() % 8);
    for (int i = 0; i < words; ++i) {
      text += kWords[rng() % kWords.size()];
      if (rng() % 10 == 0) text += kLatin[rng() % kLatin.size()];
    }
    text += kPunctuation[rng() % kPunctuation.size()];
    if (rng() % 10 == 0) text += "\n";
  }
  return text;
}

void RunEncode(benchmark::State& state, const std::string& text) {
  const Tokenizer* tokenizer = GetTokenizer();
  size_t tokens = 0;
  for (auto _ : state) {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(text);
    if (!ids.ok()) state.SkipWithError(ids.status().ToString().c_str());
    tokens = ids->size();
    benchmark::DoNotOptimize(ids->data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
  state.counters["bytes_per_token"] = static_cast<double>(text.size()) / tokens;
}

void BM_EncodeEnglishProse(benchmark::State& state) {
  static const std::string text = EnglishProse();
  RunEncode(state, text);
}
BENCHMARK(BM_EncodeEnglishProse)->Unit(benchmark::kMillisecond);

void BM_EncodeMixedCjk(benchmark::State& state) {
  static const std::string text = MixedCjkText();
  RunEncode(state, text);
}
BENCHMARK(BM_EncodeMixedCjk)->Unit(benchmark::kMillisecond);

void BM_DecodeEnglishProse(benchmark::State& state) {
  static const std::string text = EnglishProse();
  const std::vector<int32_t> ids = *GetTokenizer()->Encode(text);
  for (auto _ : state) {
    absl::StatusOr<std::string> decoded = GetTokenizer()->Decode(ids);
    benchmark::DoNotOptimize(decoded->data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}
BENCHMARK(BM_DecodeEnglishProse)->Unit(benchmark::kMillisecond);

// Streaming decode one id at a time, as the router does for every generated token.
void BM_IncrementalDetokenizeMixedCjk(benchmark::State& state) {
  static const std::string text = MixedCjkText();
  const std::vector<int32_t> ids = *GetTokenizer()->Encode(text);
  for (auto _ : state) {
    IncrementalDetokenizer stream(*GetTokenizer());
    for (int32_t id : ids) benchmark::DoNotOptimize(stream.Push(id)->size());
    benchmark::DoNotOptimize(stream.Finish());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * ids.size()));
}
BENCHMARK(BM_IncrementalDetokenizeMixedCjk)->Unit(benchmark::kMillisecond);

void BM_LoadTokenizer(benchmark::State& state) {
  for (auto _ : state) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = Tokenizer::FromDirectory(TokenizerDir());
    benchmark::DoNotOptimize(loaded->get());
  }
}
BENCHMARK(BM_LoadTokenizer)->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace
}  // namespace mobius::tokenizer

BENCHMARK_MAIN();
