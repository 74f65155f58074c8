#include "worker/model/model_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace mobius::worker {
namespace {

using nlohmann::json;

// Reads typed fields from one JSON object, recording the first error with the field's name.
class FieldReader {
 public:
  FieldReader(const json& object, std::string source)
      : object_(object), source_(std::move(source)) {}

  bool Has(const char* name) const {
    auto it = object_.find(name);
    return it != object_.end() && !it->is_null();
  }

  absl::StatusOr<int64_t> Int(const char* name) const {
    if (!Has(name)) return Missing(name);
    const json& v = object_.at(name);
    if (!v.is_number_integer()) return WrongType(name, "an integer", v);
    return v.get<int64_t>();
  }
  absl::StatusOr<int64_t> Int(const char* name, int64_t fallback) const {
    return Has(name) ? Int(name) : fallback;
  }
  absl::StatusOr<int> PositiveInt(const char* name) const {
    ASSIGN_OR_RETURN(int64_t v, Int(name));
    return CheckPositive(name, v);
  }
  absl::StatusOr<int> PositiveInt(const char* name, int64_t fallback) const {
    ASSIGN_OR_RETURN(int64_t v, Int(name, fallback));
    return CheckPositive(name, v);
  }
  absl::StatusOr<double> Number(const char* name, double fallback) const {
    if (!Has(name)) return fallback;
    const json& v = object_.at(name);
    if (!v.is_number()) return WrongType(name, "a number", v);
    return v.get<double>();
  }
  absl::StatusOr<bool> Bool(const char* name, bool fallback) const {
    if (!Has(name)) return fallback;
    const json& v = object_.at(name);
    if (!v.is_boolean()) return WrongType(name, "true or false", v);
    return v.get<bool>();
  }
  absl::StatusOr<std::string> String(const char* name, const std::string& fallback) const {
    if (!Has(name)) return fallback;
    const json& v = object_.at(name);
    if (!v.is_string()) return WrongType(name, "a string", v);
    return v.get<std::string>();
  }

  absl::Status Invalid(const char* name, const std::string& why) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field \"", name, "\" ", why));
  }

 private:
  absl::Status Missing(const char* name) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": required field \"", name, "\" is missing"));
  }
  absl::Status WrongType(const char* name, const char* expected, const json& v) const {
    return Invalid(name, absl::StrCat("must be ", expected, ", got ", v.dump()));
  }
  absl::StatusOr<int> CheckPositive(const char* name, int64_t v) const {
    if (v <= 0 || v > (int64_t{1} << 30)) {
      return Invalid(name, absl::StrCat("must be a positive integer, got ", v));
    }
    return static_cast<int>(v);
  }

  const json& object_;
  std::string source_;
};

absl::StatusOr<std::vector<LayerType>> ReadLayerTypes(const FieldReader& r, const json& text,
                                                      int num_layers) {
  std::vector<LayerType> types;
  if (r.Has("layer_types")) {
    const json& list = text.at("layer_types");
    if (!list.is_array()) return r.Invalid("layer_types", "must be a list");
    if (static_cast<int>(list.size()) != num_layers) {
      return r.Invalid("layer_types", absl::StrFormat("has %d entries but num_hidden_layers is %d",
                                                      list.size(), num_layers));
    }
    for (const json& entry : list) {
      const std::string name = entry.is_string() ? entry.get<std::string>() : entry.dump();
      if (name == "linear_attention") {
        types.push_back(LayerType::kLinearAttention);
      } else if (name == "full_attention") {
        types.push_back(LayerType::kFullAttention);
      } else {
        return r.Invalid("layer_types",
                         absl::StrCat("has unknown entry ", entry.dump(),
                                      " (expected \"linear_attention\" or \"full_attention\")"));
      }
    }
    return types;
  }
  ASSIGN_OR_RETURN(int interval, r.PositiveInt("full_attention_interval", 4));
  for (int i = 0; i < num_layers; ++i) {
    types.push_back((i + 1) % interval == 0 ? LayerType::kFullAttention
                                            : LayerType::kLinearAttention);
  }
  return types;
}

absl::Status ReadRope(const FieldReader& r, const json& text, const std::string& source,
                      ModelConfig& c) {
  ASSIGN_OR_RETURN(c.rope_theta, r.Number("rope_theta", 10000.0));
  ASSIGN_OR_RETURN(c.partial_rotary_factor, r.Number("partial_rotary_factor", 0.25));
  if (r.Has("rope_parameters")) {
    const json& rope = text.at("rope_parameters");
    if (!rope.is_object()) return r.Invalid("rope_parameters", "must be an object");
    FieldReader rr(rope, absl::StrCat(source, ": rope_parameters"));
    ASSIGN_OR_RETURN(c.rope_theta, rr.Number("rope_theta", c.rope_theta));
    ASSIGN_OR_RETURN(c.partial_rotary_factor,
                     rr.Number("partial_rotary_factor", c.partial_rotary_factor));
    ASSIGN_OR_RETURN(std::string type, rr.String("rope_type", "default"));
    if (type != "default") {
      return rr.Invalid("rope_type",
                        absl::StrCat("\"", type, "\" is not supported (only \"default\")"));
    }
  }
  if (!(c.rope_theta > 0)) return r.Invalid("rope_theta", "must be positive");
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1)) {
    return r.Invalid("partial_rotary_factor", "must be in (0, 1]");
  }
  return absl::OkStatus();
}

// What a config may describe. Every size derived from it must fit the engine's types (weight
// matrix sides are 32-bit, with room for the fused gate/up doubling; byte counts are 64-bit) and
// listing its parameters (loops over layers and experts) must stay cheap, so that a corrupt or
// hostile config.json is refused here by name rather than overflowing later. The limits are far
// above any model of the family (40-94 layers, 512-2560 experts, matrix sides up to 248320,
// 35-80B parameters).
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = int64_t{1} << 20;
constexpr int64_t kMaxMatrixSide = int64_t{1} << 30;
constexpr double kMaxParameters = 0x1p44;  // ~17.6T parameters: 35 TB in bf16

// The parameter count `c` describes, in double so that no product can overflow: the terms of
// parameter_layout.cc's list that grow with the config (norms and other vectors left out).
double ParameterCount(const ModelConfig& c) {
  const double H = c.hidden_size;
  const double E = c.num_experts, I = c.moe_intermediate_size;
  const double shared = 3.0 * c.shared_expert_intermediate_size * H + H;  // + its gate
  const double attention = (3.0 * c.num_attention_heads + 2.0 * c.num_key_value_heads) *
                           c.head_dim * H;  // q + gate, k, v, o
  const double key = static_cast<double>(c.linear_num_key_heads) * c.linear_key_head_dim;
  const double value = static_cast<double>(c.linear_num_value_heads) * c.linear_value_head_dim;
  const double deltanet = (2 * key + 3 * value + 2.0 * c.linear_num_value_heads) * H +
                          (2 * key + value) * c.linear_conv_kernel_dim;
  double n = (c.tie_word_embeddings ? 1.0 : 2.0) * c.vocab_size * H;
  int moe_layers = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    n += c.layer_types[i] == LayerType::kFullAttention ? attention : deltanet;
    if (c.mlp_types[i] == MlpType::kDense) {
      n += 3.0 * c.intermediate_size * H;
    } else {
      n += shared;
      ++moe_layers;
    }
  }
  // Mobius shares num_blocks banks across its layers; Qwen3-Next has one per MoE layer.
  const int banks = c.family == ModelFamily::kInternS2Mobius ? c.num_blocks : moe_layers;
  n += banks * E * (3 * I + 1) * H;  // + the router's row per expert
  if (c.mtp_num_hidden_layers > 0) {
    n +=
        2.0 * H * H + attention + shared + static_cast<double>(c.mtp_num_experts) * (3 * I + 1) * H;
  }
  return n;
}

absl::Status CheckSizes(const ModelConfig& c, const FieldReader& r, const std::string& source) {
  if (c.num_experts > kMaxExperts) {
    return r.Invalid("num_experts",
                     absl::StrCat("(", c.num_experts, ") exceeds the limit of ", kMaxExperts));
  }
  if (c.mtp_num_experts > kMaxExperts) {
    return r.Invalid("mtp_num_experts",
                     absl::StrCat("(", c.mtp_num_experts, ") exceeds the limit of ", kMaxExperts));
  }
  // The longest side of a weight matrix that each field sets.
  const int64_t key = int64_t{c.linear_num_key_heads} * c.linear_key_head_dim;
  const int64_t value = int64_t{c.linear_num_value_heads} * c.linear_value_head_dim;
  // The DeltaNet in-projection stacks q, k (key) and v, z (value): each half gets half the limit.
  const struct {
    const char* field;
    int64_t side;
    int64_t limit;
  } sides[] = {
      {"hidden_size", 2 * int64_t{c.hidden_size}, kMaxMatrixSide},  // the MTP head's fc: [H, 2H]
      {"vocab_size", c.vocab_size, kMaxMatrixSide},
      {"num_attention_heads x head_dim", 2 * int64_t{c.num_attention_heads} * c.head_dim,
       kMaxMatrixSide},  // q and its gate
      {"num_key_value_heads x head_dim", int64_t{c.num_key_value_heads} * c.head_dim,
       kMaxMatrixSide},
      {"linear_num_key_heads x linear_key_head_dim", 2 * key, kMaxMatrixSide / 2},
      {"linear_num_value_heads x linear_value_head_dim", 2 * value, kMaxMatrixSide / 2},
      {"moe_intermediate_size", 2 * int64_t{c.moe_intermediate_size}, kMaxMatrixSide},  // gate+up
      {"shared_expert_intermediate_size", 2 * int64_t{c.shared_expert_intermediate_size},
       kMaxMatrixSide},
      {"intermediate_size", 2 * int64_t{c.intermediate_size}, kMaxMatrixSide},
  };
  for (const auto& [field, side, limit] : sides) {
    if (side > limit) {
      return r.Invalid(field, absl::StrCat("makes a weight matrix side of ", side,
                                           ", above the limit of ", limit));
    }
  }
  const double parameters = ParameterCount(c);
  if (parameters > kMaxParameters) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: describes %.3g parameters, above the limit of %.3g (is a size field corrupt?)", source,
        parameters, kMaxParameters));
  }
  return absl::OkStatus();
}

}  // namespace

int ModelConfig::rotary_dim() const {
  return static_cast<int>(std::lround(head_dim * partial_rotary_factor));
}

int ModelConfig::num_layers_of(LayerType type) const {
  int n = 0;
  for (LayerType t : layer_types) n += t == type;
  return n;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": top level must be a JSON object"));
  }
  ModelConfig c;
  FieldReader top(root, source);
  ASSIGN_OR_RETURN(c.model_type, top.String("model_type", ""));

  // Mobius nests the language model under text_config; Qwen3-Next is flat.
  const json* text = &root;
  std::string text_source = source;
  if (top.Has("text_config")) {
    text = &root.at("text_config");
    if (!text->is_object()) return top.Invalid("text_config", "must be an object");
    text_source = absl::StrCat(source, ": text_config");
  }
  FieldReader r(*text, text_source);
  ASSIGN_OR_RETURN(std::string text_type, r.String("model_type", c.model_type));
  if (c.model_type == "qwen3_next" || text_type == "qwen3_next") {
    c.family = ModelFamily::kQwen3Next;
  } else if (c.model_type.starts_with("interns2_mobius") ||
             text_type.starts_with("interns2_mobius")) {
    c.family = ModelFamily::kInternS2Mobius;
  } else {
    return top.Invalid("model_type",
                       absl::StrCat("\"", c.model_type.empty() ? text_type : c.model_type,
                                    "\" is not supported (expected \"interns2_mobius\" or "
                                    "\"qwen3_next\")"));
  }

  ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("hidden_size"));
  ASSIGN_OR_RETURN(c.num_hidden_layers, r.PositiveInt("num_hidden_layers"));
  if (c.num_hidden_layers > kMaxLayers) {  // before anything is sized by it
    return r.Invalid("num_hidden_layers",
                     absl::StrCat("(", c.num_hidden_layers, ") exceeds the limit of ", kMaxLayers));
  }
  ASSIGN_OR_RETURN(c.layer_types, ReadLayerTypes(r, *text, c.num_hidden_layers));
  ASSIGN_OR_RETURN(c.vocab_size, r.PositiveInt("vocab_size"));
  ASSIGN_OR_RETURN(double eps, r.Number("rms_norm_eps", 1e-6));
  if (!(eps > 0 && eps < 1)) return r.Invalid("rms_norm_eps", "must be in (0, 1)");
  c.rms_norm_eps = static_cast<float>(eps);
  // A top-level tie_word_embeddings (Mobius keeps it beside text_config) counts too.
  ASSIGN_OR_RETURN(bool tie_top, top.Bool("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, r.Bool("tie_word_embeddings", tie_top));
  ASSIGN_OR_RETURN(c.max_position_embeddings, r.Int("max_position_embeddings", 262144));
  if (c.max_position_embeddings <= 0) {
    return r.Invalid("max_position_embeddings",
                     absl::StrCat("must be positive, got ", c.max_position_embeddings));
  }

  if (c.num_layers_of(LayerType::kFullAttention) > 0) {
    ASSIGN_OR_RETURN(c.num_attention_heads, r.PositiveInt("num_attention_heads"));
    ASSIGN_OR_RETURN(c.num_key_value_heads, r.PositiveInt("num_key_value_heads"));
    if (r.Has("head_dim")) {
      ASSIGN_OR_RETURN(c.head_dim, r.PositiveInt("head_dim"));
    } else {
      if (c.hidden_size % c.num_attention_heads != 0) {
        return r.Invalid("head_dim", "is missing and hidden_size is not a multiple of heads");
      }
      c.head_dim = c.hidden_size / c.num_attention_heads;
    }
    if (c.num_attention_heads % c.num_key_value_heads != 0) {
      return r.Invalid("num_key_value_heads",
                       absl::StrFormat("(%d) must divide num_attention_heads (%d)",
                                       c.num_key_value_heads, c.num_attention_heads));
    }
    RETURN_IF_ERROR(ReadRope(r, *text, text_source, c));
    const int rd = c.rotary_dim();
    if (rd % 2 != 0 || rd <= 0 || rd > c.head_dim) {
      return r.Invalid("partial_rotary_factor",
                       absl::StrFormat("gives rotary dim %d for head_dim %d; it must be even "
                                       "and at most head_dim",
                                       rd, c.head_dim));
    }
  }
  if (c.has_linear_attention()) {
    ASSIGN_OR_RETURN(c.linear_num_key_heads, r.PositiveInt("linear_num_key_heads"));
    ASSIGN_OR_RETURN(c.linear_num_value_heads, r.PositiveInt("linear_num_value_heads"));
    ASSIGN_OR_RETURN(c.linear_key_head_dim, r.PositiveInt("linear_key_head_dim"));
    ASSIGN_OR_RETURN(c.linear_value_head_dim, r.PositiveInt("linear_value_head_dim"));
    ASSIGN_OR_RETURN(c.linear_conv_kernel_dim, r.PositiveInt("linear_conv_kernel_dim"));
    if (c.linear_num_value_heads % c.linear_num_key_heads != 0) {
      return r.Invalid("linear_num_value_heads",
                       absl::StrFormat("(%d) must be a multiple of linear_num_key_heads (%d)",
                                       c.linear_num_value_heads, c.linear_num_key_heads));
    }
  }

  // Which layers route to experts.
  c.mlp_types.assign(c.num_hidden_layers, MlpType::kMoe);
  if (c.family == ModelFamily::kQwen3Next) {
    ASSIGN_OR_RETURN(int sparse_step, r.PositiveInt("decoder_sparse_step", 1));
    ASSIGN_OR_RETURN(int64_t num_experts, r.Int("num_experts", 0));
    for (int i = 0; i < c.num_hidden_layers; ++i) {
      if (num_experts <= 0 || (i + 1) % sparse_step != 0) c.mlp_types[i] = MlpType::kDense;
    }
    if (r.Has("mlp_only_layers")) {
      const json& list = text->at("mlp_only_layers");
      if (!list.is_array()) return r.Invalid("mlp_only_layers", "must be a list of layer indices");
      for (const json& v : list) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
            v.get<int64_t>() >= c.num_hidden_layers) {
          return r.Invalid("mlp_only_layers", absl::StrCat("has invalid layer index ", v.dump()));
        }
        c.mlp_types[v.get<int>()] = MlpType::kDense;
      }
    }
  }
  bool any_moe = false, any_dense = false;
  for (MlpType t : c.mlp_types) (t == MlpType::kMoe ? any_moe : any_dense) = true;
  if (any_moe) {
    ASSIGN_OR_RETURN(c.num_experts, r.PositiveInt("num_experts"));
    ASSIGN_OR_RETURN(c.num_experts_per_tok, r.PositiveInt("num_experts_per_tok"));
    ASSIGN_OR_RETURN(c.moe_intermediate_size, r.PositiveInt("moe_intermediate_size"));
    ASSIGN_OR_RETURN(c.shared_expert_intermediate_size,
                     r.PositiveInt("shared_expert_intermediate_size"));
    ASSIGN_OR_RETURN(c.norm_topk_prob, r.Bool("norm_topk_prob", true));
    if (c.num_experts_per_tok > c.num_experts) {
      return r.Invalid(
          "num_experts_per_tok",
          absl::StrFormat("(%d) exceeds num_experts (%d)", c.num_experts_per_tok, c.num_experts));
    }
  }
  if (any_dense) {
    ASSIGN_OR_RETURN(c.intermediate_size, r.PositiveInt("intermediate_size"));
  }

  if (c.family == ModelFamily::kInternS2Mobius) {
    ASSIGN_OR_RETURN(c.num_blocks, r.PositiveInt("num_blocks", 4));
    if (c.num_blocks > c.num_hidden_layers) {
      return r.Invalid("num_blocks", absl::StrFormat("(%d) exceeds num_hidden_layers (%d)",
                                                     c.num_blocks, c.num_hidden_layers));
    }
  } else {
    c.num_blocks = c.num_hidden_layers;
  }

  ASSIGN_OR_RETURN(int64_t mtp_layers, r.Int("mtp_num_hidden_layers", 0));
  if (mtp_layers < 0) return r.Invalid("mtp_num_hidden_layers", "must not be negative");
  c.mtp_num_hidden_layers = static_cast<int>(mtp_layers);
  if (c.mtp_num_hidden_layers > 0) {
    ASSIGN_OR_RETURN(c.mtp_num_experts, r.PositiveInt("mtp_num_experts", c.num_experts));
    ASSIGN_OR_RETURN(c.mtp_num_experts_per_tok,
                     r.PositiveInt("mtp_num_experts_per_tok", c.num_experts_per_tok));
    if (c.mtp_num_experts_per_tok > c.mtp_num_experts) {
      return r.Invalid("mtp_num_experts_per_tok",
                       absl::StrFormat("(%d) exceeds mtp_num_experts (%d)",
                                       c.mtp_num_experts_per_tok, c.mtp_num_experts));
    }
  }
  RETURN_IF_ERROR(CheckSizes(c, r, text_source));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  std::filesystem::path file(path);
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) file /= "config.json";
  std::ifstream in(file);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read model config ", file.string()));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseModelConfig(buffer.str(), file.string());
}

}  // namespace mobius::worker
