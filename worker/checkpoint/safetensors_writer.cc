// WriteSafetensors: header + data into a temporary file beside the target, then rename, so that
// readers never see a half-written checkpoint.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <set>

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
using checkpoint_internal::kHeaderAlignment;
using checkpoint_internal::kHeaderLengthBytes;
using checkpoint_internal::kMetadataKey;
using checkpoint_internal::ShapeString;

// nlohmann's dump() throws on invalid UTF-8; check names and metadata up front instead.
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t extra;
    uint32_t code;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      extra = 1;
      code = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      extra = 2;
      code = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      extra = 3;
      code = c & 0x07;
    } else {
      return false;
    }
    if (i + extra >= s.size()) return false;
    for (size_t k = 1; k <= extra; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      code = (code << 6) | (cc & 0x3f);
    }
    // Overlong encodings, surrogates and values past U+10FFFF.
    static constexpr uint32_t kMinForLength[] = {0, 0x80, 0x800, 0x10000};
    if (code < kMinForLength[extra] || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) {
      return false;
    }
    i += extra + 1;
  }
  return true;
}

absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat(path, ": write failed: ", std::strerror(errno)));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> BuildHeader(const std::string& path,
                                        const std::vector<TensorToWrite>& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) {
      if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": metadata entry \"", key, "\" is not valid UTF-8"));
      }
      meta[key] = value;
    }
    header[kMetadataKey] = std::move(meta);
  }
  std::set<absl::string_view> seen;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    auto error = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor \"", t.name, "\": ", what));
    };
    if (t.name.empty() || t.name == kMetadataKey || !IsValidUtf8(t.name)) {
      return error("invalid tensor name");
    }
    if (!seen.insert(t.name).second) return error("written twice");
    const std::optional<uint64_t> expected = CheckedByteSize(t.shape, t.dtype);
    if (!expected.has_value()) {
      return error(absl::StrCat("shape ", ShapeString(t.shape),
                                " has a negative dim or overflows a 64-bit byte count"));
    }
    if (*expected != t.num_bytes) {
      return error(absl::StrFormat("num_bytes %d, but shape %s of %s needs %d bytes", t.num_bytes,
                                   ShapeString(t.shape), std::string(kernels::DTypeName(t.dtype)),
                                   *expected));
    }
    if (t.data == nullptr && t.num_bytes > 0) return error("data is null");
    header[t.name] = {{"dtype", std::string(kernels::DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.num_bytes}}};
    offset += t.num_bytes;
  }
  std::string text = header.dump();
  text.append((kHeaderAlignment - text.size() % kHeaderAlignment) % kHeaderAlignment, ' ');
  return text;
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(const std::string header, BuildHeader(path, tensors, metadata));

  std::string temp_path = path + ".tmp.XXXXXX";
  const int fd = mkstemp(temp_path.data());
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat(path, ": cannot create a temporary file: ", std::strerror(errno)));
  }
  auto write_contents = [&]() -> absl::Status {
    // mkstemp creates 0600; a checkpoint is meant to be shared like any other output file.
    static_cast<void>(fchmod(fd, 0644));
    uint8_t prefix[kHeaderLengthBytes];
    uint64_t length = header.size();
    for (size_t i = 0; i < kHeaderLengthBytes; ++i) prefix[i] = (length >> (8 * i)) & 0xff;
    RETURN_IF_ERROR(WriteAll(fd, prefix, sizeof(prefix), temp_path));
    RETURN_IF_ERROR(WriteAll(fd, header.data(), header.size(), temp_path));
    for (const TensorToWrite& t : tensors) {
      RETURN_IF_ERROR(WriteAll(fd, t.data, t.num_bytes, temp_path));
    }
    if (fsync(fd) != 0) {
      return absl::UnavailableError(
          absl::StrCat(temp_path, ": fsync failed: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  };
  absl::Status status = write_contents();
  if (close(fd) != 0 && status.ok()) {
    status =
        absl::UnavailableError(absl::StrCat(temp_path, ": close failed: ", std::strerror(errno)));
  }
  if (status.ok() && rename(temp_path.c_str(), path.c_str()) != 0) {
    status = absl::UnavailableError(
        absl::StrCat(path, ": cannot rename ", temp_path, " into place: ", std::strerror(errno)));
  }
  if (!status.ok()) unlink(temp_path.c_str());
  return status;
}

}  // namespace mobius::worker
