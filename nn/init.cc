#include "nn/init.h"

#include <cmath>

namespace tessera::nn::init {
namespace {

void check(const Tensor& t, const char* fn) {
  TS_CHECK(t.defined(), "init::{}: tensor is undefined", fn);
  TS_CHECK(is_floating(t.dtype()), "init::{}: expected a floating-point tensor, got {}", fn,
           t.dtype());
}

// Draws in f32 (f64 for f64 tensors) and writes into t: the same numbers for every dtype up
// to rounding, and no graph.
Tensor& fill_from(Tensor& t, const Tensor& values) {
  NoGradGuard no_grad;
  t.copy_(values);
  return t;
}

DType draw_dtype(const Tensor& t) { return t.dtype() == DType::f64 ? DType::f64 : DType::f32; }

int64_t fan(const Tensor& t, FanMode mode) {
  auto [in, out] = fans(t);
  return mode == FanMode::fan_in ? in : out;
}

}  // namespace

std::pair<int64_t, int64_t> fans(const Tensor& t) {
  TS_CHECK(t.dim() >= 2, "init: fan in/out needs a tensor with at least 2 dims, got shape {}",
           shape_str(t.shape()));
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

double gain(Nonlinearity nonlinearity, double param) {
  switch (nonlinearity) {
    case Nonlinearity::linear:
    case Nonlinearity::sigmoid:
      return 1.0;
    case Nonlinearity::tanh:
      return 5.0 / 3.0;
    case Nonlinearity::relu:
      return std::sqrt(2.0);
    case Nonlinearity::leaky_relu:
      return std::sqrt(2.0 / (1.0 + param * param));
  }
  return 1.0;
}

Tensor& normal_(Tensor& t, double mean, double std, Generator* generator) {
  check(t, "normal_");
  TS_CHECK(std >= 0.0, "init::normal_: std must be >= 0, got {}", std);
  return fill_from(t, randn(t.shape(), draw_dtype(t), t.device(), generator) * std + mean);
}

Tensor& uniform_(Tensor& t, double low, double high, Generator* generator) {
  check(t, "uniform_");
  TS_CHECK(low <= high, "init::uniform_: low {} is above high {}", low, high);
  return fill_from(t, rand(t.shape(), draw_dtype(t), t.device(), generator) * (high - low) + low);
}

Tensor& zeros_(Tensor& t) { return constant_(t, 0.0); }
Tensor& ones_(Tensor& t) { return constant_(t, 1.0); }

Tensor& constant_(Tensor& t, double value) {
  TS_CHECK(t.defined(), "init::constant_: tensor is undefined");
  return fill_from(t, full({}, value, t.dtype()));
}

Tensor& kaiming_uniform_(Tensor& t, double a, FanMode mode, Nonlinearity nonlinearity,
                         Generator* generator) {
  check(t, "kaiming_uniform_");
  const double bound = gain(nonlinearity, a) * std::sqrt(3.0 / fan(t, mode));
  return uniform_(t, -bound, bound, generator);
}

Tensor& kaiming_normal_(Tensor& t, double a, FanMode mode, Nonlinearity nonlinearity,
                        Generator* generator) {
  check(t, "kaiming_normal_");
  return normal_(t, 0.0, gain(nonlinearity, a) / std::sqrt(static_cast<double>(fan(t, mode))),
                 generator);
}

Tensor& xavier_uniform_(Tensor& t, double gain, Generator* generator) {
  check(t, "xavier_uniform_");
  auto [in, out] = fans(t);
  const double bound = gain * std::sqrt(6.0 / static_cast<double>(in + out));
  return uniform_(t, -bound, bound, generator);
}

Tensor& xavier_normal_(Tensor& t, double gain, Generator* generator) {
  check(t, "xavier_normal_");
  auto [in, out] = fans(t);
  return normal_(t, 0.0, gain * std::sqrt(2.0 / static_cast<double>(in + out)), generator);
}

}  // namespace tessera::nn::init
