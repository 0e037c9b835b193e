// nn::Module and the layers: naming, registration errors, train/eval, state_dict round trips
// and load errors, dtype conversion, initialiser statistics, and each layer's forward against
// the same computation written with ops (exact: identical op sequences) or closed forms.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "tests/testing.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "tensor/autocast.h"

namespace tessera::nn {
namespace {

using testing::error_of;
using testing::contains;

struct Net : Module {
  Net() : Module("Net") {
    fc1 = register_module("fc1", std::make_shared<Linear>(4, 3));
    norm = register_module("norm", std::make_shared<LayerNorm>(Shape{3}));
    fc2 = register_module("fc2", std::make_shared<Linear>(3, 2, /*bias=*/false));
    steps = register_buffer("steps", zeros({1}, DType::i64));
  }
  Tensor forward(const Tensor& x) override { return fc2->forward(relu(norm->forward(fc1->forward(x)))); }
  std::shared_ptr<Linear> fc1, fc2;
  std::shared_ptr<LayerNorm> norm;
  Tensor steps;
};

TEST_CASE("named_parameters and buffers: dotted names in registration order") {
  Net net;
  std::vector<std::string> names;
  for (auto& [n, t] : net.named_parameters()) {
    names.push_back(n);
    CHECK(t.requires_grad());
    CHECK(t.is_leaf());
  }
  CHECK(names == std::vector<std::string>{"fc1.weight", "fc1.bias", "norm.weight", "norm.bias",
                                          "fc2.weight"});
  CHECK(net.named_buffers().size() == 1);
  CHECK(net.named_buffers()[0].first == "steps");
  CHECK(net.num_parameters() == 12 + 3 + 3 + 3 + 6);
  CHECK(net.named_parameters(/*recurse=*/false).empty());
  // The registered handle is the layer's member: an optimizer updating it updates the layer.
  CHECK(net.parameters()[0].is_same(net.fc1->weight));
  CHECK(contains(net.str(), "fc1: Linear (weight [3, 4], bias [3])"));
}

TEST_CASE("registration errors name the module and the name") {
  struct Bad : Module {
    Bad() : Module("Bad") {}
    void twice() {
      register_parameter("w", zeros({2}));
      register_buffer("w", zeros({2}));
    }
    void dotted() { register_parameter("a.b", zeros({2})); }
  };
  Bad b;
  CHECK(contains(error_of([&] { b.twice(); }), "Bad: the name 'w' is already registered"));
  CHECK(contains(error_of([&] { b.dotted(); }), "contain no '.', got 'a.b'"));
  CHECK(contains(error_of([&] { Linear(0, 3); }), "Linear: in_features must be positive, got 0"));
  CHECK(contains(error_of([&] { Linear(4, 3).forward(zeros({2, 5})); }),
                 "Linear: expected input [..., 4], got [2, 5]"));
  CHECK(contains(error_of([&] { Dropout(1.0); }), "Dropout: p must be in [0, 1), got 1"));
  CHECK(contains(error_of([&] { ReLU().Module::forward(zeros({1})); }), "ReLU"));
}

TEST_CASE("train/eval propagates to submodules; Dropout is the identity in eval") {
  manual_seed(3);
  Sequential seq({std::make_shared<Dropout>(0.5), std::make_shared<ReLU>()});
  Tensor x = ones({1000});
  std::vector<float> train_out = seq.forward(x).to_vector<float>();
  int zeros_seen = 0;
  for (float v : train_out) {
    CHECK((v == 0.0f || v == 2.0f));
    zeros_seen += v == 0.0f;
  }
  CHECK(zeros_seen > 400);
  CHECK(zeros_seen < 600);
  seq.eval();
  CHECK_FALSE(seq[0]->is_training());
  CHECK(seq.forward(x).to_vector<float>() == std::vector<float>(1000, 1.0f));
  seq.train();
  CHECK(seq[0]->is_training());
}

TEST_CASE("state_dict round trip into a differently initialised model is exact") {
  manual_seed(1);
  Net a;
  manual_seed(2);
  Net b;
  Tensor x = randn({5, 4});
  CHECK(a.forward(x).to_vector<float>() != b.forward(x).to_vector<float>());
  StateDict sd = a.state_dict();
  CHECK(sd.size() == 6);
  CHECK_FALSE(sd.at("fc1.weight").requires_grad());
  b.load_state_dict(sd);
  CHECK(a.forward(x).to_vector<float>() == b.forward(x).to_vector<float>());
  // Loading copies values: b's tensors stay its own.
  CHECK_FALSE(b.fc1->weight.storage().get() == a.fc1->weight.storage().get());
}

TEST_CASE("load_state_dict: missing, unexpected and mis-shaped keys are all reported") {
  Net net;
  StateDict sd = net.state_dict();
  StateDict missing = sd;
  missing.erase("fc2.weight");
  missing.erase("steps");
  CHECK(contains(error_of([&] { net.load_state_dict(missing); }),
                 "Net.load_state_dict: missing keys: fc2.weight, steps"));
  StateDict extra = sd;
  extra["fc3.weight"] = zeros({1});
  CHECK(contains(error_of([&] { net.load_state_dict(extra); }), "unexpected keys: fc3.weight"));
  StateDict shaped = sd;
  shaped["fc1.weight"] = zeros({4, 3});
  const std::string msg = error_of([&] { net.load_state_dict(shaped); });
  CHECK(contains(msg, "shape mismatch: fc1.weight (module [3, 4], given [4, 3])"));
  // Nothing was modified by the failed load.
  CHECK(net.fc1->weight.to_vector<float>() == sd.at("fc1.weight").to_vector<float>());
  // Non-strict tolerates missing and extra keys but never a wrong shape.
  const std::vector<float> w2 = net.fc2->weight.to_vector<float>();
  extra.erase("fc2.weight");
  net.load_state_dict(extra, /*strict=*/false);
  CHECK(net.fc2->weight.to_vector<float>() == w2);
  CHECK_FALSE(error_of([&] { net.load_state_dict(shaped, false); }).empty());
}

TEST_CASE("to(dtype) converts every float parameter in place, seen through every handle") {
  manual_seed(4);
  Net net;
  const std::vector<float> w = net.fc1->weight.to_vector<float>();
  Tensor handle = net.parameters()[0];
  net.to(DType::bf16);
  CHECK(net.fc1->weight.dtype() == DType::bf16);
  CHECK(handle.dtype() == DType::bf16);
  CHECK(handle.requires_grad());
  CHECK(net.steps.dtype() == DType::i64);  // integer buffers keep their dtype
  const std::vector<float> wb = net.fc1->weight.to_vector<float>();
  for (size_t i = 0; i < w.size(); ++i) CHECK(wb[i] == static_cast<float>(BFloat16(w[i])));
  Tensor y = net.forward(randn({2, 4}).cast(DType::bf16));
  CHECK(y.dtype() == DType::bf16);
  y.sum().backward();
  CHECK(net.fc1->weight.grad().dtype() == DType::bf16);
  CHECK(contains(error_of([&] { net.to(DType::i32); }), "only floating-point dtypes"));
}

TEST_CASE("initialisers: bounds and moments match their definitions") {
  manual_seed(5);
  Tensor w = Tensor::empty({256, 400});
  init::kaiming_uniform_(w, std::sqrt(5.0));  // bound = sqrt(6 / (1 + 5)) / sqrt(400) = 1/20
  std::vector<float> v = w.to_vector<float>();
  double lo = 1, hi = -1, mean = 0, sq = 0;
  for (float x : v) {
    lo = std::min<double>(lo, x);
    hi = std::max<double>(hi, x);
    mean += x;
    sq += double(x) * x;
  }
  mean /= v.size();
  CHECK(lo >= -0.05);
  CHECK(hi < 0.05);
  CHECK(lo < -0.0499);
  CHECK(hi > 0.0499);
  // Var of U(-b, b) is b^2/3; 102400 samples put the sample variance within ~1% (5 sigma).
  CHECK(sq / v.size() == doctest::Approx(0.05 * 0.05 / 3).epsilon(0.01));
  CHECK(std::abs(mean) < 5 * 0.05 / std::sqrt(3.0 * v.size()));

  init::xavier_normal_(w);  // std = sqrt(2 / 656)
  v = w.to_vector<float>();
  sq = 0;
  for (float x : v) sq += double(x) * x;
  CHECK(std::sqrt(sq / v.size()) == doctest::Approx(std::sqrt(2.0 / 656)).epsilon(0.01));
  init::kaiming_normal_(w, 0.0, init::FanMode::fan_out, init::Nonlinearity::relu);
  v = w.to_vector<float>();
  sq = 0;
  for (float x : v) sq += double(x) * x;
  CHECK(std::sqrt(sq / v.size()) == doctest::Approx(std::sqrt(2.0 / 256)).epsilon(0.01));
  init::xavier_uniform_(w, 2.0);
  v = w.to_vector<float>();
  for (float x : v) CHECK(std::abs(x) <= 2.0 * std::sqrt(6.0 / 656));
  init::zeros_(w);
  CHECK(w.sum().item<float>() == 0.0f);
  init::constant_(w, 0.5);
  CHECK(w.sum().item<float>() == 0.5f * 256 * 400);
  CHECK(init::fans(Tensor::empty({8, 3, 5, 5})) == std::pair<int64_t, int64_t>{75, 200});
  CHECK(init::gain(init::Nonlinearity::tanh) == doctest::Approx(5.0 / 3.0));
  // The seeded RNG makes initialisation reproducible.
  manual_seed(9);
  Linear l1(16, 8);
  manual_seed(9);
  Linear l2(16, 8);
  CHECK(l1.weight.to_vector<float>() == l2.weight.to_vector<float>());
  CHECK(l1.bias.to_vector<float>() == l2.bias.to_vector<float>());
}

TEST_CASE("layers compute what their definitions say") {
  manual_seed(6);
  Tensor x = randn({3, 4});
  Linear lin(4, 5);
  CHECK(lin.forward(x).to_vector<float>() ==
        (matmul(x, lin.weight.t()) + lin.bias).to_vector<float>());
  Embedding emb(10, 3);
  Tensor idx = Tensor::from_vector<int64_t>({7, 0, 7}, {3});
  CHECK(emb.forward(idx).to_vector<float>() == index_select(emb.weight, 0, idx).to_vector<float>());
  LayerNorm ln(Shape{4});
  std::vector<float> y = ln.forward(x).to_vector<float>();
  std::vector<float> xv = x.to_vector<float>();
  for (int r = 0; r < 3; ++r) {
    double m = 0, v = 0;
    for (int c = 0; c < 4; ++c) m += xv[r * 4 + c] / 4.0;
    for (int c = 0; c < 4; ++c) v += (xv[r * 4 + c] - m) * (xv[r * 4 + c] - m) / 4.0;
    for (int c = 0; c < 4; ++c) {
      CHECK(y[r * 4 + c] == doctest::Approx((xv[r * 4 + c] - m) / std::sqrt(v + 1e-5)).epsilon(1e-5));
    }
  }
  Tensor img = randn({2, 3, 8, 8});
  Conv2d conv(3, 4, {3, 3}, {1, 1}, {1, 1});
  CHECK(conv.forward(img).shape() == Shape{2, 4, 8, 8});
  CHECK(conv.forward(img).to_vector<float>() ==
        conv2d(img, conv.weight, conv.bias, {1, 1}, {1, 1}).to_vector<float>());
  MaxPool2d pool({2, 2});
  CHECK(pool.forward(img).shape() == Shape{2, 3, 4, 4});
  CHECK(Flatten().forward(img).shape() == Shape{2, 192});
  CHECK(GELU().forward(x).to_vector<float>() == gelu(x).to_vector<float>());

  MLP mlp({4, 8, 8, 2}, Activation::relu, 0.1);
  std::vector<std::string> names;
  for (auto& [n, _] : mlp.named_parameters()) names.push_back(n);
  // Linear, ReLU, Dropout, Linear, ReLU, Dropout, Linear.
  CHECK(names == std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.3.weight",
                                          "layers.3.bias", "layers.6.weight", "layers.6.bias"});
  CHECK(mlp.layers->size() == 7);
  mlp.eval();
  CHECK(mlp.forward(x).shape() == Shape{3, 2});
}

TEST_CASE("gradients of a module flow to every parameter") {
  manual_seed(7);
  Net net;
  Tensor loss = cross_entropy(net.forward(randn({6, 4})),
                              Tensor::from_vector<int64_t>({0, 1, 1, 0, 1, 0}, {6}));
  loss.backward();
  // Plain variables, not a structured binding: CAPTURE captures them (clang < 16 rejects that).
  for (auto& entry : net.named_parameters()) {
    const std::string& n = entry.first;
    Tensor& p = entry.second;
    CAPTURE(n);
    REQUIRE(p.grad().defined());
    CHECK(p.grad().shape() == p.shape());
  }
  net.zero_grad();
  for (const Tensor& p : net.parameters()) CHECK_FALSE(p.grad().defined());
}

TEST_CASE("autocast: GEMMs in low precision, loss in f32, f32 gradients for f32 weights") {
  manual_seed(8);
  Linear lin(16, 4);
  Tensor x = randn({8, 16});
  Tensor target = Tensor::from_vector<int64_t>({0, 1, 2, 3, 0, 1, 2, 3}, {8});
  Tensor logits, loss;
  {
    AutocastGuard amp(DType::bf16);
    CHECK(autocast_enabled());
    Tensor y = matmul(x, lin.weight.t());
    CHECK(y.dtype() == DType::bf16);
    // The matmul equals the one on bf16-rounded operands, rounded once to bf16.
    CHECK(y.to_vector<float>() ==
          matmul(x.cast(DType::bf16), lin.weight.t().cast(DType::bf16)).to_vector<float>());
    // One op (tessera::linear) under autocast: every input lowered, bf16 out, as torch's
    // linear/addmm; it equals the product of the bf16-rounded operands plus the rounded bias,
    // computed in f32 and rounded once.
    logits = lin.forward(x);
    CHECK(logits.dtype() == DType::bf16);
    {
      AutocastGuard off(DType::f32);
      const Tensor wide = matmul(x.cast(DType::bf16).cast(DType::f32),
                                 lin.weight.cast(DType::bf16).cast(DType::f32).t()) +
                          lin.bias.cast(DType::bf16).cast(DType::f32);
      CHECK(logits.to_vector<float>() == wide.cast(DType::bf16).to_vector<float>());
    }
    CHECK(softmax(y).dtype() == DType::f32);
    loss = cross_entropy(y, target);
    CHECK(loss.dtype() == DType::f32);
    CHECK_THROWS_AS(AutocastGuard{DType::i32}, Error);
  }
  CHECK_FALSE(autocast_enabled());
  loss.backward();
  CHECK(lin.weight.grad().dtype() == DType::f32);
  // Against f32: the bf16 forward is close (bf16 has 8 significant bits).
  Tensor ref = cross_entropy(matmul(x, lin.weight.t()), target);
  CHECK(loss.item<float>() == doctest::Approx(ref.item<float>()).epsilon(0.02));
}

}  // namespace
}  // namespace tessera::nn
