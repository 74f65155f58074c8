// Fuzzes loading a tokenizer.json (part of a checkpoint, so file input): a corrupt or unsupported
// file must be refused with InvalidArgument, never crash; a file that loads must encode and
// decode text without crashing, give ids inside its vocabulary, and its streaming detokenizer
// must join up to its whole decode.
//
// Input: the tokenizer.json text.
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/fuzz/fuzz_check.h"
#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace {

// Text that reaches the pre-tokenizer's splits, the normalizer, added tokens and multi-byte
// characters.
constexpr char kSample[] = "Hello,  world!\n\tcafe\xCC\x81 \xE4\xBD\xA0\xE5\xA5\xBD <|im_start|>x";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  auto tokenizer = mobius::tokenizer::Tokenizer::FromJsonString(json);
  if (!tokenizer.ok()) {
    FUZZ_CHECK(tokenizer.status().code() == absl::StatusCode::kInvalidArgument,
               tokenizer.status().ToString());
    FUZZ_CHECK(!tokenizer.status().message().empty(), "refused without a message");
    return 0;
  }
  const mobius::tokenizer::Tokenizer& t = **tokenizer;
  auto ids = t.Encode(kSample);
  if (!ids.ok()) return 0;  // e.g. a vocabulary without some byte: refused, by name
  for (const int32_t id : *ids) {
    FUZZ_CHECK(id >= 0 && static_cast<size_t>(id) < t.id_limit() && t.TokenBytes(id).ok(),
               "Encode produced id " + std::to_string(id));
  }
  auto decoded = t.Decode(*ids);
  FUZZ_CHECK(decoded.ok(), decoded.status().ToString());
  mobius::tokenizer::IncrementalDetokenizer stream(t);
  std::string streamed;
  for (const int32_t id : *ids) {
    auto piece = stream.Push(id);
    FUZZ_CHECK(piece.ok(), piece.status().ToString());
    streamed += *piece;
  }
  streamed += stream.Finish();
  FUZZ_CHECK(streamed == *decoded, "streamed text differs from the whole decode");
  return 0;
}
