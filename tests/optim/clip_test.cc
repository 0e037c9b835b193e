// clip_grad_norm: the global norm, the scaled gradients, nothing scaled below max_norm, and
// non-finite norms returned without touching the gradients.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "autograd/autograd.h"
#include "optim/clip.h"
#include "tests/optim/optim_test_util.h"

namespace tessera::optim {
namespace {

using testing::bitwise_equal;
using testing::expect_error_with;
using testing::expect_rel;
using testing::f32;

// Gradients {3, 4} and {12}: global norm sqrt(9 + 16 + 144) = 13 exactly; a third param has
// no gradient and is skipped.
struct Params {
  Tensor a = zeros({2}).requires_grad_(), b = zeros({1}).requires_grad_(),
         c = zeros({3}).requires_grad_();
  Params() {
    a.set_grad(f32({3.0f, 4.0f}));
    b.set_grad(f32({12.0f}));
  }
  std::vector<Tensor> all() const { return {a, b, c}; }
};

TEST_CASE("clip_grad_norm leaves gradients alone below max_norm and returns the norm") {
  Params p;
  const Tensor ga = p.a.grad().clone(), gb = p.b.grad().clone();
  CHECK(clip_grad_norm(p.all(), 26.0) == 13.0);  // exact: small integers in f64
  // At max_norm == norm the coefficient 13 / (13 + 1e-6) = 1 - 7.7e-8 still scales; with
  // the f32 rounding of the scaled gradients (6e-8 each) the norm stays within 3e-7.
  CHECK(clip_grad_norm(p.all(), 13.0) == 13.0);
  CHECK(grad_norm(p.all()) == doctest::Approx(13.0).epsilon(3e-7));
  Params q;
  CHECK(clip_grad_norm(q.all(), 13.5) == 13.0);
  CHECK(bitwise_equal(q.a.grad(), ga));
  CHECK(bitwise_equal(q.b.grad(), gb));
  CHECK_FALSE(q.c.grad().defined());
}

TEST_CASE("clip_grad_norm scales every gradient by max_norm / (norm + 1e-6)") {
  Params p;
  CHECK(clip_grad_norm(p.all(), 6.5) == 13.0);
  const double coef = 6.5 / (13.0 + 1e-6);
  // f32 gradients times an f32-rounded coefficient: 2 roundings, 1.2e-7 relative.
  expect_rel(p.a.grad(), {3 * coef, 4 * coef}, 2e-7, "a");
  expect_rel(p.b.grad(), {12 * coef}, 2e-7, "b");
  CHECK(grad_norm(p.all()) == doctest::Approx(6.5).epsilon(1e-6));
  CHECK(grad_norm(p.all()) < 6.5);
}

TEST_CASE("clip_grad_norm sums in f64 and rounds 16-bit gradients once") {
  // 10^6 gradient elements of 1e-3: norm 1.0; an f32 running sum would drift by ~1e-2.
  Tensor w = zeros({1000, 1000}).requires_grad_();
  w.set_grad(full({1000, 1000}, 1e-3));
  const double f32_value = static_cast<double>(1e-3f);
  CHECK(grad_norm({w}) == doctest::Approx(1000 * f32_value).epsilon(1e-12));

  Tensor h = zeros({2}, DType::bf16).requires_grad_();
  h.set_grad(cast(f32({3.0f, 4.0f}), DType::bf16));
  CHECK(clip_grad_norm({h}, 1.0) == 5.0);
  // 3 / 5 and 4 / 5 rounded to bf16 once (0.6 -> 0.6015625, 0.8 -> 0.80078125).
  CHECK(h.grad().to_vector<double>() == std::vector<double>{0.6015625, 0.80078125});
}

TEST_CASE("clip_grad_norm returns a non-finite norm without scaling") {
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    Params p;
    p.b.set_grad(f32({bad}));
    const Tensor ga = p.a.grad().clone();
    const double norm = clip_grad_norm(p.all(), 1.0);
    CHECK_FALSE(std::isfinite(norm));
    CHECK(std::isnan(norm) == std::isnan(bad));
    CHECK(bitwise_equal(p.a.grad(), ga));
  }
  Params p;
  expect_error_with([&] { clip_grad_norm(p.all(), 0.0); }, {"clip_grad_norm", "max_norm", "0"});
  CHECK(clip_grad_norm({zeros({2}).requires_grad_()}, 1.0) == 0.0);  // no gradients at all
}

}  // namespace
}  // namespace tessera::optim
