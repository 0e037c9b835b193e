// Optimizer state dicts: the documented keys, snapshot semantics, bitwise-exact resume
// (AdamW with a bf16 master, SGD with momentum), and load errors that name the key and both
// shapes while leaving the optimizer untouched.
#include <doctest/doctest.h>

#include "autograd/autograd.h"
#include "optim/adamw.h"
#include "optim/sgd.h"
#include "tests/optim/optim_test_util.h"

namespace tessera::optim {
namespace {

using testing::bitwise_equal;
using testing::expect_error_with;
using StateDict = Optimizer::StateDict;

// Params: 0 f32 [3, 4], 1 f32 [4] (gets gradients from step 4 on), 2 bf16 [2, 3].
std::vector<Tensor> make_params() {
  Generator gen(7);
  return {randn({3, 4}, DType::f32, kCPU, &gen).requires_grad_(),
          randn({4}, DType::f32, kCPU, &gen).requires_grad_(),
          cast(randn({2, 3}, DType::f32, kCPU, &gen), DType::bf16).requires_grad_()};
}

std::vector<Tensor> clones(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// The same gradients for the same step in every run.
void set_grads(const std::vector<Tensor>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (i == 1 && step < 4) {
      params[i].set_grad(Tensor());
      continue;
    }
    Generator gen(1000 * step + i);
    params[i].set_grad(cast(randn(params[i].shape(), DType::f32, kCPU, &gen), params[i].dtype()));
  }
}

template <typename Opt, typename Options>
void check_exact_resume(Options options, Options resumed_options) {
  // Uninterrupted: 6 steps, with a snapshot of params and optimizer after 3.
  std::vector<Tensor> run = make_params();
  Opt a(run, options);
  StateDict snapshot;
  std::vector<Tensor> snapshot_params;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {
      snapshot = a.state_dict();
      snapshot_params = clones(run);
    }
    set_grads(run, step);
    a.step();
  }
  // Resumed: fresh params and optimizer (built with other hyperparameters), then steps 3..5.
  std::vector<Tensor> resumed = clones(snapshot_params);
  Opt b(resumed, resumed_options);
  b.load_state_dict(snapshot);
  CHECK(b.param_groups()[0].lr == a.param_groups()[0].lr);
  for (int step = 3; step < 6; ++step) {
    set_grads(resumed, step);
    b.step();
  }
  for (size_t i = 0; i < run.size(); ++i) {
    CHECK_MESSAGE(bitwise_equal(run[i], resumed[i]), "param ", i, " differs after resuming");
  }
  const StateDict sa = a.state_dict(), sb = b.state_dict();
  REQUIRE(sa.size() == sb.size());
  // Plain variables, not a structured binding: the _MESSAGE macros capture them (clang < 16
  // rejects that).
  for (const auto& entry : sa) {
    const std::string& key = entry.first;
    const Tensor& t = entry.second;
    REQUIRE_MESSAGE(sb.count(key) == 1, key);
    CHECK_MESSAGE(bitwise_equal(t, sb.at(key)), key, " differs after resuming");
  }
}

TEST_CASE("AdamW state_dict holds the documented keys, as copies") {
  std::vector<Tensor> params = make_params();
  AdamW opt(params, {.lr = 0.01});
  for (int step = 0; step < 3; ++step) {
    set_grads(params, step);
    opt.step();
  }
  const StateDict d = opt.state_dict();
  CHECK(d.at("state.0.step").dtype() == DType::i64);
  CHECK(d.at("state.0.step").dim() == 0);
  CHECK(d.at("state.0.step").item<int64_t>() == 3);
  CHECK(d.at("state.0.exp_avg").shape() == Shape{3, 4});
  CHECK(d.at("state.0.exp_avg_sq").dtype() == DType::f32);
  CHECK(d.count("state.1.step") == 0);  // param 1 has not stepped yet
  CHECK(d.at("state.2.master").dtype() == DType::f32);
  CHECK(d.at("state.2.exp_avg").shape() == Shape{2, 3});
  CHECK(d.at("group.0.lr").dtype() == DType::f64);
  CHECK(d.at("group.0.lr").item<double>() == 0.01);
  CHECK(d.at("group.0.weight_decay").item<double>() == 1e-2);
  CHECK(d.at("group.0.params").to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2});
  CHECK(d.at("hparam.beta1").item<double>() == 0.9);
  CHECK(d.at("hparam.beta2").item<double>() == 0.999);
  CHECK(d.at("hparam.eps").item<double>() == 1e-8);
  CHECK(d.size() == 3 + 4 + 3 + 3);  // group, state.0, state.2 (+ master), hparams

  // A copy: training on does not change a dict already taken.
  const Tensor before = d.at("state.0.exp_avg").clone();
  set_grads(params, 3);
  opt.step();
  CHECK(bitwise_equal(d.at("state.0.exp_avg"), before));
  CHECK_FALSE(bitwise_equal(opt.state(0).at("exp_avg"), before));
}

TEST_CASE("AdamW resumed from a state_dict continues bitwise like the uninterrupted run") {
  check_exact_resume<AdamW>(AdamWOptions{.lr = 0.01, .weight_decay = 0.1},
                            AdamWOptions{.lr = 0.5, .betas = {0.5, 0.5}});
}

TEST_CASE("SGD with momentum resumed from a state_dict continues bitwise") {
  check_exact_resume<SGD>(SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01,
                                     .nesterov = true},
                          SGDOptions{.lr = 0.3, .momentum = 0.5});
}

TEST_CASE("load_state_dict errors name the key and both shapes, and change nothing") {
  std::vector<Tensor> params = make_params();
  AdamW opt(params, {.lr = 0.01});
  set_grads(params, 0);
  opt.step();
  const StateDict good = opt.state_dict();
  auto with = [&](const std::function<void(StateDict&)>& edit) {
    StateDict d = good;
    edit(d);
    return d;
  };
  auto load = [&](const StateDict& d) { return [&opt, d] { opt.load_state_dict(d); }; };

  expect_error_with(load(with([](StateDict& d) { d.erase("state.0.exp_avg_sq"); })),
                    {"AdamW.load_state_dict", "missing key", "'state.0.exp_avg_sq'"});
  expect_error_with(load(with([](StateDict& d) { d.erase("hparam.eps"); })),
                    {"AdamW.load_state_dict", "missing key", "'hparam.eps'"});
  expect_error_with(load(with([](StateDict& d) { d.erase("group.0.lr"); })),
                    {"missing key", "'group.0.lr'"});
  expect_error_with(load(with([](StateDict& d) { d.erase("state.2.master"); })),
                    {"missing key", "'state.2.master'"});
  expect_error_with(load(with([](StateDict& d) { d["state.0.velocity"] = zeros({3, 4}); })),
                    {"AdamW.load_state_dict", "unexpected key", "'state.0.velocity'"});
  expect_error_with(load(with([](StateDict& d) { d["state.7.exp_avg"] = zeros({3, 4}); })),
                    {"unexpected key", "'state.7.exp_avg'"});
  expect_error_with(load(with([](StateDict& d) { d["group.1.lr"] = zeros({}, DType::f64); })),
                    {"unexpected key", "'group.1.lr'"});
  expect_error_with(load(with([](StateDict& d) { d["state.0.exp_avg"] = zeros({4, 3}); })),
                    {"AdamW.load_state_dict", "'state.0.exp_avg'", "[4, 3]", "[3, 4]"});
  expect_error_with(
      load(with([](StateDict& d) { d["state.2.master"] = zeros({2, 3}, DType::bf16); })),
      {"'state.2.master'", "bf16", "f32", "[2, 3]"});
  expect_error_with(load(with([](StateDict& d) { d["state.0.step"] = zeros({}, DType::f64); })),
                    {"'state.0.step'", "f64", "i64"});
  expect_error_with(
      load(with([](StateDict& d) { d["state.0.step"] = Tensor::from_vector<int64_t>({0}, {}); })),
      {"'state.0.step'", "step >= 1"});
  expect_error_with(
      load(with([](StateDict& d) { d["group.0.lr"] = Tensor::from_vector<double>({-1}, {}); })),
      {"AdamW", "learning rate", "-1"});

  // A bad key after valid hyperparameters: the hyperparameters taken from the dict are put
  // back, and the state is untouched.
  const StateDict bad = with([](StateDict& d) {
    d["hparam.beta1"] = Tensor::from_vector<double>({0.5}, {});
    d["state.0.exp_avg"] = zeros({4, 3});
  });
  expect_error_with(load(bad), {"state.0.exp_avg"});
  CHECK(opt.options().betas.first == 0.9);
  expect_error_with(load(with([](StateDict& d) {
                      d["hparam.beta1"] = Tensor::from_vector<double>({1.5}, {});
                    })),
                    {"AdamW", "beta1", "1.5"});
  CHECK(opt.options().betas.first == 0.9);
  const StateDict after = opt.state_dict();
  for (const auto& entry : good) {
    CHECK_MESSAGE(bitwise_equal(entry.second, after.at(entry.first)), entry.first);
  }

  // The same params grouped differently: the group layout is checked.
  std::vector<ParamGroup> regrouped = {ParamGroup{{params[0]}}, ParamGroup{{params[1], params[2]}}};
  AdamW other(regrouped);
  std::vector<ParamGroup> original = {ParamGroup{{params[0], params[1]}}, ParamGroup{{params[2]}}};
  AdamW two_groups(original);
  expect_error_with([&] { other.load_state_dict(two_groups.state_dict()); },
                    {"'group.0.params'", "[2]", "[1]"});

  // Another optimizer's dict.
  SGD sgd(params, {.lr = 0.1});
  expect_error_with([&] { opt.load_state_dict(sgd.state_dict()); },
                    {"AdamW.load_state_dict", "missing key", "'hparam.beta1'"});
}

TEST_CASE("SGD takes its hyperparameters from a loaded dict, as PyTorch") {
  std::vector<Tensor> params = make_params();
  SGD with_momentum(params, {.lr = 0.1, .momentum = 0.9, .dampening = 0.25});
  set_grads(params, 0);
  with_momentum.step();
  SGD plain(clones(params), {.lr = 0.2});
  plain.load_state_dict(with_momentum.state_dict());
  CHECK(plain.options().momentum == 0.9);
  CHECK(plain.options().dampening == 0.25);
  CHECK(plain.param_groups()[0].lr == 0.1);
  CHECK(plain.state(0).at("momentum_buffer").shape() == Shape{3, 4});
}

}  // namespace
}  // namespace tessera::optim
