// Shape inference for matmul and the fused layers.
#include <cmath>

#include "tensor/internal/meta_util.h"

namespace tessera {
namespace {

using namespace internal;

std::vector<TensorSpec> matmul_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::matmul;
  require_count(op, in, 2);
  const TensorSpec& a = in[0];
  const TensorSpec& b = required(op, in, 1, "second operand");
  require_float(op, a, "first operand");
  require_same_dtype(op, a, b);
  TS_CHECK(a.shape.size() >= 2 && b.shape.size() >= 2,
           "matmul: kernel expects operands of rank >= 2, got {} and {}", shape_str(a.shape),
           shape_str(b.shape));
  const int64_t m = a.shape[a.shape.size() - 2], k = a.shape.back();
  const int64_t k2 = b.shape[b.shape.size() - 2], n = b.shape.back();
  TS_CHECK(k == k2, "matmul: inner dimensions differ: {} @ {} ({} vs {})", shape_str(a.shape),
           shape_str(b.shape), k, k2);
  const Shape batch_a(a.shape.begin(), a.shape.end() - 2);
  const Shape batch_b(b.shape.begin(), b.shape.end() - 2);
  Shape out = broadcast_shapes("matmul (batch dims)", batch_a, batch_b);
  out.push_back(m);
  out.push_back(n);
  return {spec(out, a.dtype, a.device)};
}

// linear: x [..., K], weight [N, K], optional bias [N] -> y [..., N] and, with an activation,
// the pre-activation x W^T + b [..., N] its backward reads (absent otherwise).
std::vector<TensorSpec> linear_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::linear;
  require_count(op, in, 3);
  const TensorSpec& x = in[0];
  const TensorSpec& w = required(op, in, 1, "weight");
  require_float(op, x, "input");
  require_same_dtype(op, x, w);
  TS_CHECK(!x.shape.empty(), "linear: input must have at least one dim ([..., in_features]), got "
           "a 0-d tensor");
  require_ndim(op, w, 2, "weight ([out_features, in_features])");
  const int64_t k = x.shape.back(), n = w.shape[0];
  TS_CHECK(w.shape[1] == k, "linear: input {} has {} features but weight {} takes {}",
           shape_str(x.shape), k, shape_str(w.shape), w.shape[1]);
  if (in[2].defined) {
    require_same_dtype(op, x, in[2]);
    TS_CHECK(in[2].shape == Shape{n}, "linear: bias shape {} must be [{}] (weight {})",
             shape_str(in[2].shape), n, shape_str(w.shape));
  }
  TS_CHECK(attrs.activation <= Activation::gelu_tanh, "linear: unknown activation {}",
           static_cast<int>(attrs.activation));
  Shape out = x.shape;
  out.back() = n;
  const TensorSpec y = spec(out, x.dtype, x.device);
  return {y, attrs.activation == Activation::none ? absent() : y};
}

// linear_act_backward: grad [..., N], pre [..., N] -> grad_pre = grad * act'(pre) [..., N] and
// its sum over the leading dims, the bias's gradient [N].
std::vector<TensorSpec> linear_act_backward_meta(std::span<const TensorSpec> in,
                                                 const Attrs& attrs) {
  constexpr OpId op = OpId::linear_act_backward;
  require_count(op, in, 2);
  const TensorSpec& g = in[0];
  const TensorSpec& pre = required(op, in, 1, "pre-activation");
  require_float(op, g, "grad");
  require_same_dtype(op, g, pre);
  TS_CHECK(g.shape == pre.shape && !g.shape.empty(),
           "linear_act_backward: grad {} and pre-activation {} must have one shape of rank >= 1",
           shape_str(g.shape), shape_str(pre.shape));
  TS_CHECK(attrs.activation != Activation::none && attrs.activation <= Activation::gelu_tanh,
           "linear_act_backward: activation must be relu, gelu or gelu_tanh, got {}",
           activation_name(attrs.activation));
  return {g, spec(Shape{g.shape.back()}, g.dtype, g.device)};
}

template <OpId op>
std::vector<TensorSpec> softmax_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  require_count(op, in, 1);
  require_float(op, in[0], "input");
  normalize_dim(name_of(op), attrs.dim, static_cast<int64_t>(in[0].shape.size()));
  return {in[0]};
}

// Checks the trailing normalized dims and returns the leading (statistics) shape.
Shape layer_norm_rows(OpId op, const TensorSpec& x, const TensorSpec* weight,
                      const TensorSpec* bias, int64_t nd) {
  const int64_t ndim = static_cast<int64_t>(x.shape.size());
  TS_CHECK(nd >= 1 && nd <= ndim, "{}: cannot normalise {} trailing dims of shape {}",
           name_of(op), nd, shape_str(x.shape));
  const Shape norm(x.shape.end() - nd, x.shape.end());
  for (const TensorSpec* p : {weight, bias}) {
    if (p == nullptr || !p->defined) continue;
    TS_CHECK(p->shape == norm, "{}: weight/bias shape {} must equal the normalized shape {} of "
             "input {}", name_of(op), shape_str(p->shape), shape_str(norm), shape_str(x.shape));
    require_same_dtype(op, x, *p);
  }
  return Shape(x.shape.begin(), x.shape.end() - nd);
}

std::vector<TensorSpec> layer_norm_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::layer_norm;
  require_count(op, in, 3);
  const TensorSpec& x = in[0];
  require_float(op, x, "input");
  TS_CHECK(attrs.eps >= 0, "layer_norm: eps must be >= 0, got {}", attrs.eps);
  const Shape rows = layer_norm_rows(op, x, &in[1], &in[2], attrs.normalized_ndim);
  const DType st = stats_dtype(x.dtype);
  return {x, spec(rows, st, x.device), spec(rows, st, x.device)};
}

// Inputs: x, r, weight, bias. Outputs: s = x + r, layer_norm(s), mean, rstd.
std::vector<TensorSpec> add_layer_norm_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::add_layer_norm;
  require_count(op, in, 4);
  const TensorSpec& x = required(op, in, 0, "input");
  const TensorSpec& r = required(op, in, 1, "residual");
  require_float(op, x, "input");
  TS_CHECK(r.shape == x.shape, "add_layer_norm: residual {} must have the input's shape {}",
           shape_str(r.shape), shape_str(x.shape));
  require_same_dtype(op, x, r);
  TS_CHECK(attrs.eps >= 0, "add_layer_norm: eps must be >= 0, got {}", attrs.eps);
  const Shape rows = layer_norm_rows(op, x, &in[2], &in[3], attrs.normalized_ndim);
  const DType st = stats_dtype(x.dtype);
  return {x, x, spec(rows, st, x.device), spec(rows, st, x.device)};
}

// Inputs: grad, x, mean, rstd, weight, bias[, residual_grad]. Outputs: grad_x, grad_weight,
// grad_bias.
std::vector<TensorSpec> layer_norm_backward_meta(std::span<const TensorSpec> in,
                                                 const Attrs& attrs) {
  constexpr OpId op = OpId::layer_norm_backward;
  TS_CHECK(in.size() == 6 || in.size() == 7,
           "layer_norm_backward: expected 6 or 7 inputs (grad, x, mean, rstd, weight, bias[, "
           "residual_grad]), got {}", in.size());
  const TensorSpec& x = required(op, in, 1, "input");
  require_float(op, x, "input");
  TS_CHECK(in[0].shape == x.shape, "layer_norm_backward: grad {} vs input {}",
           shape_str(in[0].shape), shape_str(x.shape));
  require_same_dtype(op, in[0], x);
  if (in.size() == 7 && in[6].defined) {
    TS_CHECK(in[6].shape == in[0].shape, "layer_norm_backward: residual_grad {} vs grad {}",
             shape_str(in[6].shape), shape_str(in[0].shape));
    require_same_dtype(op, in[0], in[6]);
  }
  const Shape rows = layer_norm_rows(op, x, &in[4], &in[5], attrs.normalized_ndim);
  TS_CHECK(in[2].shape == rows && in[3].shape == rows,
           "layer_norm_backward: mean/rstd shapes {} {} must be {}", shape_str(in[2].shape),
           shape_str(in[3].shape), shape_str(rows));
  return {x, in[4].defined ? in[4] : absent(), in[5].defined ? in[5] : absent()};
}

void check_cross_entropy(OpId op, const TensorSpec& logits, const TensorSpec& target) {
  require_float(op, logits, "logits");
  require_ndim(op, logits, 2, "logits ([N, C]; reshape other layouts)");
  require_index(op, target, "target");
  TS_CHECK(target.shape == Shape{logits.shape[0]},
           "{}: target shape {} must be [N] = [{}] for logits {}", name_of(op),
           shape_str(target.shape), logits.shape[0], shape_str(logits.shape));
  TS_CHECK(logits.shape[1] > 0, "{}: logits {} have no classes", name_of(op),
           shape_str(logits.shape));
}

std::vector<TensorSpec> cross_entropy_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::cross_entropy;
  require_count(op, in, 2);
  const TensorSpec& target = required(op, in, 1, "target");
  check_cross_entropy(op, in[0], target);
  // The loss in the stats dtype (f32 for 16-bit logits, which are read as they are: under
  // autocast no f32 copy of the logits is made).
  const Shape loss = attrs.reduction == Reduction::none ? Shape{in[0].shape[0]} : Shape{};
  return {spec(loss, stats_dtype(in[0].dtype), in[0].device),
          spec({in[0].shape[0]}, stats_dtype(in[0].dtype), in[0].device)};
}

// Inputs: grad, logits, target, logsumexp.
std::vector<TensorSpec> cross_entropy_backward_meta(std::span<const TensorSpec> in,
                                                    const Attrs& attrs) {
  constexpr OpId op = OpId::cross_entropy_backward;
  require_count(op, in, 4);
  check_cross_entropy(op, required(op, in, 1, "logits"), required(op, in, 2, "target"));
  const Shape loss = attrs.reduction == Reduction::none ? Shape{in[1].shape[0]} : Shape{};
  TS_CHECK(in[0].shape == loss, "cross_entropy_backward: grad shape {} must be {}",
           shape_str(in[0].shape), shape_str(loss));
  TS_CHECK(in[0].dtype == stats_dtype(in[1].dtype),
           "cross_entropy_backward: grad dtype {} must be the loss's, {} for {} logits",
           in[0].dtype, stats_dtype(in[1].dtype), in[1].dtype);
  return {in[1]};
}

std::vector<TensorSpec> dropout_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::dropout;
  require_count(op, in, 1);
  require_float(op, in[0], "input");
  TS_CHECK(attrs.p >= 0.0 && attrs.p < 1.0, "dropout: p must be in [0, 1), got {}", attrs.p);
  return {in[0]};
}

// q, k, v [B, H, T, D]: one float dtype, one shape, a non-empty head dim.
void check_attention(OpId op, const TensorSpec& q, const TensorSpec& k, const TensorSpec& v,
                     const Attrs& attrs) {
  require_float(op, q, "q");
  require_ndim(op, q, 4, "q ([B, H, T, D])");
  for (const TensorSpec* t : {&k, &v}) {
    require_same_dtype(op, q, *t);
    TS_CHECK(t->shape == q.shape, "{}: q, k and v must have one shape [B, H, T, D], got {}, {}, {}",
             name_of(op), shape_str(q.shape), shape_str(k.shape), shape_str(v.shape));
  }
  TS_CHECK(q.shape[3] > 0, "{}: head dim of q {} must be positive", name_of(op),
           shape_str(q.shape));
  TS_CHECK(std::isfinite(attrs.scale), "{}: scale must be finite, got {}", name_of(op),
           attrs.scale);
}

// Outputs: out [B, H, T, D] and the row logsumexp [B, H, T] (f32; f64 for f64).
std::vector<TensorSpec> attention_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::attention;
  require_count(op, in, 3);
  check_attention(op, in[0], required(op, in, 1, "k"), required(op, in, 2, "v"), attrs);
  const Shape& s = in[0].shape;
  return {in[0], spec({s[0], s[1], s[2]}, stats_dtype(in[0].dtype), in[0].device)};
}

// Inputs: grad, q, k, v, out, lse. Outputs: grad_q, grad_k, grad_v.
std::vector<TensorSpec> attention_backward_meta(std::span<const TensorSpec> in,
                                                const Attrs& attrs) {
  constexpr OpId op = OpId::attention_backward;
  require_count(op, in, 6);
  const TensorSpec& q = required(op, in, 1, "q");
  check_attention(op, q, required(op, in, 2, "k"), required(op, in, 3, "v"), attrs);
  for (size_t i : {size_t{0}, size_t{4}}) {
    const TensorSpec& t = required(op, in, i, i == 0 ? "grad" : "out");
    require_same_dtype(op, q, t);
    TS_CHECK(t.shape == q.shape, "attention_backward: {} shape {} must equal q's {}",
             i == 0 ? "grad" : "out", shape_str(t.shape), shape_str(q.shape));
  }
  const TensorSpec& lse = required(op, in, 5, "lse");
  const Shape rows{q.shape[0], q.shape[1], q.shape[2]};
  TS_CHECK(lse.shape == rows && lse.dtype == stats_dtype(q.dtype),
           "attention_backward: lse must be {} {}, got {} {}", stats_dtype(q.dtype),
           shape_str(rows), lse.dtype, shape_str(lse.shape));
  return {q, q, q};
}

// attention_qkv: qkv [3, B, T, C] (q, k, v stacked; C a positive multiple of head_dim) ->
// out [B, T, C] and the row logsumexp [B, C / head_dim, T] (f32; f64 for f64).
void check_attention_qkv(OpId op, const TensorSpec& qkv, const Attrs& attrs) {
  require_float(op, qkv, "qkv");
  require_ndim(op, qkv, 4, "qkv ([3, B, T, C])");
  TS_CHECK(qkv.shape[0] == 3, "{}: qkv {} must stack q, k and v in dim 0 (size 3)", name_of(op),
           shape_str(qkv.shape));
  TS_CHECK(attrs.head_dim > 0 && qkv.shape[3] > 0 && qkv.shape[3] % attrs.head_dim == 0,
           "{}: width {} of qkv {} must be a positive multiple of head_dim {}", name_of(op),
           qkv.shape[3], shape_str(qkv.shape), attrs.head_dim);
  TS_CHECK(std::isfinite(attrs.scale), "{}: scale must be finite, got {}", name_of(op),
           attrs.scale);
}

// The row logsumexp's shape [B, H, T].
Shape attention_qkv_stats_shape(const TensorSpec& qkv, const Attrs& attrs) {
  return {qkv.shape[1], qkv.shape[3] / attrs.head_dim, qkv.shape[2]};
}

std::vector<TensorSpec> attention_qkv_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::attention_qkv;
  require_count(op, in, 1);
  const TensorSpec& qkv = in[0];
  check_attention_qkv(op, qkv, attrs);
  const Shape& s = qkv.shape;
  return {spec({s[1], s[2], s[3]}, qkv.dtype, qkv.device),
          spec(attention_qkv_stats_shape(qkv, attrs), stats_dtype(qkv.dtype), qkv.device)};
}

// Inputs: grad [B, T, C], qkv, out [B, T, C], lse. Output: grad_qkv [3, B, T, C].
std::vector<TensorSpec> attention_qkv_backward_meta(std::span<const TensorSpec> in,
                                                    const Attrs& attrs) {
  constexpr OpId op = OpId::attention_qkv_backward;
  require_count(op, in, 4);
  const TensorSpec& qkv = required(op, in, 1, "qkv");
  check_attention_qkv(op, qkv, attrs);
  const Shape rows{qkv.shape[1], qkv.shape[2], qkv.shape[3]};
  for (size_t i : {size_t{0}, size_t{2}}) {
    const TensorSpec& t = required(op, in, i, i == 0 ? "grad" : "out");
    require_same_dtype(op, qkv, t);
    TS_CHECK(t.shape == rows, "attention_qkv_backward: {} shape {} must be {} for qkv {}",
             i == 0 ? "grad" : "out", shape_str(t.shape), shape_str(rows), shape_str(qkv.shape));
  }
  const TensorSpec& lse = required(op, in, 3, "lse");
  const Shape want = attention_qkv_stats_shape(qkv, attrs);
  TS_CHECK(lse.shape == want && lse.dtype == stats_dtype(qkv.dtype),
           "attention_qkv_backward: lse must be {} {}, got {} {}", stats_dtype(qkv.dtype),
           shape_str(want), lse.dtype, shape_str(lse.shape));
  return {qkv};
}

int64_t conv_out(int64_t in, int64_t k, int64_t s, int64_t p) { return (in + 2 * p - k) / s + 1; }

void check_window(OpId op, const Shape& x, const Attrs& a, int64_t kh, int64_t kw) {
  TS_CHECK(a.stride[0] > 0 && a.stride[1] > 0 && a.padding[0] >= 0 && a.padding[1] >= 0,
           "{}: stride [{}, {}] must be positive and padding [{}, {}] non-negative", name_of(op),
           a.stride[0], a.stride[1], a.padding[0], a.padding[1]);
  TS_CHECK(kh > 0 && kw > 0 && x[2] + 2 * a.padding[0] >= kh && x[3] + 2 * a.padding[1] >= kw,
           "{}: window {}x{} does not fit input {} with padding [{}, {}]", name_of(op), kh, kw,
           shape_str(x), a.padding[0], a.padding[1]);
}

Shape conv_output_shape(OpId op, const Shape& x, const Shape& w, const Attrs& a) {
  TS_CHECK(x[1] == w[1], "{}: input {} has {} channels but weight {} expects {}", name_of(op),
           shape_str(x), x[1], shape_str(w), w[1]);
  check_window(op, x, a, w[2], w[3]);
  return {x[0], w[0], conv_out(x[2], w[2], a.stride[0], a.padding[0]),
          conv_out(x[3], w[3], a.stride[1], a.padding[1])};
}

std::vector<TensorSpec> conv2d_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::conv2d;
  require_count(op, in, 3);
  const TensorSpec& x = in[0];
  const TensorSpec& w = required(op, in, 1, "weight");
  require_float(op, x, "input");
  require_ndim(op, x, 4, "input ([N, C, H, W])");
  require_ndim(op, w, 4, "weight ([O, C, kh, kw])");
  require_same_dtype(op, x, w);
  if (in[2].defined) {
    require_same_dtype(op, x, in[2]);
    TS_CHECK(in[2].shape == Shape{w.shape[0]}, "conv2d: bias shape {} must be [{}]",
             shape_str(in[2].shape), w.shape[0]);
  }
  return {spec(conv_output_shape(op, x.shape, w.shape, attrs), x.dtype, x.device)};
}

// Inputs: grad, weight; attrs.shape = input shape.
std::vector<TensorSpec> conv2d_backward_input_meta(std::span<const TensorSpec> in,
                                                   const Attrs& attrs) {
  constexpr OpId op = OpId::conv2d_backward_input;
  require_count(op, in, 2);
  const TensorSpec& w = required(op, in, 1, "weight");
  require_float(op, w, "weight");
  require_ndim(op, w, 4, "weight");
  TS_CHECK(attrs.shape.size() == 4, "conv2d_backward_input: input shape {} must be 4-D",
           shape_str(attrs.shape));
  TS_CHECK(in[0].shape == conv_output_shape(op, attrs.shape, w.shape, attrs),
           "conv2d_backward_input: grad shape {} does not match the conv output",
           shape_str(in[0].shape));
  require_same_dtype(op, in[0], w);
  return {spec(attrs.shape, w.dtype, w.device)};
}

// Inputs: grad, input; attrs.shape = weight shape.
std::vector<TensorSpec> conv2d_backward_weight_meta(std::span<const TensorSpec> in,
                                                    const Attrs& attrs) {
  constexpr OpId op = OpId::conv2d_backward_weight;
  require_count(op, in, 2);
  const TensorSpec& x = required(op, in, 1, "input");
  require_float(op, x, "input");
  require_ndim(op, x, 4, "input");
  TS_CHECK(attrs.shape.size() == 4, "conv2d_backward_weight: weight shape {} must be 4-D",
           shape_str(attrs.shape));
  TS_CHECK(in[0].shape == conv_output_shape(op, x.shape, attrs.shape, attrs),
           "conv2d_backward_weight: grad shape {} does not match the conv output",
           shape_str(in[0].shape));
  require_same_dtype(op, in[0], x);
  return {spec(attrs.shape, x.dtype, x.device)};
}

std::vector<TensorSpec> max_pool2d_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::max_pool2d;
  require_count(op, in, 1);
  const TensorSpec& x = in[0];
  require_numeric(op, x, "input");
  require_ndim(op, x, 4, "input ([N, C, H, W])");
  const int64_t kh = a.kernel_size[0], kw = a.kernel_size[1];
  check_window(op, x.shape, a, kh, kw);
  TS_CHECK(a.padding[0] * 2 <= kh && a.padding[1] * 2 <= kw,
           "max_pool2d: padding [{}, {}] must be at most half the kernel [{}, {}]", a.padding[0],
           a.padding[1], kh, kw);
  const Shape out = {x.shape[0], x.shape[1], conv_out(x.shape[2], kh, a.stride[0], a.padding[0]),
                     conv_out(x.shape[3], kw, a.stride[1], a.padding[1])};
  return {spec(out, x.dtype, x.device), spec(out, DType::i64, x.device)};
}

// Inputs: grad [N, C, OH, OW], indices (max_pool2d's second output: flat positions within
// each input plane); attrs.shape = input shape.
std::vector<TensorSpec> max_pool2d_backward_meta(std::span<const TensorSpec> in,
                                                 const Attrs& attrs) {
  constexpr OpId op = OpId::max_pool2d_backward;
  require_count(op, in, 2);
  const TensorSpec& grad = required(op, in, 0, "grad");
  const TensorSpec& idx = required(op, in, 1, "indices");
  require_float(op, grad, "grad");
  require_ndim(op, grad, 4, "grad ([N, C, OH, OW])");
  require_index(op, idx, "indices");
  TS_CHECK(idx.shape == grad.shape, "max_pool2d_backward: indices shape {} must match grad {}",
           shape_str(idx.shape), shape_str(grad.shape));
  TS_CHECK(attrs.shape.size() == 4 && attrs.shape[0] == grad.shape[0] &&
               attrs.shape[1] == grad.shape[1],
           "max_pool2d_backward: input shape {} must be 4-D with grad {}'s N and C",
           shape_str(attrs.shape), shape_str(grad.shape));
  return {spec(attrs.shape, grad.dtype, grad.device)};
}

// grouped_matmul: x [N, K] (rows grouped consecutively: group e has sizes[e] rows) times w
// [E, K, M] -> [N, M]; group e's rows times w[e]. The sizes' values (summing to N) are checked
// by the kernel: shapes do not depend on them.
std::vector<TensorSpec> grouped_matmul_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::grouped_matmul;
  require_count(op, in, 3);
  const TensorSpec& x = required(op, in, 0, "x");
  const TensorSpec& w = required(op, in, 1, "weight");
  const TensorSpec& sizes = required(op, in, 2, "group sizes");
  require_float(op, x, "x");
  require_same_dtype(op, x, w);
  require_index(op, sizes, "group sizes");
  require_ndim(op, x, 2, "x");
  require_ndim(op, w, 3, "weight");
  require_ndim(op, sizes, 1, "group sizes");
  TS_CHECK(w.shape[1] == x.shape[1] && sizes.shape[0] == w.shape[0],
           "grouped_matmul: x {} @ weight {} with group sizes {}: expected weight [E, {}, M] and "
           "sizes [E]", shape_str(x.shape), shape_str(w.shape), shape_str(sizes.shape), x.shape[1]);
  return {spec({x.shape[0], w.shape[2]}, x.dtype, x.device)};
}

// grouped_matmul_backward_weight: x [N, K], grad [N, M], sizes [E] -> [E, K, M], group e's
// x rows transposed times its grad rows (an empty group gives zeros).
std::vector<TensorSpec> grouped_matmul_backward_weight_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::grouped_matmul_backward_weight;
  require_count(op, in, 3);
  const TensorSpec& x = required(op, in, 0, "x");
  const TensorSpec& g = required(op, in, 1, "grad");
  const TensorSpec& sizes = required(op, in, 2, "group sizes");
  require_float(op, x, "x");
  require_same_dtype(op, x, g);
  require_index(op, sizes, "group sizes");
  require_ndim(op, x, 2, "x");
  require_ndim(op, g, 2, "grad");
  require_ndim(op, sizes, 1, "group sizes");
  TS_CHECK(g.shape[0] == x.shape[0], "grouped_matmul_backward_weight: x {} and grad {} must have "
           "the same rows", shape_str(x.shape), shape_str(g.shape));
  return {spec({sizes.shape[0], x.shape[1], g.shape[1]}, x.dtype, x.device)};
}

TS_REGISTER_META(matmul, matmul_meta);
TS_REGISTER_META(grouped_matmul, grouped_matmul_meta);
TS_REGISTER_META(grouped_matmul_backward_weight, grouped_matmul_backward_weight_meta);
TS_REGISTER_META(softmax, softmax_meta<OpId::softmax>);
TS_REGISTER_META(log_softmax, softmax_meta<OpId::log_softmax>);
TS_REGISTER_META(layer_norm, layer_norm_meta);
TS_REGISTER_META(layer_norm_backward, layer_norm_backward_meta);
TS_REGISTER_META(add_layer_norm, add_layer_norm_meta);
TS_REGISTER_META(cross_entropy, cross_entropy_meta);
TS_REGISTER_META(cross_entropy_backward, cross_entropy_backward_meta);
TS_REGISTER_META(dropout, dropout_meta);
TS_REGISTER_META(linear, linear_meta);
TS_REGISTER_META(linear_act_backward, linear_act_backward_meta);
TS_REGISTER_META(attention, attention_meta);
TS_REGISTER_META(attention_backward, attention_backward_meta);
TS_REGISTER_META(attention_qkv, attention_qkv_meta);
TS_REGISTER_META(attention_qkv_backward, attention_qkv_backward_meta);
TS_REGISTER_META(conv2d, conv2d_meta);
TS_REGISTER_META(conv2d_backward_input, conv2d_backward_input_meta);
TS_REGISTER_META(conv2d_backward_weight, conv2d_backward_weight_meta);
TS_REGISTER_META(max_pool2d, max_pool2d_meta);
TS_REGISTER_META(max_pool2d_backward, max_pool2d_backward_meta);

}  // namespace
}  // namespace tessera
