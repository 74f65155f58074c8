// Which ids end generation for a model: the EOS tokens named by `generation_config.json`
// ("eos_token_id": an int or a list) and by `tokenizer_config.json` ("eos_token": a string or an
// {"content": ...} object). A model directory may ship either file or both.
#ifndef MOBIUS_TOKENIZER_GENERATION_STOP_CONFIG_H_
#define MOBIUS_TOKENIZER_GENERATION_STOP_CONFIG_H_

#include <cstdint>
#include <filesystem>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"

namespace mobius::tokenizer {

struct GenerationStopConfig {
  // generation_config.json ids first, then tokenizer_config.json's, without repeats.
  std::vector<int32_t> eos_token_ids;

  [[nodiscard]] bool IsStopToken(int32_t id) const;
};

// NotFound when neither file names an EOS token; InvalidArgument for malformed files or an EOS
// token the tokenizer does not know.
absl::StatusOr<GenerationStopConfig> LoadGenerationStopConfig(const std::filesystem::path& dir,
                                                              const Tokenizer& tokenizer);

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_GENERATION_STOP_CONFIG_H_
