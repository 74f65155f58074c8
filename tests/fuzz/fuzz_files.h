// Files the fuzz targets read or write: the reference fixtures (tokenizer, tiny model) and a
// scratch path for code that takes a file rather than bytes.
#ifndef MOBIUS_TESTS_FUZZ_FUZZ_FILES_H_
#define MOBIUS_TESTS_FUZZ_FUZZ_FILES_H_

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "tokenizer/tokenizer.h"

namespace mobius::fuzz {

// `name` in the fixtures folder: $MOBIUS_FIXTURES_DIR when set, else the one configured at build
// time (every fuzz target is compiled with MOBIUS_FIXTURES_DIR).
inline std::filesystem::path FixturePath(std::string_view name) {
  const char* env = std::getenv("MOBIUS_FIXTURES_DIR");
  return std::filesystem::path(env != nullptr ? env : MOBIUS_FIXTURES_DIR) / name;
}

// `name` with this process's id under $TMPDIR (else /tmp), so that parallel runs do not collide.
inline std::filesystem::path ScratchPath(std::string_view name) {
  const char* tmp = std::getenv("TMPDIR");
  return std::filesystem::path(tmp != nullptr ? tmp : "/tmp") /
         (std::string(name) + "." + std::to_string(getpid()));
}

// The Qwen3 tokenizer fixture; a target cannot run without it, so a load failure aborts.
inline std::unique_ptr<tokenizer::Tokenizer> QwenTokenizerOrDie() {
  auto tokenizer = tokenizer::Tokenizer::FromDirectory(FixturePath("tokenizer-qwen3"));
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "the Qwen3 tokenizer fixture: %s\n",
                 tokenizer.status().ToString().c_str());
    std::abort();
  }
  return *std::move(tokenizer);
}

}  // namespace mobius::fuzz

#endif  // MOBIUS_TESTS_FUZZ_FUZZ_FILES_H_
