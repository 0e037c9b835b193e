// The timing loop every CPU benchmark shares: warm-up calls, then repetitions of enough
// calls to last min_ms each, reporting the median time of one call.
//
//   tessera::bench::Timing t{.reps = 21, .warmup = 3, .min_ms = 20.0};
//   double ms = tessera::bench::median_ms(t, [&] { tessera::bench::consume(matmul(a, b)); });
#pragma once

#include <time.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::bench {

struct Timing {
  int reps = 15;
  int warmup = 3;
  double min_ms = 20.0;
  // The process's CPU time (all threads, spinning included) instead of wall time: on a
  // machine busy with other jobs, time spent descheduled does not count. Comparable only
  // between runs with the same thread count.
  bool cpu_time = false;
};

inline double now_ms(bool cpu_time = false) {
  if (cpu_time) {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
  }
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

// The median of `values` (the mean of the middle two for an even count; 0 for none).
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Calls of `op` per repetition: enough to take t.min_ms, judged from one call.
inline int calls_per_repetition(const Timing& t, const std::function<void()>& op) {
  const double t0 = now_ms(t.cpu_time);
  op();
  const double once = std::max(now_ms(t.cpu_time) - t0, 1e-3);
  return std::max(1, static_cast<int>(t.min_ms / once));
}

// Median time (ms) of one call of `op`, over t.reps repetitions after t.warmup calls.
inline double median_ms(const Timing& t, const std::function<void()>& op) {
  for (int i = 0; i < t.warmup; ++i) op();
  const int inner = calls_per_repetition(t, op);
  std::vector<double> times;
  for (int r = 0; r < t.reps; ++r) {
    const double start = now_ms(t.cpu_time);
    for (int i = 0; i < inner; ++i) op();
    times.push_back((now_ms(t.cpu_time) - start) / inner);
  }
  return median(std::move(times));
}

// Keeps results alive so the compiler cannot drop an operation; main() returns a value
// that depends on it.
inline float sink = 0.0f;
inline void consume(const Tensor& t) { sink += static_cast<const float*>(t.raw_data())[0]; }

}  // namespace tessera::bench
