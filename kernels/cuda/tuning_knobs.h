// Timing and test overrides of the CUDA kernels' choices, read from MOBIUS_* environment
// variables (every one is listed in docs/environment-variables.md). Each call site reads its
// knob once into a function-local static, so launches pay nothing for them. A value the knob
// does not accept is reported on stderr (the variable, the value, what it accepts) and ignored:
// a mistyped A/B run then says so instead of silently timing the default.
#ifndef MOBIUS_KERNELS_CUDA_TUNING_KNOBS_H_
#define MOBIUS_KERNELS_CUDA_TUNING_KNOBS_H_

#include <initializer_list>
#include <string_view>

namespace mobius::kernels::cuda {

// 0 when `name` is unset or empty; otherwise 1 + the index of its value among `choices`
// (0 for a value that is none of them, after the report).
int KnobChoice(const char* name, std::initializer_list<std::string_view> choices);

// `fallback` when `name` is unset or empty; its value when that is an integer in [min, max];
// otherwise `fallback`, after the report.
int KnobInt(const char* name, int fallback, int min, int max);

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_TUNING_KNOBS_H_
