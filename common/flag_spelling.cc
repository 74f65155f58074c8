#include "common/flag_spelling.h"

#include <algorithm>

#include "absl/flags/reflection.h"
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

}  // namespace mobius
