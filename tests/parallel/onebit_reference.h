// An independent f64 1-bit all-reduce (DeepSpeed's compressed_allreduce, written on plain
// arrays), shared by onebit_test and onebit_adam_test.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace tessera::parallel::testing_onebit {

using Vec = std::vector<double>;

inline double sgn(double v) { return v < 0 ? -1.0 : 1.0; }

// The signs' scale: mean |v| (l1) or ||v|| / sqrt(n) (l2).
inline double scale_of(const Vec& v, bool l2) {
  double s = 0;
  for (double x : v) s += l2 ? x * x : std::abs(x);
  return l2 ? std::sqrt(s) / std::sqrt(static_cast<double>(v.size()))
            : s / static_cast<double>(v.size());
}

struct RefState {
  std::vector<Vec> worker, server;  // per rank
};

// One call on every rank's x; returns the result (the same on every rank).
inline Vec reference(std::vector<Vec> x, RefState& st, int w, bool l2) {
  const int64_t n = static_cast<int64_t>(x[0].size()), chunk = n / w;
  std::vector<Vec> c(static_cast<size_t>(w));
  Vec s(static_cast<size_t>(w));
  for (int r = 0; r < w; ++r) {
    Vec y(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = x[static_cast<size_t>(r)][static_cast<size_t>(i)] + st.worker[static_cast<size_t>(r)][static_cast<size_t>(i)];
    s[static_cast<size_t>(r)] = scale_of(y, l2);
    c[static_cast<size_t>(r)] = y;
    for (int64_t i = 0; i < n; ++i) {
      st.worker[static_cast<size_t>(r)][static_cast<size_t>(i)] = y[static_cast<size_t>(i)] - s[static_cast<size_t>(r)] * sgn(y[static_cast<size_t>(i)]);
    }
  }
  Vec out(static_cast<size_t>(n));
  for (int j = 0; j < w; ++j) {
    Vec z(static_cast<size_t>(chunk), 0.0);
    for (int r = 0; r < w; ++r) {
      for (int64_t i = 0; i < chunk; ++i) {
        z[static_cast<size_t>(i)] += sgn(c[static_cast<size_t>(r)][static_cast<size_t>(j * chunk + i)]) * (s[static_cast<size_t>(r)] * (1.0 / w));
      }
    }
    for (int64_t i = 0; i < chunk; ++i) z[static_cast<size_t>(i)] += st.server[static_cast<size_t>(j)][static_cast<size_t>(i)];
    const double t = scale_of(z, l2);
    for (int64_t i = 0; i < chunk; ++i) {
      const double q = t * sgn(z[static_cast<size_t>(i)]);
      st.server[static_cast<size_t>(j)][static_cast<size_t>(i)] = z[static_cast<size_t>(i)] - q;
      out[static_cast<size_t>(j * chunk + i)] = q;
    }
  }
  return out;
}


// Errors of a fresh call: zeros, for `w` ranks of n elements.
inline RefState fresh_state(int w, int64_t n) {
  return RefState{std::vector<Vec>(static_cast<size_t>(w), Vec(static_cast<size_t>(n), 0.0)),
                  std::vector<Vec>(static_cast<size_t>(w), Vec(static_cast<size_t>(n / w), 0.0))};
}

}  // namespace tessera::parallel::testing_onebit
