#include "tokenizer/json_fields.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mobius::tokenizer {
namespace {

bool Absent(const nlohmann::json& object, const char* key) {
  return !object.is_object() || !object.contains(key) || object[key].is_null();
}

absl::Status WrongType(const nlohmann::json& value, const char* key, const char* section,
                       const char* type) {
  return absl::InvalidArgumentError(
      absl::StrCat(section, ": \"", key, "\" must be a ", type, ", got ", value.dump()));
}

}  // namespace

absl::StatusOr<bool> OptionalBool(const nlohmann::json& object, const char* key, bool fallback,
                                  const char* section) {
  if (Absent(object, key)) return fallback;
  const nlohmann::json& value = object[key];
  if (!value.is_boolean()) return WrongType(value, key, section, "boolean");
  return value.get<bool>();
}

absl::StatusOr<std::optional<std::string>> OptionalString(const nlohmann::json& object,
                                                          const char* key, const char* section) {
  if (Absent(object, key)) return std::nullopt;
  const nlohmann::json& value = object[key];
  if (!value.is_string()) return WrongType(value, key, section, "string");
  return value.get<std::string>();
}

}  // namespace mobius::tokenizer
