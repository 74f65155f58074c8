#include "tokenizer/normalizer.h"

#include <cstdlib>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "utf8proc.h"

namespace mobius::tokenizer {
namespace {

utf8proc_option_t OptionsFor(NormalizationForm form) {
  const int stable = UTF8PROC_STABLE;
  switch (form) {
    case NormalizationForm::kNfc:
      return static_cast<utf8proc_option_t>(stable | UTF8PROC_COMPOSE);
    case NormalizationForm::kNfd:
      return static_cast<utf8proc_option_t>(stable | UTF8PROC_DECOMPOSE);
    case NormalizationForm::kNfkc:
      return static_cast<utf8proc_option_t>(stable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    case NormalizationForm::kNfkd:
      return static_cast<utf8proc_option_t>(stable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  }
  return UTF8PROC_STABLE;
}

void NormalizeChunk(std::string_view chunk, utf8proc_option_t options, std::string& out) {
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(chunk.data()),
                   static_cast<utf8proc_ssize_t>(chunk.size()), &result, options);
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(result, &std::free);
  if (length < 0) {
    // Only reachable on invalid UTF-8, which callers have already replaced; keep the text.
    out.append(chunk);
    return;
  }
  out.append(reinterpret_cast<const char*>(result), static_cast<size_t>(length));
}

// An ASCII character is a starter that never takes part in a composition as the second
// character and never reorders, so text can be normalised piecewise with cuts just before ASCII
// bytes. Only the pieces holding non-ASCII bytes then need utf8proc, which keeps English fast.
std::string NormalizeWithForm(std::string_view text, NormalizationForm form) {
  const utf8proc_option_t options = OptionsFor(form);
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  const size_t n = text.size();
  while (pos < n) {
    size_t first_non_ascii = pos;
    while (first_non_ascii < n && static_cast<uint8_t>(text[first_non_ascii]) < 0x80) {
      ++first_non_ascii;
    }
    if (first_non_ascii == n) {
      out.append(text.substr(pos));
      break;
    }
    // The ASCII character just before a non-ASCII run may compose with it (e + U+0301).
    const size_t chunk_start = first_non_ascii > pos ? first_non_ascii - 1 : first_non_ascii;
    out.append(text.substr(pos, chunk_start - pos));
    size_t chunk_end = first_non_ascii;
    while (chunk_end < n && static_cast<uint8_t>(text[chunk_end]) >= 0x80) ++chunk_end;
    NormalizeChunk(text.substr(chunk_start, chunk_end - chunk_start), options, out);
    pos = chunk_end;
  }
  return out;
}

absl::Status AppendForms(const nlohmann::json& config, std::vector<NormalizationForm>& forms) {
  if (config.is_null()) return absl::OkStatus();
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string()) {
    return absl::InvalidArgumentError("tokenizer.json normalizer: expected an object with a type");
  }
  const std::string type = config["type"].get<std::string>();
  if (type == "NFC") {
    forms.push_back(NormalizationForm::kNfc);
  } else if (type == "NFD") {
    forms.push_back(NormalizationForm::kNfd);
  } else if (type == "NFKC") {
    forms.push_back(NormalizationForm::kNfkc);
  } else if (type == "NFKD") {
    forms.push_back(NormalizationForm::kNfkd);
  } else if (type == "Sequence") {
    if (!config.contains("normalizers") || !config["normalizers"].is_array()) {
      return absl::InvalidArgumentError(
          "tokenizer.json normalizer: Sequence needs a \"normalizers\" array");
    }
    for (const nlohmann::json& child : config["normalizers"]) {
      RETURN_IF_ERROR(AppendForms(child, forms));
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json normalizer: unsupported type \"", type,
                     "\" (supported: NFC, NFD, NFKC, NFKD, Sequence)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Normalizer> Normalizer::FromJson(const nlohmann::json& config) {
  Normalizer normalizer;
  RETURN_IF_ERROR(AppendForms(config, normalizer.forms_));
  return normalizer;
}

std::string Normalizer::Normalize(std::string_view text) const {
  if (forms_.empty()) return std::string(text);
  std::string current = NormalizeWithForm(text, forms_.front());
  for (size_t i = 1; i < forms_.size(); ++i) current = NormalizeWithForm(current, forms_[i]);
  return current;
}

}  // namespace mobius::tokenizer
