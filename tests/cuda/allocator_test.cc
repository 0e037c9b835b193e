// GPU-tagged: the CUDA caching allocator (kernels/cuda/runtime.cc) under churn. Several
// threads allocate and free thousands of tensors from a few bytes to 32 MiB, each filled on
// the device with its own value (full) and read back before it is freed, so two live blocks
// that overlapped, or a block handed out while still in use, show up as wrong values. Then
// the statistics' invariants, empty_cache, record_stream holding a block back until another
// stream's work is done, and process_memory()'s tags for device storages.
//
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:allocator_test
#include <doctest/doctest.h>

#ifdef TESSERA_CUDA

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "tensor/allocator.h"
#include "tensor/ops.h"

namespace tessera {
namespace {

using cuda_kernels::CachingStats;
using cuda_kernels::caching_stats;

const Device kDev = cuda(0);

// The values of t (on the device) that verification reads: all of it up to 1 MiB, else
// three 4096-element windows (start, middle, end).
bool holds(const Tensor& t, double value, std::string& why) {
  const int64_t n = t.numel(), w = 4096;
  std::vector<std::pair<int64_t, int64_t>> windows;
  if (t.nbytes() <= (1 << 20)) {
    windows.push_back({0, n});
  } else {
    windows = {{0, w}, {n / 2 - w / 2, w}, {n - w, w}};
  }
  for (auto [start, len] : windows) {
    const std::vector<double> got = t.narrow(0, start, len).to(kCPU).to_vector<double>();
    for (int64_t i = 0; i < len; ++i) {
      if (got[i] != value) {
        why = fmt::format("{}[{}]: element {} is {}, expected {}", dtype_name(t.dtype()), n,
                          start + i, got[i], value);
        return false;
      }
    }
  }
  return true;
}

TEST_CASE("caching allocator: multi-threaded churn keeps every live block's data") {
  REQUIRE(cuda_kernels::device_count() > 0);
  Allocator& alloc = allocator_for(kDev);
  cuda_kernels::synchronize(kDev);
  const MemoryStats base = alloc.stats();
  const CachingStats base_c = caching_stats(kDev);

  constexpr int kThreads = 4, kIters = 700, kLive = 8;
  std::atomic<int64_t> allocations{0}, bad{0}, invariant_violations{0};
  std::mutex msg_mu;
  std::string first_bad;
  auto worker = [&](int tid) {
    std::mt19937_64 rng(1234 + tid);
    // Log-uniform sizes from 1 byte to 32 MiB: mostly small, some tens of MB.
    std::uniform_real_distribution<double> log_bytes(0.0, std::log(32.0 * (1 << 20)));
    struct Live {
      Tensor t;
      double value;
    };
    std::vector<Live> live;
    auto verify_and_drop = [&](size_t i) {
      std::string why;
      if (!holds(live[i].t, live[i].value, why)) {
        ++bad;
        std::lock_guard<std::mutex> lock(msg_mu);
        if (first_bad.empty()) first_bad = fmt::format("thread {}: {}", tid, why);
      }
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    };
    for (int it = 0; it < kIters; ++it) {
      const int64_t bytes = std::max<int64_t>(1, std::llround(std::exp(log_bytes(rng))));
      Live l;
      if (bytes < 16) {
        l.value = 1;  // a few bytes: bools
        l.t = full({bytes}, 1, DType::b8, kDev);
      } else {
        l.value = static_cast<double>(tid * 1000000 + it + 1);  // exact in i32
        l.t = full({bytes / 4}, l.value, DType::i32, kDev);
      }
      ++allocations;
      live.push_back(std::move(l));
      if (static_cast<int>(live.size()) > kLive) {
        verify_and_drop(std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng));
      }
      if (it % 50 == 0) {
        const CachingStats s = caching_stats(kDev);
        if (s.peak_allocated_bytes < s.allocated_bytes || s.reserved_bytes < s.allocated_bytes ||
            s.peak_reserved_bytes < s.reserved_bytes) {
          ++invariant_violations;
        }
      }
    }
    while (!live.empty()) verify_and_drop(live.size() - 1);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (std::thread& t : threads) t.join();
  cuda_kernels::synchronize(kDev);

  CHECK_MESSAGE(bad == 0, bad.load(), " tensors lost their values; first: ", first_bad);
  CHECK(invariant_violations == 0);
  const CachingStats s = caching_stats(kDev);
  const MemoryStats m = alloc.stats();
  MESSAGE(fmt::format(
      "{} allocations from {} threads: {} cudaMallocs, {} cache hits; peak {:.1f} MiB "
      "allocated, {:.1f} MiB reserved (peak {:.1f})",
      allocations.load(), kThreads, s.num_cuda_mallocs - base_c.num_cuda_mallocs,
      s.num_cache_hits - base_c.num_cache_hits, s.peak_allocated_bytes / 1048576.0,
      s.reserved_bytes / 1048576.0, s.peak_reserved_bytes / 1048576.0));
  // Every block went back: allocated is where it started.
  CHECK(s.allocated_bytes == base_c.allocated_bytes);
  CHECK(m.allocated_bytes == base.allocated_bytes);
  CHECK(s.peak_allocated_bytes >= s.allocated_bytes);
  CHECK(s.reserved_bytes >= s.allocated_bytes);
  CHECK(s.peak_reserved_bytes >= s.reserved_bytes);
  // Each allocation was counted (the read-back copies allocate too: at least, not equal).
  CHECK(s.num_allocs - base_c.num_allocs >= allocations.load());
  CHECK(m.num_allocs == s.num_allocs);
  CHECK(m.reserved_bytes == s.reserved_bytes);
  // Repeated size classes were served from the cache, so far fewer cudaMallocs than requests.
  CHECK(s.num_cache_hits - base_c.num_cache_hits > 0);
  CHECK(s.num_cuda_mallocs - base_c.num_cuda_mallocs < allocations.load() / 2);

  // empty_cache returns every free block: reserved comes down to what is live.
  {
    const Tensor keep = full({3 << 20}, 2.0, DType::f32, kDev);  // 12 MiB live across it
    cuda_kernels::empty_cache(kDev);
    const CachingStats e = caching_stats(kDev);
    CHECK(e.reserved_bytes == e.allocated_bytes);
    CHECK(e.allocated_bytes >= keep.nbytes());
    CHECK(e.num_frees_to_system > s.num_frees_to_system);
    std::string why;
    CHECK_MESSAGE(holds(keep, 2.0, why), why);
  }
  cuda_kernels::empty_cache(kDev);
  CHECK(caching_stats(kDev).reserved_bytes == caching_stats(kDev).allocated_bytes);
  CHECK(caching_stats(kDev).allocated_bytes == base_c.allocated_bytes);
}

TEST_CASE("caching allocator: a block freed after record_stream waits for that stream") {
  // An odd size class (797 x 512 bytes) that nothing else in this test uses.
  constexpr int64_t kBytes = 797 * 512;
  cuda_kernels::empty_cache(kDev);  // (cudaFree synchronises: never while `side` is held)
  cudaStream_t side = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess);
  // The side stream runs a host function that waits for `release`: its work is "not done"
  // until the test says so.
  std::atomic<bool> release{false};
  REQUIRE(cudaLaunchHostFunc(
              side,
              [](void* flag) {
                auto* f = static_cast<std::atomic<bool>*>(flag);
                while (!f->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
              },
              &release) == cudaSuccess);

  void* first = nullptr;
  {
    const Tensor a = Tensor::empty({kBytes / 4}, DType::f32, kDev);
    first = a.storage()->data();
    cuda_kernels::record_stream(kDev, first, side);
  }  // freed while the side stream is still busy
  const int64_t hits = caching_stats(kDev).num_cache_hits;
  const Tensor b = Tensor::empty({kBytes / 4}, DType::f32, kDev);
  CHECK_MESSAGE(b.storage()->data() != first,
                "the block was reused while the stream recorded on it still had work queued");
  CHECK(caching_stats(kDev).num_cache_hits == hits);  // b came from cudaMalloc

  release = true;
  REQUIRE(cudaStreamSynchronize(side) == cudaSuccess);
  // The side stream's work is done: the next request of that class gets the held block.
  const Tensor c = Tensor::empty({kBytes / 4}, DType::f32, kDev);
  CHECK(c.storage()->data() == first);
  CHECK(caching_stats(kDev).num_cache_hits == hits + 1);
  // Not the start of a live block: an Error.
  CHECK_THROWS_AS(cuda_kernels::record_stream(kDev, static_cast<char*>(c.storage()->data()) + 512,
                                              cuda_kernels::compute_stream(kDev)),
                  Error);
  cudaStreamDestroy(side);
}

TEST_CASE("process_memory and MemoryScope count device storages under their tags") {
  cuda_kernels::synchronize(kDev);
  MemoryTracker& proc = process_memory();
  const int64_t opt0 = proc.current(MemoryTag::optimizer_state);
  const int64_t grad0 = proc.current(MemoryTag::gradients);
  MemoryTracker mine;
  {
    MemoryScope scope(&mine);
    Tensor state, grad;
    {
      MemoryTagScope tag(MemoryTag::optimizer_state);
      state = zeros({1000, 3}, DType::f32, kDev);  // 12000 bytes
    }
    {
      MemoryTagScope tag(MemoryTag::gradients);
      grad = Tensor::empty({5, 7}, DType::f64, kDev);  // 280 bytes
    }
    CHECK(state.device() == kDev);
    CHECK(proc.current(MemoryTag::optimizer_state) - opt0 == 12000);
    CHECK(proc.current(MemoryTag::gradients) - grad0 == 280);
    CHECK(mine.current(MemoryTag::optimizer_state) == 12000);
    CHECK(mine.current(MemoryTag::gradients) == 280);
    CHECK(mine.current() == 12280);
    CHECK(state.storage()->tag() == MemoryTag::optimizer_state);
    // A device -> host copy is charged to the host's allocator but the same trackers.
    const Tensor host = state.to(kCPU);
    CHECK(mine.current() == 12280 + 12000);
  }
  CHECK(mine.current() == 0);
  CHECK(mine.peak() >= 24280);
  CHECK(proc.current(MemoryTag::optimizer_state) == opt0);
  CHECK(proc.current(MemoryTag::gradients) == grad0);
}

}  // namespace
}  // namespace tessera

#endif  // TESSERA_CUDA
