// Derivatives of matmul and the fused layers, written with ops (fused
// backward ops where speed or memory needs them: gelu, layer_norm, cross_entropy, attention,
// conv2d, max_pool2d).
#include "autograd/derivatives.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

using Grads = std::vector<Tensor>;

// d/db of a @ b for a 2-D b (a weight). A batched a is flattened so the batch folds into the
// GEMM's K instead of a [B, k, n] product summed afterwards. The result is produced in b's
// own layout: for a transposed view (x @ W^T, as nn::Linear computes) it is (g^T a)^T, so
// the transpose's backward hands AccumulateGrad a contiguous gradient and nothing is copied.
Tensor matmul_grad_weight(const Tensor& a, const Tensor& b, const Tensor& g) {
  const Tensor a2 = a.dim() == 2 ? a : reshape(a, {-1, a.size(-1)});
  const Tensor g2 = g.dim() == 2 ? g : reshape(g, {-1, g.size(-1)});
  const bool column_major = b.stride(0) == 1 && b.stride(1) != 1;
  if (column_major) return transpose(matmul(transpose(g2, 0, 1), a2), 0, 1);
  return matmul(transpose(a2, 0, 1), g2);
}

// d/db of a @ b for a batch of weights b [..., k, n] and one 2-D a (GPT's [B*T, C] @ [3, C,
// C]^T): per matrix the same product, in b's own layout when each of its matrices is a
// transposed view, so the transposes' backward hands on a contiguous gradient. The same
// terms summed in the same order as a^T g: the same bits through the CPU's f32 GEMM (its
// K order is a function of K alone); elsewhere the same value up to rounding.
Tensor batched_matmul_grad_weight(const Tensor& a, const Tensor& b, const Tensor& g) {
  const int64_t n = b.dim();
  const bool column_major = b.stride(n - 2) == 1 && b.stride(n - 1) != 1;
  if (column_major) return transpose(matmul(transpose(g, -1, -2), a), -1, -2);
  return matmul(transpose(a, -1, -2), g);
}

TS_REGISTER_DERIVATIVE(matmul, kIn0 | kIn1, 0, [](const GradCtx& c) {
  const Tensor &a = c.input(0), &b = c.input(1);
  Tensor grad_b;
  if (c.needs(1)) {
    if (b.dim() == 2 && a.dim() >= 2) {
      grad_b = matmul_grad_weight(a, b, c.grad());
    } else if (a.dim() == 2 && b.dim() > 2) {
      grad_b = sum_to(batched_matmul_grad_weight(a, b, c.grad()), c.in_shape(1));
    } else {
      grad_b = sum_to(matmul(transpose(a, -1, -2), c.grad()), c.in_shape(1));
    }
  }
  return Grads{c.needs(0) ? sum_to(matmul(c.grad(), transpose(b, -1, -2)), c.in_shape(0)) : Tensor(),
               grad_b};
});

// linear: x [..., K], w [N, K], b [N]. With an activation, its derivative and the bias's
// gradient are one pass over the saved pre-activation (linear_act_backward). The products
// are the ones matmul's derivative runs for x @ w.t(): the weight's gradient comes out in
// w's layout [N, K], with the batch folded into K.
TS_REGISTER_DERIVATIVE_OUTPUTS(linear, kIn0 | kIn1, kOut1, kOut0, [](const GradCtx& c) {
  const Tensor &x = c.input(0), &w = c.input(1);
  Tensor g = c.grad(0), grad_b;
  if (c.attrs.activation != Activation::none) {
    std::vector<Tensor> gb = linear_act_backward(g, c.output(1), c.attrs.activation);
    g = gb[0];
    grad_b = gb[1];
  } else if (c.needs(2)) {
    grad_b = sum_to(g, c.in_shape(2));
  }
  Tensor grad_w;
  if (c.needs(1)) {
    int64_t rows = 1;  // x's leading dims (not inferred by reshape: any of them may be 0)
    for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
    grad_w = matmul(transpose(reshape(g, {rows, w.size(0)}), 0, 1), reshape(x, {rows, w.size(1)}));
  }
  return Grads{c.needs(0) ? matmul(g, w) : Tensor(), grad_w, c.needs(2) ? grad_b : Tensor()};
});

// x's gradient runs the same grouping through the transposed experts; the weights' is one
// product per group (grouped_matmul_backward_weight), in w's logical layout [E, K, M].
TS_REGISTER_DERIVATIVE(grouped_matmul, kIn0 | kIn1 | kIn2, 0, [](const GradCtx& c) {
  const Tensor &x = c.input(0), &w = c.input(1), &sizes = c.input(2);
  return Grads{c.needs(0) ? grouped_matmul(c.grad(), transpose(w, 1, 2), sizes) : Tensor(),
               c.needs(1) ? grouped_matmul_backward_weight(x, c.grad(), sizes) : Tensor(), Tensor()};
});

TS_REGISTER_DERIVATIVE(softmax, 0, kOut0, [](const GradCtx& c) {
  const Tensor& y = c.output(0);
  const Tensor gy = c.grad() * y;
  return Grads{gy - y * sum(gy, {c.attrs.dim}, /*keepdim=*/true)};
});

TS_REGISTER_DERIVATIVE(log_softmax, 0, kOut0, [](const GradCtx& c) {
  return Grads{c.grad() - exp(c.output(0)) * sum(c.grad(), {c.attrs.dim}, /*keepdim=*/true)};
});

TS_REGISTER_DERIVATIVE_OUTPUTS(layer_norm, kAllInputs, kOut1 | kOut2, kOut0, [](const GradCtx& c) {
  return layer_norm_backward(c.grad(0), c.input(0), c.output(1), c.output(2), c.input(1),
                             c.input(2), c.attrs.normalized_ndim);
});

// s = x + r feeds y = layer_norm(s): the gradient of s is its own plus layer_norm's (added by
// layer_norm_backward, rounded as the add would be); x and r both get it (the same tensor).
TS_REGISTER_DERIVATIVE_OUTPUTS(add_layer_norm, kIn2 | kIn3, kOut0 | kOut2 | kOut3, kOut0 | kOut1,
                               [](const GradCtx& c) {
  if (!c.grad(1).defined()) return Grads{c.grad(0), c.grad(0), Tensor(), Tensor()};
  // The sum's own gradient joins layer_norm's in the same pass.
  const std::vector<Tensor> ln =
      layer_norm_backward(c.grad(1), c.output(0), c.output(2), c.output(3), c.input(2), c.input(3),
                          c.attrs.normalized_ndim, c.grad(0));
  return Grads{ln[0], ln[0], ln[1], ln[2]};
});

TS_REGISTER_DERIVATIVE_OUTPUTS(cross_entropy, kIn0 | kIn1, kOut1, kOut0, [](const GradCtx& c) {
  return Grads{cross_entropy_backward(c.grad(0), c.input(0), c.input(1), c.output(1),
                                      c.attrs.reduction, c.attrs.ignore_index),
               Tensor()};
});

// The fused backward recomputes the probabilities from q, k and the saved row logsumexp.
TS_REGISTER_DERIVATIVE_OUTPUTS(attention, kIn0 | kIn1 | kIn2, kOut0 | kOut1, kOut0,
                               [](const GradCtx& c) {
  return attention_backward(c.grad(0), c.input(0), c.input(1), c.input(2), c.output(0),
                            c.output(1), c.attrs.causal, c.attrs.scale);
});

// The packed form: one gradient for the stacked q, k and v.
TS_REGISTER_DERIVATIVE_OUTPUTS(attention_qkv, kIn0, kOut0 | kOut1, kOut0, [](const GradCtx& c) {
  return Grads{attention_qkv_backward(c.grad(0), c.input(0), c.output(0), c.output(1),
                                      c.attrs.head_dim, c.attrs.causal, c.attrs.scale)};
});

// The mask is a pure function of (seed, offset, index), so the backward redraws it.
TS_REGISTER_DERIVATIVE(dropout, 0, 0, [](const GradCtx& c) {
  return Grads{call1(OpId::dropout, {c.grad()}, c.attrs)};
});

TS_REGISTER_DERIVATIVE(conv2d, kIn0 | kIn1, 0, [](const GradCtx& c) {
  const Tensor &x = c.input(0), &w = c.input(1);
  const Attrs& a = c.attrs;
  return Grads{
      c.needs(0) ? conv2d_backward_input(c.grad(), w, x.shape(), a.stride, a.padding) : Tensor(),
      c.needs(1) ? conv2d_backward_weight(c.grad(), x, w.shape(), a.stride, a.padding) : Tensor(),
      c.needs(2) ? sum(c.grad(), {0, 2, 3}) : Tensor()};
});

// The gradient goes to each window's argmax (a fused scatter: max_pool2d_backward).
TS_REGISTER_DERIVATIVE(max_pool2d, 0, kOut1, [](const GradCtx& c) {
  Attrs a = c.attrs;
  a.shape = c.in_shape(0);
  return Grads{call1(OpId::max_pool2d_backward, {c.grad(0), c.output(1)}, a)};
});

}  // namespace
}  // namespace tessera::autograd
