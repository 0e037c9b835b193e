#include "models/hello.h"

#include "autograd/autograd.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::models {
namespace {

// Three classes centred on the vertices of a triangle, unit-ish spread.
void make_blobs(int64_t n, Generator& gen, Tensor& x, Tensor& y) {
  const Tensor centres = Tensor::from_vector<float>({0, 2.5f, -2.2f, -1.2f, 2.2f, -1.2f}, {3, 2});
  std::vector<int64_t> labels(n);
  for (int64_t i = 0; i < n; ++i) labels[i] = i % 3;
  y = Tensor::from_vector<int64_t>(labels, {n});
  x = embedding(centres, y) + randn({n, 2}, DType::f32, kCPU, &gen) * 1.2;
}

Tensor init(const Shape& shape, double scale, Generator& gen) {
  return (randn(shape, DType::f32, kCPU, &gen) * scale).requires_grad_();
}

}  // namespace

HelloResult train_hello(const HelloConfig& c, const std::function<void(int64_t, double)>& on_log) {
  Generator gen(c.seed);
  Tensor w1 = init({2, c.hidden}, 1.0 / std::sqrt(2.0), gen);
  Tensor b1 = zeros({c.hidden}).requires_grad_();
  Tensor w2 = init({c.hidden, 3}, 1.0 / std::sqrt(static_cast<double>(c.hidden)), gen);
  Tensor b2 = zeros({3}).requires_grad_();
  const std::vector<Tensor> params = {w1, b1, w2, b2};
  auto forward = [&](const Tensor& x) { return matmul(gelu(matmul(x, w1) + b1), w2) + b2; };

  HelloResult result;
  for (int64_t step = 0; step < c.steps; ++step) {
    Tensor x, y;
    make_blobs(c.batch, gen, x, y);
    Tensor loss = cross_entropy(forward(x), y);
    loss.backward();
    {
      NoGradGuard no_grad;
      for (const Tensor& p : params) {
        p.copy_(p - p.grad() * c.lr);
        p.set_grad(Tensor());
      }
    }
    result.losses.push_back(loss.item<double>());
    if (on_log && (step % c.log_every == 0 || step + 1 == c.steps)) on_log(step, result.losses.back());
  }

  NoGradGuard no_grad;
  Tensor x, y;
  make_blobs(3000, gen, x, y);
  const Tensor correct = eq(argmax(forward(x), 1), y);
  result.accuracy = sum(cast(correct, DType::f64)).item<double>() / 3000.0;
  return result;
}

}  // namespace tessera::models
