// Derivatives of the elementwise ops, written with ops.

#include "autograd/derivatives.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

using Grads = std::vector<Tensor>;

Tensor zero_like_scalar(const Tensor& t) { return scalar_like(0.0, t, "backward"); }

// 1.0 where mask is true, as t's dtype.
Tensor as_float(const Tensor& mask, const Tensor& like) { return cast(mask, like.dtype()); }

// ---- unary ----------------------------------------------------------------------------
TS_REGISTER_DERIVATIVE(neg, 0, 0, [](const GradCtx& c) { return Grads{-c.grad()}; });
TS_REGISTER_DERIVATIVE(exp, 0, kOut0, [](const GradCtx& c) {
  return Grads{c.grad() * c.output(0)};
});
TS_REGISTER_DERIVATIVE(log, kIn0, 0, [](const GradCtx& c) { return Grads{c.grad() / c.input(0)}; });
TS_REGISTER_DERIVATIVE(sqrt, 0, kOut0, [](const GradCtx& c) {
  return Grads{c.grad() * 0.5 / c.output(0)};
});
TS_REGISTER_DERIVATIVE(rsqrt, 0, kOut0, [](const GradCtx& c) {
  const Tensor& y = c.output(0);
  return Grads{c.grad() * (y * y * y) * -0.5};
});
TS_REGISTER_DERIVATIVE(abs, kIn0, 0, [](const GradCtx& c) {
  const Tensor& x = c.input(0);
  const Tensor zero = zero_like_scalar(x);
  return Grads{c.grad() * (as_float(gt(x, zero), x) - as_float(lt(x, zero), x))};
});
TS_REGISTER_DERIVATIVE(tanh, 0, kOut0, [](const GradCtx& c) {
  const Tensor& y = c.output(0);
  return Grads{c.grad() * (1.0 - y * y)};
});
TS_REGISTER_DERIVATIVE(sigmoid, 0, kOut0, [](const GradCtx& c) {
  const Tensor& y = c.output(0);
  return Grads{c.grad() * y * (1.0 - y)};
});
TS_REGISTER_DERIVATIVE(relu, 0, kOut0, [](const GradCtx& c) {
  const Tensor& y = c.output(0);
  const Tensor zero = zero_like_scalar(y);
  return Grads{where(gt(y, zero), c.grad(), zero)};
});
// d/dx x s(x) = s (1 + x (1 - s)).
TS_REGISTER_DERIVATIVE(silu, kIn0, 0, [](const GradCtx& c) {
  const Tensor& x = c.input(0);
  const Tensor s = sigmoid(x);
  return Grads{c.grad() * s * (1.0 + x * (1.0 - s))};
});
TS_REGISTER_DERIVATIVE(gelu, kIn0, 0, [](const GradCtx& c) {
  return Grads{gelu_backward(c.grad(), c.input(0), c.attrs.approximate_tanh)};
});

// ---- binary (gradients summed back over broadcast dims) ---------------------------------
TS_REGISTER_DERIVATIVE(add, 0, 0, [](const GradCtx& c) {
  return Grads{sum_to(c.grad(), c.in_shape(0)), sum_to(c.grad(), c.in_shape(1))};
});
TS_REGISTER_DERIVATIVE(sub, 0, 0, [](const GradCtx& c) {
  return Grads{sum_to(c.grad(), c.in_shape(0)), c.needs(1) ? sum_to(-c.grad(), c.in_shape(1)) : Tensor()};
});
TS_REGISTER_DERIVATIVE(mul, kIn0 | kIn1, 0, [](const GradCtx& c) {
  return Grads{c.needs(0) ? sum_to(c.grad() * c.input(1), c.in_shape(0)) : Tensor(),
               c.needs(1) ? sum_to(c.grad() * c.input(0), c.in_shape(1)) : Tensor()};
});
TS_REGISTER_DERIVATIVE(div, kIn1, kOut0, [](const GradCtx& c) {
  const Tensor ga = c.grad() / c.input(1);
  return Grads{c.needs(0) ? sum_to(ga, c.in_shape(0)) : Tensor(),
               c.needs(1) ? sum_to(-ga * c.output(0), c.in_shape(1)) : Tensor()};
});
TS_REGISTER_DERIVATIVE(pow, kIn0 | kIn1, kOut0, [](const GradCtx& c) {
  const Tensor &a = c.input(0), &b = c.input(1);
  Grads g(2);
  if (c.needs(0)) g[0] = sum_to(c.grad() * b * pow(a, b - 1.0), c.in_shape(0));
  if (c.needs(1)) g[1] = sum_to(c.grad() * c.output(0) * log(a), c.in_shape(1));
  return g;
});
// Ties split the gradient evenly, as PyTorch does.
Grads extremum_grad(const GradCtx& c, bool is_max) {
  const Tensor &a = c.input(0), &b = c.input(1);
  const Tensor half_tie = as_float(eq(a, b), a) * 0.5;
  const Tensor a_wins = as_float(is_max ? gt(a, b) : lt(a, b), a) + half_tie;
  const Tensor b_wins = as_float(is_max ? lt(a, b) : gt(a, b), a) + half_tie;
  return Grads{c.needs(0) ? sum_to(c.grad() * a_wins, c.in_shape(0)) : Tensor(),
               c.needs(1) ? sum_to(c.grad() * b_wins, c.in_shape(1)) : Tensor()};
}
TS_REGISTER_DERIVATIVE(maximum, kIn0 | kIn1, 0, [](const GradCtx& c) { return extremum_grad(c, true); });
TS_REGISTER_DERIVATIVE(minimum, kIn0 | kIn1, 0, [](const GradCtx& c) { return extremum_grad(c, false); });
TS_REGISTER_DERIVATIVE(where, kIn0, 0, [](const GradCtx& c) {
  const Tensor& cond = c.input(0);
  const Tensor zero = zero_like_scalar(c.grad());
  return Grads{Tensor(), c.needs(1) ? sum_to(where(cond, c.grad(), zero), c.in_shape(1)) : Tensor(),
               c.needs(2) ? sum_to(where(cond, zero, c.grad()), c.in_shape(2)) : Tensor()};
});

}  // namespace
}  // namespace tessera::autograd
