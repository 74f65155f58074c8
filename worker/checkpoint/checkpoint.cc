// Checkpoint: one model.safetensors or the shards of model.safetensors.index.json, merged into
// one name -> TensorRecord index. Also ConvertToFloat.
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/safetensors_format.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace mobius::worker {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kSingleFileName = "model.safetensors";
constexpr const char* kIndexFileName = "model.safetensors.index.json";

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return std::move(contents).str();
}

// Shard names come from a file we do not control; keep them inside the checkpoint directory.
bool IsSafeShardName(const std::string& shard) {
  if (shard.empty()) return false;
  const fs::path p(shard);
  if (p.is_absolute()) return false;
  for (const fs::path& part : p) {
    if (part == "..") return false;
  }
  return true;
}

struct ShardIndex {
  // tensor name -> shard file name, as the index lists them
  std::map<std::string, std::string> weight_map;
  std::set<std::string> shards;
};

absl::StatusOr<ShardIndex> ReadIndex(const std::string& index_path) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(index_path));
  ASSIGN_OR_RETURN(Json index, checkpoint_internal::ParseCheckpointJson(text, index_path));
  if (!index.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": is a JSON ", index.type_name(), ", expected an object"));
  }
  const auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": missing \"weight_map\" object (tensor name -> shard file)"));
  }
  ShardIndex result;
  for (const auto& [name, shard] : map_it->items()) {
    if (!shard.is_string() || !IsSafeShardName(shard.get<std::string>())) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map entry for tensor \"", name, "\" is ", shard.dump(),
                       ", expected a shard file name inside the directory"));
    }
    // "./a.safetensors" and "a.safetensors" are one shard.
    std::string normal = fs::path(shard.get<std::string>()).lexically_normal().string();
    result.shards.insert(normal);
    result.weight_map.emplace(name, std::move(normal));
  }
  if (result.weight_map.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map lists no tensors"));
  }
  return result;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint directory ", dir,
                     fs::exists(dir, ec) ? " is not a directory" : " does not exist"));
  }
  const fs::path root(dir);
  const std::string index_path = (root / kIndexFileName).string();
  const std::string single_path = (root / kSingleFileName).string();

  std::unique_ptr<Checkpoint> checkpoint(new Checkpoint());
  checkpoint->dir_ = dir;

  std::optional<ShardIndex> index;
  if (fs::exists(index_path, ec)) {
    ASSIGN_OR_RETURN(index, ReadIndex(index_path));
    for (const std::string& shard : index->shards) {
      const std::string shard_path = (root / shard).string();
      if (!fs::exists(shard_path, ec)) {
        // Name one tensor that needs the shard, so the message points at a concrete entry.
        std::string example;
        for (const auto& [name, s] : index->weight_map) {
          if (s == shard) {
            example = name;
            break;
          }
        }
        return absl::NotFoundError(absl::StrCat(index_path, ": shard \"", shard,
                                                "\" (holding tensor \"", example,
                                                "\" and others) does not exist at ", shard_path));
      }
      ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(shard_path));
      checkpoint->files_.push_back(std::move(file));
    }
  } else if (fs::exists(single_path, ec)) {
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single_path));
    checkpoint->files_.push_back(std::move(file));
  } else {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " holds neither ",
                                            kSingleFileName, " nor ", kIndexFileName));
  }

  // Every tensor of every shard is indexed, including ones the index does not list.
  for (const auto& file : checkpoint->files_) {
    for (const auto& [name, record] : file->tensors()) {
      auto [it, inserted] = checkpoint->index_.emplace(name, &record);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" is in both ",
                                                       it->second->file, " and ", file->path()));
      }
    }
  }

  if (index.has_value()) {
    for (const auto& [name, shard] : index->weight_map) {
      const TensorRecord* record = checkpoint->Find(name);
      const std::string shard_path = (root / shard).string();
      if (record == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor \"", name,
                                                       "\" is mapped to shard \"", shard,
                                                       "\", but that shard does not hold it"));
      }
      if (record->file != shard_path) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor \"", name,
                                                       "\" is mapped to shard \"", shard,
                                                       "\", but it is in ", record->file));
      }
    }
  }
  return checkpoint;
}

const TensorRecord* Checkpoint::Find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

absl::StatusOr<const TensorRecord*> Checkpoint::Get(const std::string& name) const {
  const TensorRecord* record = Find(name);
  if (record == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("tensor \"", name, "\" is not in the checkpoint at ", dir_));
  }
  return record;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, record] : index_) names.push_back(name);
  return names;
}

size_t Checkpoint::total_bytes() const {
  size_t total = 0;
  for (const auto& [name, record] : index_) total += record->num_bytes;
  return total;
}

void ConvertToFloat(const TensorRecord& record, float* out) {
  const size_t n = static_cast<size_t>(record.num_elements());
  // Tensors in the data section need not be aligned to their element size: copy through memcpy.
  switch (record.dtype) {
    case kernels::DType::kF32:
      std::memcpy(out, record.data, n * sizeof(float));
      return;
    case kernels::DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, record.data + 2 * i, sizeof(bits));
        out[i] = kernels::BF16ToFloat(bits);
      }
      return;
    case kernels::DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, record.data + 2 * i, sizeof(bits));
        out[i] = kernels::F16ToFloat(bits);
      }
      return;
    case kernels::DType::kI32:
      for (size_t i = 0; i < n; ++i) {
        int32_t value;
        std::memcpy(&value, record.data + 4 * i, sizeof(value));
        out[i] = static_cast<float>(value);
      }
      return;
  }
}

}  // namespace mobius::worker
