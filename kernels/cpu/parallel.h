// One thread pool for the whole library: OpenMP's, shared with Eigen's GEMM.
//
//   parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { ... });
//   set_num_threads(1);   // per thread: each simulated rank runs its kernels single-threaded
//
// Exceptions thrown inside a chunk are carried out of the parallel region and rethrown on
// the caller's thread (an exception escaping an OpenMP region would terminate).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>

namespace tessera::cpu {

// Elements of simple elementwise work below which a single thread is faster.
inline constexpr int64_t kElementwiseGrain = 1 << 15;

// Threads kernels started from the calling thread may use.
inline int num_threads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

// Sets the calling thread's kernel thread count (OpenMP's per-thread ICV; Eigen reads it).
void set_num_threads(int n);

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
  std::exception_ptr error;
  std::mutex error_mu;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t nt = omp_get_num_threads();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t b = begin + t * chunk;
    const int64_t e = std::min(end, b + chunk);
    if (b < e) {
      try {
        fn(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace tessera::cpu
