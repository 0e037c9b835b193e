// DynamicLossScaler: skipped steps on inf/NaN gradients (params untouched, scale backed off;
// on every rank when one rank's gradients overflowed, with the global check),
// exact unscaling (powers of two), growth after growth_interval good steps, the disabled
// identity, f16 overflow recovery, and state dict round trips.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "autograd/autograd.h"
#include "optim/loss_scaler.h"
#include "optim/sgd.h"
#include "parallel/comm/threads.h"
#include "tests/optim/optim_test_util.h"
#include "tests/testing.h"

namespace tessera::optim {
namespace {

using testing::bitwise_equal;
using testing::expect_error_with;
using testing::f32;

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST_CASE("a step with inf or NaN gradients is skipped and the scale backs off") {
  Tensor p = f32({1.0f, 2.0f}).requires_grad_();
  SGD opt({p}, {.lr = 0.1});
  DynamicLossScaler scaler({.init_scale = 1024, .growth_interval = 3});
  const Tensor before = p.detach().clone();
  int iteration = 0;
  for (float bad : {kInf, std::nanf(""), -kInf}) {
    CAPTURE(bad);
    p.set_grad(f32({512.0f, bad}));
    CHECK_FALSE(scaler.step(opt));
    CHECK(bitwise_equal(p, before));
    CHECK(opt.step_count(0) == 0);
    CHECK(scaler.skipped_steps() == ++iteration);
    scaler.update();
    CHECK(scaler.scale_value() == 1024.0 / (1 << iteration));
    CHECK(scaler.growth_tracker() == 0);
  }
}

TEST_CASE("with a global check, every rank skips the step whose gradients overflowed on one rank") {
  // Two ranks (threads) with different gradients, as ZeRO shards or tensor-parallel blocks
  // have: rank 1's overflow makes rank 0 skip too, and both back off to the same scale.
  struct Seen {
    bool first_stepped = true, second_stepped = false, untouched = false;
    int64_t skipped = -1;
    double scale_after_first = 0, scale_after_second = 0;
  };
  std::vector<Seen> seen(2);
  parallel::run_threads(2, [&](parallel::CommPtr world) {
    Seen& s = seen[static_cast<size_t>(world->rank())];
    Tensor p = f32({1.0f, 2.0f}).requires_grad_();
    SGD opt({p}, {.lr = 0.1});
    DynamicLossScaler scaler({.init_scale = 1024});
    scaler.reduce_found_inf_with([&](bool here) {
      Tensor t = Tensor::from_vector<double>({here ? 1.0 : 0.0}, {1});
      world->all_reduce(t, parallel::ReduceOp::max);
      return t.to_vector<double>()[0] > 0;
    });
    const Tensor before = p.detach().clone();
    p.set_grad(f32({512.0f, world->rank() == 1 ? kInf : 256.0f}));
    s.first_stepped = scaler.step(opt);
    s.untouched = bitwise_equal(p, before);
    s.skipped = scaler.skipped_steps();
    scaler.update();
    s.scale_after_first = scaler.scale_value();
    p.set_grad(f32({512.0f, 256.0f}));  // finite everywhere: every rank steps
    s.second_stepped = scaler.step(opt);
    scaler.update();
    s.scale_after_second = scaler.scale_value();
  });
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    const Seen& s = seen[static_cast<size_t>(rank)];
    CHECK_FALSE(s.first_stepped);
    CHECK(s.untouched);
    CHECK(s.skipped == 1);
    CHECK(s.scale_after_first == 512.0);
    CHECK(s.second_stepped);
    CHECK(s.scale_after_second == 512.0);
  }
}

TEST_CASE("finite gradients are unscaled exactly and stepped; the scale grows every N steps") {
  Tensor p = f32({1.0f, 2.0f}).requires_grad_();
  Tensor reference = f32({1.0f, 2.0f}).requires_grad_();
  SGD opt({p}, {.lr = 0.1, .momentum = 0.9});
  SGD ref_opt({reference}, {.lr = 0.1, .momentum = 0.9});
  DynamicLossScaler scaler({.init_scale = 1024, .growth_interval = 3});
  const std::vector<float> g = {0.5f, -0.25f};
  auto iterate = [&](float bad = 0.0f) {
    const float s = static_cast<float>(scaler.scale_value());
    p.set_grad(f32({g[0] * s, bad == 0.0f ? g[1] * s : bad}));
    const bool stepped = scaler.step(opt);
    if (stepped) {
      // Dividing by a power of two is exact: the unscaled gradient is g itself.
      CHECK(p.grad().to_vector<float>() == g);
      reference.set_grad(f32(g));
      ref_opt.step();
    }
    scaler.update();
    return stepped;
  };
  CHECK(iterate());
  CHECK(iterate());
  CHECK(scaler.scale_value() == 1024);
  CHECK(scaler.growth_tracker() == 2);
  CHECK(iterate());
  CHECK(scaler.scale_value() == 2048);  // 3 good steps in a row
  CHECK(scaler.growth_tracker() == 0);
  CHECK(iterate());
  CHECK(iterate());
  CHECK_FALSE(iterate(kInf));  // an overflow resets the count: no growth at the 3rd
  CHECK(scaler.scale_value() == 1024);
  CHECK(iterate());
  CHECK(iterate());
  CHECK(scaler.scale_value() == 1024);
  CHECK(iterate());
  CHECK(scaler.scale_value() == 2048);
  CHECK(bitwise_equal(p, reference));  // skipped steps left no trace
  CHECK(opt.step_count(0) == 8);  // 9 iterations, 1 skipped
  CHECK(scaler.skipped_steps() == 1);
}

TEST_CASE("unscale_and_check: one scale_ and one check for the whole set, the per-parameter bits") {
  // f32, bf16 and f16 gradients (a transposed one too) at scale 1024, against the
  // per-parameter definition: copy_(g, (16-bit ? cast(g, f32) : g) * (1 / scale)).
  std::vector<Tensor> params, want;
  for (const DType dt : {DType::f32, DType::bf16, DType::f16, DType::f32}) {
    Tensor p = randn({37, 5}).cast(dt).requires_grad_();
    Tensor g = (randn({37, 5}) * 1024.0).cast(dt);
    if (params.size() == 3) g = transpose(randn({5, 37}) * 1024.0, 0, 1);
    p.set_grad(g.clone());
    const bool narrow = dt != DType::f32;
    const Tensor w = g.clone();
    copy_(w, (narrow ? cast(w, DType::f32) : w) * (1.0 / 1024.0));
    params.push_back(p);
    want.push_back(w);
  }
  DynamicLossScaler scaler({.init_scale = 1024});
  {
    const tessera::testing::KernelCalls calls;
    CHECK(scaler.unscale_and_check(params));
    // scale_, sum_squares and the copy_ that reads its result (before: a cast for 16-bit,
    // mul, copy_, abs, max and a read per parameter).
    CHECK(calls.count() == 3);
  }
  for (size_t i = 0; i < params.size(); ++i) CHECK(bitwise_equal(params[i].grad(), want[i]));
  scaler.update();

  // The check: a NaN in a bf16 gradient, an inf in an f64 one (checked by max |g|, whose
  // squares could overflow), and finite f32 values near the top of the range (their squares
  // do not overflow f64) are told apart.
  auto check = [&](const Tensor& g) {
    Tensor p = zeros(g.shape(), g.dtype()).requires_grad_();
    p.set_grad(g);
    DynamicLossScaler s({.init_scale = 1.0});
    return s.unscale_and_check(std::vector<Tensor>{params[0], p});
  };
  CHECK_FALSE(check(f32({1.0f, std::nanf("")}).cast(DType::bf16)));
  CHECK_FALSE(check(Tensor::from_vector<double>({1.0, HUGE_VAL}, {2})));
  CHECK(check(Tensor::from_vector<double>({1e300, -1e300}, {2})));  // squares overflow; finite
  CHECK(check(f32({3.0e38f, -3.0e38f})));
  // A 16-bit gradient that the unscale itself overflows (scale below 1) is caught: the
  // check reads the stored values.
  {
    Tensor p = zeros({2}, DType::f16).requires_grad_();
    p.set_grad(f32({60000.0f, 1.0f}).cast(DType::f16));
    DynamicLossScaler s({.init_scale = 0.25});
    CHECK_FALSE(s.unscale_and_check(std::vector<Tensor>{p}));
  }
}

TEST_CASE("scale() multiplies the loss; unscale_and_check() recovers the true gradient") {
  Tensor w = f32({1.0f, 2.0f, -3.0f}).requires_grad_();
  DynamicLossScaler scaler;  // 65536
  const Tensor loss = sum(w * w);
  const Tensor scaled = scaler.scale(loss);
  CHECK(scaled.item<float>() == 14.0f * 65536.0f);
  scaled.backward();
  CHECK(w.grad().to_vector<float>() == std::vector<float>{2 * 65536.0f, 4 * 65536.0f, -6 * 65536.0f});
  CHECK(scaler.unscale_and_check({w}));
  CHECK(w.grad().to_vector<float>() == std::vector<float>{2.0f, 4.0f, -6.0f});
  expect_error_with([&] { scaler.unscale_and_check({w}); },
                    {"DynamicLossScaler", "already unscaled", "update()"});
  SGD opt({w}, {.lr = 0.5});
  CHECK(scaler.step(opt));  // uses the check above; does not unscale again
  CHECK(w.to_vector<float>() == std::vector<float>{0.0f, 0.0f, 0.0f});
  scaler.update();
  expect_error_with([&] { scaler.update(); }, {"DynamicLossScaler.update", "step()"});
}

// f16 gradients of 2 * scale overflow at 65536 and 32768 (65536 rounds past the f16
// maximum 65504), and fit at 16384: two skipped steps, then training proceeds.
TEST_CASE("f16 training recovers from overflow by backing off") {
  Tensor w = Tensor::from_vector<float>({1.0f}, {1});
  w = cast(w, DType::f16).requires_grad_();
  SGD opt({w}, {.lr = 0.01});
  DynamicLossScaler scaler;
  std::vector<bool> stepped;
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    scaler.scale(sum(cast(w, DType::f32) * 2.0)).backward();
    stepped.push_back(scaler.step(opt));
    scaler.update();
  }
  CHECK(stepped == std::vector<bool>{false, false, true});
  CHECK(scaler.scale_value() == 16384);
  CHECK(scaler.skipped_steps() == 2);
  CHECK(opt.state(0).at("master").item<float>() == doctest::Approx(1.0 - 0.02).epsilon(1e-7));
}

TEST_CASE("a disabled scaler is the identity, so one loop serves f32 and bf16") {
  Tensor w = f32({1.0f, 2.0f}).requires_grad_();
  SGD opt({w}, {.lr = 0.5});
  DynamicLossScaler scaler({.enabled = false});
  const Tensor loss = sum(w * w);
  CHECK(scaler.scale(loss).is_same(loss));
  CHECK(scaler.scale_value() == 1.0);
  loss.backward();
  CHECK(scaler.unscale_and_check({w}));
  CHECK(w.grad().to_vector<float>() == std::vector<float>{2.0f, 4.0f});
  CHECK(scaler.step(opt));
  scaler.update();
  scaler.update();  // no checks to enforce when disabled
  CHECK(w.to_vector<float>() == std::vector<float>{0.0f, 0.0f});
  CHECK(scaler.skipped_steps() == 0);
}

TEST_CASE("loss scaler state dict round trip and errors") {
  DynamicLossScaler a({.init_scale = 1024, .growth_interval = 3});
  Tensor p = f32({1.0f}).requires_grad_();
  SGD opt({p}, {.lr = 0.1});
  for (float g : {kInf, 1.0f, 1.0f}) {  // skip (-> 512), then two good steps
    p.set_grad(f32({g}));
    a.step(opt);
    a.update();
  }
  const std::map<std::string, Tensor> d = a.state_dict();
  CHECK(d.at("scale").dtype() == DType::f64);
  CHECK(d.at("scale").item<double>() == 512);
  CHECK(d.at("growth_tracker").dtype() == DType::i64);
  CHECK(d.at("growth_tracker").item<int64_t>() == 2);
  CHECK(d.at("skipped_steps").item<int64_t>() == 1);
  CHECK(d.at("growth_interval").item<int64_t>() == 3);

  DynamicLossScaler b;  // default options, replaced by the dict's
  b.load_state_dict(d);
  CHECK(b.scale_value() == 512);
  CHECK(b.growth_tracker() == 2);
  CHECK(b.skipped_steps() == 1);
  // One more good step completes the interval in both.
  for (DynamicLossScaler* s : {&a, &b}) {
    p.set_grad(f32({1.0f}));
    s->step(opt);
    s->update();
    CHECK(s->scale_value() == 1024);
  }

  auto edited = [&](const std::function<void(std::map<std::string, Tensor>&)>& edit) {
    std::map<std::string, Tensor> e = d;
    edit(e);
    return e;
  };
  DynamicLossScaler c;
  expect_error_with([&] { c.load_state_dict(edited([](auto& e) { e.erase("growth_tracker"); })); },
                    {"DynamicLossScaler.load_state_dict", "missing key", "'growth_tracker'"});
  expect_error_with([&] { c.load_state_dict(edited([](auto& e) { e["extra"] = zeros({}); })); },
                    {"unexpected key", "'extra'"});
  expect_error_with(
      [&] { c.load_state_dict(edited([](auto& e) { e["scale"] = zeros({1}, DType::f64); })); },
      {"'scale'", "[1]", "[]"});
  expect_error_with([&] {
    c.load_state_dict(edited([](auto& e) { e["growth_tracker"] = Tensor::from_vector<int64_t>({5}, {}); }));
  }, {"growth_tracker 5", "growth_interval 3"});
  CHECK(c.scale_value() == 65536);  // untouched by the failed loads
}

}  // namespace
}  // namespace tessera::optim
