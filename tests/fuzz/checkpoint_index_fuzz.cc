// Fuzzes opening a sharded checkpoint: a fuzzed model.safetensors.index.json beside two valid
// shards. The index names shard files for tensors; a corrupt one (a shard outside the folder, a
// missing or repeated tensor, a shard that does not exist) must be refused by name, with
// InvalidArgument or NotFound, and an accepted one must find every tensor it maps in the shard it
// names.
//
// Input: the index's text.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_files.h"
#include "worker/checkpoint/checkpoint.h"

namespace {

namespace fs = std::filesystem;

fs::path g_dir;

// A shard holding F32 tensors of one element each, named `names`.
void WriteShard(const fs::path& path, std::initializer_list<const char*> names) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const char* name : names) {
    header[name] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {offset, offset + 4}}};
    offset += 4;
  }
  const std::string text = header.dump();
  const uint64_t length = text.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&length), 8);  // little-endian on the hosts we run
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  const std::string data(offset, '\0');
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_dir = mobius::fuzz::ScratchPath("mobius_checkpoint_index_fuzz");
  fs::create_directories(g_dir);
  WriteShard(g_dir / "model-00001-of-00002.safetensors", {"a.weight", "b.weight"});
  WriteShard(g_dir / "model-00002-of-00002.safetensors", {"c.weight"});
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(g_dir, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream out(g_dir / "model.safetensors.index.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  auto checkpoint = mobius::worker::Checkpoint::Open(g_dir.string());
  if (!checkpoint.ok()) {
    const absl::StatusCode code = checkpoint.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound,
               checkpoint.status().ToString());
    FUZZ_CHECK(!checkpoint.status().message().empty(), "refused without a message");
    return 0;
  }
  // Accepted: the index is a JSON object whose weight_map maps each tensor to the shard that
  // holds it; every tensor it names must be found there.
  const nlohmann::json index = nlohmann::json::parse(
      std::string(reinterpret_cast<const char*>(data), size), nullptr, /*allow_exceptions=*/false);
  FUZZ_CHECK(index.is_object() && index.contains("weight_map"),
             "an index that is not a JSON object with a weight_map was accepted");
  size_t total = 0;
  for (const auto& [name, shard] : index.at("weight_map").items()) {
    const mobius::worker::TensorRecord* record = (*checkpoint)->Find(name);
    FUZZ_CHECK(record != nullptr, "tensor " + name + " of the index is not found");
    FUZZ_CHECK(fs::path(record->file).filename() ==
                   fs::path(shard.get<std::string>()).lexically_normal().filename(),
               "tensor " + name + " is read from " + record->file);
    total += record->num_bytes;
  }
  FUZZ_CHECK((*checkpoint)->total_bytes() >= total, "total_bytes below the mapped tensors'");
  return 0;
}
