// Helpers for the optim/ tests: tensors from literals, relative comparisons that report the
// worst element, bitwise equality, and an Error-message check.
//
//   Tensor p = f32({1.0, -2.0}).requires_grad_();
//   expect_rel(p, {0.95, -2.1}, 1e-6);
//   expect_error_with([&] { opt.load_state_dict(bad); }, {"missing", "state.0.exp_avg"});
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tensor/ops.h"

namespace tessera::optim::testing {

inline Tensor f32(const std::vector<float>& values, Shape shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(values.size())};
  return Tensor::from_vector<float>(values, shape);
}

// |got - want| <= rel * |want| for every element, failing with the worst one.
inline void expect_rel(const Tensor& got, const std::vector<double>& want, double rel,
                       const std::string& what = "") {
  const std::vector<double> g = got.to_vector<double>();
  REQUIRE_MESSAGE(g.size() == want.size(), what, ": ", g.size(), " values, expected ",
                  want.size());
  size_t worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double bound = rel * std::fabs(want[i]);
    const double diff = std::fabs(g[i] - want[i]);
    const double ratio = diff == 0 ? 0 : (bound > 0 ? diff / bound : INFINITY);
    if (ratio > worst_ratio || std::isnan(g[i]) != std::isnan(want[i])) {
      worst_ratio = std::isnan(g[i]) != std::isnan(want[i]) ? INFINITY : ratio;
      worst = i;
    }
  }
  CHECK_MESSAGE(worst_ratio <= 1.0, what, ": element ", worst, " is ", g[worst], ", expected ",
                want[worst], " (|diff| ", std::fabs(g[worst] - want[worst]), " > ", rel,
                " relative)");
}

// Same dtype, shape and bytes.
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.raw_data(), cb.raw_data(), static_cast<size_t>(ca.nbytes())) == 0;
}

// f throws tessera::Error whose message contains every one of `parts`.
inline void expect_error_with(const std::function<void()>& f,
                              const std::vector<std::string>& parts) {
  try {
    f();
    FAIL_CHECK("expected tessera::Error, nothing was thrown");
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& part : parts) {
      CHECK_MESSAGE(msg.find(part) != std::string::npos, "message '", msg, "' lacks '", part,
                    "'");
    }
  }
}

}  // namespace tessera::optim::testing
