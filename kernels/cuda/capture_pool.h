// Device memory of recorded steps (CUDA graphs). A recorded step's kernels keep pointing at the
// buffers they were recorded with, so those buffers cannot go back to the shared block cache.
// They come from chunks that this pool holds for the backend's lifetime, and every capture
// starts again at the first chunk: each recorded step owns the pool while it replays, and the
// tensors of an earlier capture are invalid once another is recorded or replayed (the contract
// of Backend::BeginCapture).
//
// Within one capture, a block whose tensor is released is handed out again to later
// allocations of the same capture, exactly as the block cache does outside captures: the
// recorded kernels run in stream order, so a block is only rewritten by kernels recorded after
// its last reader. A recorded step then needs about the live set of one layer (plus what the
// caller keeps, such as logits), not the sum of every layer's temporaries (docs/cuda-backend.md,
// "Memory of recorded steps").
#ifndef MOBIUS_KERNELS_CUDA_CAPTURE_POOL_H_
#define MOBIUS_KERNELS_CUDA_CAPTURE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {

class CapturePool : public std::enable_shared_from_this<CapturePool> {
 public:
  // `reuse` false keeps every block of a capture to its end (the bump allocation of earlier
  // versions, for A/B measurements: MOBIUS_CAPTURE_POOL_REUSE=0).
  CapturePool(int device, bool reuse) : device_(device), reuse_(reuse) {}
  ~CapturePool();
  CapturePool(const CapturePool&) = delete;
  CapturePool& operator=(const CapturePool&) = delete;

  // Starts a capture: every chunk is free again.
  void Begin();
  // A block of at least `bytes` for the capture in progress, or nullptr when the device is out
  // of memory. Released during the same capture, the block serves later allocations of it.
  std::shared_ptr<void> Get(size_t bytes);
  // The capture's scratch buffer of at least `bytes`: one buffer shared by every op, as the
  // backend's scratch outside captures (an op's scratch is dead once the next op is queued).
  // nullptr when the device is out of memory.
  void* Scratch(size_t bytes);

  // Bytes of device memory the pool holds (its chunks).
  [[nodiscard]] size_t reserved_bytes();
  // The most any capture has used (high-water mark of the chunks' used extents).
  [[nodiscard]] size_t peak_bytes();

 private:
  struct Chunk {
    void* ptr;
    size_t bytes;
    size_t used;  // by the capture in progress, from the chunk's start
  };
  void* Carve(size_t bytes);  // from the chunks' free tails; mu_ held
  void Release(void* ptr, size_t bytes, uint64_t epoch);

  int device_;
  bool reuse_;
  std::mutex mu_;
  std::vector<Chunk> chunks_;
  size_t used_ = 0, peak_ = 0;         // bytes carved by this capture; the largest capture's
  uint64_t epoch_ = 0;                 // which capture a released block belongs to
  std::multimap<size_t, void*> free_;  // released blocks of this capture, by bucket size
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  // MOBIUS_CAPTURE_POOL_TRACE=1: every carved block on stderr (what a recording is made of).
  const bool trace_ = KnobChoice("MOBIUS_CAPTURE_POOL_TRACE", {"0", "1"}) == 2;
  // MOBIUS_CAPTURE_POOL_LIMIT_KIB=N: a capture that would use more than N KiB fails as if the
  // device were out of memory (tests of what a failed recording leaves).
  const size_t limit_ =
      size_t{1024} * static_cast<size_t>(KnobInt("MOBIUS_CAPTURE_POOL_LIMIT_KIB", 0, 0, 1 << 30));
};

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_CAPTURE_POOL_H_
