// Read-only, memory-mapped access to a model checkpoint in safetensors format: one
// `model.safetensors` file or shards listed by `model.safetensors.index.json`. Every header is
// validated strictly on open, so that the loader can trust each TensorRecord it is handed.
#ifndef MOBIUS_WORKER_CHECKPOINT_CHECKPOINT_H_
#define MOBIUS_WORKER_CHECKPOINT_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/dtype.h"

namespace mobius::worker {

// One tensor of a checkpoint: where its bytes are and what they mean. `data` points into a
// read-only mapping owned by the Checkpoint (or SafetensorsFile) and lives as long as it.
struct TensorRecord {
  std::string name;
  kernels::DType dtype;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t num_bytes = 0;
  std::string file;  // path of the file that holds it, for error messages

  [[nodiscard]] int64_t num_elements() const;
};

// One mmap'd safetensors file. Open() checks: the file exists and is at least 8 bytes; the
// header length is sane and within the file; the header is a JSON object; every entry (except
// "__metadata__", a string->string map) has a known dtype (BF16, F16, F32, I32), an integer
// shape with non-negative dims, and data_offsets [begin, end] with begin <= end, end within the
// data section, end - begin == product(shape) * dtype size; no two tensors' byte ranges overlap.
// Errors are absl::InvalidArgumentError / NotFoundError naming the file, the tensor and the field.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] const std::map<std::string, TensorRecord>& tensors() const { return tensors_; }
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::map<std::string, TensorRecord> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory. Open(dir) uses `model.safetensors.index.json`
// ({"weight_map": {tensor name: shard file name}}) when present, else `model.safetensors`.
// With an index: every shard named must exist and validate, every tensor named must be in the
// shard the index says, and a tensor present in two shards is an error.
class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  // nullptr when absent.
  [[nodiscard]] const TensorRecord* Find(const std::string& name) const;
  // NotFoundError naming the tensor and the directory when absent.
  [[nodiscard]] absl::StatusOr<const TensorRecord*> Get(const std::string& name) const;
  // All tensor names, sorted.
  [[nodiscard]] std::vector<std::string> Names() const;
  [[nodiscard]] const std::string& dir() const { return dir_; }
  [[nodiscard]] size_t total_bytes() const;

 private:
  Checkpoint() = default;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorRecord*> index_;
};

// Copies a tensor's elements to fp32 (BF16, F16, F32 sources). `out` must hold num_elements().
void ConvertToFloat(const TensorRecord& record, float* out);

// Writes a safetensors file (used for `--dump-logits` and by tests to build checkpoints, both
// valid and deliberately broken ones). Tensors are laid out in the order given; `num_bytes`
// must equal product(shape) * dtype size.
struct TensorToWrite {
  std::string name;
  kernels::DType dtype;
  std::vector<int64_t> shape;
  const void* data;
  size_t num_bytes;
};
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_CHECKPOINT_CHECKPOINT_H_
