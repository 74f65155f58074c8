// Exception-free JSON parsing for untrusted input (checkpoint headers, index files, HTTP request
// bodies): the parser's own message (byte position and reason) is kept for the error status,
// nesting depth is capped so that hostile input cannot exhaust the stack, and duplicate object
// keys can be rejected (plain nlohmann parsing silently keeps the last one, which would hide e.g.
// a duplicated tensor entry).
#ifndef MOBIUS_COMMON_JSON_PARSE_H_
#define MOBIUS_COMMON_JSON_PARSE_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace mobius {

struct JsonParseOptions {
  size_t max_depth = 64;
  bool reject_duplicate_keys = false;
};

// InvalidArgument with "invalid JSON at byte N: <reason>", "duplicate key \"k\"" or "nesting
// deeper than N levels" on failure; callers prefix what was being parsed.
absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text,
                                         const JsonParseOptions& options = {});
// The same, keeping object members in the text's order (JSON schemas: declared properties are
// generated in that order).
absl::StatusOr<nlohmann::ordered_json> ParseOrderedJson(absl::string_view text,
                                                        const JsonParseOptions& options = {});

}  // namespace mobius

#endif  // MOBIUS_COMMON_JSON_PARSE_H_
