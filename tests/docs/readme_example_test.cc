// The C++ example in README.md, compiled and checked so the README never rots. Keep the
// body of readme_example() identical to the README's snippet.
#include <doctest/doctest.h>

#include "tessera.h"

using namespace tessera;

namespace {
Tensor readme_example() {
  manual_seed(0);
  Tensor x = randn({64, 16});                              // a batch of inputs
  Tensor y = argmax(x.narrow(1, 0, 4), 1);                 // labels: i64, shape [64]
  Tensor w = (randn({16, 4}) * 0.1).requires_grad_();      // a leaf we train
  Tensor b = zeros({4}).requires_grad_();

  for (int step = 0; step < 100; ++step) {
    Tensor loss = cross_entropy(matmul(x, w) + b, y);      // fused log-softmax + NLL
    loss.backward();                                       // fills w.grad(), b.grad()
    NoGradGuard no_grad;                                   // plain SGD, no graph
    w.copy_(w - w.grad() * 0.5);
    b.copy_(b - b.grad() * 0.5);
    w.set_grad(Tensor());
    b.set_grad(Tensor());
  }
  return cross_entropy(matmul(x, w) + b, y);
}
}  // namespace

TEST_CASE("the README example trains") {
  const Tensor loss = readme_example();
  // Starts at ~ln 4 = 1.39; 100 steps of SGD on a linearly separable problem drive it down.
  CHECK(loss.item<float>() < 0.5f);
}
