#include "kernels/cuda/device_block_cache.h"

#include <cuda_runtime_api.h>

namespace mobius::kernels::cuda {
namespace {

// Blocks of 1 GiB and more (weights, caches) are not kept: they are allocated once.
constexpr size_t kLargestCached = size_t{1} << 30;

}  // namespace

DeviceBlockCache::~DeviceBlockCache() { Trim(); }

size_t DeviceBlockCache::Bucket(size_t bytes) {
  if (bytes <= 512) return 512;
  // Quarter-power-of-two buckets: at most 25% waste, few distinct sizes.
  size_t power = 1;
  while (power < bytes) power <<= 1;
  const size_t quarter = power / 8;  // steps of power/8 above power/2
  return (bytes + quarter - 1) / quarter * quarter;
}

std::shared_ptr<void> DeviceBlockCache::Get(size_t bytes) {
  const size_t size = Bucket(bytes);
  void* ptr = nullptr;
  if (size < kLargestCached) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end()) {
      ptr = it->second;
      free_.erase(it);
      cached_bytes_ -= size;
    }
  }
  if (ptr == nullptr) {
    cudaSetDevice(device_);
    if (cudaMalloc(&ptr, size) != cudaSuccess) {
      cudaGetLastError();
      Trim();  // give cached blocks back to the device and try once more
      if (cudaMalloc(&ptr, size) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
      }
    }
  }
  std::weak_ptr<DeviceBlockCache> owner = weak_from_this();
  const int device = device_;
  return std::shared_ptr<void>(ptr, [owner, size, device](void* p) {
    if (auto cache = owner.lock(); cache && size < kLargestCached) {
      cache->Put(p, size);
      return;
    }
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaFree(p);
    cudaSetDevice(previous);
  });
}

void DeviceBlockCache::Put(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace(bytes, ptr);
  cached_bytes_ += bytes;
}

size_t DeviceBlockCache::Trim() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) return 0;
  cudaSetDevice(device_);
  cudaDeviceSynchronize();  // blocks may still be in use by queued work
  for (auto& [size, ptr] : free_) cudaFree(ptr);
  free_.clear();
  const size_t bytes = cached_bytes_;
  cached_bytes_ = 0;
  return bytes;
}

size_t DeviceBlockCache::cached_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_bytes_;
}

}  // namespace mobius::kernels::cuda
