// Pieces of the safetensors layout shared by the reader and the writer: the 8-byte header length
// prefix, the header alignment and the overflow-checked size of a tensor.
#ifndef MOBIUS_WORKER_CHECKPOINT_SAFETENSORS_FORMAT_H_
#define MOBIUS_WORKER_CHECKPOINT_SAFETENSORS_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "kernels/dtype.h"

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace mobius::worker::checkpoint_internal {

inline constexpr size_t kHeaderLengthBytes = 8;
// The official writer pads the header with spaces so that the data section starts 8-aligned.
inline constexpr size_t kHeaderAlignment = 8;
inline constexpr const char* kMetadataKey = "__metadata__";

// product(shape) * DTypeSize(dtype), or nullopt when a dim is negative or the result does not fit
// in 64 bits.
std::optional<uint64_t> CheckedByteSize(std::span<const int64_t> shape, kernels::DType dtype);

// "[2048,128]" for messages.
std::string ShapeString(std::span<const int64_t> shape);

// Parses a header or index file strictly (duplicate keys rejected, nesting capped); `what`
// prefixes the error, e.g. "model.safetensors: header".
absl::StatusOr<nlohmann::json> ParseCheckpointJson(absl::string_view text, absl::string_view what);

}  // namespace mobius::worker::checkpoint_internal

#endif  // MOBIUS_WORKER_CHECKPOINT_SAFETENSORS_FORMAT_H_
