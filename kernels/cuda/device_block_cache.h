// Reuses freed device allocations so that an engine step's scratch tensors do not cost a
// cudaMalloc / cudaFree each (cudaFree waits for the whole device). Blocks are bucketed by
// rounded size; all users run on one stream, so a block handed back while kernels still use it
// is only reused by work queued after them on that stream.
#ifndef MOBIUS_KERNELS_CUDA_DEVICE_BLOCK_CACHE_H_
#define MOBIUS_KERNELS_CUDA_DEVICE_BLOCK_CACHE_H_

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace mobius::kernels::cuda {

class DeviceBlockCache : public std::enable_shared_from_this<DeviceBlockCache> {
 public:
  explicit DeviceBlockCache(int device) : device_(device) {}
  ~DeviceBlockCache();

  // Rounds `bytes` up to the cache's bucket size.
  [[nodiscard]] static size_t Bucket(size_t bytes);
  // A block of at least `bytes` (bucketed), or nullptr when the device is out of memory even
  // after returning every cached block to it.
  std::shared_ptr<void> Get(size_t bytes);
  // Blocks held for reuse, in bytes.
  [[nodiscard]] size_t cached_bytes();
  // Returns every block held for reuse to the device (after the device's queued work); the
  // bytes returned.
  size_t Trim();

 private:
  void Put(void* ptr, size_t bytes);

  int device_;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;  // bucket size -> block
  size_t cached_bytes_ = 0;
};

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_DEVICE_BLOCK_CACHE_H_
