#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"
#include "tokenizer/utf8.h"

namespace mobius::tokenizer {
namespace {

// Members of the Unicode White_Space property, spelled for use inside a PCRE2 class.
constexpr char kWhiteSpaceClassBody[] =
    "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";

// PCRE2 uses the machine stack of the calling thread by default (32 KiB); patterns that
// backtrack over long runs may need more, which is only allocated when a match asks for it.
constexpr size_t kLargeJitStackBytes = size_t{256} << 20;

std::string Pcre2ErrorMessage(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

}  // namespace

std::string TranslateOnigurumaPattern(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  size_t class_start = 0;  // Position just after '[' or '[^' of the open class.
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      ++i;
      if (next == 's') {
        if (in_class) {
          out.append(kWhiteSpaceClassBody);
        } else {
          absl::StrAppend(&out, "[", kWhiteSpaceClassBody, "]");
        }
        continue;
      }
      if (next == 'S' && !in_class) {
        absl::StrAppend(&out, "[^", kWhiteSpaceClassBody, "]");
        continue;
      }
      out.push_back(c);
      out.push_back(next);
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      class_start = i + 1;
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      // A POSIX class such as [:alpha:] holds a ']' that does not close the outer class.
      const size_t end = pattern.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(pattern.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']' && i != class_start) in_class = false;
    out.push_back(c);
  }
  return out;
}

std::string EscapeRegexLiteral(std::string_view literal) {
  std::string out;
  out.reserve(literal.size() * 2);
  for (char c : literal) {
    const auto byte = static_cast<unsigned char>(c);
    const bool is_word = (byte >= '0' && byte <= '9') || (byte >= 'a' && byte <= 'z') ||
                         (byte >= 'A' && byte <= 'Z') || byte >= 0x80;
    if (!is_word) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

struct Regex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
  // Shared by all threads; only read while matching.
  pcre2_match_context* context = nullptr;

  ~Impl() {
    pcre2_match_context_free(context);
    pcre2_code_free(code);
  }
};

Regex::Regex(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Regex::~Regex() = default;

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern) {
  const std::string translated = TranslateOnigurumaPattern(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  auto impl = std::make_unique<Impl>();
  impl->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                             PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (impl->code == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot compile pre-tokenizer regex \"", std::string(pattern),
                     "\": ", Pcre2ErrorMessage(error_code), " at offset ", error_offset));
  }
  // Without JIT the interpreter still gives the same matches, only slower.
  impl->jit = pcre2_jit_compile(impl->code, PCRE2_JIT_COMPLETE) == 0;
  // A single match may legitimately scan and backtrack over a whole input (e.g. 10 MB of
  // spaces against \s*[\r\n]+); the work stays linear overall, so the default limit of ten
  // million steps would only turn large valid inputs into errors.
  impl->context = pcre2_match_context_create(nullptr);
  if (impl->context == nullptr) return absl::ResourceExhaustedError("pcre2 context allocation");
  pcre2_set_match_limit(impl->context, UINT32_MAX);
  pcre2_set_heap_limit(impl->context, UINT32_MAX);
  return std::unique_ptr<Regex>(new Regex(std::move(impl)));
}

absl::Status Regex::FindAll(std::string_view subject,
                            std::vector<std::pair<size_t, size_t>>& matches) const {
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match_data(
      pcre2_match_data_create_from_pattern(impl_->code, nullptr), &pcre2_match_data_free);
  std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> large_context(
      nullptr, &pcre2_match_context_free);
  std::unique_ptr<pcre2_jit_stack, decltype(&pcre2_jit_stack_free)> large_stack(
      nullptr, &pcre2_jit_stack_free);

  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t offset = 0;
  while (offset < subject.size()) {
    int rc;
    if (impl_->jit) {
      rc = pcre2_jit_match(impl_->code, data, subject.size(), offset, 0, match_data.get(),
                           large_context != nullptr ? large_context.get() : impl_->context);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT && large_context == nullptr) {
        large_stack.reset(pcre2_jit_stack_create(size_t{1} << 20, kLargeJitStackBytes, nullptr));
        large_context.reset(pcre2_match_context_copy(impl_->context));
        if (large_stack == nullptr || large_context == nullptr) {
          return absl::ResourceExhaustedError("cannot allocate a PCRE2 JIT stack");
        }
        pcre2_jit_stack_assign(large_context.get(), nullptr, large_stack.get());
        continue;
      }
    } else {
      // The caller guarantees valid UTF-8; checking it on every call would make the scan
      // quadratic in the subject length.
      rc = pcre2_match(impl_->code, data, subject.size(), offset, PCRE2_NO_UTF_CHECK,
                       match_data.get(), impl_->context);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pre-tokenizer regex failed at byte ", offset, ": ", Pcre2ErrorMessage(rc)));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data.get());
    const size_t start = ovector[0];
    const size_t end = ovector[1];
    matches.emplace_back(start, end);
    if (end > offset) {
      offset = end;
    } else if (end >= subject.size()) {
      break;
    } else {
      // An empty match: step over one character so that the scan always advances.
      offset = end + DecodeUtf8Step(subject, end).length;
    }
  }
  return absl::OkStatus();
}

}  // namespace mobius::tokenizer
