// Per-device allocators and memory accounting.
//
//   Allocator& a = allocator_for(kCPU);
//   MemoryStats s = a.stats();            // bytes in use now, peak, allocation count
//   { MemoryScope scope(&tracker); ... }  // also credit allocations made here to `tracker`
//   { MemoryTagScope tag(MemoryTag::optimizer_state); opt.step(); }   // what the bytes are
//   tracker.current(MemoryTag::optimizer_state);                       // bytes by tag
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

// What a block of memory holds, as declared by the code that allocated it (MemoryTagScope).
// Data parallelism and ZeRO tag their buffers so a run can print bytes per rank by kind.
enum class MemoryTag : uint8_t { untagged, parameters, gradients, optimizer_state, gathered };
inline constexpr int kNumMemoryTags = 5;
const char* memory_tag_name(MemoryTag tag);

// Counts bytes in use and their peak, in all and per tag; thread-safe.
class MemoryTracker {
 public:
  void add(int64_t nbytes, MemoryTag tag = MemoryTag::untagged);
  void sub(int64_t nbytes, MemoryTag tag = MemoryTag::untagged);
  int64_t current() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  int64_t count() const { return count_.load(std::memory_order_relaxed); }
  int64_t current(MemoryTag tag) const {
    return tag_current_[static_cast<int>(tag)].load(std::memory_order_relaxed);
  }
  int64_t peak(MemoryTag tag) const {
    return tag_peak_[static_cast<int>(tag)].load(std::memory_order_relaxed);
  }
  // Every peak (the total's and each tag's) restarts from its current value.
  void reset_peak();

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> tag_current_[kNumMemoryTags] = {};
  std::atomic<int64_t> tag_peak_[kNumMemoryTags] = {};
};

// Every storage allocated on any thread of the process, by tag (a process is one rank under
// MPI; under the threads backend give each rank a MemoryScope of its own).
MemoryTracker& process_memory();

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

// Tags the calling thread's allocations for the scope's lifetime (nested scopes: innermost).
class MemoryTagScope {
 public:
  explicit MemoryTagScope(MemoryTag tag);
  ~MemoryTagScope();
  MemoryTagScope(const MemoryTagScope&) = delete;
  MemoryTagScope& operator=(const MemoryTagScope&) = delete;
  static MemoryTag current();

 private:
  MemoryTag previous_;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns memory for nbytes (64-byte aligned on the CPU); nbytes may be 0. Throws Error
  // when the system has no memory left or the request would exceed the budget.
  virtual void* allocate(int64_t nbytes) = 0;
  virtual void deallocate(void* ptr, int64_t nbytes) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns cached blocks to the system (no-op for allocators that do not cache).
  virtual void empty_cache() {}
  // False for the host tier (host_tier_allocator()): its storages are not charged to the
  // MemoryScope trackers or process_memory(), which count the device's memory.
  virtual bool is_device() const { return true; }

  // A budget for the bytes in use (0: none, the default). A request that would take the
  // bytes in use above it throws Error naming the request, the caller's MemoryTag and the
  // budget, before asking the system: a run that does not fit fails cleanly instead of
  // meeting the kernel's OOM killer. `gpt/mnist --memory_limit` set it.
  void set_limit(int64_t bytes);
  int64_t limit() const { return limit_.load(std::memory_order_relaxed); }

 protected:
  // Throws the budget Error when in_use + nbytes > limit(); `device` names the allocator.
  void check_limit(Device device, int64_t nbytes, int64_t in_use) const {
    const int64_t cap = limit();
    if (cap > 0 && nbytes > cap - in_use) [[unlikely]] exceed_limit(device, nbytes, in_use, cap);
  }

 private:
  [[noreturn]] static void exceed_limit(Device device, int64_t nbytes, int64_t in_use,
                                        int64_t cap);
  std::atomic<int64_t> limit_{0};
};

// The allocator for a device; throws Error when no backend for its type is linked in.
Allocator& allocator_for(Device device);

// The host tier of offloading (parallel/offload.h): host memory outside the device's budget,
// for state a device does not keep (ZeRO-Offload's optimizer state, master weights and
// gradients). On a CPU-only machine the "device" is the CPU allocator with its budget
// (Allocator::set_limit), and this is the memory beside it. Blocks are 4096-byte aligned and
// padded to 4096 bytes (O_DIRECT file I/O reads and writes them whole) and cached by size
// after free, so paging a segment out and the next one in reuses the same buffers. Never
// destroyed; its stats() are the whole process's host-tier bytes.
Allocator& host_tier_allocator();

// While alive, CPU storages the calling thread allocates come from host_tier_allocator()
// instead of the CPU device allocator (an offloaded optimizer creating its state).
class HostTierScope {
 public:
  HostTierScope();
  ~HostTierScope();
  HostTierScope(const HostTierScope&) = delete;
  HostTierScope& operator=(const HostTierScope&) = delete;
  static bool active();

 private:
  bool previous_;
};

// The allocator a new storage on `device` takes: host_tier_allocator() for the CPU inside a
// HostTierScope, else allocator_for(device).
Allocator& storage_allocator(Device device);

// Backends register a factory per device type (kernels/cuda registers cuda).
using AllocatorFactory = std::function<Allocator&(Device)>;
void register_allocator(DeviceType type, AllocatorFactory factory);
bool has_allocator(DeviceType type);

}  // namespace tessera
