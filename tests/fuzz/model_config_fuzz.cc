// Fuzzes a checkpoint's config.json: ParseModelConfig, then what loading derives from an accepted
// config before any weight is read: the parameter list with every tensor's element count, and
// the step cost model the memory planner and the benchmarks use. A hostile or corrupt config must
// be refused by name (InvalidArgument), not overflow a size (UBSan) or crash later.
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "tests/fuzz/fuzz_check.h"
#include "worker/model/decode_cost.h"
#include "worker/model/model_config.h"
#include "worker/model/parameter_layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = mobius::worker::ParseModelConfig(text, "fuzz/config.json");
  if (!config.ok()) {
    FUZZ_CHECK(config.status().code() == absl::StatusCode::kInvalidArgument,
               config.status().ToString());
    FUZZ_CHECK(config.status().message().find("fuzz/config.json") != std::string::npos,
               "the error does not name the file: " + config.status().ToString());
    return 0;
  }
  for (const bool mtp : {false, true}) {
    mobius::worker::LayoutOptions options;
    options.include_mtp = mtp;
    options.prefix = mobius::worker::DefaultTensorPrefix(*config);
    int64_t total = 0;
    for (const auto& spec : mobius::worker::ListParameters(*config, options, nullptr)) {
      const int64_t n = spec.numel();
      FUZZ_CHECK(n >= 0, "negative element count");
      FUZZ_CHECK(total <= std::numeric_limits<int64_t>::max() - n, "parameter count overflows");
      total += n;
    }
  }
  mobius::worker::DecodeCostOptions cost;
  cost.batch = 8;
  cost.context = 1024;
  (void)mobius::worker::EstimateDecodeStepBytes(*config, cost).total();
  (void)mobius::worker::EstimateDecodeStepFlops(*config, cost).total();
  return 0;
}
