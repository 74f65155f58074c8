// What the fuzz targets share: the libFuzzer entry points they define, and FUZZ_CHECK for the
// properties they assert beyond "no crash" (a failed check aborts, which both libFuzzer and the
// standalone seed runner report as a failure, with the message).
#ifndef MOBIUS_TESTS_FUZZ_FUZZ_CHECK_H_
#define MOBIUS_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv);

#define FUZZ_CHECK(cond, what)                                                              \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(what).c_str());                                              \
      std::abort();                                                                         \
    }                                                                                       \
  } while (false)

namespace mobius::fuzz {

// Reads an input front to back: leading bytes choose a target's mode or a stream's chunk sizes,
// the rest is the text under test, so one input drives both.
class InputCursor {
 public:
  InputCursor(const uint8_t* data, size_t size)
      : data_(reinterpret_cast<const char*>(data)), size_(size) {}
  // The next byte (0 once the input is used up).
  uint8_t TakeByte() {
    if (pos_ >= size_) return 0;
    return static_cast<uint8_t>(data_[pos_++]);
  }
  // Everything up to the next 0 byte, which is taken too (all the rest when there is none): the
  // first of two texts in one input.
  std::string_view TakeUntilNul() {
    const std::string_view rest = Rest();
    const size_t nul = rest.find('\0');
    const std::string_view text = rest.substr(0, nul);
    pos_ += nul == std::string_view::npos ? rest.size() : nul + 1;
    return text;
  }
  // Everything not taken yet.
  std::string_view Rest() const { return std::string_view(data_ + pos_, size_ - pos_); }

 private:
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace mobius::fuzz

#endif  // MOBIUS_TESTS_FUZZ_FUZZ_CHECK_H_
