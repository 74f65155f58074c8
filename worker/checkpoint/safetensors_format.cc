#include "worker/checkpoint/safetensors_format.h"

#include "absl/strings/str_cat.h"
#include "common/json_parse.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mobius::worker::checkpoint_internal {

std::optional<uint64_t> CheckedByteSize(std::span<const int64_t> shape, kernels::DType dtype) {
  bool has_zero = false;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    has_zero |= dim == 0;
  }
  // A zero dim makes the product zero however large the others are.
  if (has_zero) return 0;
  uint64_t bytes = kernels::DTypeSize(dtype);
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes)) return std::nullopt;
  }
  return bytes;
}

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::StatusOr<nlohmann::json> ParseCheckpointJson(absl::string_view text, absl::string_view what) {
  // Safetensors headers and index files nest three levels deep; anything far deeper is not ours.
  absl::StatusOr<nlohmann::json> json =
      ParseJson(text, JsonParseOptions{.max_depth = 64, .reject_duplicate_keys = true});
  if (!json.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not valid JSON: ", json.status().message()));
  }
  return json;
}

}  // namespace mobius::worker::checkpoint_internal
