// SafetensorsFile: mmap one file and validate its header before any TensorRecord is handed out.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/safetensors_format.h"

namespace mobius::worker {
namespace {

using checkpoint_internal::CheckedByteSize;
using checkpoint_internal::kHeaderLengthBytes;
using checkpoint_internal::kMetadataKey;
using checkpoint_internal::ShapeString;
using Json = nlohmann::json;

absl::Status FileError(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

absl::Status TensorError(const std::string& path, const std::string& name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": tensor \"", name, "\": ", what));
}

absl::Status OpenError(const std::string& path, int err) {
  const std::string message = absl::StrCat(path, ": cannot open: ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::UnavailableError(message);
  }
}

uint64_t LoadLittleEndianU64(const std::byte* p) {
  uint64_t value;
  std::memcpy(&value, p, sizeof(value));
  if constexpr (std::endian::native == std::endian::big) value = __builtin_bswap64(value);
  return value;
}

// A JSON number that is a non-negative integer, as uint64.
std::optional<uint64_t> AsNonNegativeInteger(const Json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) return value.get<int64_t>();
  return std::nullopt;
}

// Keeps the file descriptor closed on every path out of Open().
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() { close(fd_); }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  int fd_;
};

struct ByteRange {
  uint64_t begin;
  uint64_t end;
  const std::string* name;
};

}  // namespace

int64_t TensorRecord::num_elements() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return OpenError(path, errno);
  FdCloser closer(fd);

  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::UnavailableError(absl::StrCat(path, ": cannot stat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return FileError(path, "not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size == 0) return FileError(path, "the file is empty; expected a safetensors file");
  if (file_size < kHeaderLengthBytes) {
    return FileError(path, absl::StrFormat("the file is %d bytes, shorter than the 8-byte header "
                                           "length prefix; the file is truncated or corrupt",
                                           file_size));
  }

  // Constructed before mmap so that the destructor unmaps on every error path below.
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  void* mapping = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (mapping == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s: cannot mmap %d bytes: %s", path, file_size, std::strerror(errno)));
  }
  file->mapping_ = mapping;
  file->mapping_size_ = file_size;
  const auto* bytes = static_cast<const std::byte*>(mapping);

  const uint64_t header_length = LoadLittleEndianU64(bytes);
  const uint64_t after_prefix = file_size - kHeaderLengthBytes;
  if (header_length > after_prefix) {
    return FileError(path, absl::StrFormat("header length %d runs past the end of the file (%d "
                                           "bytes after the 8-byte prefix); the file is truncated "
                                           "or not a safetensors file",
                                           header_length, after_prefix));
  }
  const absl::string_view header_text(reinterpret_cast<const char*>(bytes + kHeaderLengthBytes),
                                      header_length);
  ASSIGN_OR_RETURN(Json header, checkpoint_internal::ParseCheckpointJson(
                                    header_text, absl::StrCat(path, ": header")));
  if (!header.is_object()) {
    return FileError(path, absl::StrCat("header is a JSON ", header.type_name(),
                                        ", expected an object of tensor entries"));
  }

  const std::byte* data_section = bytes + kHeaderLengthBytes + header_length;
  const uint64_t data_size = after_prefix - header_length;
  std::vector<ByteRange> ranges;
  ranges.reserve(header.size());

  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) {
        return FileError(path, absl::StrCat("\"__metadata__\" is a JSON ", entry.type_name(),
                                            ", expected an object of strings"));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return FileError(path, absl::StrCat("\"__metadata__\" entry \"", key, "\" is a JSON ",
                                              value.type_name(), ", expected a string"));
        }
        file->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) {
      return TensorError(path, name,
                         absl::StrCat("entry is a JSON ", entry.type_name(),
                                      ", expected an object "
                                      "with dtype, shape and data_offsets"));
    }

    TensorRecord record;
    record.name = name;
    record.file = path;

    const auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end()) return TensorError(path, name, "missing field \"dtype\"");
    if (!dtype_it->is_string()) {
      return TensorError(path, name, absl::StrCat("dtype is ", dtype_it->dump(), ", not a string"));
    }
    const std::string dtype_name = dtype_it->get<std::string>();
    const std::optional<kernels::DType> dtype = kernels::ParseDType(dtype_name);
    if (!dtype.has_value()) {
      return TensorError(
          path, name,
          absl::StrCat("unknown dtype \"", dtype_name, "\" (supported: BF16, F16, F32, I32)"));
    }
    record.dtype = *dtype;

    const auto shape_it = entry.find("shape");
    if (shape_it == entry.end()) return TensorError(path, name, "missing field \"shape\"");
    if (!shape_it->is_array()) {
      return TensorError(path, name,
                         absl::StrCat("shape ", shape_it->dump(), " is not a list of integers"));
    }
    for (size_t i = 0; i < shape_it->size(); ++i) {
      const Json& dim = (*shape_it)[i];
      const std::optional<uint64_t> value = AsNonNegativeInteger(dim);
      if (!value.has_value() ||
          *value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return TensorError(path, name,
                           absl::StrCat("shape ", shape_it->dump(), ": dim ", i, " is ", dim.dump(),
                                        ", expected a non-negative integer"));
      }
      record.shape.push_back(static_cast<int64_t>(*value));
    }

    const auto offsets_it = entry.find("data_offsets");
    if (offsets_it == entry.end()) return TensorError(path, name, "missing field \"data_offsets\"");
    std::optional<uint64_t> begin, end;
    if (offsets_it->is_array() && offsets_it->size() == 2) {
      begin = AsNonNegativeInteger((*offsets_it)[0]);
      end = AsNonNegativeInteger((*offsets_it)[1]);
    }
    if (!begin.has_value() || !end.has_value()) {
      return TensorError(path, name,
                         absl::StrCat("data_offsets ", offsets_it->dump(),
                                      " is not a list of two non-negative integers"));
    }
    if (*begin > *end) {
      return TensorError(path, name,
                         absl::StrFormat("data_offsets begin %d is after end %d", *begin, *end));
    }
    if (*end > data_size) {
      return TensorError(path, name,
                         absl::StrFormat("data_offsets end %d runs past the data section (%d "
                                         "bytes); the file is truncated or corrupt",
                                         *end, data_size));
    }

    const std::optional<uint64_t> expected = CheckedByteSize(record.shape, record.dtype);
    const std::string shape_string = ShapeString(record.shape);
    if (!expected.has_value()) {
      return TensorError(path, name,
                         absl::StrCat("shape ", shape_string, " of ", dtype_name,
                                      " overflows a 64-bit byte count"));
    }
    if (*expected != *end - *begin) {
      return TensorError(
          path, name,
          absl::StrFormat("data_offsets [%d, %d] span %d bytes, but shape %s of %s needs %d bytes",
                          *begin, *end, *end - *begin, shape_string, dtype_name, *expected));
    }

    record.data = data_section + *begin;
    record.num_bytes = static_cast<size_t>(*expected);
    auto [it, inserted] = file->tensors_.emplace(name, std::move(record));
    ranges.push_back({*begin, *end, &it->first});
  }

  // Empty tensors occupy no bytes and cannot overlap anything.
  std::erase_if(ranges, [](const ByteRange& r) { return r.begin == r.end; });
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const ByteRange& prev = ranges[i - 1];
    const ByteRange& cur = ranges[i];
    if (cur.begin < prev.end) {
      return TensorError(path, *cur.name,
                         absl::StrFormat("data_offsets [%d, %d] overlap tensor \"%s\" at [%d, %d]",
                                         cur.begin, cur.end, *prev.name, prev.begin, prev.end));
    }
  }
  return file;
}

}  // namespace mobius::worker
