#include "common/json_parse.h"

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mobius {
namespace {

// Forwards SAX events to nlohmann's DOM builder (exceptions off) and adds the checks.
template <class Json>
class CheckingSax {
 public:
  CheckingSax(Json& root, const JsonParseOptions& options)
      : dom_(root, /*allow_exceptions_=*/false), options_(options) {}

  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(typename Json::number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(typename Json::number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(typename Json::number_float_t v, const typename Json::string_t& s) {
    return dom_.number_float(v, s);
  }
  bool string(typename Json::string_t& v) { return dom_.string(v); }
  bool binary(typename Json::binary_t& v) { return dom_.binary(v); }

  bool start_object(size_t len) {
    if (!Enter()) return false;
    keys_.emplace_back();
    return dom_.start_object(len);
  }
  bool key(typename Json::string_t& k) {
    if (options_.reject_duplicate_keys && !keys_.back().insert(k).second) {
      error_ = absl::StrCat("duplicate key \"", k, "\"");
      return false;
    }
    return dom_.key(k);
  }
  bool end_object() {
    keys_.pop_back();
    --depth_;
    return dom_.end_object();
  }
  bool start_array(size_t len) { return Enter() && dom_.start_array(len); }
  bool end_array() {
    --depth_;
    return dom_.end_array();
  }

  template <class Exception>
  bool parse_error(size_t position, const std::string& /*last_token*/, const Exception& ex) {
    error_ = absl::StrCat("invalid JSON at byte ", position, ": ", ex.what());
    return false;
  }

  [[nodiscard]] const std::string& error() const { return error_; }

 private:
  bool Enter() {
    if (++depth_ > options_.max_depth) {
      error_ = absl::StrCat("nesting deeper than ", options_.max_depth, " levels");
      return false;
    }
    return true;
  }

  nlohmann::detail::json_sax_dom_parser<Json> dom_;
  const JsonParseOptions& options_;
  std::vector<std::set<std::string>> keys_;
  size_t depth_ = 0;
  std::string error_;
};

template <class Json>
absl::StatusOr<Json> ParseWithChecks(absl::string_view text, const JsonParseOptions& options) {
  Json root;
  CheckingSax<Json> sax(root, options);
  const bool ok = Json::sax_parse(text.begin(), text.end(), &sax);
  if (!ok || !sax.error().empty()) {
    return absl::InvalidArgumentError(sax.error().empty() ? "invalid JSON" : sax.error());
  }
  return root;
}

}  // namespace

absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, const JsonParseOptions& options) {
  return ParseWithChecks<nlohmann::json>(text, options);
}

absl::StatusOr<nlohmann::ordered_json> ParseOrderedJson(absl::string_view text,
                                                        const JsonParseOptions& options) {
  return ParseWithChecks<nlohmann::ordered_json>(text, options);
}

}  // namespace mobius
