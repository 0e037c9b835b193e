// Derivatives of the data ops: indexing, joining, copies and views, written with ops.
#include <algorithm>

#include "autograd/derivatives.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

using Grads = std::vector<Tensor>;

// ---- indexing ------------------------------------------------------------------------------
TS_REGISTER_DERIVATIVE(embedding, kIn1, 0, [](const GradCtx& c) {
  const Shape& w = c.in_shape(0);
  const Tensor& g = c.grad();
  return Grads{index_add(zeros(w, g.dtype(), g.device()), 0, reshape(c.input(1), {-1}),
                         reshape(g, {-1, w[1]})),
               Tensor()};
});

TS_REGISTER_DERIVATIVE(index_select, kIn1, 0, [](const GradCtx& c) {
  const Tensor& g = c.grad();
  return Grads{index_add(zeros(c.in_shape(0), g.dtype(), g.device()), c.attrs.dim, c.input(1), g),
               Tensor()};
});

TS_REGISTER_DERIVATIVE(index_add, kIn1, 0, [](const GradCtx& c) {
  return Grads{c.grad(), Tensor(),
               c.needs(2) ? index_select(c.grad(), c.attrs.dim, c.input(1)) : Tensor()};
});

TS_REGISTER_DERIVATIVE(gather, kIn1, 0, [](const GradCtx& c) {
  const Tensor& g = c.grad();
  return Grads{scatter_add(zeros(c.in_shape(0), g.dtype(), g.device()), c.attrs.dim, c.input(1), g),
               Tensor()};
});

// The values' gradient goes back to the positions they were taken from.
TS_REGISTER_DERIVATIVE(topk, 0, kOut1, [](const GradCtx& c) {
  const Tensor& g = c.grad(0);
  return Grads{scatter_add(zeros(c.in_shape(0), g.dtype(), g.device()), c.attrs.dim, c.output(1), g)};
});

TS_REGISTER_DERIVATIVE(scatter_add, kIn1, 0, [](const GradCtx& c) {
  Tensor gs;
  if (c.needs(2)) {
    // src entries beyond the index's extent received nothing: their gradient is zero.
    gs = gather(c.grad(), c.attrs.dim, c.input(1));
    const Shape& src = c.in_shape(2);
    for (size_t d = 0; d < src.size(); ++d) {
      const int64_t missing = src[d] - gs.shape()[d];
      if (missing == 0) continue;
      Shape pad = gs.shape();
      pad[d] = missing;
      gs = cat({gs, zeros(pad, gs.dtype(), gs.device())}, static_cast<int64_t>(d));
    }
  }
  return Grads{c.grad(), Tensor(), gs};
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
