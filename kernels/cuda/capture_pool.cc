#include "kernels/cuda/capture_pool.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>

#include "kernels/cuda/device_block_cache.h"

namespace mobius::kernels::cuda {
namespace {

// Chunks are at least this large, so that a capture's many small blocks cost few cudaMallocs.
constexpr size_t kMinChunkBytes = size_t{64} << 20;

}  // namespace

CapturePool::~CapturePool() {
  cudaSetDevice(device_);
  for (const Chunk& chunk : chunks_) cudaFree(chunk.ptr);
}

void CapturePool::Begin() {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  if (trace_) {
    std::fprintf(stderr, "capture pool: capture %llu begins\n",
                 static_cast<unsigned long long>(epoch_));
  }
  for (Chunk& chunk : chunks_) chunk.used = 0;
  used_ = 0;
  free_.clear();
  scratch_ = nullptr;
  scratch_bytes_ = 0;
}

void* CapturePool::Carve(size_t bytes) {
  bytes = (bytes + 255) / 256 * 256;  // every block 256-byte aligned, as cudaMalloc's are
  if (limit_ > 0 && used_ + bytes > limit_) return nullptr;
  // First fit over the chunks' free tails: a large block (the logits) that does not fit the
  // current chunk must not strand that chunk's tail for the smaller blocks after it.
  Chunk* chunk = nullptr;
  for (Chunk& c : chunks_) {
    if (c.used + bytes <= c.bytes) {
      chunk = &c;
      break;
    }
  }
  if (chunk == nullptr) {
    Chunk fresh{nullptr, std::max(bytes, kMinChunkBytes), 0};
    cudaSetDevice(device_);
    if (cudaMalloc(&fresh.ptr, fresh.bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    chunks_.push_back(fresh);
    chunk = &chunks_.back();
  }
  void* ptr = static_cast<char*>(chunk->ptr) + chunk->used;
  chunk->used += bytes;
  used_ += bytes;
  peak_ = std::max(peak_, used_);
  if (trace_) {
    std::fprintf(stderr, "capture pool: carved %zu bytes, %zu used by this capture\n", bytes,
                 used_);
  }
  return ptr;
}

std::shared_ptr<void> CapturePool::Get(size_t bytes) {
  // The block cache's buckets: the same shapes meet the same blocks, layer after layer.
  const size_t size = DeviceBlockCache::Bucket(bytes);
  void* ptr = nullptr;
  uint64_t epoch = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    epoch = epoch_;
    if (auto it = free_.find(size); it != free_.end()) {
      ptr = it->second;
      free_.erase(it);
    } else {
      ptr = Carve(size);
      if (ptr == nullptr) return nullptr;
    }
  }
  std::weak_ptr<CapturePool> owner = weak_from_this();
  return std::shared_ptr<void>(ptr, [owner, size, epoch](void* p) {
    if (auto pool = owner.lock()) pool->Release(p, size, epoch);
  });
}

void CapturePool::Release(void* ptr, size_t bytes, uint64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  // A block of an earlier capture belongs to that capture's recording (or to nothing): the
  // current capture carves its memory afresh.
  if (reuse_ && epoch == epoch_) free_.emplace(bytes, ptr);
}

void* CapturePool::Scratch(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes = std::max<size_t>(bytes, 1);  // nullptr means out of memory, even for an empty request
  if (!reuse_) return Carve(bytes);
  if (bytes > scratch_bytes_) {
    // Kernels recorded before keep the smaller buffer; it is simply not handed out again.
    const size_t size = DeviceBlockCache::Bucket(bytes);
    void* ptr = Carve(size);
    if (ptr == nullptr) return nullptr;
    scratch_ = ptr;
    scratch_bytes_ = size;
  }
  return scratch_;
}

size_t CapturePool::reserved_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t total = 0;
  for (const Chunk& chunk : chunks_) total += chunk.bytes;
  return total;
}

size_t CapturePool::peak_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

}  // namespace mobius::kernels::cuda
