#include "bench/serve/sse_parser.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace mobius::bench {

absl::Status SseParser::Feed(absl::string_view bytes, std::vector<std::string>& events) {
  if (first_ && !bytes.empty()) {
    // The BOM may itself be split across reads; only a complete one at the very start counts.
    if (absl::StartsWith(bytes, "\xEF\xBB\xBF")) bytes.remove_prefix(3);
    first_ = false;
  }
  for (char c : bytes) {
    if (skip_lf_) {
      skip_lf_ = false;
      if (c == '\n') continue;
    }
    if (c == '\r' || c == '\n') {
      skip_lf_ = c == '\r';
      ProcessLine(events);
      continue;
    }
    if (line_.size() >= max_line_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("SSE line longer than ", max_line_bytes_, " bytes"));
    }
    line_.push_back(c);
  }
  return absl::OkStatus();
}

void SseParser::ProcessLine(std::vector<std::string>& events) {
  if (line_.empty()) {
    // A blank line ends the event; one without data lines dispatches nothing (per the spec).
    if (has_data_) events.push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    return;
  }
  if (line_[0] != ':') {
    absl::string_view line = line_;
    const size_t colon = line.find(':');
    absl::string_view field = line.substr(0, colon);
    absl::string_view value;
    if (colon != absl::string_view::npos) {
      value = line.substr(colon + 1);
      if (absl::StartsWith(value, " ")) value.remove_prefix(1);
    }
    if (field == "data") {
      if (has_data_) data_.push_back('\n');
      absl::StrAppend(&data_, value);
      has_data_ = true;
    }
  }
  line_.clear();
}

}  // namespace mobius::bench
