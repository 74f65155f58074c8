// Exception-free JSON parsing for checkpoint headers and index files, with the parser's own
// message (position and reason) kept for the error status, duplicate object keys rejected (plain
// nlohmann parsing would silently keep the last one, hiding a duplicated tensor entry) and nesting
// depth capped so that a hostile header cannot exhaust the stack.
#ifndef MOBIUS_WORKER_CHECKPOINT_JSON_PARSE_H_
#define MOBIUS_WORKER_CHECKPOINT_JSON_PARSE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace mobius::worker::checkpoint_internal {

// `what` prefixes the error message, e.g. "model.safetensors: header".
absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, absl::string_view what);

}  // namespace mobius::worker::checkpoint_internal

#endif  // MOBIUS_WORKER_CHECKPOINT_JSON_PARSE_H_
