// The library's CPU parallelism: a pool of worker threads per calling thread (as OpenMP keeps
// a team per thread), whose workers spin briefly for the next job and then sleep, and whose
// jobs' parts are claimed dynamically by whichever thread is free - the caller included.
//
//   parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { ... });
//   parallel_parts(4, [&](int part) { ... });   // parts 0..3, on any threads
//   set_num_threads(1);   // per thread: each simulated rank runs its kernels single-threaded
//
// Why not OpenMP's regions: a region splits its work statically over a team and its caller
// waits at the barrier for every member. On a busy machine a member that the OS has not
// scheduled holds the whole region for a time slice (milliseconds), and libgomp's members
// spin for a long time between regions, taking the core from the thread with the serial
// work. Here the caller takes every part nobody has started, so it waits only for parts a
// worker has already begun (it can still wait a time slice for a worker preempted inside
// one), and idle workers sleep after TESSERA_SPIN_US microseconds (default 50; 0: sleep at
// once). Only min(parts, num_threads()) - 1 workers take part in a job; any others (the
// thread count went down) go back to sleep at once.
//
// Which thread runs a part never changes a result: parts are fixed by the range, grain and
// thread count alone. An exception thrown by a part is carried to the caller and rethrown
// (the first one caught, when several parts throw; with one thread, the parts after a
// throwing one do not run). Calls made from inside a part run inline, single-threaded.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <type_traits>

namespace tessera::cpu {

// Elements of simple elementwise work below which a single thread is faster.
inline constexpr int64_t kElementwiseGrain = 1 << 15;

// Threads kernels started from the calling thread may use (1 inside a part).
int num_threads();

// Sets the calling thread's kernel thread count (also OpenMP's per-thread ICV, which Eigen's
// f64 GEMM reads).
void set_num_threads(int n);

namespace internal {
// Runs part(ctx, i) for i in [0, parts) on the calling thread's pool; `part` must not throw
// (parallel_parts catches for it).
void run_parts(int parts, void (*part)(void* ctx, int i), void* ctx);
// Jobs the calling thread has handed to its pool so far (for profiles).
int64_t jobs_started();
}  // namespace internal

// Runs fn(part) once for each part in [0, parts), spread over up to `parts` threads.
template <typename F>
void parallel_parts(int parts, F&& fn) {
  if (parts <= 0) return;
  if (parts == 1 || num_threads() <= 1) {
    for (int i = 0; i < parts; ++i) fn(i);
    return;
  }
  struct Ctx {
    std::remove_reference_t<F>* fn;
    std::exception_ptr error;
    std::mutex mu;
  } ctx{&fn, nullptr, {}};
  internal::run_parts(
      parts,
      [](void* p, int i) {
        Ctx& c = *static_cast<Ctx*>(p);
        try {
          (*c.fn)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(c.mu);
          if (!c.error) c.error = std::current_exception();
        }
      },
      &ctx);
  if (ctx.error) std::rethrow_exception(ctx.error);
}

// Splits [begin, end) into at most num_threads() contiguous chunks of at least `grain`
// items; fn(chunk_begin, chunk_end) runs once per chunk. Chunking depends only on the range,
// grain and thread count, never on timing.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(grain, 1));
  const int threads = static_cast<int>(std::min<int64_t>(num_threads(), max_chunks));
  if (threads <= 1) {
    fn(begin, end);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  parallel_parts(threads, [&](int t) {
    const int64_t b = begin + t * chunk;
    const int64_t e = std::min(end, b + chunk);
    if (b < e) fn(b, e);
  });
}

}  // namespace tessera::cpu
