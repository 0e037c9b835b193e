// clip_grad_norm: the global norm, the scaled gradients, nothing scaled below max_norm, and
// non-finite norms returned without touching the gradients; clip_grad_norm(Optimizer&): the
// coefficient applied by the optimizer's step, bitwise as clipping the gradients first.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "optim/adafactor.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/clip.h"
#include "optim/sgd.h"
#include "tensor/random.h"
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

// ---- clip_grad_norm(Optimizer&): the scale applied in the step ---------------------------

using MakeOpt = std::function<std::unique_ptr<Optimizer>(std::vector<Tensor>)>;

struct StepCase {
  std::string name;
  DType dtype;
  MakeOpt make;
  bool fuses;
};

// Two parameters (one past AdamW8bit's 8-bit threshold), equal start values.
std::vector<Tensor> make_params(DType dt) {
  return {(randn({64, 80}, DType::f32, kCPU) * 0.5).cast(dt).requires_grad_(),
          (randn({7}, DType::f32, kCPU) * 0.5).cast(dt).requires_grad_()};
}

std::vector<Tensor> clones(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const Tensor& p : ps) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// The same gradients (norm ~60, so max_norm 1 clips) on both sets of parameters.
void set_grads(const std::vector<Tensor>& a, const std::vector<Tensor>& b, int step) {
  for (size_t i = 0; i < a.size(); ++i) {
    manual_seed(1000 + 10 * step + static_cast<int>(i));
    const Tensor g = (randn(a[i].shape(), DType::f32, kCPU) * (i == 0 ? 0.8 : 3.0)).cast(a[i].dtype());
    a[i].set_grad(g.clone());
    b[i].set_grad(g.clone());
  }
}

bool same_state(const Optimizer& a, const Optimizer& b) {
  const Optimizer::StateDict sa = a.state_dict(), sb = b.state_dict();
  if (sa.size() != sb.size()) return false;
  for (const auto& [key, t] : sa) {
    auto it = sb.find(key);
    if (it == sb.end() || !bitwise_equal(t, it->second)) return false;
  }
  return true;
}

std::vector<StepCase> step_cases() {
  std::vector<StepCase> cases;
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    const std::string d(dtype_name(dt));
    cases.push_back({"AdamW " + d, dt, [](std::vector<Tensor> ps) -> std::unique_ptr<Optimizer> {
                       return std::make_unique<AdamW>(std::move(ps), AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
                     }, true});
    cases.push_back({"SGD nesterov " + d, dt, [](std::vector<Tensor> ps) -> std::unique_ptr<Optimizer> {
                       return std::make_unique<SGD>(std::move(ps), SGDOptions{.lr = 0.1, .momentum = 0.9,
                                                                              .weight_decay = 0.01, .nesterov = true});
                     }, true});
    cases.push_back({"AdamW8bit " + d, dt, [](std::vector<Tensor> ps) -> std::unique_ptr<Optimizer> {
                       return std::make_unique<AdamW8bit>(std::move(ps), AdamW8bitOptions{.lr = 1e-2});
                     }, true});
  }
  cases.push_back({"AdamW bf16 without master", DType::bf16, [](std::vector<Tensor> ps) -> std::unique_ptr<Optimizer> {
                     return std::make_unique<AdamW>(std::move(ps), AdamWOptions{.master_weights = false});
                   }, true});
  cases.push_back({"SGD plain f32", DType::f32, [](std::vector<Tensor> ps) -> std::unique_ptr<Optimizer> {
                     return std::make_unique<SGD>(std::move(ps), SGDOptions{.lr = 0.1});
                   }, true});
  cases.push_back({"Adafactor f32 (scales the gradients in clip)", DType::f32,
                   [](std::vector<Tensor> ps) -> std::unique_ptr<Optimizer> {
                     return std::make_unique<Adafactor>(std::move(ps), AdafactorOptions{});
                   }, false});
  return cases;
}

TEST_CASE("clip_grad_norm(opt) then step() is bitwise clip_grad_norm(params), then step()") {
  int ran = 0;
  for (const StepCase& c : step_cases()) {
    CAPTURE(c.name);
    manual_seed(7);
    const std::vector<Tensor> ref = make_params(c.dtype), fused = clones(ref);
    std::unique_ptr<Optimizer> ref_opt = c.make(ref), opt = c.make(fused);
    CHECK(opt->fuses_grad_scale() == c.fuses);
    for (int step = 0; step < 3; ++step) {
      set_grads(ref, fused, step);
      const Tensor unclipped = fused[0].grad().clone();
      const double want = clip_grad_norm(ref, 1.0);
      // In opt's order (here the same as ref's) or in the order given.
      const double got = step == 1 ? clip_grad_norm(fused, 1.0, *opt) : clip_grad_norm(*opt, 1.0);
      CHECK(got == want);
      REQUIRE(want > 10.0);  // it clips
      if (c.fuses) {
        // Not written: the step reads them scaled.
        CHECK(bitwise_equal(fused[0].grad(), unclipped));
        CHECK(opt->pending_grad_scale() == 1.0 / (want + 1e-6));
      } else {
        CHECK(bitwise_equal(fused[0].grad(), ref[0].grad()));
        CHECK(opt->pending_grad_scale() == 1.0);
      }
      ref_opt->step();
      opt->step();
      CHECK(opt->pending_grad_scale() == 1.0);
      for (size_t i = 0; i < ref.size(); ++i) CHECK(bitwise_equal(fused[i], ref[i]));
      CHECK(same_state(*opt, *ref_opt));
    }
    ++ran;
  }
  CHECK(ran == 15);
}

TEST_CASE("a pending gradient scale: zero_grad drops it, a second one applies the first") {
  manual_seed(3);
  const std::vector<Tensor> ref = make_params(DType::f32), fused = clones(ref);
  AdamW ref_opt(ref), opt(fused);
  // Clipped, then zero_grad (a skipped step): the next step is unscaled.
  set_grads(ref, fused, 0);
  clip_grad_norm(opt, 1.0);
  CHECK(opt.pending_grad_scale() < 1.0);
  opt.zero_grad();
  CHECK(opt.pending_grad_scale() == 1.0);
  set_grads(ref, fused, 1);
  ref_opt.step();
  opt.step();
  for (size_t i = 0; i < ref.size(); ++i) CHECK(bitwise_equal(fused[i], ref[i]));
  // Two scales before a step: as two scale_ passes.
  set_grads(ref, fused, 2);
  scale_gradients(ref, 0.5);
  scale_gradients(ref, 0.3);
  opt.scale_grads(0.5);
  opt.scale_grads(0.3);
  CHECK(opt.pending_grad_scale() == 0.3);
  ref_opt.step();
  opt.step();
  for (size_t i = 0; i < ref.size(); ++i) CHECK(bitwise_equal(fused[i], ref[i]));
  // Clipped twice before a step: the second norm is of the clipped gradients, as in place.
  set_grads(ref, fused, 3);
  const double r1 = clip_grad_norm(ref, 1.0), r2 = clip_grad_norm(ref, 0.5);
  CHECK(clip_grad_norm(opt, 1.0) == r1);
  CHECK(clip_grad_norm(opt, 0.5) == r2);
  CHECK(r2 == doctest::Approx(1.0).epsilon(1e-6));  // the norm after the first clip
  ref_opt.step();
  opt.step();
  for (size_t i = 0; i < ref.size(); ++i) CHECK(bitwise_equal(fused[i], ref[i]));
  // apply_pending_grad_scale writes the coefficient into .grad, as clipping in place does.
  set_grads(ref, fused, 4);
  clip_grad_norm(ref, 1.0);
  clip_grad_norm(opt, 1.0);
  opt.apply_pending_grad_scale();
  CHECK(opt.pending_grad_scale() == 1.0);
  for (size_t i = 0; i < ref.size(); ++i) CHECK(bitwise_equal(fused[i].grad(), ref[i].grad()));
  // A non-finite norm leaves nothing pending; a non-finite scale is refused.
  fused[1].set_grad(f32({std::numeric_limits<float>::infinity(), 0, 0, 0, 0, 0, 0}, {7}));
  CHECK(std::isinf(clip_grad_norm(opt, 1.0)));
  CHECK(opt.pending_grad_scale() == 1.0);
  expect_error_with([&] { opt.scale_grads(std::nan("")); }, {"AdamW", "scale_grads", "finite", "nan"});
  expect_error_with([&] { clip_grad_norm(opt, 0.0); }, {"clip_grad_norm", "max_norm", "0"});
  expect_error_with([&] { clip_grad_norm({fused[0]}, 1.0, opt); },
                    {"clip_grad_norm", "the 1 parameters", "AdamW's 2"});
}

}  // namespace
}  // namespace tessera::optim
