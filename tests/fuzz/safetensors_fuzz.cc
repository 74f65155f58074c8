// Fuzzes the safetensors reader with arbitrary files: a corrupt or hostile checkpoint must be
// refused with InvalidArgument naming the file, never read out of bounds. For a file the reader
// accepts, every tensor it hands out must lie inside the file and hold exactly its shape's bytes,
// which is what the loader trusts without checking again.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_files.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/safetensors_format.h"

namespace {

// One file per process, rewritten for each input (the reader maps a path).
const std::string& InputPath() {
  static const std::string path = mobius::fuzz::ScratchPath("mobius_safetensors_fuzz").string();
  return path;
}

// Keeps the reads above from being optimised away.
volatile unsigned g_sink = 0;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = InputPath();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  auto file = mobius::worker::SafetensorsFile::Open(path);
  if (!file.ok()) {
    const absl::StatusCode code = file.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument, file.status().ToString());
    FUZZ_CHECK(file.status().message().find(path) != std::string::npos,
               "the error does not name the file: " + file.status().ToString());
    std::remove(path.c_str());
    return 0;
  }
  for (const auto& [name, record] : (*file)->tensors()) {
    const auto bytes =
        mobius::worker::checkpoint_internal::CheckedByteSize(record.shape, record.dtype);
    FUZZ_CHECK(bytes.has_value() && *bytes == record.num_bytes,
               "tensor " + name + " holds a byte count other than its shape's");
    FUZZ_CHECK(record.num_bytes <= size, "tensor " + name + " is larger than the file");
    // Read every byte: a range past the mapping's end faults here.
    unsigned sum = 0;
    for (size_t i = 0; i < record.num_bytes; ++i) sum += static_cast<unsigned>(record.data[i]);
    g_sink = g_sink + sum;
  }
  file->reset();
  std::remove(path.c_str());
  return 0;
}
