#include "tensor/allocator.h"

#include <cstdlib>
#include <mutex>

#include "tensor/error.h"

namespace tessera {

void MemoryTracker::add(int64_t nbytes) {
  const int64_t now = current_.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  count_.fetch_add(1, std::memory_order_relaxed);
}

void MemoryTracker::sub(int64_t nbytes) { current_.fetch_sub(nbytes, std::memory_order_relaxed); }

namespace {
thread_local MemoryTracker* t_scope_tracker = nullptr;
}

MemoryScope::MemoryScope(MemoryTracker* tracker) : previous_(t_scope_tracker) {
  t_scope_tracker = tracker;
}
MemoryScope::~MemoryScope() { t_scope_tracker = previous_; }
MemoryTracker* MemoryScope::current() { return t_scope_tracker; }

namespace {

// Plain aligned malloc with counters. 64-byte alignment suits AVX-512 loads and avoids
// false sharing between tensors written by different threads.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(int64_t nbytes) override {
    const size_t rounded = (static_cast<size_t>(nbytes) + 63) & ~size_t{63};
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (p == nullptr) fail("cpu allocator: out of memory allocating {} bytes", nbytes);
    tracker_.add(nbytes);
    return p;
  }
  void deallocate(void* ptr, int64_t nbytes) override {
    std::free(ptr);
    tracker_.sub(nbytes);
  }
  MemoryStats stats() const override {
    return MemoryStats{tracker_.current(), tracker_.peak(), tracker_.current(), tracker_.count()};
  }
  void reset_peak() override { tracker_.reset_peak(); }

 private:
  MemoryTracker tracker_;
};

struct Registry {
  std::mutex mu;
  AllocatorFactory factories[kNumDeviceTypes];
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    reg->factories[static_cast<int>(DeviceType::cpu)] = [](Device d) -> Allocator& {
      return allocator_for(d);
    };
    return reg;
  }();
  return *r;
}

}  // namespace

Allocator& allocator_for(Device device) {
  if (device.type == DeviceType::cpu) {
    static CpuAllocator* cpu = new CpuAllocator;  // the hot path takes no lock
    return *cpu;
  }
  Registry& r = registry();
  AllocatorFactory factory;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    factory = r.factories[static_cast<int>(device.type)];
  }
  if (!factory) {
    fail("allocator: no backend for device {} is linked in (build with --config=cuda for cuda)",
         device);
  }
  return factory(device);
}

void register_allocator(DeviceType type, AllocatorFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[static_cast<int>(type)] = std::move(factory);
}

bool has_allocator(DeviceType type) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return static_cast<bool>(r.factories[static_cast<int>(type)]);
}

}  // namespace tessera
