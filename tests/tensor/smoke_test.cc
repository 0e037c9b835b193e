#include <doctest/doctest.h>

#include "autograd/autograd.h"
#include "tensor/ops.h"

using namespace tessera;

TEST_CASE("smoke") {
  Tensor a = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = Tensor::from_vector<float>({10, 20, 30}, {3});
  Tensor c = a + b;
  CHECK(c.to_vector<float>() == std::vector<float>{11, 22, 33, 14, 25, 36});
  Tensor w = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2}).requires_grad_();
  Tensor y = matmul(a, w);
  MESSAGE(y.str());
  Tensor loss = sum(y * y);
  loss.backward();
  MESSAGE(w.grad().str());
  Tensor s = sum(a, {0});
  MESSAGE(s.str());
  MESSAGE(softmax(a, 1).str());
  MESSAGE(randn({5}).str());
}
