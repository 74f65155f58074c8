// Incremental parser of a text/event-stream body (the WHATWG Server-Sent Events format), fed
// with whatever bytes one socket read returned: events may arrive split across reads or several
// in one read. Only `data` fields matter to the OpenAI streaming API; `event`, `id`, `retry` and
// comment lines (": ping") are skipped.
#ifndef MOBIUS_BENCH_SERVE_SSE_PARSER_H_
#define MOBIUS_BENCH_SERVE_SSE_PARSER_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mobius::bench {

class SseParser {
 public:
  // A line longer than this is an error rather than unbounded buffering of a broken stream.
  explicit SseParser(size_t max_line_bytes = size_t{16} << 20) : max_line_bytes_(max_line_bytes) {}

  // Appends the data of every event completed by `bytes` to `events` (several `data:` lines of
  // one event joined with '\n'). InvalidArgument when a line exceeds the limit.
  absl::Status Feed(absl::string_view bytes, std::vector<std::string>& events);

  // True when bytes of an unfinished event are buffered (a stream that ends here was cut).
  [[nodiscard]] bool HasPartialEvent() const { return !line_.empty() || has_data_; }

 private:
  void ProcessLine(std::vector<std::string>& events);

  size_t max_line_bytes_;
  std::string line_;
  std::string data_;
  bool has_data_ = false;
  bool skip_lf_ = false;  // the previous chunk ended in '\r' (of a "\r\n" split across reads)
  bool first_ = true;     // a UTF-8 byte order mark may open the stream
};

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_SSE_PARSER_H_
