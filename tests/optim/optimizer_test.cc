// SGD and AdamW against values computed by hand (SGD) or in closed form / an f64 recurrence
// written here (AdamW); master weights for bf16 params; skipped params; decay_groups; and
// the errors for bad hyperparameters and parameter lists.
//
// Tolerance 1e-6 relative: each f32 result element goes through fewer than ten roundings
// (2^-24 each) of terms no larger than the result (the values keep clear of cancellation),
// so the f32 error is below 10 * 6e-8 = 6e-7 relative.
#include <doctest/doctest.h>

#include <cmath>

#include "autograd/autograd.h"
#include "optim/adamw.h"
#include "optim/sgd.h"
#include "tests/optim/optim_test_util.h"

namespace tessera::optim {
namespace {

using testing::bitwise_equal;
using testing::expect_error_with;
using testing::expect_rel;
using testing::f32;

constexpr double kRel = 1e-6;

// Three steps of `opt` over one param starting at {1, -2, 0.5} with gradients g1, g2, g3;
// returns the param after each step.
template <typename Opt, typename Options>
std::vector<std::vector<double>> three_sgd_steps(Options options) {
  Tensor p = f32({1.0f, -2.0f, 0.5f}).requires_grad_();
  Opt opt({p}, options);
  const std::vector<std::vector<float>> grads = {
      {0.5f, 0.25f, -1.0f}, {-0.5f, 1.0f, 2.0f}, {0.25f, -0.75f, 0.5f}};
  std::vector<std::vector<double>> out;
  for (const auto& g : grads) {
    p.set_grad(f32(g));
    opt.step();
    out.push_back(p.to_vector<double>());
  }
  return out;
}

void expect_steps(const std::vector<std::vector<double>>& got,
                  const std::vector<std::vector<double>>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (size_t t = 0; t < got.size(); ++t) {
    expect_rel(f32(std::vector<float>(got[t].begin(), got[t].end())), want[t], kRel,
               fmt::format("{} step {}", what, t + 1));
  }
}

TEST_CASE("SGD: plain, momentum, nesterov, dampening and weight decay match hand values") {
  // lr 0.1; g1 = {0.5, 0.25, -1}, g2 = {-0.5, 1, 2}, g3 = {0.25, -0.75, 0.5}.
  // plain: p -= 0.1 g.
  expect_steps(three_sgd_steps<SGD>(SGDOptions{.lr = 0.1}),
               {{0.95, -2.025, 0.6}, {1.0, -2.125, 0.4}, {0.975, -2.05, 0.35}}, "plain");
  // momentum 0.9: b1 = g1, b2 = 0.9 b1 + g2 = {-0.05, 1.225, 1.1},
  // b3 = 0.9 b2 + g3 = {0.205, 0.3525, 1.49}; p -= 0.1 b.
  expect_steps(three_sgd_steps<SGD>(SGDOptions{.lr = 0.1, .momentum = 0.9}),
               {{0.95, -2.025, 0.6}, {0.955, -2.1475, 0.49}, {0.9345, -2.18275, 0.341}},
               "momentum");
  // nesterov: the step is g + 0.9 b: 1.9 g1 = {0.95, 0.475, -1.9}, then
  // g2 + 0.9 b2 = {-0.545, 2.1025, 2.99}, then g3 + 0.9 b3 = {0.4345, 0.06725, 1.841}.
  expect_steps(three_sgd_steps<SGD>(SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true}),
               {{0.905, -2.0475, 0.69}, {0.9595, -2.25775, 0.391}, {0.91605, -2.214475, 0.2069}},
               "nesterov");
  // dampening 0.5 (not applied at step 1, as PyTorch): b2 = 0.9 g1 + 0.5 g2 = {0.2, 0.725, 0.1}.
  expect_steps(three_sgd_steps<SGD>(SGDOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.5}),
               {{0.95, -2.025, 0.6}, {0.93, -2.0975, 0.59}, {0.8995, -2.12525, 0.556}},
               "dampening");
  // weight decay 0.1 joins the gradient: d1 = g1 + 0.1 p0 = {0.6, 0.05, -0.95},
  // d2 = g2 + 0.1 p1 = {-0.406, 0.7995, 2.0595}.
  expect_steps(three_sgd_steps<SGD>(SGDOptions{.lr = 0.1, .weight_decay = 0.1}),
               {{0.94, -2.005, 0.595},
                {0.9806, -2.08495, 0.38905},
                {0.945794, -1.9891005, 0.3351595}},
               "weight decay");
}

TEST_CASE("SGD keeps its momentum buffer in the state, f32 for f32 params and f64 for f64") {
  Tensor p = f32({1.0f, -2.0f}).requires_grad_();
  Tensor q = Tensor::from_vector<double>({3.0}, {1}).requires_grad_();
  SGD opt({p, q}, {.lr = 0.1, .momentum = 0.9});
  p.set_grad(f32({0.5f, 0.25f}));
  q.set_grad(Tensor::from_vector<double>({-1.0}, {1}));
  opt.step();
  opt.step();  // same gradients: b2 = 1.9 g
  CHECK(opt.state(0).at("momentum_buffer").dtype() == DType::f32);
  CHECK(opt.state(1).at("momentum_buffer").dtype() == DType::f64);
  expect_rel(opt.state(0).at("momentum_buffer"), {0.95, 0.475}, kRel, "buffer");
  expect_rel(opt.state(1).at("momentum_buffer"), {-1.9}, 1e-14, "f64 buffer");
  expect_rel(q, {3.0 + 0.1 + 0.19}, 1e-14, "f64 param");  // f64: a few 2^-53 roundings
  CHECK(opt.step_count(0) == 2);
}

// AdamW with one gradient g held for every step: m_t = (1 - b1^t) g and
// v_t = (1 - b2^t) g^2, so the bias-corrected step is lr g / (|g| + eps) every time and
// p_t = p_{t-1} (1 - lr wd) - lr g / (|g| + eps).
TEST_CASE("AdamW with a constant gradient follows the closed form") {
  const double lr = 0.01, wd = 0.1, eps = 1e-8, b1 = 0.9, b2 = 0.999;
  const std::vector<double> p0 = {1.0, -2.0, 0.5, 3.0}, g = {0.5, -0.25, 2.0, 0.0};
  Tensor p = f32({1.0f, -2.0f, 0.5f, 3.0f}).requires_grad_();
  AdamW opt({p}, {.lr = lr, .weight_decay = wd});
  std::vector<double> want = p0;
  for (int t = 1; t <= 3; ++t) {
    p.set_grad(f32({0.5f, -0.25f, 2.0f, 0.0f}));
    opt.step();
    for (size_t i = 0; i < want.size(); ++i) {
      want[i] = want[i] * (1 - lr * wd) - lr * g[i] / (std::fabs(g[i]) + eps);
    }
    expect_rel(p, want, kRel, fmt::format("param after step {}", t));
  }
  std::vector<double> m(4), v(4);
  for (size_t i = 0; i < 4; ++i) {
    m[i] = (1 - std::pow(b1, 3)) * g[i];
    v[i] = (1 - std::pow(b2, 3)) * g[i] * g[i];
  }
  expect_rel(opt.state(0).at("exp_avg"), m, kRel, "exp_avg");
  expect_rel(opt.state(0).at("exp_avg_sq"), v, kRel, "exp_avg_sq");
  CHECK(opt.step_count(0) == 3);
}

TEST_CASE("AdamW over three different gradients matches the recurrence in f64") {
  const double lr = 0.05, wd = 0.02, eps = 1e-6, b1 = 0.8, b2 = 0.95;
  const std::vector<std::vector<double>> grads = {
      {0.5, 0.25, -1.0}, {-0.5, 1.0, 2.0}, {0.25, -0.75, 0.5}};
  Tensor p = f32({1.0f, -2.0f, 0.5f}).requires_grad_();
  AdamW opt({p}, {.lr = lr, .betas = {b1, b2}, .eps = eps, .weight_decay = wd});
  std::vector<double> x = {1.0, -2.0, 0.5}, m(3, 0.0), v(3, 0.0);
  for (int t = 1; t <= 3; ++t) {
    const std::vector<double>& g = grads[t - 1];
    p.set_grad(f32({static_cast<float>(g[0]), static_cast<float>(g[1]), static_cast<float>(g[2])}));
    opt.step();
    for (size_t i = 0; i < 3; ++i) {
      x[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      const double m_hat = m[i] / (1 - std::pow(b1, t)), v_hat = v[i] / (1 - std::pow(b2, t));
      x[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
    expect_rel(p, x, kRel, fmt::format("param after step {}", t));
  }
  expect_rel(opt.state(0).at("exp_avg"), m, kRel, "exp_avg");
  expect_rel(opt.state(0).at("exp_avg_sq"), v, kRel, "exp_avg_sq");
}

TEST_CASE("AdamW defaults are PyTorch's") {
  const AdamWOptions o;
  CHECK(o.lr == 1e-3);
  CHECK(o.betas.first == 0.9);
  CHECK(o.betas.second == 0.999);
  CHECK(o.eps == 1e-8);
  CHECK(o.weight_decay == 1e-2);
}

// lr 1e-3 moves {1, -2, 4, 3} by 1e-3 per step: less than half a bf16 ulp (2^-8 .. 2^-6 at
// these magnitudes), so a bf16 param updated in place never moves, while the f32 master
// accumulates the steps and the param follows it, rounded.
TEST_CASE("master weights: bf16 params follow their f32 master; without one they stall") {
  for (bool adam : {true, false}) {
    CAPTURE(adam);
    auto make = [&](const Tensor& p, bool master) -> std::unique_ptr<Optimizer> {
      if (adam) return std::make_unique<AdamW>(std::vector<Tensor>{p},
                                               AdamWOptions{.lr = 1e-3, .weight_decay = 0.0,
                                                            .master_weights = master});
      return std::make_unique<SGD>(std::vector<Tensor>{p},
                                   SGDOptions{.lr = 1e-3, .master_weights = master});
    };
    const Tensor p0 = cast(f32({1.0f, -2.0f, 4.0f, 3.0f}), DType::bf16);
    Tensor with = p0.clone().requires_grad_(), without = p0.clone().requires_grad_();
    auto opt_with = make(with, true), opt_without = make(without, false);
    // Unit gradients: AdamW's step is lr * sign(g) (to 1e-8), SGD's lr * g.
    const Tensor g = cast(f32({1.0f, -1.0f, 1.0f, -1.0f}), DType::bf16);
    for (int t = 0; t < 10; ++t) {
      with.set_grad(g.clone());
      without.set_grad(g.clone());
      opt_with->step();
      opt_without->step();
    }
    const Tensor master = opt_with->state(0).at("master");
    CHECK(master.dtype() == DType::f32);
    expect_rel(master, {0.99, -1.99, 3.99, 3.01}, 1e-6, "master after 10 steps");
    CHECK(with.dtype() == DType::bf16);
    CHECK(bitwise_equal(with, cast(master, DType::bf16)));
    // Nearest bf16 values (spacing 2^-8, 2^-7, 2^-6, 2^-6 there).
    CHECK(with.to_vector<double>() ==
          std::vector<double>{0.98828125, -1.9921875, 3.984375, 3.015625});
    CHECK(opt_without->state(0).count("master") == 0);
    CHECK(bitwise_equal(without, p0));
    if (adam) CHECK(opt_with->state(0).at("exp_avg").dtype() == DType::f32);
  }
}

TEST_CASE("parameters without a gradient are skipped; zero_grad drops gradients") {
  Tensor a = f32({1.0f, 2.0f}).requires_grad_(), b = f32({3.0f}).requires_grad_();
  AdamW opt({a, b}, {.lr = 0.1});
  a.set_grad(f32({1.0f, 1.0f}));
  opt.step();
  CHECK(opt.step_count(0) == 1);
  CHECK(opt.step_count(1) == 0);
  CHECK(opt.state(1).empty());
  CHECK(b.to_vector<float>() == std::vector<float>{3.0f});  // not even decayed
  opt.zero_grad();
  CHECK_FALSE(a.grad().defined());
  CHECK_FALSE(b.grad().defined());
  opt.step();  // nothing has a gradient: nothing changes
  CHECK(opt.step_count(0) == 1);
}

TEST_CASE("decay_groups: 2-D and larger decay, biases, norm gains and scalars do not") {
  const std::vector<std::pair<std::string, Tensor>> named = {
      {"fc.weight", zeros({4, 3}).requires_grad_()}, {"fc.bias", zeros({4}).requires_grad_()},
      {"ln.weight", ones({4}).requires_grad_()},     {"ln.bias", zeros({4}).requires_grad_()},
      {"emb.weight", zeros({10, 4}).requires_grad_()}, {"temperature", ones({}).requires_grad_()}};
  const std::vector<ParamGroup> groups = decay_groups(named, 3e-4, 0.1);
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].names == std::vector<std::string>{"fc.weight", "emb.weight"});
  CHECK(groups[1].names == std::vector<std::string>{"fc.bias", "ln.weight", "ln.bias",
                                                    "temperature"});
  CHECK(groups[0].weight_decay == 0.1);
  CHECK(groups[1].weight_decay == 0.0);
  CHECK(groups[0].lr == 3e-4);
  CHECK(groups[1].lr == 3e-4);
  CHECK(groups[0].params[1].is_same(named[4].second));

  // Through AdamW with zero gradients (so the Adam term is 0): the decayed weight shrinks by
  // 1 - lr * wd, the layer-norm gain keeps its value.
  Tensor w = ones({2, 2}).requires_grad_(), gain = ones({2}).requires_grad_();
  AdamW opt(decay_groups({{"w", w}, {"gain", gain}}, 0.5, 0.1));
  w.set_grad(zeros({2, 2}));
  gain.set_grad(zeros({2}));
  opt.step();
  expect_rel(w, {0.95, 0.95, 0.95, 0.95}, kRel, "decayed weight");
  CHECK(gain.to_vector<float>() == std::vector<float>{1.0f, 1.0f});
}

TEST_CASE("groups keep their own lr and weight decay; set_lr sets all of them") {
  Tensor a = f32({1.0f}).requires_grad_(), b = f32({1.0f}).requires_grad_();
  ParamGroup ga{{a}, {"a"}, 0.1};  // weight_decay inherited from the options
  ParamGroup gb{{b}, {"b"}};       // both inherited
  SGD opt({ga, gb}, {.lr = 0.5, .weight_decay = 0.25});
  CHECK(opt.param_groups()[0].lr == 0.1);
  CHECK(opt.param_groups()[0].weight_decay == 0.25);
  CHECK(opt.param_groups()[1].lr == 0.5);
  a.set_grad(f32({1.0f}));
  b.set_grad(f32({1.0f}));
  opt.step();
  // d = 1 + 0.25 * 1 = 1.25: a = 1 - 0.1 * 1.25, b = 1 - 0.5 * 1.25.
  expect_rel(a, {0.875}, kRel, "a");
  expect_rel(b, {0.375}, kRel, "b");
  opt.set_lr(0.01);
  CHECK(opt.param_groups()[0].lr == 0.01);
  CHECK(opt.param_groups()[1].lr == 0.01);
  expect_error_with([&] { opt.set_lr(-1.0); }, {"SGD", "learning rate", "-1"});
  CHECK(opt.param_groups()[1].lr == 0.01);  // unchanged by the failed call
}

TEST_CASE("invalid hyperparameters and parameter lists are errors naming the value") {
  Tensor p = zeros({2}).requires_grad_();
  expect_error_with([&] { SGD({p}, {.lr = -0.1}); }, {"SGD", "learning rate", "-0.1"});
  expect_error_with([&] { SGD({p}, {.momentum = -0.5}); }, {"SGD", "momentum", "-0.5"});
  expect_error_with([&] { SGD({p}, {.weight_decay = -1}); }, {"SGD", "weight_decay", "-1"});
  expect_error_with([&] { SGD({p}, {.lr = 0.1, .nesterov = true}); },
                    {"SGD", "nesterov", "momentum 0"});
  expect_error_with([&] { SGD({p}, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
                    {"SGD", "nesterov", "dampening 0.1"});
  expect_error_with([&] { AdamW({p}, {.betas = {0.9, 1.0}}); }, {"AdamW", "beta2", "1"});
  expect_error_with([&] { AdamW({p}, {.betas = {-0.1, 0.999}}); }, {"AdamW", "beta1", "-0.1"});
  expect_error_with([&] { AdamW({p}, {.eps = -1e-8}); }, {"AdamW", "eps"});
  expect_error_with([&] { AdamW({p}, {.lr = std::nan("")}); }, {"AdamW", "learning rate"});
  expect_error_with([&] { AdamW(std::vector<Tensor>{}); }, {"AdamW", "empty parameter list"});
  expect_error_with([&] { AdamW({p, p}); }, {"AdamW", "more than once"});
  expect_error_with([&] { AdamW({p * 2.0}); }, {"AdamW", "not a leaf"});
  expect_error_with([&] { AdamW({zeros({2}, DType::i64)}); }, {"AdamW", "i64", "floating"});
  expect_error_with([&] { AdamW({ParamGroup{{p}, {"a", "b"}}}); }, {"AdamW", "2 names", "1 params"});

  // A gradient that does not fit its param: the step names the param.
  Tensor w = zeros({2, 3}).requires_grad_();
  AdamW opt({ParamGroup{{w}, {"fc.weight"}}});
  w.ensure_autograd_meta().grad = zeros({3, 2});  // set_grad would refuse it
  expect_error_with([&] { opt.step(); }, {"AdamW.step", "fc.weight", "[3, 2]", "[2, 3]"});
  CHECK(opt.step_count(0) == 0);
}

}  // namespace
}  // namespace tessera::optim
