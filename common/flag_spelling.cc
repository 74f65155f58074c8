#include "common/flag_spelling.h"

#include <algorithm>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace mobius {

std::vector<std::string> NormalizeFlagSpelling(int argc, char** argv, int first) {
  std::vector<std::string> out;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      for (; i < argc; ++i) out.push_back(argv[i]);
      break;
    }
    if (absl::StartsWith(arg, "-")) {
      const size_t begin = std::min(arg.find_first_not_of('-'), arg.size());
      const size_t end = std::min(arg.find('='), arg.size());
      std::string name = arg.substr(begin, end - begin);
      std::replace(name.begin(), name.end(), '-', '_');
      const bool known =
          absl::FindCommandLineFlag(name) != nullptr ||
          (absl::StartsWith(name, "no") && absl::FindCommandLineFlag(name.substr(2)) != nullptr);
      if (known) arg = arg.substr(0, begin) + name + arg.substr(end);
    }
    out.push_back(std::move(arg));
  }
  return out;
}

void ListFlagsOfFilesInHelp(std::vector<std::string> files) {
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [files = std::move(files)](absl::string_view file) {
    return std::any_of(files.begin(), files.end(),
                       [&](const std::string& f) { return absl::EndsWith(file, f); });
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
}

std::vector<std::string> ParseFlags(const char* program, std::vector<std::string> args) {
  std::vector<char*> pointers = {const_cast<char*>(program)};
  for (std::string& a : args) pointers.push_back(a.data());
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());
  return std::vector<std::string>(positional.begin() + 1, positional.end());
}

}  // namespace mobius
