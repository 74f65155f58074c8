#include "router/http/openai_request.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "common/json_parse.h"
#include "router/http/python_json.h"
#include "router/http/structured_output_request.h"
#include "router/inference_service.h"

namespace mobius::router::openai {
namespace {

using Json = nlohmann::json;

constexpr char kParamPayload[] = "type.mobius.dev/openai.param";
constexpr char kCodePayload[] = "type.mobius.dev/openai.code";
// A request's own structure nests a few levels (messages[i].tool_calls[j].function); the JSON
// schemas of tools nest deeper, rarely past a few dozen levels.
constexpr size_t kMaxDepth = 64;
// OpenAI's limit on stop sequences.
constexpr size_t kMaxStopStrings = 4;
// The service's limit on logit_bias entries (OpenAI's is 300).
constexpr size_t kMaxLogitBias = 1024;
// OpenAI's default for the legacy completions endpoint.
constexpr int kDefaultCompletionMaxTokens = 16;

constexpr int64_t kInt32Min = std::numeric_limits<int32_t>::min();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// A short rendering of a value for error messages: scalars as JSON, containers by kind.
std::string Describe(const Json& value) {
  if (value.is_array()) return "an array";
  if (value.is_object()) return "an object";
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  constexpr size_t kMaxShown = 64;
  if (text.size() > kMaxShown) text = absl::StrCat(text.substr(0, kMaxShown - 3), "...");
  return text;
}

absl::Status TypeError(absl::string_view field, absl::string_view expected, const Json& value) {
  return FieldError(field, absl::StrCat(field, " must be ", expected, ", got ", Describe(value)));
}

// The member `field` of `object`, or nullptr when absent or null (OpenAI clients send null for
// "unset").
const Json* Member(const Json& object, const char* field) {
  auto it = object.find(field);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integral JSON number (integers, or floats with no fractional part such as 40.0).
bool AsInt64(const Json& value, int64_t* out) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(v);
    return true;
  }
  if (value.is_number_integer()) {
    *out = value.get<int64_t>();
    return true;
  }
  if (value.is_number_float()) {
    const double v = value.get<double>();
    if (!std::isfinite(v) || std::floor(v) != v || std::fabs(v) >= 9.2e18) return false;
    *out = static_cast<int64_t>(v);
    return true;
  }
  return false;
}

absl::StatusOr<int64_t> ToInteger(const Json& value, absl::string_view field, int64_t min,
                                  int64_t max) {
  int64_t v = 0;
  if (!AsInt64(value, &v)) return TypeError(field, "an integer", value);
  if (v < min || v > max) {
    return FieldError(field, absl::StrCat(field, " must be an integer in [", min, ", ", max,
                                          "], got ", Describe(value)));
  }
  return v;
}

absl::StatusOr<std::optional<int64_t>> ReadInteger(const Json& object, const char* field,
                                                   int64_t min = kInt32Min,
                                                   int64_t max = kInt32Max) {
  const Json* value = Member(object, field);
  if (value == nullptr) return std::nullopt;
  absl::StatusOr<int64_t> v = ToInteger(*value, field, min, max);
  if (!v.ok()) return v.status();
  return std::optional<int64_t>(*v);
}

absl::StatusOr<std::optional<float>> ReadFloat(const Json& object, const char* field) {
  const Json* value = Member(object, field);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) return TypeError(field, "a number", *value);
  return std::optional<float>(value->get<float>());
}

absl::StatusOr<std::optional<bool>> ReadBool(const Json& object, const char* field) {
  const Json* value = Member(object, field);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) return TypeError(field, "a boolean", *value);
  return std::optional<bool>(value->get<bool>());
}

absl::StatusOr<std::optional<std::string>> ReadString(const Json& object, const char* field) {
  const Json* value = Member(object, field);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) return TypeError(field, "a string", *value);
  return std::optional<std::string>(value->get<std::string>());
}

#define MOBIUS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = *std::move(tmp)
#define MOBIUS_CONCAT_INNER(a, b) a##b
#define MOBIUS_CONCAT(a, b) MOBIUS_CONCAT_INNER(a, b)
#define ASSIGN_OR_RETURN(lhs, expr) \
  MOBIUS_ASSIGN_OR_RETURN_IMPL(MOBIUS_CONCAT(status_or_, __LINE__), lhs, expr)
#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (false)

absl::Status CheckBody(const Json& body) {
  if (!body.is_object()) {
    return FieldError("", absl::StrCat("request body must be a JSON object, got ", Describe(body)));
  }
  return absl::OkStatus();
}

absl::Status CheckModel(const Json& body, const std::string& served_model_name) {
  std::optional<std::string> model;
  ASSIGN_OR_RETURN(model, ReadString(body, "model"));
  if (model.has_value() && !served_model_name.empty() && *model != served_model_name) {
    // A bad field of the request: 400 (the contract), with OpenAI's code kept so
    // clients that look for model_not_found still find it.
    absl::Status status = absl::InvalidArgumentError(absl::StrCat(
        "model: `", *model, "` does not exist; this server serves `", served_model_name, "`"));
    status.SetPayload(kParamPayload, absl::Cord("model"));
    status.SetPayload(kCodePayload, absl::Cord("model_not_found"));
    return status;
  }
  return absl::OkStatus();
}

absl::Status ParseStop(const Json& body, v1::SamplingParams* sampling) {
  const Json* stop = Member(body, "stop");
  if (stop == nullptr) return absl::OkStatus();
  if (stop->is_string()) {
    if (stop->get_ref<const std::string&>().empty()) {
      return FieldError("stop", "stop must not be an empty string");
    }
    sampling->add_stop(stop->get<std::string>());
    return absl::OkStatus();
  }
  if (!stop->is_array()) return TypeError("stop", "a string or an array of strings", *stop);
  if (stop->size() > kMaxStopStrings) {
    return FieldError("stop", absl::StrCat("stop takes at most ", kMaxStopStrings, " strings, got ",
                                           stop->size()));
  }
  for (size_t i = 0; i < stop->size(); ++i) {
    const std::string field = absl::StrCat("stop[", i, "]");
    const Json& s = (*stop)[i];
    if (!s.is_string()) return TypeError(field, "a string", s);
    if (s.get_ref<const std::string&>().empty()) {
      return FieldError(field, absl::StrCat(field, " must not be an empty string"));
    }
    sampling->add_stop(s.get<std::string>());
  }
  return absl::OkStatus();
}

// Request fields (of OpenAI's API or vLLM's extensions) that would change what is generated
// and that we do not implement: refused by name rather than ignored, so that a client never
// gets output it did not ask for. Each is refused only when set to something with an effect
// (clients send the neutral values by default).
absl::Status RefuseUnimplemented(const Json& body) {
  auto effective = [](const Json& v) {
    if (v.is_null()) return false;
    if (v.is_boolean()) return v.get<bool>();
    if (v.is_number()) return v.get<double>() != 0;
    if (v.is_object() || v.is_array() || v.is_string()) return !v.empty();
    return true;
  };
  struct Unimplemented {
    const char* field;
    const char* why;
  };
  static constexpr Unimplemented kFields[] = {
      {"use_beam_search", "beam search is not supported"},
  };
  for (const Unimplemented& u : kFields) {
    const Json* value = Member(body, u.field);
    if (value != nullptr && effective(*value)) {
      return FieldError(u.field, absl::StrCat(u.field, " is not supported: ", u.why,
                                              " (send it unset, or its neutral value)"));
    }
  }
  return absl::OkStatus();
}

// Fields both endpoints share; max_tokens and logprobs differ between them and are left out.
absl::Status ParseSampling(const Json& body, v1::SamplingParams* sampling) {
  RETURN_IF_ERROR(RefuseUnimplemented(body));
  v1::StructuredOutput form;
  RETURN_IF_ERROR(ParseStructuredOutput(body, &form));
  if (form.kind_case() != v1::StructuredOutput::KIND_NOT_SET) {
    *sampling->mutable_structured_output() = std::move(form);
  }
  std::optional<float> f;
  ASSIGN_OR_RETURN(f, ReadFloat(body, "temperature"));
  if (f) sampling->set_temperature(*f);
  ASSIGN_OR_RETURN(f, ReadFloat(body, "top_p"));
  if (f) sampling->set_top_p(*f);
  ASSIGN_OR_RETURN(f, ReadFloat(body, "min_p"));
  if (f) sampling->set_min_p(*f);
  ASSIGN_OR_RETURN(f, ReadFloat(body, "presence_penalty"));
  if (f) sampling->set_presence_penalty(*f);
  ASSIGN_OR_RETURN(f, ReadFloat(body, "frequency_penalty"));
  if (f) sampling->set_frequency_penalty(*f);
  ASSIGN_OR_RETURN(f, ReadFloat(body, "repetition_penalty"));
  if (f) sampling->set_repetition_penalty(*f);

  std::optional<int64_t> i;
  ASSIGN_OR_RETURN(i, ReadInteger(body, "top_k"));
  if (i) sampling->set_top_k(static_cast<int32_t>(*i));
  // Any 64-bit integer: negative seeds keep their two's-complement bits.
  if (const Json* seed = Member(body, "seed"); seed != nullptr) {
    if (seed->is_number_unsigned()) {
      sampling->set_seed(seed->get<uint64_t>());
    } else {
      int64_t v = 0;
      if (!AsInt64(*seed, &v)) return TypeError("seed", "an integer", *seed);
      sampling->set_seed(static_cast<uint64_t>(v));
    }
  }

  RETURN_IF_ERROR(ParseStop(body, sampling));
  if (const Json* ids = Member(body, "stop_token_ids"); ids != nullptr) {
    if (!ids->is_array()) return TypeError("stop_token_ids", "an array of integers", *ids);
    for (size_t k = 0; k < ids->size(); ++k) {
      int64_t id = 0;
      ASSIGN_OR_RETURN(id,
                       ToInteger((*ids)[k], absl::StrCat("stop_token_ids[", k, "]"), 0, kInt32Max));
      sampling->add_stop_token_ids(static_cast<int32_t>(id));
    }
  }
  std::optional<bool> b;
  ASSIGN_OR_RETURN(b, ReadBool(body, "ignore_eos"));
  if (b) sampling->set_ignore_eos(*b);
  ASSIGN_OR_RETURN(b, ReadBool(body, "skip_special_tokens"));
  if (b) sampling->set_skip_special_tokens(*b);
  ASSIGN_OR_RETURN(b, ReadBool(body, "include_stop_str_in_output"));
  if (b) sampling->set_include_stop_str_in_output(*b);
  ASSIGN_OR_RETURN(i, ReadInteger(body, "min_tokens", 0, kInt32Max));
  if (i) sampling->set_min_tokens(static_cast<int32_t>(*i));
  ASSIGN_OR_RETURN(i, ReadInteger(body, "prompt_logprobs", 0, kInt32Max));
  if (i) sampling->set_prompt_logprobs(static_cast<int32_t>(*i));
  if (const Json* ids = Member(body, "allowed_token_ids"); ids != nullptr) {
    if (!ids->is_array()) return TypeError("allowed_token_ids", "an array of integers", *ids);
    if (ids->empty()) {
      return FieldError("allowed_token_ids",
                        "allowed_token_ids is empty: no token could be drawn (leave it out for "
                        "no restriction)");
    }
    for (size_t k = 0; k < ids->size(); ++k) {
      int64_t id = 0;
      ASSIGN_OR_RETURN(
          id, ToInteger((*ids)[k], absl::StrCat("allowed_token_ids[", k, "]"), 0, kInt32Max));
      sampling->add_allowed_token_ids(static_cast<int32_t>(id));
    }
  }
  if (const Json* words = Member(body, "bad_words"); words != nullptr) {
    if (!words->is_array()) return TypeError("bad_words", "an array of strings", *words);
    for (size_t k = 0; k < words->size(); ++k) {
      const Json& word = (*words)[k];
      if (!word.is_string()) return TypeError(absl::StrCat("bad_words[", k, "]"), "a string", word);
      sampling->add_bad_words(word.get<std::string>());
    }
  }
  // logit_bias: {"<token id>": bias}, ids as strings (JSON keys), as OpenAI sends them; checked
  // in full here (the service checks again) so that a huge map is refused before it is copied.
  if (const Json* bias = Member(body, "logit_bias"); bias != nullptr) {
    if (!bias->is_object()) return TypeError("logit_bias", "an object of token id -> bias", *bias);
    if (bias->size() > kMaxLogitBias) {
      return FieldError("logit_bias",
                        absl::StrCat("logit_bias has ", bias->size(), " entries; at most ",
                                     kMaxLogitBias, " are taken"));
    }
    for (const auto& [key, value] : bias->items()) {
      // Canonical decimal ids only: "+5", " 5" and "05" would all name token 5.
      int64_t id = 0;
      const bool canonical =
          !key.empty() && key.size() <= 10 &&
          std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
          (key.size() == 1 || key[0] != '0');
      if (!canonical || !absl::SimpleAtoi(key, &id) || id > kInt32Max) {
        return FieldError("logit_bias",
                          absl::StrCat("logit_bias keys must be token ids, got \"", key, "\""));
      }
      const double b = value.is_number() ? value.get<double>() : 0.0;
      if (!value.is_number() || !(b >= -100 && b <= 100)) {
        const std::string field = absl::StrCat("logit_bias[\"", key, "\"]");
        return value.is_number()
                   ? FieldError(field, absl::StrCat(field, " = ", Describe(value),
                                                    " is invalid: must be in [-100, 100]"))
                   : TypeError(field, "a number", value);
      }
      (*sampling->mutable_logit_bias())[static_cast<int32_t>(id)] = static_cast<float>(b);
    }
  }
  return absl::OkStatus();
}

// `stream` and `stream_options.include_usage` (ignored unless streaming, as OpenAI's clients
// send it regardless).
absl::Status ParseStreaming(const Json& body, bool* stream, bool* include_usage) {
  std::optional<bool> b;
  ASSIGN_OR_RETURN(b, ReadBool(body, "stream"));
  *stream = b.value_or(false);
  const Json* options = Member(body, "stream_options");
  if (options == nullptr) return absl::OkStatus();
  if (!options->is_object()) return TypeError("stream_options", "an object", *options);
  if (const Json* usage = Member(*options, "include_usage"); usage != nullptr) {
    if (!usage->is_boolean()) {
      return TypeError("stream_options.include_usage", "a boolean", *usage);
    }
    *include_usage = *stream && usage->get<bool>();
  }
  return absl::OkStatus();
}

absl::Status ParseTokenIds(const Json& ids, absl::string_view field, v1::TokenIds* out) {
  if (ids.empty()) return FieldError(field, absl::StrCat(field, " must not be empty"));
  for (size_t k = 0; k < ids.size(); ++k) {
    int64_t id = 0;
    ASSIGN_OR_RETURN(id, ToInteger(ids[k], absl::StrCat(field, "[", k, "]"), 0, kInt32Max));
    out->add_ids(static_cast<int32_t>(id));
  }
  return absl::OkStatus();
}

// A prompt is a string or an array of token ids; `prompt` is one of those, or a batch of them.
absl::Status ParsePrompts(const Json& body, std::vector<v1::GenerateRequest>* prompts) {
  const Json* prompt = Member(body, "prompt");
  if (prompt == nullptr) return FieldError("prompt", "prompt is required");
  constexpr char kShape[] = "a string, an array of token ids, or an array of those";
  if (prompt->is_string()) {
    // Refused here rather than by the service, so that the message names `prompt`.
    if (prompt->get_ref<const std::string&>().empty()) {
      return FieldError("prompt", "prompt must not be empty");
    }
    prompts->emplace_back().set_text(prompt->get<std::string>());
    return absl::OkStatus();
  }
  if (!prompt->is_array()) return TypeError("prompt", kShape, *prompt);
  if (prompt->empty()) return FieldError("prompt", "prompt must not be empty");
  const Json& first = prompt->front();
  if (!first.is_string() && !first.is_array()) {
    return ParseTokenIds(*prompt, "prompt", prompts->emplace_back().mutable_input_ids());
  }
  if (prompt->size() > static_cast<size_t>(kMaxChoices)) {
    return FieldError("prompt", absl::StrCat("prompt holds ", prompt->size(),
                                             " prompts; a request takes at most ", kMaxChoices));
  }
  // A batch: every element of the first one's kind.
  for (size_t k = 0; k < prompt->size(); ++k) {
    const std::string field = absl::StrCat("prompt[", k, "]");
    const Json& p = (*prompt)[k];
    v1::GenerateRequest& request = prompts->emplace_back();
    if (first.is_string()) {
      if (!p.is_string()) return TypeError(field, "a string, as prompt[0] is", p);
      if (p.get_ref<const std::string&>().empty()) {
        return FieldError(field, absl::StrCat(field, " must not be empty"));
      }
      request.set_text(p.get<std::string>());
    } else {
      if (!p.is_array()) return TypeError(field, "an array of token ids, as prompt[0] is", p);
      RETURN_IF_ERROR(ParseTokenIds(p, field, request.mutable_input_ids()));
    }
  }
  return absl::OkStatus();
}

// vLLM's truncate_prompt_tokens: keep the prompt's last N tokens (N >= 1), or -1 for as many as
// the context leaves room for; 0 and null leave the prompt whole.
absl::StatusOr<std::optional<int32_t>> ParseTruncation(const Json& body) {
  std::optional<int64_t> n;
  ASSIGN_OR_RETURN(n, ReadInteger(body, "truncate_prompt_tokens", -1, kInt32Max));
  if (!n.has_value() || *n == 0) return std::optional<int32_t>();
  return std::optional<int32_t>(static_cast<int32_t>(*n));
}

// `n`: choices per prompt, and the request's total (prompts x n) within kMaxChoices.
absl::StatusOr<int> ParseChoiceCount(const Json& body, size_t prompts) {
  std::optional<int64_t> n;
  ASSIGN_OR_RETURN(n, ReadInteger(body, "n", 1, kMaxChoices));
  const int64_t count = n.value_or(1);
  if (count * static_cast<int64_t>(prompts) > kMaxChoices) {
    return FieldError("n", absl::StrCat("n = ", count, " choices for each of ", prompts,
                                        " prompts is ", count * static_cast<int64_t>(prompts),
                                        "; a request takes at most ", kMaxChoices));
  }
  return static_cast<int>(count);
}

absl::StatusOr<std::string> ParseMessageContent(const Json& message, const std::string& field) {
  const Json* content = Member(message, "content");
  if (content == nullptr) return std::string();  // assistant turns may carry no content
  if (content->is_string()) return content->get<std::string>();
  if (!content->is_array()) {
    return TypeError(field, "a string or an array of content parts", *content);
  }
  // Text parts are joined with newlines, as vLLM does.
  std::string text;
  for (size_t k = 0; k < content->size(); ++k) {
    const std::string part_field = absl::StrCat(field, "[", k, "]");
    const Json& part = (*content)[k];
    if (!part.is_object()) return TypeError(part_field, "an object", part);
    const std::string type_field = absl::StrCat(part_field, ".type");
    const Json* type = Member(part, "type");
    if (type == nullptr || !type->is_string()) {
      return FieldError(type_field, absl::StrCat(type_field, " must be \"text\""));
    }
    if (type->get_ref<const std::string&>() != "text") {
      return FieldError(type_field, absl::StrCat(type_field, " ", Describe(*type),
                                                 " is not supported; only \"text\" parts are"));
    }
    const std::string text_field = absl::StrCat(part_field, ".text");
    const Json* part_text = Member(part, "text");
    if (part_text == nullptr || !part_text->is_string()) {
      return part_text == nullptr ? FieldError(text_field, absl::StrCat(text_field, " is required"))
                                  : TypeError(text_field, "a string", *part_text);
    }
    if (k > 0) text += '\n';
    text += part_text->get_ref<const std::string&>();
  }
  return text;
}

// An assistant turn's `tool_calls` ([{id, type: "function", function: {name, arguments}}],
// arguments a JSON string as OpenAI sends it, or an object) and vLLM's `reasoning_content`.
absl::Status ParseAssistantTurn(const Json& message, const std::string& field,
                                tokenizer::ChatMessage* out) {
  if (const Json* reasoning = Member(message, "reasoning_content"); reasoning != nullptr) {
    if (!reasoning->is_string()) {
      return TypeError(absl::StrCat(field, ".reasoning_content"), "a string", *reasoning);
    }
    out->reasoning_content = reasoning->get<std::string>();
  }
  const Json* calls = Member(message, "tool_calls");
  if (calls == nullptr) return absl::OkStatus();
  const std::string calls_field = absl::StrCat(field, ".tool_calls");
  if (!calls->is_array()) return TypeError(calls_field, "an array of tool calls", *calls);
  for (size_t k = 0; k < calls->size(); ++k) {
    const std::string call_field = absl::StrCat(calls_field, "[", k, "]");
    const Json& call = (*calls)[k];
    if (!call.is_object()) return TypeError(call_field, "an object", call);
    const Json* function = Member(call, "function");
    const std::string function_field = absl::StrCat(call_field, ".function");
    if (function == nullptr || !function->is_object()) {
      return function == nullptr
                 ? FieldError(function_field, absl::StrCat(function_field, " is required"))
                 : TypeError(function_field, "an object", *function);
    }
    tokenizer::ToolCall parsed;
    const Json* name = Member(*function, "name");
    const std::string name_field = absl::StrCat(function_field, ".name");
    if (name == nullptr || !name->is_string()) {
      return name == nullptr ? FieldError(name_field, absl::StrCat(name_field, " is required"))
                             : TypeError(name_field, "a string", *name);
    }
    parsed.name = name->get<std::string>();
    const Json* arguments = Member(*function, "arguments");
    const std::string arguments_field = absl::StrCat(function_field, ".arguments");
    if (arguments == nullptr) {
      parsed.arguments = "{}";
    } else if (arguments->is_string()) {
      parsed.arguments = arguments->get<std::string>();
    } else if (arguments->is_object()) {
      parsed.arguments = PythonJsonDumps(nlohmann::ordered_json(*arguments));
    } else {
      return TypeError(arguments_field, "a JSON string or an object", *arguments);
    }
    out->tool_calls.push_back(std::move(parsed));
  }
  return absl::OkStatus();
}

// `tools`: [{type: "function", function: {name, description?, parameters?}}]; `tool_choice`:
// "auto" or "none" ("required" and a named function would need constrained decoding).
absl::Status ParseTools(const Json& body, ChatParams* params) {
  const Json* tools = Member(body, "tools");
  const bool has_tools = tools != nullptr && !(tools->is_array() && tools->empty());
  if (has_tools) {
    if (!tools->is_array()) return TypeError("tools", "an array of tools", *tools);
    for (size_t k = 0; k < tools->size(); ++k) {
      const std::string field = absl::StrCat("tools[", k, "]");
      const Json& tool = (*tools)[k];
      if (!tool.is_object()) return TypeError(field, "an object", tool);
      const Json* type = Member(tool, "type");
      if (type == nullptr || *type != "function") {
        return type == nullptr ? FieldError(absl::StrCat(field, ".type"),
                                            absl::StrCat(field, ".type is required (\"function\")"))
                               : TypeError(absl::StrCat(field, ".type"), "\"function\"", *type);
      }
      const Json* function = Member(tool, "function");
      if (function == nullptr || !function->is_object()) {
        return function == nullptr
                   ? FieldError(absl::StrCat(field, ".function"),
                                absl::StrCat(field, ".function is required"))
                   : TypeError(absl::StrCat(field, ".function"), "an object", *function);
      }
      const Json* name = Member(*function, "name");
      if (name == nullptr || !name->is_string() || name->get_ref<const std::string&>().empty()) {
        return name == nullptr
                   ? FieldError(absl::StrCat(field, ".function.name"),
                                absl::StrCat(field, ".function.name is required"))
                   : TypeError(absl::StrCat(field, ".function.name"), "a non-empty string", *name);
      }
    }
  }
  std::string choice = "auto";
  if (const Json* tool_choice = Member(body, "tool_choice"); tool_choice != nullptr) {
    if (tool_choice->is_string()) {
      choice = tool_choice->get<std::string>();
      if (choice == "required") params->forced_tool = "";
    } else if (tool_choice->is_object()) {
      // {"type": "function", "function": {"name": ...}}: one of the tools.
      const Json* function = Member(*tool_choice, "function");
      const Json* name =
          function != nullptr && function->is_object() ? Member(*function, "name") : nullptr;
      if (name == nullptr || !name->is_string()) {
        return FieldError("tool_choice.function.name",
                          "tool_choice names a function as {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}");
      }
      choice = "named";
      params->forced_tool = name->get<std::string>();
      bool known = false;
      for (size_t k = 0; has_tools && k < tools->size(); ++k) {
        known |= (*tools)[k]["function"]["name"] == *name;
      }
      if (!known) {
        return FieldError(
            "tool_choice.function.name",
            absl::StrCat("tool_choice names ", Describe(*name), ", which is not among the tools"));
      }
    } else {
      return TypeError("tool_choice", "a string or an object", *tool_choice);
    }
    if (choice != "auto" && choice != "none" && choice != "required" && choice != "named") {
      return FieldError("tool_choice",
                        absl::StrCat("tool_choice must be \"auto\", \"none\", \"required\" or a "
                                     "named function, got ",
                                     Describe(*tool_choice)));
    }
    if (choice == "required" && !has_tools) {
      return FieldError("tool_choice", "tool_choice \"required\" needs tools");
    }
    if (params->forced_tool.has_value() && params->sampling.has_structured_output()) {
      return FieldError("tool_choice",
                        "a forced tool call already fixes the output's form: leave out "
                        "response_format / guided_json / guided_choice");
    }
  }
  std::optional<bool> parallel;
  ASSIGN_OR_RETURN(parallel, ReadBool(body, "parallel_tool_calls"));
  params->parallel_tool_calls = parallel.value_or(true);
  // "none": the model answers in text; the tools stay out of the prompt, as OpenAI describes it.
  params->use_tools = has_tools && choice != "none";
  return absl::OkStatus();
}

// vLLM's `chat_template_kwargs`: the template's own arguments. The Qwen3 template reads one,
// `enable_thinking`; any other would be ignored by it, so it is refused by name.
absl::Status ParseChatTemplateKwargs(const Json& body, bool* enable_thinking) {
  const Json* kwargs = Member(body, "chat_template_kwargs");
  if (kwargs == nullptr) return absl::OkStatus();
  if (!kwargs->is_object()) return TypeError("chat_template_kwargs", "an object", *kwargs);
  for (const auto& [key, value] : kwargs->items()) {
    const std::string field = absl::StrCat("chat_template_kwargs.", key);
    if (key != "enable_thinking") {
      return FieldError(field, absl::StrCat(field,
                                            " is not supported: the chat template takes "
                                            "enable_thinking only"));
    }
    if (value.is_null()) continue;
    if (!value.is_boolean()) return TypeError(field, "a boolean", value);
    *enable_thinking = value.get<bool>();
  }
  return absl::OkStatus();
}

absl::Status ParseMessages(const Json& body, std::vector<tokenizer::ChatMessage>* messages) {
  const Json* list = Member(body, "messages");
  if (list == nullptr) return FieldError("messages", "messages is required");
  if (!list->is_array()) return TypeError("messages", "an array of messages", *list);
  if (list->empty()) return FieldError("messages", "messages must not be empty");
  for (size_t k = 0; k < list->size(); ++k) {
    const std::string field = absl::StrCat("messages[", k, "]");
    const Json& message = (*list)[k];
    if (!message.is_object()) return TypeError(field, "an object", message);
    const std::string role_field = absl::StrCat(field, ".role");
    const Json* role = Member(message, "role");
    if (role == nullptr) return FieldError(role_field, absl::StrCat(role_field, " is required"));
    if (!role->is_string()) return TypeError(role_field, "a string", *role);
    tokenizer::ChatMessage out;
    out.role = role->get<std::string>();
    ASSIGN_OR_RETURN(out.content, ParseMessageContent(message, absl::StrCat(field, ".content")));
    if (out.role == "assistant") {
      RETURN_IF_ERROR(ParseAssistantTurn(message, field, &out));
    } else if (out.role == "tool") {
      // Answers a call by id; the template does not show it, so only its type is checked.
      if (const Json* id = Member(message, "tool_call_id"); id != nullptr && !id->is_string()) {
        return TypeError(absl::StrCat(field, ".tool_call_id"), "a string", *id);
      }
    }
    messages->push_back(std::move(out));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FieldError(absl::string_view field, absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  if (!field.empty()) status.SetPayload(kParamPayload, absl::Cord(field));
  return status;
}

absl::Status ForOpenAiClient(const absl::Status& status, bool chat) {
  if (status.ok() || !ErrorParam(status).empty()) return status;
  const std::string field = RequestFieldOf(status);
  if (field.empty()) return status;
  std::string param = field;
  if (field == "input_ids" || field == "text") param = chat ? "messages" : "prompt";
  if (chat && field == "logprobs") param = "top_logprobs";
  // The messages name the gRPC field first ("sampling_params.temperature = ...", "text has 600
  // tokens; ..."): this API's spelling replaces it.
  std::string message(status.message());
  constexpr absl::string_view kSamplingPrefix = "sampling_params.";
  if (absl::StartsWith(message, kSamplingPrefix)) message.erase(0, kSamplingPrefix.size());
  if (param != field && absl::StartsWith(message, field)) {
    message = param + message.substr(field.size());
  }
  absl::Status mapped(status.code(), message);
  mapped.SetPayload(kParamPayload, absl::Cord(param));
  return mapped;
}

std::string ErrorParam(const absl::Status& status) {
  absl::optional<absl::Cord> param = status.GetPayload(kParamPayload);
  return param.has_value() ? std::string(*param) : std::string();
}

std::string ErrorCode(const absl::Status& status) {
  absl::optional<absl::Cord> code = status.GetPayload(kCodePayload);
  return code.has_value() ? std::string(*code) : std::string();
}

absl::Status ModelNotFoundError(absl::string_view model) {
  absl::Status status =
      absl::NotFoundError(absl::StrCat("The model `", model, "` does not exist."));
  status.SetPayload(kParamPayload, absl::Cord("model"));
  status.SetPayload(kCodePayload, absl::Cord("model_not_found"));
  return status;
}

std::vector<v1::GenerateRequest> ExpandChoices(const std::vector<v1::GenerateRequest>& prompts,
                                               int n, const std::string& request_id) {
  std::vector<v1::GenerateRequest> choices;
  choices.reserve(prompts.size() * static_cast<size_t>(n));
  for (const v1::GenerateRequest& prompt : prompts) {
    for (int k = 0; k < n; ++k) {
      v1::GenerateRequest& choice = choices.emplace_back(prompt);
      if (k > 0 && choice.sampling_params().has_seed()) {
        choice.mutable_sampling_params()->set_seed(choice.sampling_params().seed() +
                                                   static_cast<uint64_t>(k));
      }
    }
  }
  const bool several = choices.size() > 1;
  for (size_t i = 0; i < choices.size(); ++i) {
    choices[i].set_request_id(several ? absl::StrCat(request_id, "-", i) : request_id);
  }
  return choices;
}

absl::StatusOr<Json> ParseJsonBody(absl::string_view body) {
  if (body.empty()) return FieldError("", "request body is empty; expected a JSON object");
  absl::StatusOr<Json> root = ParseJson(body, JsonParseOptions{.max_depth = kMaxDepth});
  if (!root.ok()) return FieldError("", absl::StrCat("request body: ", root.status().message()));
  return root;
}

absl::StatusOr<CompletionParams> ParseCompletionRequest(const Json& body,
                                                        const std::string& served_model_name) {
  RETURN_IF_ERROR(CheckBody(body));
  RETURN_IF_ERROR(CheckModel(body, served_model_name));
  CompletionParams params;
  RETURN_IF_ERROR(ParsePrompts(body, &params.prompts));
  ASSIGN_OR_RETURN(params.n, ParseChoiceCount(body, params.prompts.size()));
  v1::SamplingParams sampling_params;
  v1::SamplingParams* sampling = &sampling_params;
  RETURN_IF_ERROR(ParseSampling(body, sampling));
  std::optional<bool> echo;
  ASSIGN_OR_RETURN(echo, ReadBool(body, "echo"));
  params.echo = echo.value_or(false);
  std::optional<int64_t> i;
  // At least 1, as vLLM asks (0 would return nothing and call it a length stop), except where
  // the prompt is the answer: with echo (OpenAI's "echo the prompt without generating") or
  // prompt_logprobs (score a prompt).
  ASSIGN_OR_RETURN(i, ReadInteger(body, "max_tokens", /*min=*/0));
  if (i && *i == 0 && !params.echo && !sampling->has_prompt_logprobs()) {
    return FieldError("max_tokens",
                      "max_tokens must be at least 1 (0 only with echo or prompt_logprobs, which "
                      "return the prompt)");
  }
  sampling->set_max_tokens(i ? static_cast<int32_t>(*i) : kDefaultCompletionMaxTokens);
  ASSIGN_OR_RETURN(i, ReadInteger(body, "logprobs", 0, kInt32Max));
  if (i) {
    sampling->set_logprobs(static_cast<int32_t>(*i));
    params.logprobs = true;
    // The echoed prompt's tokens are scored as the output's are (vLLM's default).
    if (params.echo && !sampling->has_prompt_logprobs()) {
      sampling->set_prompt_logprobs(static_cast<int32_t>(*i));
    }
  }
  RETURN_IF_ERROR(ParseStreaming(body, &params.stream, &params.include_usage));
  std::optional<bool> as_ids;
  ASSIGN_OR_RETURN(as_ids, ReadBool(body, "return_tokens_as_token_ids"));
  params.tokens_as_ids = as_ids.value_or(false);

  // best_of > n would generate more choices and return the n with the highest likelihood:
  // not implemented. best_of == n (or 1 with n = 1) is every choice returned, which we do.
  ASSIGN_OR_RETURN(i, ReadInteger(body, "best_of"));
  if (i && *i != params.n) {
    return FieldError("best_of", absl::StrCat("best_of must equal n (", params.n, "), got ", *i,
                                              "; ranking choices by likelihood is not supported"));
  }
  std::optional<std::string> suffix;
  ASSIGN_OR_RETURN(suffix, ReadString(body, "suffix"));
  if (suffix.has_value() && !suffix->empty()) {
    return FieldError("suffix", "suffix is not supported");
  }
  std::optional<int32_t> truncation;
  ASSIGN_OR_RETURN(truncation, ParseTruncation(body));
  std::optional<bool> token_ids;
  ASSIGN_OR_RETURN(token_ids, ReadBool(body, "return_token_ids"));
  params.return_token_ids = token_ids.value_or(false);
  for (v1::GenerateRequest& prompt : params.prompts) {
    *prompt.mutable_sampling_params() = sampling_params;
    // (The service sends the prompt, its ids, for either.)
    prompt.set_echo(params.echo || params.return_token_ids);
    if (truncation.has_value()) prompt.set_truncate_prompt_tokens(*truncation);
  }
  return params;
}

absl::StatusOr<ChatParams> ParseChatRequest(const Json& body,
                                            const std::string& served_model_name) {
  RETURN_IF_ERROR(CheckBody(body));
  RETURN_IF_ERROR(CheckModel(body, served_model_name));
  ChatParams params;
  RETURN_IF_ERROR(ParseMessages(body, &params.messages));
  RETURN_IF_ERROR(ParseSampling(body, &params.sampling));
  ASSIGN_OR_RETURN(params.n, ParseChoiceCount(body, 1));
  // max_completion_tokens replaces the deprecated max_tokens and wins when both are set.
  std::optional<int64_t> max_tokens;
  ASSIGN_OR_RETURN(max_tokens, ReadInteger(body, "max_completion_tokens", /*min=*/1));
  if (!max_tokens) {
    ASSIGN_OR_RETURN(max_tokens, ReadInteger(body, "max_tokens", /*min=*/1));
  }
  if (max_tokens) params.sampling.set_max_tokens(static_cast<int32_t>(*max_tokens));

  std::optional<bool> logprobs;
  ASSIGN_OR_RETURN(logprobs, ReadBool(body, "logprobs"));
  params.logprobs = logprobs.value_or(false);
  std::optional<bool> as_ids;
  ASSIGN_OR_RETURN(as_ids, ReadBool(body, "return_tokens_as_token_ids"));
  params.tokens_as_ids = as_ids.value_or(false);
  std::optional<bool> token_ids;
  ASSIGN_OR_RETURN(token_ids, ReadBool(body, "return_token_ids"));
  params.return_token_ids = token_ids.value_or(false);
  std::optional<int64_t> top;
  ASSIGN_OR_RETURN(top, ReadInteger(body, "top_logprobs", 0, kInt32Max));
  if (top && !params.logprobs) {
    return FieldError("top_logprobs", "top_logprobs requires logprobs to be true");
  }
  if (params.logprobs) params.sampling.set_logprobs(top ? static_cast<int32_t>(*top) : 0);
  RETURN_IF_ERROR(ParseStreaming(body, &params.stream, &params.include_usage));

  RETURN_IF_ERROR(ParseTools(body, &params));
  RETURN_IF_ERROR(ParseChatTemplateKwargs(body, &params.enable_thinking));
  ASSIGN_OR_RETURN(params.truncate_prompt_tokens, ParseTruncation(body));
  return params;
}

absl::StatusOr<std::vector<std::string>> ToolDefinitions(absl::string_view body) {
  // The body was parsed (and its depth checked) once already; this parse keeps the key order.
  const nlohmann::ordered_json ordered =
      nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  std::vector<std::string> out;
  if (!ordered.is_object() || !ordered.contains("tools") || !ordered["tools"].is_array()) {
    return out;
  }
  for (const nlohmann::ordered_json& tool : ordered["tools"]) out.push_back(PythonJsonDumps(tool));
  return out;
}

absl::StatusOr<TokenizeParams> ParseTokenizeRequest(const Json& body,
                                                    const std::string& served_model_name) {
  RETURN_IF_ERROR(CheckBody(body));
  RETURN_IF_ERROR(CheckModel(body, served_model_name));
  TokenizeParams params;
  const bool has_prompt = Member(body, "prompt") != nullptr;
  const bool has_messages = Member(body, "messages") != nullptr;
  if (has_prompt == has_messages) {
    return FieldError(has_prompt ? "messages" : "prompt",
                      "give either prompt (a text) or messages (a chat), not both or neither");
  }
  if (has_prompt) {
    ASSIGN_OR_RETURN(params.prompt, ReadString(body, "prompt"));
  } else {
    RETURN_IF_ERROR(ParseMessages(body, &params.messages));
    std::optional<bool> b;
    ASSIGN_OR_RETURN(b, ReadBool(body, "add_generation_prompt"));
    params.add_generation_prompt = b.value_or(true);
    RETURN_IF_ERROR(ParseChatTemplateKwargs(body, &params.enable_thinking));
    ChatParams chat;
    RETURN_IF_ERROR(ParseTools(body, &chat));
    params.use_tools = chat.use_tools;
  }
  // The Qwen tokenizers add no special tokens to a text, so either value gives the same ids; the
  // type is still checked.
  std::optional<bool> special;
  ASSIGN_OR_RETURN(special, ReadBool(body, "add_special_tokens"));
  return params;
}

absl::StatusOr<v1::DetokenizeRequest> ParseDetokenizeRequest(const Json& body,
                                                             const std::string& served_model_name) {
  RETURN_IF_ERROR(CheckBody(body));
  RETURN_IF_ERROR(CheckModel(body, served_model_name));
  const Json* tokens = Member(body, "tokens");
  if (tokens == nullptr) return FieldError("tokens", "tokens is required");
  if (!tokens->is_array()) return TypeError("tokens", "an array of token ids", *tokens);
  v1::DetokenizeRequest request;
  for (size_t k = 0; k < tokens->size(); ++k) {
    int64_t id = 0;
    ASSIGN_OR_RETURN(id, ToInteger((*tokens)[k], absl::StrCat("tokens[", k, "]"), 0, kInt32Max));
    request.add_ids(static_cast<int32_t>(id));
  }
  return request;
}

#undef RETURN_IF_ERROR
#undef ASSIGN_OR_RETURN
#undef MOBIUS_CONCAT
#undef MOBIUS_CONCAT_INNER
#undef MOBIUS_ASSIGN_OR_RETURN_IMPL

}  // namespace mobius::router::openai
