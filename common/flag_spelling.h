// Lets users spell flags with dashes (--max-tokens, as vLLM does) although absl names them with
// underscores. Only arguments that name a known flag are rewritten, so values pass unchanged.
#ifndef MOBIUS_COMMON_FLAG_SPELLING_H_
#define MOBIUS_COMMON_FLAG_SPELLING_H_

#include <string>
#include <vector>

namespace mobius {

// argv[first..argc) with known flag names normalised to underscores.
std::vector<std::string> NormalizeFlagSpelling(int argc, char** argv, int first);

}  // namespace mobius

#endif  // MOBIUS_COMMON_FLAG_SPELLING_H_
