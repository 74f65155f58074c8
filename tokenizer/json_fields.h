#ifndef MOBIUS_TOKENIZER_JSON_FIELDS_H_
#define MOBIUS_TOKENIZER_JSON_FIELDS_H_

// Optional typed fields of tokenizer.json objects. A tokenizer file is input like any other: a
// field of the wrong type is an InvalidArgument naming the section and the field, never a
// nlohmann::json exception (whose typed getters throw).

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace mobius::tokenizer {

// object[key] as a boolean; `fallback` when the key is absent or null. `section` names the part
// of the file in the error, e.g. "tokenizer.json model".
absl::StatusOr<bool> OptionalBool(const nlohmann::json& object, const char* key, bool fallback,
                                  const char* section);

// object[key] as a string; nullopt when the key is absent or null.
absl::StatusOr<std::optional<std::string>> OptionalString(const nlohmann::json& object,
                                                          const char* key, const char* section);

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_JSON_FIELDS_H_
