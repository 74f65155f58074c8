#include "router/http/structured_output_request.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/json_parse.h"
#include "common/status_macros.h"
#include "grammar/json_schema_compiler.h"
#include "router/http/openai_request.h"

namespace mobius::router::openai {
namespace {

using Json = nlohmann::json;

// Where a request can put its schema, in the order they are looked for. The ordered re-parse
// follows the same paths.
struct SchemaPlace {
  const char* field;    // as errors name it
  const char* path[3];  // members from the body down, nullptr-terminated
};
constexpr SchemaPlace kSchemaPlaces[] = {
    {"response_format.json_schema.schema", {"response_format", "json_schema", "schema"}},
    {"guided_json", {"guided_json", nullptr, nullptr}},
    {"structured_outputs.json", {"structured_outputs", "json", nullptr}},
};

template <class J>
const J* Find(const J& body, const SchemaPlace& place) {
  const J* at = &body;
  for (const char* member : place.path) {
    if (member == nullptr) break;
    if (!at->is_object()) return nullptr;
    auto it = at->find(member);
    if (it == at->end() || it->is_null()) return nullptr;
    at = &*it;
  }
  return at;
}

// A schema given as JSON text (vLLM takes guided_json as a string too) or as a value.
template <class J>
absl::StatusOr<std::string> SchemaText(const J& value, const char* field) {
  if (value.is_string()) return value.template get<std::string>();
  if (value.is_object() || value.is_boolean()) return value.dump();
  return FieldError(field, absl::StrCat(field, " must be a JSON schema (an object, or its text)"));
}

absl::Status Compile(const v1::StructuredOutput& out, const std::string& field) {
  absl::StatusOr<grammar::Grammar> g;
  switch (out.kind_case()) {
    case v1::StructuredOutput::kJsonSchema:
      g = grammar::CompileJsonSchemaText(out.json_schema());
      break;
    case v1::StructuredOutput::kRegex:
      g = grammar::RegexGrammar(out.regex());
      break;
    case v1::StructuredOutput::kChoice:
      g = grammar::ChoiceGrammar(
          std::vector<std::string>(out.choice().choices().begin(), out.choice().choices().end()));
      break;
    default:
      return absl::OkStatus();
  }
  if (g.ok()) return absl::OkStatus();
  return FieldError(field, absl::StrCat(field, ": ", g.status().message()));
}

absl::Status ReadRegex(const Json& value, const std::string& field, v1::StructuredOutput* out) {
  if (!value.is_string()) {
    return FieldError(field, absl::StrCat(field, " must be a string (a regular expression)"));
  }
  out->set_regex(value.get<std::string>());
  return Compile(*out, field);
}

absl::Status ReadChoices(const Json& value, const char* field, v1::StructuredOutput* out) {
  if (!value.is_array()) {
    return FieldError(field, absl::StrCat(field, " must be an array of strings"));
  }
  for (size_t k = 0; k < value.size(); ++k) {
    if (!value[k].is_string()) {
      return FieldError(field, absl::StrCat(field, "[", k, "] must be a string"));
    }
    out->mutable_choice()->add_choices(value[k].get<std::string>());
  }
  return Compile(*out, field);
}

// Whether a vLLM field is set to something with an effect (clients send neutral values).
template <class J>
bool Effective(const J& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.template get<bool>();
  if (v.is_object() || v.is_array() || v.is_string()) return !v.empty();
  return true;
}

}  // namespace

absl::Status ParseStructuredOutput(const Json& body, v1::StructuredOutput* out) {
  std::vector<std::string> given;  // the fields that ask for a form, to refuse two at once
  auto take = [&](const std::string& field) { given.push_back(field); };

  if (auto it = body.find("response_format"); it != body.end() && !it->is_null()) {
    const Json& format = *it;
    const Json* type = format.is_object() && format.contains("type") ? &format["type"] : nullptr;
    if (type == nullptr || !type->is_string()) {
      return FieldError(
          "response_format.type",
          "response_format.type must be \"text\", \"json_object\" or \"json_schema\"");
    }
    const std::string t = type->get<std::string>();
    if (t == "json_object") {
      out->set_json_object(true);
      take("response_format");
    } else if (t == "json_schema") {
      const Json* schema = Find(body, kSchemaPlaces[0]);
      if (schema == nullptr) {
        return FieldError("response_format.json_schema.schema",
                          "response_format of type json_schema needs json_schema.schema");
      }
      absl::StatusOr<std::string> text = SchemaText(*schema, kSchemaPlaces[0].field);
      if (!text.ok()) return text.status();
      out->set_json_schema(*text);
      take("response_format");
      RETURN_IF_ERROR(Compile(*out, kSchemaPlaces[0].field));
    } else if (t != "text") {
      return FieldError("response_format.type",
                        absl::StrCat("response_format.type \"", t,
                                     "\" is not supported (\"text\", \"json_object\" or "
                                     "\"json_schema\")"));
    }
  }
  if (const Json* schema = Find(body, kSchemaPlaces[1]); schema != nullptr && Effective(*schema)) {
    absl::StatusOr<std::string> text = SchemaText(*schema, "guided_json");
    if (!text.ok()) return text.status();
    out->set_json_schema(*text);
    take("guided_json");
    RETURN_IF_ERROR(Compile(*out, "guided_json"));
  }
  if (auto it = body.find("guided_choice"); it != body.end() && Effective(*it)) {
    take("guided_choice");
    RETURN_IF_ERROR(ReadChoices(*it, "guided_choice", out));
  }
  if (auto it = body.find("guided_regex"); it != body.end() && Effective(*it)) {
    take("guided_regex");
    RETURN_IF_ERROR(ReadRegex(*it, "guided_regex", out));
  }
  if (auto it = body.find("structured_outputs"); it != body.end() && Effective(*it)) {
    const Json& so = *it;
    if (!so.is_object()) {
      return FieldError("structured_outputs", "structured_outputs must be an object");
    }
    for (const auto& [key, value] : so.items()) {
      if (!Effective(value)) continue;
      const std::string field = absl::StrCat("structured_outputs.", key);
      if (key == "json") {
        absl::StatusOr<std::string> text = SchemaText(value, "structured_outputs.json");
        if (!text.ok()) return text.status();
        out->set_json_schema(*text);
        take(field);
        RETURN_IF_ERROR(Compile(*out, field));
      } else if (key == "choice") {
        take(field);
        RETURN_IF_ERROR(ReadChoices(value, "structured_outputs.choice", out));
      } else if (key == "regex") {
        take(field);
        RETURN_IF_ERROR(ReadRegex(value, field, out));
      } else if (key == "json_object") {
        out->set_json_object(true);
        take(field);
      } else {
        // grammar, structural_tag, whitespace patterns...: a form we cannot enforce.
        return FieldError(field, absl::StrCat(field,
                                              " is not supported (structured output takes json, "
                                              "choice, regex or json_object)"));
      }
    }
  }
  for (const char* field : {"guided_grammar", "guided_whitespace_pattern"}) {
    if (auto it = body.find(field); it != body.end() && Effective(*it)) {
      return FieldError(field, absl::StrCat(field,
                                            " is not supported: structured output takes a JSON "
                                            "schema (guided_json), a choice (guided_choice), a "
                                            "regular expression (guided_regex) or any JSON "
                                            "object"));
    }
  }
  if (given.size() > 1) {
    return FieldError(given[1], absl::StrCat("give one form for the output, not both ", given[0],
                                             " and ", given[1]));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> OrderedSchemaText(absl::string_view body) {
  absl::StatusOr<nlohmann::ordered_json> ordered = ParseOrderedJson(body, {.max_depth = 64});
  if (!ordered.ok()) return ordered.status();
  for (const SchemaPlace& place : kSchemaPlaces) {
    const nlohmann::ordered_json* schema = Find(*ordered, place);
    if (schema == nullptr) continue;
    if (place.path[0] == std::string("response_format")) {
      const nlohmann::ordered_json& format = (*ordered)["response_format"];
      if (!format.contains("type") || format["type"] != "json_schema") continue;
    }
    // The same places ParseStructuredOutput takes: guided_json and structured_outputs.json only
    // when set to something with an effect.
    if (place.path[0] != std::string("response_format") && !Effective(*schema)) continue;
    return SchemaText(*schema, place.field);
  }
  return std::string();
}

namespace {

using Ordered = nlohmann::ordered_json;

// Points the local references of `schema` ("#/$defs/X", "#/definitions/X", at any depth) at
// `prefix` + X, where the definitions of several functions meet under distinct names. `names`:
// `schema` is a map from names to schemas (properties, $defs), whose keys are not keywords.
void PrefixLocalRefs(Ordered& schema, const std::string& prefix, bool names = false) {
  if (schema.is_array()) {
    for (Ordered& item : schema) PrefixLocalRefs(item, prefix);
    return;
  }
  if (!schema.is_object()) return;
  for (auto& [key, value] : schema.items()) {
    if (names) {
      PrefixLocalRefs(value, prefix);
      continue;
    }
    // Values, not schemas: a "$ref" inside them is data.
    if (key == "const" || key == "enum" || key == "default" || key == "examples") continue;
    if (key == "$ref" && value.is_string()) {
      const std::string ref = value.get<std::string>();
      for (const absl::string_view section : {"#/$defs/", "#/definitions/"}) {
        if (absl::StartsWith(ref, section)) {
          value = absl::StrCat(section, prefix, absl::string_view(ref).substr(section.size()));
          break;
        }
      }
      continue;
    }
    PrefixLocalRefs(value, prefix,
                    key == "properties" || key == "$defs" || key == "definitions" ||
                        key == "patternProperties" || key == "dependentSchemas");
  }
}

// One function's call as a JSON schema, {"name": <name>, "arguments": <its parameters>} in that
// order, checked alone so that an error names the function's field. The parameters'
// definitions move into `defs` (keyed "$defs" / "definitions"), their names after `prefix`.
absl::StatusOr<Ordered> CallSchema(const Ordered& function, const std::string& field,
                                   const std::string& prefix, Ordered& defs) {
  Ordered arguments = Ordered::object();
  if (function.contains("parameters") && !function["parameters"].is_null()) {
    arguments = function["parameters"];
  }
  if (!arguments.is_object()) {
    return FieldError(field, absl::StrCat(field, " must be a JSON schema object"));
  }
  // Arguments are an object (the call format and the tool-call parser need one), whatever the
  // parameters leave open ({} is common for functions without arguments).
  if (!arguments.contains("type")) arguments["type"] = "object";
  // References into the parameters from their own root would resolve against the wrapper.
  if (const std::string text = arguments.dump();
      text.find(R"("$ref":"#")") != std::string::npos ||
      text.find(R"("$ref":"#/properties)") != std::string::npos) {
    return FieldError(field, absl::StrCat(field,
                                          " refers to its own root (\"$ref\": \"#...\"), which a "
                                          "forced call cannot enforce: use $defs"));
  }
  Ordered call = {{"type", "object"}, {"required", {"name", "arguments"}}};
  Ordered own_defs = Ordered::object();
  for (const char* section : {"$defs", "definitions"}) {
    if (arguments.contains(section)) {
      own_defs[section] = arguments[section];
      arguments.erase(section);
    }
  }
  call["properties"] = Ordered{{"name", {{"const", function["name"]}}}, {"arguments", arguments}};
  // Checked with its own definitions, under their own names.
  Ordered alone = call;
  for (const auto& [section, entries] : own_defs.items()) alone[section] = entries;
  absl::StatusOr<grammar::Grammar> g = grammar::CompileJsonSchema(alone);
  if (!g.ok()) {
    return FieldError(
        field, absl::StrCat(field, " cannot be enforced for tool_choice: ", g.status().message()));
  }
  if (!prefix.empty()) PrefixLocalRefs(call, prefix);
  for (auto& [section, entries] : own_defs.items()) {
    if (!entries.is_object()) continue;
    for (auto& [name, def] : entries.items()) {
      Ordered renamed = def;
      if (!prefix.empty()) PrefixLocalRefs(renamed, prefix);
      defs[section][prefix + name] = std::move(renamed);
    }
  }
  return call;
}

}  // namespace

absl::StatusOr<v1::StructuredOutput> ForcedToolCallForm(absl::string_view body,
                                                        const std::string& function,
                                                        bool parallel) {
  absl::StatusOr<Ordered> ordered = ParseOrderedJson(body, {.max_depth = 64});
  if (!ordered.ok()) return ordered.status();
  const Ordered& tools = (*ordered)["tools"];
  // The functions the call may name: the named one, or every tool for "required".
  std::vector<size_t> open;
  for (size_t k = 0; k < tools.size(); ++k) {
    const std::string name = tools[k]["function"]["name"].get<std::string>();
    if (function.empty()) open.push_back(k);
    // A named function: its last definition, as the prompt's tool list reads to the model.
    if (name == function) open.assign(1, k);
    for (size_t j = 0; function.empty() && j < k; ++j) {
      if (tools[j]["function"]["name"] == name) {
        const std::string field = absl::StrCat("tools[", k, "].function.name");
        return FieldError(field, absl::StrCat(field, " \"", name, "\" repeats tools[", j,
                                              "]'s: tool_choice \"required\" needs distinct "
                                              "names"));
      }
    }
  }
  Ordered defs = Ordered::object();
  Ordered schema;
  if (open.size() == 1) {
    const size_t k = open[0];
    absl::StatusOr<Ordered> call = CallSchema(
        tools[k]["function"], absl::StrCat("tools[", k, "].function.parameters"), "", defs);
    if (!call.ok()) return call.status();
    schema = *std::move(call);
  } else {
    // Several functions: one call object each, told apart by the name's value (the grammar's
    // object switch), so that the arguments follow the named function's parameters. Their
    // definitions share the top level, each function's under a prefix of its own.
    Ordered calls = Ordered::array();
    for (size_t k : open) {
      absl::StatusOr<Ordered> call =
          CallSchema(tools[k]["function"], absl::StrCat("tools[", k, "].function.parameters"),
                     absl::StrCat("tools.", k, "."), defs);
      if (!call.ok()) return call.status();
      calls.push_back(*std::move(call));
    }
    schema = Ordered{{"anyOf", std::move(calls)}};
  }
  for (auto& [section, entries] : defs.items()) schema[section] = std::move(entries);
  v1::StructuredOutput form;
  v1::TaggedJson* tagged = form.mutable_tagged_json();
  tagged->set_begin("<tool_call>\n");
  tagged->set_json_schema(schema.dump());
  tagged->set_end("\n</tool_call>");
  // "required" with parallel calls: one block or more, each on its own line, as the template
  // writes several calls. A named function is called once.
  if (function.empty() && parallel) {
    tagged->set_max_blocks(-1);
    tagged->set_separator("\n");
  }
  absl::StatusOr<grammar::Grammar> g = grammar::TaggedJsonGrammar(
      tagged->begin(), tagged->json_schema(), tagged->end(),
      tagged->max_blocks() == 0 ? 1 : tagged->max_blocks(), tagged->separator());
  if (!g.ok()) {
    return FieldError(
        "tools", absl::StrCat("tools cannot be enforced for tool_choice: ", g.status().message()));
  }
  return form;
}

}  // namespace mobius::router::openai
