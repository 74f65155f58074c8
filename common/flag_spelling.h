// Lets users spell flags with dashes (--max-tokens, as vLLM does) although absl names them with
// underscores. Only arguments that name a known flag are rewritten, so values pass unchanged.
#ifndef MOBIUS_COMMON_FLAG_SPELLING_H_
#define MOBIUS_COMMON_FLAG_SPELLING_H_

#include <string>
#include <vector>

namespace mobius {

// argv[first..argc) with known flag names normalised to underscores.
std::vector<std::string> NormalizeFlagSpelling(int argc, char** argv, int first);

// What --help and --helpshort list: the flags defined in files whose path ends with one of
// `files` (a binary's own flag files, not every linked library's).
void ListFlagsOfFilesInHelp(std::vector<std::string> files);

// absl::ParseCommandLine over `program` and then `args` (normalised, e.g. by
// NormalizeFlagSpelling); returns the positional arguments after the program name.
std::vector<std::string> ParseFlags(const char* program, std::vector<std::string> args);

}  // namespace mobius

#endif  // MOBIUS_COMMON_FLAG_SPELLING_H_
