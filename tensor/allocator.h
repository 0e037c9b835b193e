// Per-device allocators and memory accounting.
//
//   Allocator& a = allocator_for(kCPU);
//   MemoryStats s = a.stats();            // bytes in use now, peak, allocation count
//   { MemoryScope scope(&tracker); ... }  // also credit allocations made here to `tracker`
//
// Every Storage remembers the allocator and tracker it was charged to, so bytes are returned
// to the right counters whichever thread frees them. Trackers let one process account
// memory per simulated rank or per phase (the checkpoint test counts saved activations).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "tensor/device.h"

namespace tessera {

struct MemoryStats {
  int64_t allocated_bytes = 0;  // in use now
  int64_t peak_bytes = 0;       // high-water mark since the last reset_peak()
  int64_t reserved_bytes = 0;   // held from the system (caching allocators hold more)
  int64_t num_allocs = 0;       // allocations ever made
};

// Counts bytes in use and their peak; thread-safe.
class MemoryTracker {
 public:
  void add(int64_t nbytes);
  void sub(int64_t nbytes);
  int64_t current() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  int64_t count() const { return count_.load(std::memory_order_relaxed); }
  void reset_peak() { peak_.store(current(), std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> count_{0};
};

// Installs `tracker` as the calling thread's extra tracker for the scope's lifetime.
class MemoryScope {
 public:
  explicit MemoryScope(MemoryTracker* tracker);
  ~MemoryScope();
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;
  static MemoryTracker* current();

 private:
  MemoryTracker* previous_;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns memory for nbytes (64-byte aligned on the CPU); nbytes may be 0.
  virtual void* allocate(int64_t nbytes) = 0;
  virtual void deallocate(void* ptr, int64_t nbytes) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns cached blocks to the system (no-op for allocators that do not cache).
  virtual void empty_cache() {}
};

// The allocator for a device; throws Error when no backend for its type is linked in.
Allocator& allocator_for(Device device);

// Backends register a factory per device type (kernels/cuda registers cuda).
using AllocatorFactory = std::function<Allocator&(Device)>;
void register_allocator(DeviceType type, AllocatorFactory factory);
bool has_allocator(DeviceType type);

}  // namespace tessera
