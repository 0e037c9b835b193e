// Derivatives of elementwise ops, reductions, views, copies and cat, written with ops.
#include <numeric>

#include "autograd/derivatives.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

using Grads = std::vector<Tensor>;

Tensor zero_like_scalar(const Tensor& t) { return scalar_like(0.0, t, "backward"); }

// 1.0 where mask is true, as t's dtype.
Tensor as_float(const Tensor& mask, const Tensor& like) { return cast(mask, like.dtype()); }

// Broadcasts a reduction's gradient back over the reduced dims.
Tensor expand_reduced(const Tensor& g, const Shape& in_shape, const std::vector<int64_t>& dims,
                      bool keepdim) {
  Tensor r = g;
  const auto nd = normalize_dims("backward", dims, static_cast<int64_t>(in_shape.size()));
  if (!keepdim) {
    for (int64_t d : nd) r = unsqueeze(r, d);
  }
  return expand(r, in_shape);
}

int64_t reduced_count(const Shape& in_shape, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : normalize_dims("backward", dims, static_cast<int64_t>(in_shape.size()))) {
    n *= in_shape[d];
  }
  return n;
}

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

// ---- reductions ---------------------------------------------------------------------------
TS_REGISTER_DERIVATIVE(sum, 0, 0, [](const GradCtx& c) {
  return Grads{expand_reduced(c.grad(), c.in_shape(0), c.attrs.dims, c.attrs.keepdim)};
});
TS_REGISTER_DERIVATIVE(mean, 0, 0, [](const GradCtx& c) {
  const double n = static_cast<double>(reduced_count(c.in_shape(0), c.attrs.dims));
  return Grads{expand_reduced(c.grad() / n, c.in_shape(0), c.attrs.dims, c.attrs.keepdim)};
});
TS_REGISTER_DERIVATIVE(max, kIn0, kOut0, [](const GradCtx& c) {
  const Tensor& x = c.input(0);
  const Tensor y = expand_reduced(c.output(0), x.shape(), c.attrs.dims, c.attrs.keepdim);
  const Tensor mask = as_float(eq(x, y), x);
  const Tensor count = sum(mask, c.attrs.dims, /*keepdim=*/true);
  const Tensor g = expand_reduced(c.grad(), x.shape(), c.attrs.dims, c.attrs.keepdim);
  return Grads{g * mask / count};
});
TS_REGISTER_DERIVATIVE(var, kIn0, 0, [](const GradCtx& c) {
  const Tensor& x = c.input(0);
  const double n = static_cast<double>(reduced_count(x.shape(), c.attrs.dims));
  const Tensor centered = x - mean(x, c.attrs.dims, /*keepdim=*/true);
  const Tensor g = expand_reduced(c.grad(), x.shape(), c.attrs.dims, c.attrs.keepdim);
  return Grads{g * centered * (2.0 / (n - static_cast<double>(c.attrs.correction)))};
});

// ---- copies ----------------------------------------------------------------------------------
TS_REGISTER_DERIVATIVE(cast, 0, 0, [](const GradCtx& c) {
  return Grads{cast(c.grad(), c.in_specs[0].dtype)};
});
TS_REGISTER_DERIVATIVE(to_device, 0, 0, [](const GradCtx& c) {
  return Grads{to(c.grad(), c.in_specs[0].device)};
});
TS_REGISTER_DERIVATIVE(clone, 0, 0, [](const GradCtx& c) { return Grads{c.grad()}; });
TS_REGISTER_DERIVATIVE(cat, 0, 0, [](const GradCtx& c) {
  const int64_t d = normalize_dim("cat", c.attrs.dim, static_cast<int64_t>(c.in_shape(0).size()));
  Grads g(c.in_specs.size());
  int64_t start = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const int64_t len = c.in_shape(i)[d];
    if (c.needs(i)) g[i] = narrow(c.grad(), d, start, len);
    start += len;
  }
  return g;
});

// ---- views -------------------------------------------------------------------------------
TS_REGISTER_DERIVATIVE(view, 0, 0, [](const GradCtx& c) {
  return Grads{reshape(c.grad(), c.in_shape(0))};
});
TS_REGISTER_DERIVATIVE(permute, 0, 0, [](const GradCtx& c) {
  const int64_t n = static_cast<int64_t>(c.attrs.dims.size());
  std::vector<int64_t> inverse(n);
  for (int64_t i = 0; i < n; ++i) inverse[normalize_dim("permute", c.attrs.dims[i], n)] = i;
  return Grads{permute(c.grad(), inverse)};
});
TS_REGISTER_DERIVATIVE(slice, 0, 0, [](const GradCtx& c) {
  // Scatter the slice's gradient into zeros at the positions it was taken from.
  const Shape& in = c.in_shape(0);
  const int64_t d = normalize_dim("slice", c.attrs.dim, static_cast<int64_t>(in.size()));
  const int64_t size = in[d];
  auto clamp = [size](int64_t i) { return std::clamp<int64_t>(i < 0 ? i + size : i, 0, size); };
  const int64_t start = clamp(c.attrs.start);
  const int64_t len = c.grad().shape()[d];
  const Tensor index = arange(static_cast<double>(start),
                              static_cast<double>(start + len * c.attrs.step),
                              static_cast<double>(c.attrs.step), DType::i64, c.grad().device());
  return Grads{index_add(zeros(in, c.grad().dtype(), c.grad().device()), d, index, c.grad())};
});
TS_REGISTER_DERIVATIVE(expand, 0, 0, [](const GradCtx& c) {
  return Grads{sum_to(c.grad(), c.in_shape(0))};
});
TS_REGISTER_DERIVATIVE(squeeze, 0, 0, [](const GradCtx& c) {
  return Grads{reshape(c.grad(), c.in_shape(0))};
});
TS_REGISTER_DERIVATIVE(unsqueeze, 0, 0, [](const GradCtx& c) {
  return Grads{reshape(c.grad(), c.in_shape(0))};
});

}  // namespace
}  // namespace tessera::autograd
