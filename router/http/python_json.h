// JSON text as Python's json.dumps writes it with ensure_ascii=False and its default separators:
// ", " between items, ": " after keys, keys in the object's order, non-ASCII characters as they
// are. The Qwen3 chat template lists tools with `tojson` (which is that), and vLLM's tool-call
// parsers write a call's arguments that way, so prompts and responses match theirs byte for byte.
#ifndef MOBIUS_ROUTER_HTTP_PYTHON_JSON_H_
#define MOBIUS_ROUTER_HTTP_PYTHON_JSON_H_

#include <string>

#include <nlohmann/json.hpp>

namespace mobius::router::openai {

// Numbers are written as nlohmann writes them (the shortest text that reads back the same
// value), which equals Python's repr except for floats in [1e15, 1e16) (nlohmann: 1e+15, Python:
// 1000000000000000.0) and integers beyond 64 bits, which nlohmann holds as doubles.
std::string PythonJsonDumps(const nlohmann::ordered_json& value);

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_PYTHON_JSON_H_
