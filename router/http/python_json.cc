#include "router/http/python_json.h"

namespace mobius::router::openai {
namespace {

void Append(const nlohmann::ordered_json& value, std::string& out) {
  if (value.is_object()) {
    out.push_back('{');
    bool first = true;
    for (const auto& [key, item] : value.items()) {
      if (!first) out.append(", ");
      first = false;
      Append(nlohmann::ordered_json(key), out);
      out.append(": ");
      Append(item, out);
    }
    out.push_back('}');
  } else if (value.is_array()) {
    out.push_back('[');
    for (size_t i = 0; i < value.size(); ++i) {
      if (i > 0) out.append(", ");
      Append(value[i], out);
    }
    out.push_back(']');
  } else {
    // Scalars: nlohmann escapes strings as Python does (\" \\ \b \f \n \r \t, other control
    // characters as \u00xx in lower case) and, without ensure_ascii, keeps the rest.
    out.append(value.dump(-1, ' ', /*ensure_ascii=*/false,
                          nlohmann::ordered_json::error_handler_t::replace));
  }
}

}  // namespace

std::string PythonJsonDumps(const nlohmann::ordered_json& value) {
  std::string out;
  Append(value, out);
  return out;
}

}  // namespace mobius::router::openai
