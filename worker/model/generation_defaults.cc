#include "worker/model/generation_defaults.h"

#include <algorithm>
#include <cstdint>
#include <fstream>

#include "nlohmann/json.hpp"

namespace mobius::worker {
namespace {

void AddIds(const nlohmann::json& v, std::vector<int32_t>& ids) {
  auto add = [&](const nlohmann::json& e) {
    // An id past int32 would wrap to another token: such an entry is skipped like a negative one.
    if (e.is_number_integer() && e.get<int64_t>() >= 0 && e.get<int64_t>() <= INT32_MAX &&
        std::find(ids.begin(), ids.end(), e.get<int32_t>()) == ids.end()) {
      ids.push_back(e.get<int32_t>());
    }
  };
  if (v.is_array()) {
    for (const auto& e : v) add(e);
  } else {
    add(v);
  }
}

}  // namespace

std::vector<int32_t> ReadEosTokenIds(const std::string& model_dir) {
  std::vector<int32_t> ids;
  if (model_dir.empty()) return ids;
  for (const char* file : {"generation_config.json", "config.json"}) {
    std::ifstream in(model_dir + "/" + file);
    if (!in) continue;
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    if (j.contains("eos_token_id")) AddIds(j["eos_token_id"], ids);
    if (j.contains("text_config") && j["text_config"].is_object() &&
        j["text_config"].contains("eos_token_id")) {
      AddIds(j["text_config"]["eos_token_id"], ids);
    }
  }
  return ids;
}

}  // namespace mobius::worker
