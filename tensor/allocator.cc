#include "tensor/allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tensor/error.h"
#include "tensor/host_pinning.h"

namespace tessera {

namespace {
void raise_peak(std::atomic<int64_t>& peak_counter, int64_t now) {
  int64_t peak = peak_counter.load(std::memory_order_relaxed);
  while (now > peak && !peak_counter.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}
}  // namespace

const char* memory_tag_name(MemoryTag tag) {
  switch (tag) {
    case MemoryTag::untagged: return "untagged";
    case MemoryTag::parameters: return "parameters";
    case MemoryTag::gradients: return "gradients";
    case MemoryTag::optimizer_state: return "optimizer state";
    case MemoryTag::gathered: return "gathered";
  }
  return "?";
}

void MemoryTracker::add(int64_t nbytes, MemoryTag tag) {
  raise_peak(peak_, current_.fetch_add(nbytes, std::memory_order_relaxed) + nbytes);
  std::atomic<int64_t>& c = tag_current_[static_cast<int>(tag)];
  raise_peak(tag_peak_[static_cast<int>(tag)], c.fetch_add(nbytes, std::memory_order_relaxed) + nbytes);
  count_.fetch_add(1, std::memory_order_relaxed);
}

void MemoryTracker::sub(int64_t nbytes, MemoryTag tag) {
  current_.fetch_sub(nbytes, std::memory_order_relaxed);
  tag_current_[static_cast<int>(tag)].fetch_sub(nbytes, std::memory_order_relaxed);
}

void MemoryTracker::reset_peak() {
  peak_.store(current(), std::memory_order_relaxed);
  for (int t = 0; t < kNumMemoryTags; ++t) {
    tag_peak_[t].store(tag_current_[t].load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
}

MemoryTracker& process_memory() {
  static MemoryTracker* tracker = new MemoryTracker;  // outlives every static storage
  return *tracker;
}

namespace {
thread_local MemoryTracker* t_scope_tracker = nullptr;
}

MemoryScope::MemoryScope(MemoryTracker* tracker) : previous_(t_scope_tracker) {
  t_scope_tracker = tracker;
}
MemoryScope::~MemoryScope() { t_scope_tracker = previous_; }
MemoryTracker* MemoryScope::current() { return t_scope_tracker; }

namespace {
thread_local MemoryTag t_tag = MemoryTag::untagged;
}

MemoryTagScope::MemoryTagScope(MemoryTag tag) : previous_(t_tag) { t_tag = tag; }
MemoryTagScope::~MemoryTagScope() { t_tag = previous_; }
MemoryTag MemoryTagScope::current() { return t_tag; }

void Allocator::set_limit(int64_t bytes) {
  TS_CHECK(bytes >= 0, "Allocator::set_limit: the budget must be >= 0 bytes (0: none), got {}",
           bytes);
  limit_.store(bytes, std::memory_order_relaxed);
}

void Allocator::exceed_limit(Device device, int64_t nbytes, int64_t in_use, int64_t cap) {
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  fail("{} allocator: allocating {} bytes ({:.1f} MiB) of {} would exceed the memory budget of "
       "{:.1f} MiB ({:.1f} MiB in use)",
       device, nbytes, mib(nbytes), memory_tag_name(MemoryTagScope::current()), mib(cap),
       mib(in_use));
}

namespace {

// The CPU allocator. Small blocks come from malloc (its bins already recycle them). Blocks
// of 1 MiB and more are rounded up to a size class and cached after free for the next
// request of the same class, as PyTorch's CUDA caching allocator does on the GPU: a fresh
// large block costs an mmap and a page fault per 4 KiB page on first touch (about 48 ms for
// 64 MiB on the development VM), a reused one nothing. Training loops allocate the same
// activation sizes every step, so after the first step they hit the cache. Large blocks are
// 2 MiB aligned and advised as huge pages, which makes even the first touch cheaper.
class CpuAllocator final : public Allocator {
 public:
  static constexpr int64_t kCacheMin = int64_t{1} << 20;
  static constexpr size_t kHugePage = size_t{2} << 20;

  CpuAllocator() {
    // Cache at most a quarter of physical memory (and 8 GiB); TESSERA_CPU_CACHE_MB overrides.
    const int64_t pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    limit_ = std::min<int64_t>(int64_t{8} << 30, pages > 0 && page > 0 ? pages * page / 4 : 0);
    if (const char* env = std::getenv("TESSERA_CPU_CACHE_MB")) limit_ = std::atoll(env) << 20;
  }

  // Large requests round up to 8 classes per power of two (at most 12.5% slack), in whole
  // MiB; small ones to the 64-byte alignment.
  static int64_t size_class(int64_t nbytes) {
    if (nbytes < kCacheMin) return std::max<int64_t>((nbytes + 63) & ~int64_t{63}, 64);
    const int64_t step = std::max<int64_t>(kCacheMin, static_cast<int64_t>(std::bit_floor(
                                                          static_cast<uint64_t>(nbytes))) / 8);
    return (nbytes + step - 1) / step * step;
  }

  void* allocate(int64_t nbytes) override {
    check_limit(kCPU, nbytes, tracker_.current());
    // Far above any machine's memory; rounding it up to a size class would overflow.
    if (nbytes > (int64_t{1} << 56)) [[unlikely]] {
      fail("cpu allocator: out of memory allocating {} bytes of {} (more than any machine has)",
           nbytes, memory_tag_name(MemoryTagScope::current()));
    }
    const int64_t cls = size_class(nbytes);
    void* p = nullptr;
    if (cls >= kCacheMin) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(cls);
      if (it != cache_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_ -= cls;
      }
    }
    if (p == nullptr) {
      // posix_memalign: a size class need not be a multiple of the alignment (1 MiB classes
      // on 2 MiB huge-page boundaries), which aligned_alloc requires in C11.
      const size_t align = cls >= kCacheMin ? kHugePage : 64;
      if (posix_memalign(&p, align, static_cast<size_t>(cls)) != 0) p = nullptr;
      if (p == nullptr) {
        empty_cache();
        if (posix_memalign(&p, align, static_cast<size_t>(cls)) != 0) p = nullptr;
      }
      if (p == nullptr) {
        fail("cpu allocator: out of memory allocating {} bytes ({:.1f} MiB) of {} ({:.1f} MiB "
             "in use)",
             nbytes, static_cast<double>(nbytes) / (1 << 20),
             memory_tag_name(MemoryTagScope::current()),
             static_cast<double>(tracker_.current()) / (1 << 20));
      }
      if (cls >= kCacheMin) madvise(p, static_cast<size_t>(cls), MADV_HUGEPAGE);
      reserved_.fetch_add(cls, std::memory_order_relaxed);
    }
    tracker_.add(nbytes);
    return p;
  }

  void deallocate(void* ptr, int64_t nbytes) override {
    tracker_.sub(nbytes);
    const int64_t cls = size_class(nbytes);
    if (cls >= kCacheMin) {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + cls <= limit_) {
        cache_[cls].push_back(ptr);
        cached_ += cls;
        return;
      }
    }
    std::free(ptr);
    reserved_.fetch_sub(cls, std::memory_order_relaxed);
  }

  MemoryStats stats() const override {
    return MemoryStats{tracker_.current(), tracker_.peak(),
                       reserved_.load(std::memory_order_relaxed), tracker_.count()};
  }
  void reset_peak() override { tracker_.reset_peak(); }

  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [cls, blocks] : cache_) {
      for (void* p : blocks) std::free(p);
      reserved_.fetch_sub(cls * static_cast<int64_t>(blocks.size()), std::memory_order_relaxed);
    }
    cache_.clear();
    cached_ = 0;
  }

 private:
  MemoryTracker tracker_;                  // live bytes as requested
  std::atomic<int64_t> reserved_{0};       // held from the system: live + cached, by class
  std::mutex mu_;
  std::unordered_map<int64_t, std::vector<void*>> cache_;  // size class -> free blocks
  int64_t cached_ = 0;
  int64_t limit_ = 0;
};

// The host tier: aligned host memory (pinned when a backend registered HostPinning), cached
// by (4096-rounded) size. No budget.
class HostTierAllocator final : public Allocator {
 public:
  void set_pinning(HostPinning pinning) {
    std::lock_guard<std::mutex> lock(mu_);
    pinning_ = std::move(pinning);
  }

  static constexpr int64_t kAlign = 4096;
  static constexpr size_t kHugePage = size_t{2} << 20;

  static int64_t rounded(int64_t nbytes) {
    return std::max<int64_t>((nbytes + kAlign - 1) / kAlign * kAlign, kAlign);
  }

  void* allocate(int64_t nbytes) override {
    check_limit(kCPU, nbytes, tracker_.current());
    if (nbytes > (int64_t{1} << 56)) [[unlikely]] {
      fail("host tier allocator: out of memory allocating {} bytes of {}", nbytes,
           memory_tag_name(MemoryTagScope::current()));
    }
    const int64_t cls = rounded(nbytes);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(cls);
      if (it != cache_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
      }
    }
    if (p == nullptr) {
      if (posix_memalign(&p, kAlign, static_cast<size_t>(cls)) != 0) p = nullptr;
      if (p == nullptr) {
        empty_cache();
        if (posix_memalign(&p, kAlign, static_cast<size_t>(cls)) != 0) p = nullptr;
      }
      if (p == nullptr) {
        fail("host tier allocator: out of memory allocating {} bytes ({:.1f} MiB) of {} "
             "({:.1f} MiB in use)",
             nbytes, static_cast<double>(nbytes) / (1 << 20),
             memory_tag_name(MemoryTagScope::current()),
             static_cast<double>(tracker_.current()) / (1 << 20));
      }
      if (static_cast<size_t>(cls) >= kHugePage) madvise(p, static_cast<size_t>(cls), MADV_HUGEPAGE);
      std::function<void(void*, int64_t)> pin;
      {
        std::lock_guard<std::mutex> lock(mu_);
        pin = pinning_.pin;
        if (pin) pinned_[p] = pinning_.unpin;
      }
      if (pin) pin(p, cls);
      reserved_.fetch_add(cls, std::memory_order_relaxed);
    }
    tracker_.add(nbytes);
    return p;
  }

  void deallocate(void* ptr, int64_t nbytes) override {
    tracker_.sub(nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    cache_[rounded(nbytes)].push_back(ptr);
  }

  MemoryStats stats() const override {
    return MemoryStats{tracker_.current(), tracker_.peak(),
                       reserved_.load(std::memory_order_relaxed), tracker_.count()};
  }
  void reset_peak() override { tracker_.reset_peak(); }
  bool is_device() const override { return false; }

  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [cls, blocks] : cache_) {
      for (void* p : blocks) {
        auto it = pinned_.find(p);
        if (it != pinned_.end()) {
          if (it->second) it->second(p, cls);
          pinned_.erase(it);
        }
        std::free(p);
      }
      reserved_.fetch_sub(cls * static_cast<int64_t>(blocks.size()), std::memory_order_relaxed);
    }
    cache_.clear();
  }

 private:
  MemoryTracker tracker_;
  std::atomic<int64_t> reserved_{0};
  std::mutex mu_;
  std::unordered_map<int64_t, std::vector<void*>> cache_;
  HostPinning pinning_;
  std::unordered_map<void*, std::function<void(void*, int64_t)>> pinned_;  // block -> its unpin
};

thread_local bool t_host_tier = false;

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

namespace {
HostTierAllocator& host_tier() {
  static HostTierAllocator* host = new HostTierAllocator;  // outlives every storage
  return *host;
}
}  // namespace

Allocator& host_tier_allocator() { return host_tier(); }

void register_host_pinning(HostPinning pinning) { host_tier().set_pinning(std::move(pinning)); }

namespace {
std::mutex g_async_mu;
std::map<int, AsyncToHost>& async_copies() {
  static auto* copies = new std::map<int, AsyncToHost>;  // outlives every caller
  return *copies;
}
}  // namespace

void register_async_to_host(int device_type, AsyncToHost copy) {
  std::lock_guard<std::mutex> lock(g_async_mu);
  if (copy) {
    async_copies()[device_type] = std::move(copy);
  } else {
    async_copies().erase(device_type);
  }
}

AsyncToHost async_to_host(int device_type) {
  std::lock_guard<std::mutex> lock(g_async_mu);
  auto it = async_copies().find(device_type);
  return it == async_copies().end() ? AsyncToHost() : it->second;
}

HostTierScope::HostTierScope() : previous_(t_host_tier) { t_host_tier = true; }
HostTierScope::~HostTierScope() { t_host_tier = previous_; }
bool HostTierScope::active() { return t_host_tier; }

Allocator& storage_allocator(Device device) {
  if (t_host_tier && device.is_cpu()) return host_tier_allocator();
  return allocator_for(device);
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
