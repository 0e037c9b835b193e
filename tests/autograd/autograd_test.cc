// Behaviour of the autograd engine: accumulation, retain_graph, grad mode, detach, hooks,
// retain_grad, autograd::grad, multiple roots, in-place detection and integer outputs.
// Values are small integers in f32 (exact), or compared against closed forms.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tests/testing.h"
#include "autograd/autograd.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera {
namespace {

using testing::error_of;

using V = std::vector<float>;

Tensor leaf(const V& values, const Shape& shape) {
  return Tensor::from_vector<float>(values, shape).requires_grad_();
}

TEST_CASE("gradients accumulate into .grad across backward calls") {
  Tensor x = leaf({1, 2, 3}, {3});
  sum(x * x).backward();
  CHECK(x.grad().to_vector<float>() == V{2, 4, 6});
  sum(x * 3.0).backward();
  CHECK(x.grad().to_vector<float>() == V{5, 7, 9});
  // A leaf reached along two paths gets the sum of both.
  Tensor y = leaf({1, 2}, {2});
  sum(y * y + exp(y) * 0.0 + y).backward();
  CHECK(y.grad().to_vector<float>() == V{3, 5});
}

TEST_CASE("backward twice needs retain_graph") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor loss = sum(x * x);  // mul saves x for backward
  loss.backward();
  CHECK(x.grad().to_vector<float>() == V{2, 4, 6});
  const std::string msg = error_of([&] { loss.backward(); });
  CHECK(msg.find("retain_graph") != std::string::npos);
  CHECK(x.grad().to_vector<float>() == V{2, 4, 6});  // the failed pass added nothing

  Tensor w = leaf({1, 2, 3}, {3});
  Tensor kept = sum(w * w);
  kept.backward(Tensor(), /*retain_graph=*/true);
  CHECK(w.grad().to_vector<float>() == V{2, 4, 6});
  kept.backward(Tensor(), /*retain_graph=*/true);
  CHECK(w.grad().to_vector<float>() == V{4, 8, 12});
  kept.backward();  // the last pass may free the graph
  CHECK(w.grad().to_vector<float>() == V{6, 12, 18});
  CHECK_THROWS_AS(kept.backward(), Error);
}

TEST_CASE("a non-scalar root needs an explicit gradient") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = x * 2.0;
  CHECK(error_of([&] { y.backward(); }).find("one-element") != std::string::npos);
  y.backward(Tensor::from_vector<float>({1, 10, 100}, {3}));
  CHECK(x.grad().to_vector<float>() == V{2, 20, 200});
  CHECK_THROWS_AS(y.backward(Tensor::from_vector<float>({1, 2}, {2})), Error);
}

TEST_CASE("NoGradGuard builds no graph and restores grad mode") {
  Tensor x = leaf({1, 2}, {2});
  REQUIRE(GradMode::enabled());
  {
    NoGradGuard no_grad;
    CHECK_FALSE(GradMode::enabled());
    Tensor y = x * 2.0 + exp(x);
    CHECK_FALSE(y.requires_grad());
    CHECK(y.grad_fn() == nullptr);
    CHECK(y.is_leaf());
    {
      GradModeGuard on(true);  // checkpoint's recomputation turns it back on like this
      CHECK((x * 2.0).requires_grad());
    }
    CHECK_FALSE(GradMode::enabled());
  }
  CHECK(GradMode::enabled());
  Tensor z = x * 2.0;
  CHECK(z.requires_grad());
  REQUIRE(z.grad_fn() != nullptr);
  CHECK(z.grad_fn()->name() == "mul");
}

TEST_CASE("detach shares data and cuts the graph") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor h = x * 2.0;
  Tensor d = h.detach();
  CHECK_FALSE(d.requires_grad());
  CHECK(d.is_leaf());
  CHECK(d.storage() == h.storage());
  sum(d * x).backward();
  CHECK(x.grad().to_vector<float>() == V{2, 4, 6});  // d is a constant: d/dx (d * x) = d
}

TEST_CASE("gradients of broadcast operands are reduced back to their shapes") {
  // a [3, 1, 4] * b [2, 4] -> [3, 2, 4].
  V av(12), bv(8);
  for (int i = 0; i < 12; ++i) av[i] = static_cast<float>(i + 1);
  for (int i = 0; i < 8; ++i) bv[i] = static_cast<float>(10 * (i + 1));
  Tensor a = leaf(av, {3, 1, 4}), b = leaf(bv, {2, 4});
  Tensor c = leaf({0.5f}, {});
  sum(a * b + c).backward();
  REQUIRE(a.grad().shape() == Shape{3, 1, 4});
  REQUIRE(b.grad().shape() == Shape{2, 4});
  REQUIRE(c.grad().shape() == Shape{});
  V ga(12), gb(8);
  for (int i = 0; i < 3; ++i) {
    for (int k = 0; k < 4; ++k) ga[i * 4 + k] = bv[k] + bv[4 + k];
  }
  for (int j = 0; j < 2; ++j) {
    for (int k = 0; k < 4; ++k) gb[j * 4 + k] = av[k] + av[4 + k] + av[8 + k];
  }
  CHECK(a.grad().to_vector<float>() == ga);
  CHECK(b.grad().to_vector<float>() == gb);
  CHECK(c.grad().item<float>() == 24.0f);  // 3 * 2 * 4 elements
}

TEST_CASE("register_hook on a leaf and on a non-leaf can replace the gradient") {
  Tensor x = leaf({1, 2, 3}, {3});
  std::vector<float> seen_leaf;
  x.register_hook([&](const Tensor& g) {
    seen_leaf = g.to_vector<float>();
    return g * 2.0;
  });
  Tensor h = x * 3.0;
  std::vector<float> seen_mid;
  h.register_hook([&](const Tensor& g) {
    seen_mid = g.to_vector<float>();
    return g * 10.0;
  });
  int observed = 0;
  h.register_hook([&](const Tensor& g) {  // runs after the first; undefined keeps g
    CHECK(g.to_vector<float>() == V{10, 10, 10});
    ++observed;
    return Tensor();
  });
  sum(h).backward();
  CHECK(seen_mid == V{1, 1, 1});
  CHECK(observed == 1);
  CHECK(seen_leaf == V{30, 30, 30});                    // 10 * d h / d x
  CHECK(x.grad().to_vector<float>() == V{60, 60, 60});  // the leaf hook doubles it
  CHECK_THROWS_AS(
      Tensor::from_vector<float>({1}, {1}).register_hook([](const Tensor& g) { return g; }), Error);
}

TEST_CASE("post-accumulate hooks fire once per leaf, last layer first") {
  // Three layers; w2 is also used a second time in layer 3 (two paths, one accumulation).
  Tensor x = Tensor::from_vector<float>({1, -1, 0.5f, 2}, {1, 4});
  Tensor w1 = leaf(V(16, 0.1f), {4, 4}), w2 = leaf(V(16, -0.2f), {4, 4});
  Tensor w3 = leaf(V(4, 0.3f), {4, 1});
  w2.set_grad(full({4, 4}, 100.0));  // accumulation adds to an existing .grad
  std::vector<std::string> order;
  std::vector<Tensor> grads_at_hook;
  // Plain variables, not a structured binding: lambdas capture them (clang < 16 rejects that).
  for (auto entry : {std::pair{"w1", w1}, std::pair{"w2", w2}, std::pair{"w3", w3}}) {
    const char* name = entry.first;
    const Tensor& w = entry.second;
    w.register_post_accumulate_grad_hook([&order, &grads_at_hook, name](const Tensor& t) {
      order.push_back(name);
      grads_at_hook.push_back(t.grad().clone());
    });
  }
  auto forward = [&] {
    Tensor h1 = tanh(matmul(x, w1));
    Tensor h2 = tanh(matmul(h1, w2));
    return sum(matmul(h2 + matmul(h2, w2), w3));
  };
  const std::vector<Tensor> expected = autograd::grad({forward()}, {w1, w2, w3});
  CHECK(order.empty());  // autograd::grad does not accumulate, so no hook runs
  forward().backward();
  CHECK(order == std::vector<std::string>{"w3", "w2", "w1"});
  REQUIRE(grads_at_hook.size() == 3);
  CHECK(grads_at_hook[0].to_vector<float>() == expected[2].to_vector<float>());
  CHECK(grads_at_hook[1].to_vector<float>() == (expected[1] + 100.0).to_vector<float>());
  CHECK(grads_at_hook[2].to_vector<float>() == expected[0].to_vector<float>());
  CHECK_THROWS_AS((w1 * 2.0).register_post_accumulate_grad_hook([](const Tensor&) {}), Error);
}

TEST_CASE("retain_grad keeps the gradient of a non-leaf") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor h = x * 3.0;
  Tensor other = x + 1.0;
  h.retain_grad();
  Tensor loss = sum(h * h + other);
  loss.backward(Tensor(), /*retain_graph=*/true);
  REQUIRE(h.grad().defined());
  CHECK(h.grad().to_vector<float>() == V{6, 12, 18});  // 2h
  CHECK_FALSE(other.grad().defined());                 // not retained
  loss.backward();
  CHECK(h.grad().to_vector<float>() == V{12, 24, 36});  // accumulates like a leaf's
  CHECK(x.grad().to_vector<float>() == V{2 * 19, 2 * 37, 2 * 55});
}

TEST_CASE("autograd::grad returns gradients without touching .grad") {
  Tensor x = leaf({1, 2, 3}, {3}), w = leaf({2, 0, -1}, {3});
  Tensor unused = leaf({5}, {1});
  Tensor loss = sum(x * w * x);
  const std::vector<Tensor> g = autograd::grad({loss}, {x, w, unused}, {}, /*retain_graph=*/true);
  REQUIRE(g.size() == 3);
  CHECK(g[0].to_vector<float>() == V{4, 0, -6});  // 2 x w
  CHECK(g[1].to_vector<float>() == V{1, 4, 9});   // x^2
  CHECK_FALSE(g[2].defined());                    // no path from loss
  CHECK_FALSE(x.grad().defined());
  CHECK_FALSE(w.grad().defined());
  // Only some inputs: the others' .grad stays untouched too.
  const std::vector<Tensor> gw = autograd::grad({loss}, {w});
  CHECK(gw[0].to_vector<float>() == V{1, 4, 9});
  CHECK_FALSE(x.grad().defined());
  // Gradients w.r.t. a non-leaf.
  Tensor y = leaf({1, 2}, {2});
  Tensor h = y * y;
  const std::vector<Tensor> gh = autograd::grad({sum(h * 3.0)}, {h});
  CHECK(gh[0].to_vector<float>() == V{3, 3});
  CHECK_FALSE(y.grad().defined());
  CHECK_THROWS_AS(autograd::grad({sum(h)}, {Tensor::from_vector<float>({1}, {1})}), Error);
}

TEST_CASE("backward from several roots sums their contributions") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor l1 = sum(x * 2.0);
  Tensor l2 = sum(x * x);
  Tensor v = x * 4.0;  // non-scalar root with its own gradient
  autograd::backward({l1, l2, v}, {Tensor(), Tensor(), Tensor::from_vector<float>({1, 0, 2}, {3})});
  CHECK(x.grad().to_vector<float>() == V{2 + 2 + 4, 2 + 4 + 0, 2 + 6 + 8});
  Tensor y = leaf({1}, {1});
  CHECK_THROWS_AS(autograd::backward({sum(y), sum(y)}, {Tensor()}), Error);
}

TEST_CASE("overwriting a tensor saved for backward is detected") {
  SUBCASE("a saved input") {
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor t = Tensor::from_vector<float>({4, 5, 6}, {3});
    Tensor loss = sum(x * t);  // mul saves t to compute d/dx
    t.copy_(Tensor::from_vector<float>({0, 0, 0}, {3}));
    const std::string msg = error_of([&] { loss.backward(); });
    CHECK(msg.find("modified in place") != std::string::npos);
    CHECK(msg.find("mul") != std::string::npos);
  }
  SUBCASE("a saved output, written through a view") {
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor y = exp(x);  // exp saves its output
    Tensor loss = sum(y);
    {
      NoGradGuard no_grad;
      y.slice(0, 1, 2).copy_(Tensor::from_vector<float>({0}, {1}));
    }
    const std::string msg = error_of([&] { loss.backward(); });
    CHECK(msg.find("modified in place") != std::string::npos);
    CHECK(msg.find("exp") != std::string::npos);
  }
  SUBCASE("an unsaved tensor may be overwritten") {
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor t = Tensor::from_vector<float>({4, 5, 6}, {3});
    Tensor loss = sum(x + t);  // add saves nothing
    t.copy_(Tensor::from_vector<float>({0, 0, 0}, {3}));
    loss.backward();
    CHECK(x.grad().to_vector<float>() == V{1, 1, 1});
  }
}

TEST_CASE("copy_ refuses a src or dst that requires grad under grad mode") {
  Tensor x = leaf({1, 2}, {2});
  Tensor dst = Tensor::from_vector<float>({0, 0}, {2});
  CHECK_THROWS_AS(dst.copy_(x), Error);
  CHECK_THROWS_AS(dst.copy_(x * 2.0), Error);
  CHECK_THROWS_AS(x.copy_(dst), Error);
  CHECK(dst.to_vector<float>() == V{0, 0});
  {
    NoGradGuard no_grad;
    dst.copy_(x * 2.0);  // no graph to lose
  }
  CHECK(dst.to_vector<float>() == V{2, 4});
  CHECK_FALSE(dst.requires_grad());
}

TEST_CASE("ties share the gradient evenly (max, maximum, minimum)") {
  // Away from ties gradcheck covers these; at a tie the subgradient is split, as in PyTorch.
  Tensor x = leaf({1, 3, 3, 2, 2, 2}, {2, 3});
  sum(max(x, {1})).backward();
  const float third = 1.0f / 3.0f;
  CHECK(x.grad().to_vector<float>() == V{0, 0.5f, 0.5f, third, third, third});
  Tensor a = leaf({1, 2, 3}, {3}), b = leaf({1, 5, 0}, {3});
  sum(maximum(a, b) + minimum(a, b) * 10.0).backward();
  CHECK(a.grad().to_vector<float>() == V{5.5f, 10, 1});
  CHECK(b.grad().to_vector<float>() == V{5.5f, 1, 10});
}

TEST_CASE("integer and bool outputs do not require grad") {
  Tensor x = leaf({1, 5, 2, 4}, {2, 2});
  Tensor am = argmax(x, 1);
  CHECK(am.dtype() == DType::i64);
  CHECK_FALSE(am.requires_grad());
  CHECK(am.grad_fn() == nullptr);
  CHECK(am.to_vector<int64_t>() == std::vector<int64_t>{1, 1});
  CHECK_FALSE(argmax(x).requires_grad());
  for (const Tensor& c : {eq(x, x), ne(x, x), lt(x, x * 2.0), le(x, x), gt(x, x), ge(x, x)}) {
    CHECK(c.dtype() == DType::b8);
    CHECK_FALSE(c.requires_grad());
    CHECK(c.grad_fn() == nullptr);
  }
  // max_pool2d's i64 indices output is not linked into the graph; its values are.
  Tensor img = leaf({1, 2, 3, 4}, {1, 1, 2, 2});
  std::vector<Tensor> pooled = call(OpId::max_pool2d, {img}, [] {
    Attrs a;
    a.kernel_size = {2, 2};
    a.stride = {2, 2};
    return a;
  }());
  CHECK(pooled[0].requires_grad());
  CHECK_FALSE(pooled[1].requires_grad());
  // A floating result of a mask still connects to the floating operand.
  Tensor masked = where(gt(x, full({}, 2.5)), x, zeros({}));
  sum(masked).backward();
  CHECK(x.grad().to_vector<float>() == V{0, 1, 0, 1});
  CHECK_THROWS_AS(Tensor::from_vector<int64_t>({1}, {1}).requires_grad_(), Error);
}

TEST_CASE("auxiliary outputs of fused ops stay out of the graph") {
  // layer_norm's mean/rstd and cross_entropy's logsumexp only feed their backward: a
  // gradient through them would be silently dropped, so they do not require grad.
  Tensor x = leaf({1, 2, 4, 3, 5, 9}, {2, 3});
  Attrs ln;
  ln.normalized_ndim = 1;
  std::vector<Tensor> y = call(OpId::layer_norm, {x, Tensor(), Tensor()}, ln);
  CHECK(y[0].requires_grad());
  CHECK_FALSE(y[1].requires_grad());
  CHECK_FALSE(y[2].requires_grad());
  std::vector<Tensor> ce = call(OpId::cross_entropy, {x, Tensor::from_vector<int64_t>({0, 2}, {2})});
  CHECK(ce[0].requires_grad());
  CHECK_FALSE(ce[1].requires_grad());
}

TEST_CASE("hooks on a leaf also apply to autograd::grad") {
  Tensor x = leaf({1, 2}, {2});
  x.register_hook([](const Tensor& g) { return g * 2.0; });
  const std::vector<Tensor> g = autograd::grad({sum(x * 3.0)}, {x});
  CHECK(g[0].to_vector<float>() == V{6, 6});
  CHECK_FALSE(x.grad().defined());
}

}  // namespace

namespace {

// A weight used through transposed views (x @ W^T, GPT's qkv product [B*T, C] @ [3, C, C]^T)
// gets its gradient in its own layout: the backward copies nothing, the gradient is the sum
// over rows of x_r g_r^T per matrix (loops here, f64), and in f32 it has the bits of the
// product a^T g the derivative used to compute (the CPU GEMM's K order depends on K alone).
TEST_CASE("the gradient of a weight used transposed is written in its layout, without a copy") {
  for (const bool batched : {false, true}) {
    CAPTURE(batched);
    const int64_t rows = 5, k = 3, n = 4;
    const Tensor x = randn({rows, k}, DType::f64);
    const Tensor w = (batched ? randn({2, n, k}, DType::f64) : randn({n, k}, DType::f64)).requires_grad_();
    const Tensor y = matmul(x, batched ? transpose(w, 1, 2) : transpose(w, 0, 1));
    const Tensor g = randn(y.shape(), DType::f64);
    {
      const testing::KernelCalls copies({OpId::clone, OpId::copy_});
      y.backward(g);
      CHECK(copies.count() == 0);
    }
    const Tensor grad = w.grad();
    REQUIRE(grad.shape() == w.shape());
    CHECK(grad.is_contiguous());
    const std::vector<double> xv = x.to_vector<double>(), gv = g.to_vector<double>();
    const std::vector<double> got = grad.contiguous().to_vector<double>();
    const int64_t mats = batched ? 2 : 1;
    double worst = 0;
    for (int64_t s = 0; s < mats; ++s) {
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t i = 0; i < k; ++i) {
          double want = 0;
          for (int64_t r = 0; r < rows; ++r) want += xv[r * k + i] * gv[(s * rows + r) * n + j];
          worst = std::max(worst, std::abs(got[(s * n + j) * k + i] - want));
        }
      }
    }
    CHECK(worst <= 1e-12);
  }
  // f32, 1000 rows: K spans several of the GEMM's K blocks (at most 384 each); bitwise.
  const Tensor x = randn({1000, 24});
  const Tensor w = randn({3, 40, 24}).requires_grad_();
  const Tensor g = randn({3, 1000, 40});
  matmul(x, transpose(w, 1, 2)).backward(g);
  const Tensor want = matmul(transpose(x, 0, 1), g).contiguous();  // [3, 24, 40]: a^T g
  const std::vector<float> got_v = transpose(w.grad(), 1, 2).contiguous().to_vector<float>();
  const std::vector<float> want_v = want.to_vector<float>();
  REQUIRE(got_v.size() == want_v.size());
  CHECK(std::memcmp(got_v.data(), want_v.data(), got_v.size() * sizeof(float)) == 0);
}

}  // namespace

}  // namespace tessera
