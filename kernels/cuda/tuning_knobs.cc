#include "kernels/cuda/tuning_knobs.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace mobius::kernels::cuda {
namespace {

void ReportIgnored(const char* name, std::string_view value, const std::string& accepted) {
  std::fprintf(stderr, "mobius cuda: ignoring %s=\"%.*s\": it takes %s\n", name,
               static_cast<int>(value.size()), value.data(), accepted.c_str());
}

}  // namespace

int KnobChoice(const char* name, std::initializer_list<std::string_view> choices) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return 0;
  const std::string_view value = env;
  int index = 1;
  for (std::string_view choice : choices) {
    if (value == choice) return index;
    ++index;
  }
  std::string accepted = "one of";
  const char* separator = " ";
  for (std::string_view choice : choices) {
    accepted += separator;
    accepted.append(choice.data(), choice.size());
    separator = ", ";
  }
  ReportIgnored(name, value, accepted);
  return 0;
}

int KnobInt(const char* name, int fallback, int min, int max) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return fallback;
  int value = 0;
  if (absl::SimpleAtoi(env, &value) && value >= min && value <= max) return value;
  ReportIgnored(name, env, absl::StrCat("an integer in [", min, ", ", max, "]"));
  return fallback;
}

}  // namespace mobius::kernels::cuda
