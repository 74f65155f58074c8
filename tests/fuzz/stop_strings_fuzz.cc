// Fuzzes the router's stop-string matcher on streamed text. For valid UTF-8 text delivered in
// whole characters (as the detokenizer delivers it) and any non-empty stop strings:
//   - the text sent is a prefix of the model's text: all of it when nothing matched, else up to
//     the match (through it with include_match);
//   - no stop string appears whole in the text sent before the match;
//   - the chunking of the stream does not change what is sent or what matched.
//
// Input: a mode byte (chunk sizes, include_match, 1-4 stop strings), each stop string as a length
// byte and its bytes, then the text.
#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "router/core/stop_string_matcher.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/utf8_text.h"
#include "tokenizer/utf8.h"

namespace {

using mobius::router::StopStringMatcher;

struct Sent {
  std::string text;
  std::optional<std::string> matched;
};

// Streams `text` in pieces of 1, 2, ... `period` characters (period 0: whole).
Sent Stream(const std::vector<std::string>& stops, bool include_match, std::string_view text,
            int period) {
  StopStringMatcher matcher(stops, include_match);
  Sent sent;
  auto push = [&](std::string_view piece) {
    StopStringMatcher::Result result = matcher.Push(std::string(piece));
    if (sent.matched.has_value()) {
      FUZZ_CHECK(result.text.empty() && !result.matched.has_value(), "output after the match");
    }
    sent.text += result.text;
    if (result.matched.has_value()) sent.matched = result.matched;
  };
  if (period == 0) {
    if (!text.empty()) push(text);
  } else {
    for (std::string_view piece : mobius::fuzz::CharacterChunks(text, period)) push(piece);
  }
  const std::string rest = matcher.Flush();
  if (sent.matched.has_value()) {
    FUZZ_CHECK(rest.empty(), "held text flushed after a match");
  }
  sent.text += rest;
  FUZZ_CHECK(matcher.matched() == sent.matched.has_value(), "matched() disagrees with the results");
  return sent;
}

void CheckAgainstText(const Sent& sent, const std::vector<std::string>& stops, bool include_match,
                      std::string_view text) {
  FUZZ_CHECK(text.substr(0, sent.text.size()) == sent.text, "sent text is not a prefix");
  std::string_view before_match = sent.text;
  if (!sent.matched.has_value()) {
    FUZZ_CHECK(sent.text.size() == text.size(), "text lost without a match");
  } else {
    const std::string& match = *sent.matched;
    FUZZ_CHECK(std::find(stops.begin(), stops.end(), match) != stops.end(),
               "matched a string that is not a stop string");
    if (include_match) {
      FUZZ_CHECK(sent.text.ends_with(match), "include_match text does not end with the match");
      before_match.remove_suffix(match.size());
    } else {
      FUZZ_CHECK(text.substr(sent.text.size()).starts_with(match), "the match does not follow");
    }
  }
  for (const std::string& stop : stops) {
    FUZZ_CHECK(before_match.find(stop) == std::string_view::npos,
               "stop string \"" + stop + "\" was sent");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mobius::fuzz::InputCursor input(data, size);
  const uint8_t mode = input.TakeByte();
  const int period = 1 + (mode & 7);
  const bool include_match = (mode & 8) != 0;
  const int count = 1 + ((mode >> 4) & 3);
  std::vector<std::string> stops;
  for (int i = 0; i < count; ++i) {
    const size_t length = 1 + input.TakeByte() % 8;
    std::string stop;
    for (size_t j = 0; j < length && !input.Rest().empty(); ++j) {
      stop.push_back(static_cast<char>(input.TakeByte()));
    }
    if (stop.empty() || !mobius::tokenizer::IsValidUtf8(stop))
      return 0;  // validation refuses these
    stops.push_back(std::move(stop));
  }
  const std::string_view text = input.Rest();
  if (!mobius::tokenizer::IsValidUtf8(text)) return 0;  // the detokenizer only sends valid UTF-8

  const Sent whole = Stream(stops, include_match, text, 0);
  CheckAgainstText(whole, stops, include_match, text);
  const Sent chunked = Stream(stops, include_match, text, period);
  CheckAgainstText(chunked, stops, include_match, text);
  FUZZ_CHECK(whole.text == chunked.text, "sent text depends on the chunking");
  FUZZ_CHECK(whole.matched == chunked.matched, "the match depends on the chunking");
  return 0;
}
