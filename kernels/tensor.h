// A typed, shaped view of memory owned by a backend (host memory for the CPU backend, device
// memory for CUDA). Copies share the storage; View() makes sub-tensors of a contiguous row range.
#ifndef MOBIUS_KERNELS_TENSOR_H_
#define MOBIUS_KERNELS_TENSOR_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kernels/dtype.h"

namespace mobius::kernels {

enum class Device { kCpu, kCuda };

class Tensor {
 public:
  Tensor() = default;
  // Wraps `data` (kept alive by `storage`) as a contiguous row-major tensor.
  Tensor(std::shared_ptr<void> storage, void* data, DType dtype, std::vector<int64_t> shape,
         Device device)
      : storage_(std::move(storage)),
        data_(data),
        dtype_(dtype),
        shape_(std::move(shape)),
        device_(device) {}

  [[nodiscard]] bool empty() const { return data_ == nullptr; }
  [[nodiscard]] DType dtype() const { return dtype_; }
  [[nodiscard]] Device device() const { return device_; }
  [[nodiscard]] const std::vector<int64_t>& shape() const { return shape_; }
  [[nodiscard]] int rank() const { return static_cast<int>(shape_.size()); }
  [[nodiscard]] int64_t dim(int i) const { return shape_[i < 0 ? i + rank() : i]; }
  [[nodiscard]] int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    return n;
  }
  [[nodiscard]] size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }

  [[nodiscard]] void* raw() const { return data_; }
  template <typename T>
  [[nodiscard]] T* data() const {
    return static_cast<T*>(data_);
  }

  // Rows [begin, begin + count) of dimension 0, sharing storage.
  [[nodiscard]] Tensor Rows(int64_t begin, int64_t count) const {
    std::vector<int64_t> shape = shape_;
    const int64_t row_elems = shape_.empty() ? 1 : numel() / shape_[0];
    shape[0] = count;
    return Tensor(storage_,
                  static_cast<char*>(data_) + begin * row_elems * DTypeSize(dtype_), dtype_,
                  std::move(shape), device_);
  }
  // The same elements under another shape with the same element count.
  [[nodiscard]] Tensor Reshape(std::vector<int64_t> shape) const {
    return Tensor(storage_, data_, dtype_, std::move(shape), device_);
  }

  [[nodiscard]] std::string ShapeString() const;

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  Device device_ = Device::kCpu;
};

inline std::string Tensor::ShapeString() const {
  std::string s = "[";
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape_[i]);
  }
  return s + "]";
}

}  // namespace mobius::kernels

#endif  // MOBIUS_KERNELS_TENSOR_H_
