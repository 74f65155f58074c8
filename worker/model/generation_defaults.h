// End-of-sequence ids a model declares, from generation_config.json and config.json
// (`eos_token_id`: an id or a list). Missing files or fields give an empty list.
#ifndef MOBIUS_WORKER_MODEL_GENERATION_DEFAULTS_H_
#define MOBIUS_WORKER_MODEL_GENERATION_DEFAULTS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace mobius::worker {

std::vector<int32_t> ReadEosTokenIds(const std::string& model_dir);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_GENERATION_DEFAULTS_H_
