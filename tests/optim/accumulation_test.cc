// Gradient accumulation as optimizer.h documents it: k micro-batches, each loss divided by k,
// backward accumulating into .grad, one step, against one backward over the whole batch.
#include <doctest/doctest.h>

#include <cmath>

#include "autograd/autograd.h"
#include "optim/adamw.h"
#include "tests/optim/optim_test_util.h"

namespace tessera::optim {
namespace {

struct Mlp {
  Tensor w1, b1, w2, b2;

  explicit Mlp(uint64_t seed) {
    Generator gen(seed);
    w1 = (randn({6, 16}, DType::f32, kCPU, &gen) * 0.5).requires_grad_();
    b1 = (randn({16}, DType::f32, kCPU, &gen) * 0.1).requires_grad_();
    w2 = (randn({16, 3}, DType::f32, kCPU, &gen) * 0.5).requires_grad_();
    b2 = (randn({3}, DType::f32, kCPU, &gen) * 0.1).requires_grad_();
  }
  std::vector<Tensor> params() const { return {w1, b1, w2, b2}; }
  Tensor loss(const Tensor& x, const Tensor& y) const {
    return cross_entropy(matmul(relu(matmul(x, w1) + b1), w2) + b2, y);
  }
};

// max |got - want| / max |want| over each tensor: the f32 error of a reordered sum is
// relative to the magnitude of its terms, not to an element that cancels to near 0.
double rel_diff(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    diff = std::max(diff, std::fabs(g[i] - w[i]));
    scale = std::max(scale, std::fabs(w[i]));
  }
  return diff / scale;
}

// Tolerance 1e-6 of each tensor's largest magnitude: the two orders sum the same 32
// per-sample terms in f32 (4 partial sums of 8, or one of 32); each adds at most
// 32 * 2^-24 = 1.9e-6 relative to the terms' magnitudes, and these gradients sum terms of
// mixed sign to values of the size of the terms, so 1e-6 holds with room (measured: 1.3e-7
// for the gradients, 2e-8 for the params after AdamW, whose first steps are +-lr).
TEST_CASE("4 micro-batches of 8 with loss / 4 equal one batch of 32, before and after AdamW") {
  Mlp whole(5), accumulated(5);
  AdamW opt_whole(whole.params(), {.lr = 1e-2, .weight_decay = 0.1});
  AdamW opt_accumulated(accumulated.params(), {.lr = 1e-2, .weight_decay = 0.1});
  constexpr int k = 4;
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    Generator gen(11 + step);
    const Tensor x = randn({32, 6}, DType::f32, kCPU, &gen);
    const Tensor y = cast(rand({32}, DType::f32, kCPU, &gen) * 3.0, DType::i64);  // 0, 1, 2

    opt_whole.zero_grad();
    whole.loss(x, y).backward();
    opt_accumulated.zero_grad();
    for (int i = 0; i < k; ++i) {
      const Tensor xi = x.slice(0, 8 * i, 8 * (i + 1)), yi = y.slice(0, 8 * i, 8 * (i + 1));
      (accumulated.loss(xi, yi) / static_cast<double>(k)).backward();
    }

    const std::vector<Tensor> pw = whole.params(), pa = accumulated.params();
    for (size_t i = 0; i < pw.size(); ++i) {
      const double d = rel_diff(pa[i].grad(), pw[i].grad());
      CHECK_MESSAGE(d < 1e-6, "param ", i, ": accumulated gradient off by ", d);
    }
    opt_whole.step();
    opt_accumulated.step();
    for (size_t i = 0; i < pw.size(); ++i) {
      const double d = rel_diff(pa[i], pw[i]);
      CHECK_MESSAGE(d < 1e-6, "param ", i, ": off by ", d, " after AdamW step ", step + 1);
    }
  }
}

}  // namespace
}  // namespace tessera::optim
