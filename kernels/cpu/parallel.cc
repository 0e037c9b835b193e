#include "kernels/cpu/parallel.h"

#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tessera::cpu {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// True on a pool's workers, and on a caller while its job runs: nested calls run inline.
thread_local bool t_in_job = false;
thread_local int64_t t_jobs = 0;  // jobs this thread handed to its pool

// How long an idle worker polls for the next job before it sleeps (TESSERA_SPIN_US).
std::chrono::nanoseconds spin_time() {
  static const std::chrono::nanoseconds t = [] {
    const char* s = std::getenv("TESSERA_SPIN_US");
    long us = 50;
    if (s != nullptr && *s != '\0') {
      char* end = nullptr;
      const long v = std::strtol(s, &end, 10);
      if (end != s && *end == '\0' && v >= 0) us = v;
    }
    return std::chrono::nanoseconds(us * 1000);
  }();
  return t;
}

// The job word: epoch (32 bits) | parts (16) | next unclaimed part (16). A worker claims part
// k of epoch e by a compare-exchange from (e, parts, k) to (e, parts, k + 1), so it can never
// claim a part of a finished job or one past its end; the job's function and context,
// written before the epoch was published, stay valid until its caller has seen every
// claimed part done, which needs this worker's part.
constexpr uint64_t pack(uint32_t epoch, uint32_t parts, uint32_t next) {
  return (static_cast<uint64_t>(epoch) << 32) | (static_cast<uint64_t>(parts) << 16) | next;
}
constexpr uint32_t epoch_of(uint64_t w) { return static_cast<uint32_t>(w >> 32); }
constexpr uint32_t parts_of(uint64_t w) { return static_cast<uint32_t>(w >> 16) & 0xffff; }
constexpr uint32_t next_of(uint64_t w) { return static_cast<uint32_t>(w) & 0xffff; }

class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  ~Pool() {
    stop_.store(true, std::memory_order_seq_cst);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  void run(int parts, int threads, void (*fn)(void*, int), void* ctx) {
    const int helpers = std::min(parts, threads) - 1;
    grow(helpers);
    helpers_.store(helpers, std::memory_order_relaxed);  // published by job_'s release
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    ++epoch_;
    job_.store(pack(epoch_, static_cast<uint32_t>(parts), 0), std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_.notify_all();
    // The caller claims parts like any worker, then waits only for parts that a running
    // worker has claimed.
    // Inside a part, Eigen's f64 GEMM must not start an OpenMP team of its own.
    const int icv = omp_get_max_threads();
    omp_set_num_threads(1);
    t_in_job = true;
    claim_and_run(epoch_);
    t_in_job = false;
    omp_set_num_threads(icv);
    int spins = 0;
    while (done_.load(std::memory_order_acquire) < static_cast<uint32_t>(parts)) {
      if (++spins < 4096) {
        cpu_relax();
      } else {
        std::this_thread::yield();  // a worker preempted inside its part: let it run
      }
    }
  }

 private:
  // Claims and runs parts of `epoch` until none is left.
  void claim_and_run(uint32_t epoch) {
    uint64_t w = job_.load(std::memory_order_acquire);
    while (epoch_of(w) == epoch && next_of(w) < parts_of(w)) {
      if (!job_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        continue;  // w reloaded
      }
      fn_(ctx_, static_cast<int>(next_of(w)));
      done_.fetch_add(1, std::memory_order_release);
      w = job_.load(std::memory_order_acquire);
    }
  }

  void grow(int workers) {
    while (static_cast<int>(workers_.size()) < workers) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { work(index); });
    }
  }

  // Worker `index` takes part in jobs that want more than `index` helpers; after one that
  // does not (the thread count went down), it sleeps at once instead of spinning.
  void work(int index) {
    t_in_job = true;
    omp_set_num_threads(1);
    uint32_t seen = epoch_of(job_.load(std::memory_order_acquire));
    bool idle = false;  // the last job did not want this worker
    while (true) {
      // Poll for a new epoch for the spin time, then sleep until run() or the destructor
      // wakes us.
      const std::chrono::nanoseconds spin = idle ? std::chrono::nanoseconds(0) : spin_time();
      uint64_t w = job_.load(std::memory_order_acquire);
      if (epoch_of(w) == seen && !stop_.load(std::memory_order_relaxed)) {
        const auto until = std::chrono::steady_clock::now() + spin;
        int polls = 0;
        while (true) {
          const uint32_t ticket = wake_.load(std::memory_order_seq_cst);
          w = job_.load(std::memory_order_acquire);
          if (epoch_of(w) != seen || stop_.load(std::memory_order_relaxed)) break;
          if ((++polls & 63) == 0 && std::chrono::steady_clock::now() >= until) {
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            // Re-check after announcing: a job published before the announcement was seen
            // by run() as "no sleepers", but it changed wake_ from `ticket`.
            w = job_.load(std::memory_order_acquire);
            if (epoch_of(w) == seen && !stop_.load(std::memory_order_seq_cst)) {
              wake_.wait(ticket, std::memory_order_seq_cst);
            }
            sleepers_.fetch_sub(1, std::memory_order_seq_cst);
            polls = 0;
            continue;
          }
          cpu_relax();
        }
      }
      if (stop_.load(std::memory_order_acquire)) return;
      seen = epoch_of(w);
      idle = index >= helpers_.load(std::memory_order_relaxed);
      if (!idle) claim_and_run(seen);
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> job_{0};
  std::atomic<uint32_t> done_{0};
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> helpers_{0};  // workers the current job may use
  std::atomic<bool> stop_{false};
  uint32_t epoch_ = 0;  // the caller's own copy of the last epoch it published
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
};

// A forked child has only the forking thread: its pools' workers are gone. Each pool
// remembers the fork generation it was made in; one from before a fork is abandoned (its
// threads cannot be joined there) and replaced.
std::atomic<uint64_t> g_fork_generation{0};

struct PoolSlot {
  std::unique_ptr<Pool> pool;
  uint64_t generation = 0;
  ~PoolSlot() {
    if (pool != nullptr && generation != g_fork_generation.load()) (void)pool.release();
  }
};

Pool& this_threads_pool() {
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, [] { g_fork_generation.fetch_add(1); });
    return true;
  }();
  (void)registered;
  thread_local PoolSlot slot;
  const uint64_t now = g_fork_generation.load();
  if (slot.pool == nullptr || slot.generation != now) {
    (void)slot.pool.release();  // from before a fork: its workers do not exist here
    slot.pool = std::make_unique<Pool>();
    slot.generation = now;
  }
  return *slot.pool;
}

}  // namespace

int num_threads() { return t_in_job || omp_in_parallel() ? 1 : omp_get_max_threads(); }

// OpenMP's per-thread ICV holds the count (Eigen's f64 GEMM reads it). Not
// Eigen::setNbThreads: that sets one process-wide count (a race between simulated ranks).
void set_num_threads(int n) { omp_set_num_threads(std::max(1, n)); }

namespace internal {

void run_parts(int parts, void (*part)(void* ctx, int i), void* ctx) {
  if (parts <= 0) return;
  // Inline: one thread (num_threads() is 1 inside a part or an OpenMP region), one part, or
  // more parts than the job word counts.
  const int threads = num_threads();
  if (threads <= 1 || parts == 1 || parts > 0xffff) {
    for (int i = 0; i < parts; ++i) part(ctx, i);
    return;
  }
  ++t_jobs;
  this_threads_pool().run(parts, threads, part, ctx);
}

int64_t jobs_started() { return t_jobs; }

}  // namespace internal
}  // namespace tessera::cpu
