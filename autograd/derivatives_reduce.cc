// Derivatives of the reductions (sum, mean, max, var), written with ops.
#include "autograd/derivatives.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

using Grads = std::vector<Tensor>;

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
  const Tensor mask = cast(eq(x, y), x.dtype());  // 1 at the maxima
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

}  // namespace
}  // namespace tessera::autograd
