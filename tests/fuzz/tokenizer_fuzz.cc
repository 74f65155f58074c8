// Fuzzes the Qwen3 tokenizer (the release vocabulary, from the fixtures) with arbitrary text and
// arbitrary id sequences, checking the properties serving relies on:
//   - Encode takes any bytes: valid UTF-8 is encoded, anything else is InvalidArgument;
//   - byte-level BPE loses nothing: text already in NFC (the tokenizer's normalizer) decodes
//     back to itself;
//   - a stream's detokenization (IncrementalDetokenizer, as the router streams) joins up to the
//     whole decode, for any ids, including unknown ones (refused without changing the stream).
//
// Input: one byte of options (special tokens parsed or not, special tokens skipped or not), then
// the text. The text's bytes read as little-endian 32-bit ids make the id sequence.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_files.h"
#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/tokenizer.h"
#include "utf8proc.h"

namespace {

using mobius::tokenizer::DecodeOptions;
using mobius::tokenizer::EncodeOptions;
using mobius::tokenizer::IncrementalDetokenizer;
using mobius::tokenizer::Tokenizer;

std::unique_ptr<Tokenizer> g_tokenizer;

// Whether `text` is valid UTF-8 in NFC, so that encoding leaves it as it is.
bool IsNfc(const std::string& text) {
  utf8proc_uint8_t* nfc = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &nfc,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  const bool same = n >= 0 && static_cast<size_t>(n) == text.size() &&
                    std::memcmp(nfc, text.data(), text.size()) == 0;
  std::free(nfc);
  return same;
}

// The stream's text for `ids`. An id the stream refuses (unknown) must leave its state as it was,
// so the text must equal the whole decode of the ids it took, which go to `known`.
std::string StreamText(const std::vector<int32_t>& ids, const DecodeOptions& options,
                       std::vector<int32_t>& known) {
  IncrementalDetokenizer stream(*g_tokenizer, options);
  std::string text;
  for (const int32_t id : ids) {
    auto piece = stream.Push(id);
    if (!piece.ok()) {
      FUZZ_CHECK(piece.status().code() == absl::StatusCode::kInvalidArgument,
                 piece.status().ToString());
      continue;
    }
    known.push_back(id);
    text += *piece;
  }
  text += stream.Finish();
  return text;
}

void CheckStreamMatchesDecode(const std::vector<int32_t>& ids, const DecodeOptions& options) {
  std::vector<int32_t> known;
  const std::string streamed = StreamText(ids, options, known);
  auto decoded = g_tokenizer->Decode(known, options);
  FUZZ_CHECK(decoded.ok(), decoded.status().ToString());
  FUZZ_CHECK(streamed == *decoded, "streamed text differs from the whole decode");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_tokenizer = mobius::fuzz::QwenTokenizerOrDie();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mobius::fuzz::InputCursor input(data, size);
  const uint8_t flags = input.TakeByte();
  EncodeOptions encode;
  encode.parse_special_tokens = (flags & 1) != 0;
  DecodeOptions decode;
  decode.skip_special_tokens = (flags & 2) != 0;
  const std::string text(input.Rest());

  auto ids = g_tokenizer->Encode(text, encode);
  if (!ids.ok()) {
    FUZZ_CHECK(ids.status().code() == absl::StatusCode::kInvalidArgument, ids.status().ToString());
  } else {
    for (const int32_t id : *ids) {
      FUZZ_CHECK(id >= 0 && static_cast<size_t>(id) < g_tokenizer->id_limit(),
                 "Encode produced id " + std::to_string(id));
    }
    auto decoded = g_tokenizer->Decode(*ids);
    FUZZ_CHECK(decoded.ok(), decoded.status().ToString());
    if (IsNfc(text)) FUZZ_CHECK(*decoded == text, "NFC text did not decode to itself");
    CheckStreamMatchesDecode(*ids, decode);
  }

  // The same bytes as ids: mostly unknown ones, which both decoders must refuse alike.
  std::vector<int32_t> raw_ids(text.size() / 4);
  if (!raw_ids.empty()) std::memcpy(raw_ids.data(), text.data(), raw_ids.size() * 4);
  // Fold most of them into the vocabulary (and a little past it), so that known ids dominate.
  const int64_t span = static_cast<int64_t>(g_tokenizer->id_limit()) + 64;
  for (int32_t& id : raw_ids) {
    if ((flags & 4) != 0)
      id = static_cast<int32_t>(((static_cast<int64_t>(id) % span) + span) % span);
  }
  CheckStreamMatchesDecode(raw_ids, decode);
  return 0;
}
