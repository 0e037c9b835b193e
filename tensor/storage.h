// Storage: a refcounted block of device memory shared by a tensor and all its views.
//
//   Storage s = make_storage(1024, kCPU);          // 1 KiB from the CPU allocator
//   s->bump_version();                             // after an in-place write
//   s->release(); ... s->reallocate();             // ZeRO-3: drop the bytes, keep the views
//
// The version counter lets autograd detect that a tensor saved for backward was overwritten.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "tensor/allocator.h"
#include "tensor/device.h"

namespace tessera {

class StorageImpl {
 public:
  // Allocates nbytes on `device`, charging the device allocator, the thread's MemoryScope
  // and process_memory() under the thread's MemoryTagScope tag.
  StorageImpl(int64_t nbytes, Device device);
  // Wraps memory owned elsewhere; `deleter` (may be empty) runs when the storage dies.
  StorageImpl(void* data, int64_t nbytes, Device device, std::function<void(void*)> deleter);
  ~StorageImpl();
  StorageImpl(const StorageImpl&) = delete;
  StorageImpl& operator=(const StorageImpl&) = delete;

  void* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }
  MemoryTag tag() const { return tag_; }
  // Whether a leaf that requires grad (a parameter) views this storage: set by requires_grad_
  // and never cleared. Autocast's cast cache serves only such storages (tensor/autocast.h).
  bool grad_leaf() const { return grad_leaf_.load(std::memory_order_relaxed); }
  void mark_grad_leaf() { grad_leaf_.store(true, std::memory_order_relaxed); }
  const Allocator* allocator() const { return allocator_; }  // null for external memory

  // Frees the bytes while every tensor viewing this storage stays valid as a handle (FSDP's
  // resize to zero): ops given such a tensor throw an Error until reallocate() brings new,
  // uninitialised bytes of the same size (charged to the current MemoryScope and tag).
  // Allocator-owned storage only.
  void release();
  void reallocate();
  bool released() const { return data_ == nullptr && nbytes_ > 0; }

 private:
  void* data_ = nullptr;
  int64_t nbytes_ = 0;
  Device device_;
  Allocator* allocator_ = nullptr;      // null for external memory
  MemoryTracker* tracker_ = nullptr;    // the MemoryScope active at allocation
  MemoryTag tag_ = MemoryTag::untagged;  // the MemoryTagScope active at allocation
  std::function<void(void*)> deleter_;  // external memory only
  std::atomic<uint64_t> version_{0};
  std::atomic<bool> grad_leaf_{false};
};

using Storage = std::shared_ptr<StorageImpl>;

inline Storage make_storage(int64_t nbytes, Device device) {
  return std::make_shared<StorageImpl>(nbytes, device);
}

}  // namespace tessera
