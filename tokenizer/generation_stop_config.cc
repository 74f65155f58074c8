#include "tokenizer/generation_stop_config.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace mobius::tokenizer {
namespace {

// Nullopt when the file does not exist; an error when it exists but is not a JSON object.
absl::StatusOr<std::optional<nlohmann::json>> ReadOptionalJson(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return std::optional<nlohmann::json>();
  nlohmann::json json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a valid JSON object"));
  }
  return std::optional<nlohmann::json>(std::move(json));
}

void AddUnique(int32_t id, std::vector<int32_t>& ids) {
  if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
}

absl::Status AddGenerationConfigIds(const nlohmann::json& config, const std::filesystem::path& path,
                                    const Tokenizer& tokenizer, std::vector<int32_t>& ids) {
  if (!config.contains("eos_token_id") || config["eos_token_id"].is_null()) {
    return absl::OkStatus();
  }
  const nlohmann::json& value = config["eos_token_id"];
  std::vector<nlohmann::json> entries;
  if (value.is_array()) {
    entries.assign(value.begin(), value.end());
  } else {
    entries.push_back(value);
  }
  for (const nlohmann::json& entry : entries) {
    if (!entry.is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path.string(), ": \"eos_token_id\" must be an integer or a list of integers, got ",
          value.dump()));
    }
    const int64_t id = entry.get<int64_t>();
    if (id < 0 || id > INT32_MAX || !tokenizer.TokenBytes(static_cast<int32_t>(id)).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path.string(), ": eos_token_id ", id, " is not in the vocabulary"));
    }
    AddUnique(static_cast<int32_t>(id), ids);
  }
  return absl::OkStatus();
}

absl::Status AddTokenizerConfigId(const nlohmann::json& config, const std::filesystem::path& path,
                                  const Tokenizer& tokenizer, std::vector<int32_t>& ids) {
  if (!config.contains("eos_token") || config["eos_token"].is_null()) return absl::OkStatus();
  const nlohmann::json& value = config["eos_token"];
  std::string content;
  if (value.is_string()) {
    content = value.get<std::string>();
  } else if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    content = value["content"].get<std::string>();
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        path.string(), ": \"eos_token\" must be a string or an object with \"content\""));
  }
  const std::optional<int32_t> id = tokenizer.TokenToId(content);
  if (!id.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": eos_token \"", content, "\" is not in the vocabulary"));
  }
  AddUnique(*id, ids);
  return absl::OkStatus();
}

}  // namespace

bool GenerationStopConfig::IsStopToken(int32_t id) const {
  return std::find(eos_token_ids.begin(), eos_token_ids.end(), id) != eos_token_ids.end();
}

absl::StatusOr<GenerationStopConfig> LoadGenerationStopConfig(const std::filesystem::path& dir,
                                                              const Tokenizer& tokenizer) {
  GenerationStopConfig stop;
  const std::filesystem::path generation_path = dir / "generation_config.json";
  const std::filesystem::path tokenizer_path = dir / "tokenizer_config.json";
  ASSIGN_OR_RETURN(const std::optional<nlohmann::json> generation,
                   ReadOptionalJson(generation_path));
  if (generation.has_value()) {
    RETURN_IF_ERROR(
        AddGenerationConfigIds(*generation, generation_path, tokenizer, stop.eos_token_ids));
  }
  ASSIGN_OR_RETURN(const std::optional<nlohmann::json> tokenizer_config,
                   ReadOptionalJson(tokenizer_path));
  if (tokenizer_config.has_value()) {
    RETURN_IF_ERROR(
        AddTokenizerConfigId(*tokenizer_config, tokenizer_path, tokenizer, stop.eos_token_ids));
  }
  if (stop.eos_token_ids.empty()) {
    return absl::NotFoundError(absl::StrCat("no EOS token in ", generation_path.string(), " or ",
                                            tokenizer_path.string()));
  }
  return stop;
}

}  // namespace mobius::tokenizer
