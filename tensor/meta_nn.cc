// Shape inference for matmul, fused layers, indexing, joining, conversions and factories.
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

// Inputs: grad, x, mean, rstd, weight, bias. Outputs: grad_x, grad_weight, grad_bias.
std::vector<TensorSpec> layer_norm_backward_meta(std::span<const TensorSpec> in,
                                                 const Attrs& attrs) {
  constexpr OpId op = OpId::layer_norm_backward;
  require_count(op, in, 6);
  const TensorSpec& x = required(op, in, 1, "input");
  require_float(op, x, "input");
  TS_CHECK(in[0].shape == x.shape, "layer_norm_backward: grad {} vs input {}",
           shape_str(in[0].shape), shape_str(x.shape));
  require_same_dtype(op, in[0], x);
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
  const Shape loss = attrs.reduction == Reduction::none ? Shape{in[0].shape[0]} : Shape{};
  return {spec(loss, in[0].dtype, in[0].device),
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

std::vector<TensorSpec> embedding_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::embedding;
  require_count(op, in, 2);
  const TensorSpec& w = in[0];
  const TensorSpec& idx = required(op, in, 1, "indices");
  require_ndim(op, w, 2, "weight ([V, D])");
  require_index(op, idx, "indices");
  Shape out = idx.shape;
  out.push_back(w.shape[1]);
  return {spec(out, w.dtype, w.device)};
}

std::vector<TensorSpec> index_select_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::index_select;
  require_count(op, in, 2);
  const TensorSpec& x = in[0];
  const TensorSpec& idx = required(op, in, 1, "index");
  require_index(op, idx, "index");
  require_ndim(op, idx, 1, "index");
  const int64_t d = normalize_dim("index_select", attrs.dim, static_cast<int64_t>(x.shape.size()));
  TS_CHECK(!x.shape.empty(), "index_select: input must have at least one dim");
  Shape out = x.shape;
  out[d] = idx.shape[0];
  return {spec(out, x.dtype, x.device)};
}

std::vector<TensorSpec> index_add_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::index_add;
  require_count(op, in, 3);
  const TensorSpec& x = in[0];
  const TensorSpec& idx = required(op, in, 1, "index");
  const TensorSpec& src = required(op, in, 2, "source");
  require_index(op, idx, "index");
  require_ndim(op, idx, 1, "index");
  require_same_dtype(op, x, src);
  require_numeric(op, x, "input");
  TS_CHECK(!x.shape.empty(), "index_add: input must have at least one dim");
  const int64_t d = normalize_dim("index_add", attrs.dim, static_cast<int64_t>(x.shape.size()));
  Shape expected = x.shape;
  expected[d] = idx.shape[0];
  TS_CHECK(src.shape == expected,
           "index_add: source shape {} must be {} (input {} with dim {} of index length {})",
           shape_str(src.shape), shape_str(expected), shape_str(x.shape), d, idx.shape[0]);
  return {x};
}

std::vector<TensorSpec> gather_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::gather;
  require_count(op, in, 2);
  const TensorSpec& x = in[0];
  const TensorSpec& idx = required(op, in, 1, "index");
  require_index(op, idx, "index");
  TS_CHECK(idx.shape.size() == x.shape.size() && !x.shape.empty(),
           "gather: index {} must have the same rank as input {}", shape_str(idx.shape),
           shape_str(x.shape));
  const int64_t d = normalize_dim("gather", attrs.dim, static_cast<int64_t>(x.shape.size()));
  for (size_t i = 0; i < x.shape.size(); ++i) {
    TS_CHECK(static_cast<int64_t>(i) == d || idx.shape[i] <= x.shape[i],
             "gather: index {} exceeds input {} in dim {}", shape_str(idx.shape),
             shape_str(x.shape), i);
  }
  return {spec(idx.shape, x.dtype, x.device)};
}

// topk: values (x's dtype) and i64 indices, x's shape with k along dim.
std::vector<TensorSpec> topk_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::topk;
  require_count(op, in, 1);
  const TensorSpec& x = in[0];
  require_numeric(op, x, "input");
  TS_CHECK(!x.shape.empty(), "topk: input must have at least one dim, got a 0-d tensor");
  const int64_t d = normalize_dim("topk", attrs.dim, static_cast<int64_t>(x.shape.size()));
  TS_CHECK(attrs.k >= 0 && attrs.k <= x.shape[d],
           "topk: k = {} is outside [0, {}] (dim {} of input {})", attrs.k, x.shape[d], d,
           shape_str(x.shape));
  Shape s = x.shape;
  s[d] = attrs.k;
  return {spec(s, x.dtype, x.device), spec(s, DType::i64, x.device)};
}

std::vector<TensorSpec> scatter_add_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::scatter_add;
  require_count(op, in, 3);
  const TensorSpec& x = in[0];
  const TensorSpec& idx = required(op, in, 1, "index");
  const TensorSpec& src = required(op, in, 2, "src");
  require_index(op, idx, "index");
  require_same_dtype(op, x, src);
  require_numeric(op, x, "input");
  TS_CHECK(idx.shape.size() == x.shape.size() && src.shape.size() == x.shape.size() &&
               !x.shape.empty(),
           "scatter_add: input {}, index {} and src {} must have the same rank",
           shape_str(x.shape), shape_str(idx.shape), shape_str(src.shape));
  const int64_t d = normalize_dim("scatter_add", attrs.dim, static_cast<int64_t>(x.shape.size()));
  for (size_t i = 0; i < x.shape.size(); ++i) {
    TS_CHECK(idx.shape[i] <= src.shape[i] &&
                 (static_cast<int64_t>(i) == d || idx.shape[i] <= x.shape[i]),
             "scatter_add: index {} exceeds src {} or input {} in dim {}", shape_str(idx.shape),
             shape_str(src.shape), shape_str(x.shape), i);
  }
  return {x};
}

std::vector<TensorSpec> cat_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::cat;
  TS_CHECK(!in.empty(), "cat: needs at least one tensor");
  const TensorSpec& first = in[0];
  TS_CHECK(!first.shape.empty(), "cat: zero-dimensional tensors cannot be concatenated");
  const int64_t d = normalize_dim("cat", attrs.dim, static_cast<int64_t>(first.shape.size()));
  Shape out = first.shape;
  out[d] = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const TensorSpec& t = required(op, in, i, "tensor");
    require_same_dtype(op, first, t);
    bool ok = t.shape.size() == first.shape.size();
    for (size_t k = 0; ok && k < t.shape.size(); ++k) {
      ok = static_cast<int64_t>(k) == d || t.shape[k] == first.shape[k];
    }
    TS_CHECK(ok, "cat: tensor {} has shape {}, incompatible with {} along dim {}", i,
             shape_str(t.shape), shape_str(first.shape), d);
    out[d] += t.shape[d];
  }
  return {spec(out, first.dtype, first.device)};
}

std::vector<TensorSpec> cast_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  require_count(OpId::cast, in, 1);
  return {spec(in[0].shape, attrs.dtype, in[0].device)};
}

std::vector<TensorSpec> to_device_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  require_count(OpId::to_device, in, 1);
  return {spec(in[0].shape, in[0].dtype, attrs.device)};
}

std::vector<TensorSpec> clone_meta(std::span<const TensorSpec> in, const Attrs&) {
  require_count(OpId::clone, in, 1);
  return {in[0]};
}

// Inputs: dst, src. src broadcasts to dst's shape and is cast to dst's dtype.
std::vector<TensorSpec> copy_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::copy_;
  require_count(op, in, 2);
  const TensorSpec& src = required(op, in, 1, "src");
  const Shape s = broadcast_shapes("copy_", in[0].shape, src.shape);
  TS_CHECK(s == in[0].shape, "copy_: src shape {} does not broadcast to dst shape {}",
           shape_str(src.shape), shape_str(in[0].shape));
  return {in[0]};
}

void check_factory_shape(OpId op, const Shape& shape) {
  for (int64_t s : shape) {
    TS_CHECK(s >= 0, "{}: negative size in shape {}", name_of(op), shape_str(shape));
  }
}

// Integer tensors take only values they hold exactly (as scalar operands do); bool takes
// any value (nonzero is true).
void check_integral_value(OpId op, DType dt, double v, const char* what) {
  if (!is_integral(dt)) return;
  TS_CHECK(std::isfinite(v) && std::trunc(v) == v, "{}: {} {} is not representable in dtype {}",
           name_of(op), what, v, dt);
}

std::vector<TensorSpec> full_meta(std::span<const TensorSpec>, const Attrs& attrs) {
  check_factory_shape(OpId::full, attrs.shape);
  check_integral_value(OpId::full, attrs.dtype, attrs.value, "value");
  return {spec(attrs.shape, attrs.dtype, attrs.device)};
}

std::vector<TensorSpec> arange_meta(std::span<const TensorSpec>, const Attrs& a) {
  TS_CHECK(a.range_step != 0.0, "arange: step must be non-zero");
  TS_CHECK(std::isfinite(a.range_start) && std::isfinite(a.range_end),
           "arange: start {} and end {} must be finite", a.range_start, a.range_end);
  TS_CHECK(a.dtype != DType::b8, "arange: bool dtype is not supported");
  check_integral_value(OpId::arange, a.dtype, a.range_start, "start");
  check_integral_value(OpId::arange, a.dtype, a.range_step, "step");
  const double n = std::ceil((a.range_end - a.range_start) / a.range_step);
  return {spec({n > 0 ? static_cast<int64_t>(n) : 0}, a.dtype, a.device)};
}

template <OpId op>
std::vector<TensorSpec> random_meta(std::span<const TensorSpec>, const Attrs& attrs) {
  check_factory_shape(op, attrs.shape);
  TS_CHECK(is_floating(attrs.dtype), "{}: dtype must be floating, got {}", name_of(op),
           attrs.dtype);
  const RngView& v = attrs.rng_view;
  if (!v.global_shape.empty()) {
    TS_CHECK(v.global_shape.size() == attrs.shape.size() && v.starts.size() == attrs.shape.size(),
             "{}: block shape {} and global shape {} / starts [{}] differ in rank", name_of(op),
             shape_str(attrs.shape), shape_str(v.global_shape), fmt::join(v.starts, ", "));
    for (size_t i = 0; i < attrs.shape.size(); ++i) {
      TS_CHECK(v.starts[i] >= 0 && v.starts[i] + attrs.shape[i] <= v.global_shape[i],
               "{}: block {} at [{}] exceeds global shape {}", name_of(op),
               shape_str(attrs.shape), fmt::join(v.starts, ", "), shape_str(v.global_shape));
    }
  }
  return {spec(attrs.shape, attrs.dtype, attrs.device)};
}

TS_REGISTER_META(matmul, matmul_meta);
TS_REGISTER_META(softmax, softmax_meta<OpId::softmax>);
TS_REGISTER_META(log_softmax, softmax_meta<OpId::log_softmax>);
TS_REGISTER_META(layer_norm, layer_norm_meta);
TS_REGISTER_META(layer_norm_backward, layer_norm_backward_meta);
TS_REGISTER_META(cross_entropy, cross_entropy_meta);
TS_REGISTER_META(cross_entropy_backward, cross_entropy_backward_meta);
TS_REGISTER_META(dropout, dropout_meta);
TS_REGISTER_META(attention, attention_meta);
TS_REGISTER_META(attention_backward, attention_backward_meta);
TS_REGISTER_META(conv2d, conv2d_meta);
TS_REGISTER_META(conv2d_backward_input, conv2d_backward_input_meta);
TS_REGISTER_META(conv2d_backward_weight, conv2d_backward_weight_meta);
TS_REGISTER_META(max_pool2d, max_pool2d_meta);
TS_REGISTER_META(max_pool2d_backward, max_pool2d_backward_meta);
TS_REGISTER_META(embedding, embedding_meta);
TS_REGISTER_META(index_select, index_select_meta);
TS_REGISTER_META(index_add, index_add_meta);
TS_REGISTER_META(gather, gather_meta);
TS_REGISTER_META(scatter_add, scatter_add_meta);
TS_REGISTER_META(topk, topk_meta);
TS_REGISTER_META(cat, cat_meta);
TS_REGISTER_META(cast, cast_meta);
TS_REGISTER_META(to_device, to_device_meta);
TS_REGISTER_META(clone, clone_meta);
TS_REGISTER_META(copy_, copy_meta);
TS_REGISTER_META(full, full_meta);
TS_REGISTER_META(arange, arange_meta);
TS_REGISTER_META(rand, random_meta<OpId::rand>);
TS_REGISTER_META(randn, random_meta<OpId::randn>);

}  // namespace
}  // namespace tessera
