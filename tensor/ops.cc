// The op API: thin wrappers that pack attributes and go through call()/call_view().
#include "tensor/ops.h"

#include <array>
#include <cmath>
#include <map>
#include <numeric>

#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/internal/views.h"
#include "tensor/op_attrs.h"

namespace tessera {

// ---- elementwise --------------------------------------------------------------------------

Tensor gelu(const Tensor& x, bool approximate_tanh) {
  return call1(OpId::gelu, {x}, op_attrs::gelu(approximate_tanh));
}

Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool approximate_tanh) {
  return call1(OpId::gelu_backward, {grad, x}, op_attrs::gelu(approximate_tanh));
}

Tensor pow(const Tensor& a, double exponent) {
  return call1(OpId::pow, {a, scalar_like(exponent, a, "pow")});
}
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  return call1(OpId::where, {cond, a, b});
}

Tensor scalar_like(double value, const Tensor& like, const char* op) {
  TS_CHECK(like.defined(), "{}: tensor operand is undefined", op);
  const DType dt = like.dtype();
  if (!is_floating(dt)) {
    TS_CHECK(std::isfinite(value) && std::trunc(value) == value && dt != DType::b8,
             "{}: scalar {} does not fit a {} tensor {}; cast the tensor to a floating dtype",
             op, value, dt, shape_str(like.shape()));
  }
  // Scalars live on the CPU as 0-d tensors; kernels on every device accept them (as PyTorch
  // does), so no device copy is made for a Python-style `x * 2`.
  Attrs a;
  a.value = value;
  a.dtype = dt;
  a.device = kCPU;
  return call1(OpId::full, {}, a);
}

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& a) { return neg(a); }
Tensor operator+(const Tensor& a, double b) { return add(a, scalar_like(b, a, "add")); }
Tensor operator-(const Tensor& a, double b) { return sub(a, scalar_like(b, a, "sub")); }
Tensor operator*(const Tensor& a, double b) { return mul(a, scalar_like(b, a, "mul")); }
Tensor operator/(const Tensor& a, double b) { return div(a, scalar_like(b, a, "div")); }
Tensor operator+(double a, const Tensor& b) { return add(scalar_like(a, b, "add"), b); }
Tensor operator-(double a, const Tensor& b) { return sub(scalar_like(a, b, "sub"), b); }
Tensor operator*(double a, const Tensor& b) { return mul(scalar_like(a, b, "mul"), b); }
Tensor operator/(double a, const Tensor& b) { return div(scalar_like(a, b, "div"), b); }

// ---- reductions -------------------------------------------------------------------------
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return call1(OpId::sum, {x}, op_attrs::reduce(dims, keepdim));
}
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return call1(OpId::mean, {x}, op_attrs::reduce(dims, keepdim));
}
Tensor max(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return call1(OpId::max, {x}, op_attrs::reduce(dims, keepdim));
}
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  return call1(OpId::argmax, {x}, op_attrs::argmax(dim, keepdim));
}
Tensor argmax(const Tensor& x) { return call1(OpId::argmax, {x}, op_attrs::argmax_all()); }
Tensor var(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, bool keepdim) {
  return call1(OpId::var, {x}, op_attrs::var(dims, correction, keepdim));
}

Tensor sum_squares(const std::vector<Tensor>& xs) { return call1(OpId::sum_squares, xs, {}); }

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  const int64_t lead = x.dim() - static_cast<int64_t>(shape.size());
  TS_CHECK(lead >= 0, "sum_to: cannot reduce {} to the larger rank {}", shape_str(x.shape()),
           shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i < lead || (shape[i - lead] == 1 && x.shape()[i] != 1)) dims.push_back(i);
    else TS_CHECK(shape[i - lead] == x.shape()[i], "sum_to: {} does not broadcast to {}",
                  shape_str(shape), shape_str(x.shape()));
  }
  if (dims.empty()) return reshape(x, shape);
  return reshape(sum(x, dims, /*keepdim=*/true), shape);
}

// ---- linear algebra and fused layers -------------------------------------------------------
Tensor matmul(const Tensor& a, const Tensor& b) {
  TS_CHECK(a.defined() && b.defined(), "matmul: undefined operand");
  TS_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul: operands must have rank >= 1, got {} and {}",
           shape_str(a.shape()), shape_str(b.shape()));
  // NumPy rules: a 1-D left operand is a row vector, a 1-D right operand a column vector;
  // the added dim is removed from the result.
  const bool vec_a = a.dim() == 1, vec_b = b.dim() == 1;
  Tensor out = call1(OpId::matmul, {vec_a ? unsqueeze(a, 0) : a, vec_b ? unsqueeze(b, 1) : b});
  if (vec_b) out = squeeze(out, {-1});
  if (vec_a) out = squeeze(out, {-2 + (vec_b ? 1 : 0)});
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Activation activation) {
  return call(OpId::linear, {x, weight, bias}, op_attrs::linear(activation))[0];
}

std::vector<Tensor> linear_act_backward(const Tensor& grad, const Tensor& pre, Activation activation) {
  return call(OpId::linear_act_backward, {grad, pre}, op_attrs::linear(activation));
}

Tensor softmax(const Tensor& x, int64_t dim) { return call1(OpId::softmax, {x}, op_attrs::dim(dim)); }
Tensor log_softmax(const Tensor& x, int64_t dim) {
  return call1(OpId::log_softmax, {x}, op_attrs::dim(dim));
}

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  TS_CHECK(x.defined(), "layer_norm: input is undefined");
  return call(OpId::layer_norm, {x, weight, bias},
              op_attrs::layer_norm(x.shape(), normalized_shape, eps))[0];
}

bool add_layer_norm_fuses(DType x, DType r) {
  if (!autocast_enabled()) return true;
  // Under autocast the op's inputs go to f32 (layer_norm's rule): the same sum only where
  // add's own rule puts both operands in f32. Otherwise (both 16-bit: a 16-bit sum; f64: an
  // f64 one) the two ops run, as they would have.
  const std::vector<DType> sum = autocast_dtypes(OpId::add, {x, r}, autocast_dtype());
  return sum[0] == DType::f32 && sum[1] == DType::f32;
}

AddLayerNorm add_layer_norm(const Tensor& x, const Tensor& r, const Shape& normalized_shape,
                            const Tensor& weight, const Tensor& bias, double eps) {
  TS_CHECK(x.defined() && r.defined(), "add_layer_norm: the input or the residual is undefined");
  if (!add_layer_norm_fuses(x.dtype(), r.dtype())) {
    const Tensor s = add(x, r);
    return {s, layer_norm(s, normalized_shape, weight, bias, eps)};
  }
  const std::vector<Tensor> out = call(OpId::add_layer_norm, {x, r, weight, bias},
                                       op_attrs::layer_norm(x.shape(), normalized_shape, eps));
  return {out[0], out[1]};
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, Reduction reduction,
                     int64_t ignore_index) {
  return call(OpId::cross_entropy, {logits, target},
              op_attrs::cross_entropy(reduction, ignore_index))[0];
}

Tensor dropout(const Tensor& x, double p, bool training, Generator* generator) {
  TS_CHECK(x.defined(), "dropout: input is undefined");
  TS_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got {}", p);
  if (!training || p == 0.0) return x;
  Generator& gen = generator != nullptr ? *generator : default_generator();
  const BatchSlice* slice = current_batch_slice();
  if (slice == nullptr) return call1(OpId::dropout, {x}, op_attrs::dropout(p, gen, x.numel()));
  // This thread runs rows [start, start + rows) of the global batch: draw that block of the
  // global input's mask.
  TS_CHECK(x.dim() >= 1 && x.size(0) == slice->rows,
           "dropout: inside a batch slice of {} rows (of {}), the input {} does not lead with "
           "the batch", slice->rows, slice->global_rows, shape_str(x.shape()));
  Shape global = x.shape();
  global[0] = slice->global_rows;
  Attrs a = op_attrs::dropout(p, gen, numel_of(global));
  std::vector<int64_t> starts(static_cast<size_t>(x.dim()), 0);
  starts[0] = slice->start;
  a.rng_view = RngView{global, starts};
  return call1(OpId::dropout, {x}, a);
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  return call(OpId::attention, {q, k, v}, op_attrs::attention(causal, scale))[0];
}

Tensor attention_qkv(const Tensor& qkv, int64_t head_dim, bool causal, double scale) {
  return call(OpId::attention_qkv, {qkv}, op_attrs::attention_qkv(head_dim, causal, scale))[0];
}

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
              std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  return call1(OpId::conv2d, {x, weight, bias}, op_attrs::conv2d(stride, padding));
}

Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel_size,
                  std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  return call(OpId::max_pool2d, {x}, op_attrs::max_pool2d(kernel_size, stride, padding))[0];
}

// ---- indexing -------------------------------------------------------------------------------
Tensor embedding(const Tensor& weight, const Tensor& indices) {
  return call1(OpId::embedding, {weight, indices});
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  return call1(OpId::index_select, {x, index}, op_attrs::dim(dim));
}
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source) {
  return call1(OpId::index_add, {x, index, source}, op_attrs::dim(dim));
}
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  return call1(OpId::gather, {x, index}, op_attrs::dim(dim));
}
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return call1(OpId::scatter_add, {x, index, src}, op_attrs::dim(dim));
}

// ---- joining and splitting -------------------------------------------------------------
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  TS_CHECK(!tensors.empty(), "cat: needs at least one tensor");
  return call1(OpId::cat, tensors, op_attrs::dim(dim));
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  TS_CHECK(!tensors.empty(), "stack: needs at least one tensor");
  TS_CHECK(tensors[0].defined(), "stack: tensor 0 is undefined");
  const int64_t d = normalize_dim("stack", dim, tensors[0].dim() + 1);
  std::vector<Tensor> parts;
  parts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TS_CHECK(tensors[i].defined() && tensors[i].shape() == tensors[0].shape(),
             "stack: tensor {} has shape {}, expected {} like tensor 0", i,
             tensors[i].defined() ? shape_str(tensors[i].shape()) : "undefined",
             shape_str(tensors[0].shape()));
    parts.push_back(unsqueeze(tensors[i], d));
  }
  return cat(parts, d);
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  TS_CHECK(x.defined() && x.dim() > 0, "split: input must have at least one dim");
  TS_CHECK(split_size > 0, "split: split_size must be positive, got {}", split_size);
  const int64_t d = normalize_dim("split", dim, x.dim());
  std::vector<int64_t> sizes;
  for (int64_t start = 0; start < x.shape()[d]; start += split_size) {
    sizes.push_back(std::min(split_size, x.shape()[d] - start));
  }
  if (sizes.empty()) sizes.push_back(0);
  return split(x, sizes, d);
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  TS_CHECK(x.defined() && x.dim() > 0, "split: input must have at least one dim");
  const int64_t d = normalize_dim("split", dim, x.dim());
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TS_CHECK(total == x.shape()[d], "split: sizes [{}] sum to {} but dim {} of {} has {}",
           fmt::join(sizes, ", "), total, d, shape_str(x.shape()), x.shape()[d]);
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    TS_CHECK(s >= 0, "split: negative size {} in [{}]", s, fmt::join(sizes, ", "));
    out.push_back(narrow(x, d, start, s));
    start += s;
  }
  return out;
}

// ---- copies and conversions -----------------------------------------------------------
Tensor cast(const Tensor& x, DType dtype) {
  TS_CHECK(x.defined(), "cast: input is undefined");
  if (x.dtype() == dtype) return x;
  return call1(OpId::cast, {x}, op_attrs::cast(dtype));
}

Tensor sign_pack(const Tensor& x) { return call1(OpId::sign_pack, {x}, {}); }

Tensor sign_unpack(const Tensor& bits, int64_t numel, DType dtype) {
  Attrs a;
  a.shape = {numel};
  a.dtype = dtype;
  return call1(OpId::sign_unpack, {bits}, a);
}

Tensor to(const Tensor& x, Device device) {
  TS_CHECK(x.defined(), "to: input is undefined");
  if (x.device() == device) return x;
  Attrs a;
  a.device = device;
  return call1(OpId::to_device, {x}, a);
}

Tensor clone(const Tensor& x) { return call1(OpId::clone, {x}); }
void copy_(const Tensor& dst, const Tensor& src) { call_copy_(dst, src); }

void scale_(const std::vector<Tensor>& xs, double scale) {
  // No element may be written twice (the parts run in parallel): tensors that share a
  // storage must not overlap there.
  std::map<const void*, std::vector<std::array<int64_t, 3>>> spans;  // storage -> {lo, hi, i}
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    if (!x.defined() || x.numel() == 0) continue;
    int64_t lo = x.offset(), hi = x.offset() + 1;
    for (int64_t d = 0; d < x.dim(); ++d) {
      const int64_t reach = (x.shape()[d] - 1) * x.strides()[d];
      (reach < 0 ? lo : hi) += reach;
    }
    std::vector<std::array<int64_t, 3>>& seen = spans[x.storage().get()];
    for (const auto& [l, h, j] : seen) {
      TS_CHECK(hi <= l || h <= lo,
               "scale_: tensors {} and {} of {} share memory (elements [{}, {}) and [{}, {}) of "
               "one storage); each element must be scaled once",
               j, i, xs.size(), l, h, lo, hi);
    }
    seen.push_back({lo, hi, static_cast<int64_t>(i)});
  }
  std::vector<size_t> written(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) written[i] = i;
  call_inplace(OpId::scale_, xs, op_attrs::scale(scale), written);
}

void adamw_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
            const Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
            double eps, double weight_decay, const Tensor& master, double grad_scale) {
  std::vector<Tensor> in = {param, grad, exp_avg, exp_avg_sq};
  if (master.defined()) in.push_back(master);
  Attrs a = op_attrs::adamw(step, lr, beta1, beta2, eps, weight_decay);
  a.grad_scale = grad_scale;
  call_inplace(OpId::adamw_, std::move(in), a, {0, 2, 3, 4});
}

void adamw8bit_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                const Tensor& exp_avg_sq, const Tensor& exp_avg_absmax,
                const Tensor& exp_avg_sq_absmax, int64_t step, double lr, double beta1,
                double beta2, double eps, double weight_decay, const Tensor& master,
                double grad_scale) {
  std::vector<Tensor> in = {param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax};
  if (master.defined()) in.push_back(master);
  Attrs a = op_attrs::adamw(step, lr, beta1, beta2, eps, weight_decay);
  a.grad_scale = grad_scale;
  call_inplace(OpId::adamw8bit_, std::move(in), a, {0, 2, 3, 4, 5, 6});
}

void adamw8bit_segments_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                         const Tensor& exp_avg_sq, const Tensor& exp_avg_absmax,
                         const Tensor& exp_avg_sq_absmax, const Tensor& master,
                         const Tensor& segments, const Tensor& new_absmax,
                         const Tensor& new_sq_absmax, int pass, int64_t step, double lr,
                         double beta1, double beta2, double eps, double weight_decay,
                         double grad_scale) {
  Attrs a = op_attrs::adamw(step, lr, beta1, beta2, eps, weight_decay);
  a.k = pass;
  a.grad_scale = grad_scale;
  const std::vector<size_t> written = pass == 1 ? std::vector<size_t>{0, 6, 8, 9}
                                                : std::vector<size_t>{2, 3, 4, 5};
  call_inplace(OpId::adamw8bit_segments_,
               {param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, master,
                segments, new_absmax, new_sq_absmax},
               a, written);
}

void adafactor_stats_(const Tensor& grad, const Tensor& out, double eps) {
  Attrs a;
  a.eps = eps;
  call_inplace(OpId::adafactor_stats_, {grad, out}, a, {1});
}

void adafactor_norm_(const Tensor& grad, const Tensor& a, const Tensor& b, const Tensor& out,
                     bool product, double divisor, double floor) {
  call_inplace(OpId::adafactor_norm_, {grad, a, b, out},
               op_attrs::adafactor(product, divisor, floor), {3});
}

void adafactor_apply_(const Tensor& param, const Tensor& grad, const Tensor& a, const Tensor& b,
                      const Tensor& exp_avg, bool product, double divisor, double floor,
                      double scale, double beta1, double c, int64_t form) {
  call_inplace(OpId::adafactor_apply_, {param, grad, a, b, exp_avg},
               op_attrs::adafactor(product, divisor, floor, scale, beta1, c, form), {0, 4});
}

void sgd_(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer, int64_t step,
          double lr, double momentum, double dampening, double weight_decay, bool nesterov,
          const Tensor& master, double grad_scale) {
  std::vector<Tensor> in = {param, grad, momentum_buffer};
  if (master.defined()) in.push_back(master);
  Attrs a = op_attrs::sgd(step, lr, momentum, dampening, weight_decay, nesterov);
  a.grad_scale = grad_scale;
  call_inplace(OpId::sgd_, std::move(in), a, {0, 2, 3});
}

// ---- views --------------------------------------------------------------------------------
Tensor view(const Tensor& x, const Shape& shape) {
  TS_CHECK(x.defined(), "view: input is undefined");
  return call_view(OpId::view, x, op_attrs::shape(internal::infer_view_shape("view", x.shape(), shape)));
}

Tensor reshape(const Tensor& x, const Shape& shape) {
  TS_CHECK(x.defined(), "reshape: input is undefined");
  const Shape target = internal::infer_view_shape("reshape", x.shape(), shape);
  if (internal::view_strides(x.shape(), x.strides(), target)) return view(x, target);
  return view(clone(x), target);
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& order) {
  return call_view(OpId::permute, x, op_attrs::dims(order));
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  TS_CHECK(x.defined(), "transpose: input is undefined");
  std::vector<int64_t> order(x.dim());
  std::iota(order.begin(), order.end(), 0);
  std::swap(order[normalize_dim("transpose", d0, x.dim())],
            order[normalize_dim("transpose", d1, x.dim())]);
  return permute(x, order);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  return call_view(OpId::slice, x, op_attrs::slice(dim, start, end, step));
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  TS_CHECK(x.defined() && x.dim() > 0, "narrow: input must have at least one dim");
  const int64_t d = normalize_dim("narrow", dim, x.dim());
  const int64_t size = x.shape()[d];
  if (start < 0) start += size;
  TS_CHECK(start >= 0 && length >= 0 && start + length <= size,
           "narrow: [{}, {}) is outside dim {} of size {} (shape {})", start, start + length, d,
           size, shape_str(x.shape()));
  return slice(x, d, start, start + length, 1);
}

Tensor expand(const Tensor& x, const Shape& shape) {
  return call_view(OpId::expand, x, op_attrs::shape(shape));
}

Tensor squeeze(const Tensor& x, const std::vector<int64_t>& dims) {
  return call_view(OpId::squeeze, x, op_attrs::dims(dims));
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  return call_view(OpId::unsqueeze, x, op_attrs::dim(dim));
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  TS_CHECK(x.defined(), "flatten: input is undefined");
  if (x.dim() == 0) return reshape(x, {1});
  const int64_t s = normalize_dim("flatten", start_dim, x.dim());
  const int64_t e = normalize_dim("flatten", end_dim, x.dim());
  TS_CHECK(s <= e, "flatten: start_dim {} is after end_dim {}", start_dim, end_dim);
  Shape shape(x.shape().begin(), x.shape().begin() + s);
  int64_t n = 1;
  for (int64_t i = s; i <= e; ++i) n *= x.shape()[i];
  shape.push_back(n);
  shape.insert(shape.end(), x.shape().begin() + e + 1, x.shape().end());
  return reshape(x, shape);
}

Tensor contiguous(const Tensor& x) {
  TS_CHECK(x.defined(), "contiguous: input is undefined");
  return x.is_contiguous() ? x : clone(x);
}

// ---- factories ----------------------------------------------------------------------------
Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Attrs a = op_attrs::full(shape, value, dtype);
  a.device = device;
  return call1(OpId::full, {}, a);
}
Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}
Tensor ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0, dtype, device);
}
Tensor zeros_like(const Tensor& x) { return zeros(x.shape(), x.dtype(), x.device()); }
Tensor ones_like(const Tensor& x) { return ones(x.shape(), x.dtype(), x.device()); }

Tensor arange(double start, double end, double step, DType dtype, Device device) {
  Attrs a = op_attrs::arange(start, end, step, dtype);
  a.device = device;
  return call1(OpId::arange, {}, a);
}

namespace {
Tensor random(OpId op, const Shape& shape, const RngView& view, uint64_t seed, uint64_t offset,
              DType dtype, Device device) {
  Attrs a = op_attrs::random(shape, seed, offset, dtype);
  a.rng_view = view;
  a.device = device;
  return call1(op, {}, a);
}
}  // namespace

Tensor rand(const Shape& shape, DType dtype, Device device, Generator* generator) {
  Generator& gen = generator != nullptr ? *generator : default_generator();
  const uint64_t offset = gen.advance(static_cast<uint64_t>(numel_of(shape)));
  return random(OpId::rand, shape, {}, gen.seed(), offset, dtype, device);
}
Tensor randn(const Shape& shape, DType dtype, Device device, Generator* generator) {
  Generator& gen = generator != nullptr ? *generator : default_generator();
  const uint64_t offset = gen.advance(static_cast<uint64_t>(numel_of(shape)));
  return random(OpId::randn, shape, {}, gen.seed(), offset, dtype, device);
}
Tensor rand_block(const Shape& shape, const RngView& view, uint64_t seed, uint64_t offset,
                  DType dtype, Device device) {
  return random(OpId::rand, shape, view, seed, offset, dtype, device);
}
Tensor randn_block(const Shape& shape, const RngView& view, uint64_t seed, uint64_t offset,
                   DType dtype, Device device) {
  return random(OpId::randn, shape, view, seed, offset, dtype, device);
}

// ---- backward helpers ---------------------------------------------------------------------
std::vector<Tensor> layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& mean,
                                        const Tensor& rstd, const Tensor& weight,
                                        const Tensor& bias, int64_t normalized_ndim,
                                        const Tensor& residual_grad) {
  Attrs a;
  a.normalized_ndim = normalized_ndim;
  if (!residual_grad.defined()) return call(OpId::layer_norm_backward, {grad, x, mean, rstd, weight, bias}, a);
  return call(OpId::layer_norm_backward, {grad, x, mean, rstd, weight, bias, residual_grad}, a);
}

Tensor cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target,
                              const Tensor& logsumexp, Reduction reduction,
                              int64_t ignore_index) {
  return call1(OpId::cross_entropy_backward, {grad, logits, target, logsumexp},
               op_attrs::cross_entropy(reduction, ignore_index));
}

std::vector<Tensor> attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k,
                                       const Tensor& v, const Tensor& out, const Tensor& lse,
                                       bool causal, double scale) {
  return call(OpId::attention_backward, {grad, q, k, v, out, lse}, op_attrs::attention(causal, scale));
}

Tensor attention_qkv_backward(const Tensor& grad, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int64_t head_dim, bool causal, double scale) {
  return call1(OpId::attention_qkv_backward, {grad, qkv, out, lse},
               op_attrs::attention_qkv(head_dim, causal, scale));
}

Tensor conv2d_backward_input(const Tensor& grad, const Tensor& weight, const Shape& input_shape,
                             std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  Attrs a;
  a.shape = input_shape;
  a.stride = stride;
  a.padding = padding;
  return call1(OpId::conv2d_backward_input, {grad, weight}, a);
}

Tensor grouped_matmul_backward_weight(const Tensor& x, const Tensor& grad, const Tensor& sizes) {
  return call1(OpId::grouped_matmul_backward_weight, {x, grad, sizes}, Attrs{});
}

Tensor conv2d_backward_weight(const Tensor& grad, const Tensor& x, const Shape& weight_shape,
                              std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  Attrs a;
  a.shape = weight_shape;
  a.stride = stride;
  a.padding = padding;
  return call1(OpId::conv2d_backward_weight, {grad, x}, a);
}

// ---- Tensor methods -----------------------------------------------------------------------
Tensor Tensor::reshape(const Shape& shape) const { return tessera::reshape(*this, shape); }
Tensor Tensor::view(const Shape& shape) const { return tessera::view(*this, shape); }
Tensor Tensor::permute(const std::vector<int64_t>& order) const {
  return tessera::permute(*this, order);
}
Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  return tessera::transpose(*this, d0, d1);
}
Tensor Tensor::t() const {
  TS_CHECK(dim() == 2, "t: expected a 2-D tensor, got shape {}", shape_str(shape()));
  return tessera::transpose(*this, 0, 1);
}
Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return tessera::slice(*this, d, start, end, step);
}
Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  return tessera::narrow(*this, d, start, length);
}
Tensor Tensor::select(int64_t d, int64_t index) const {
  const int64_t k = normalize_dim("select", d, dim());
  if (index < 0) index += shape()[k];
  TS_CHECK(index >= 0 && index < shape()[k], "select: index {} out of range for dim {} of {}",
           index, k, shape_str(shape()));
  return tessera::squeeze(tessera::narrow(*this, k, index, 1), {k});
}
Tensor Tensor::expand(const Shape& shape) const { return tessera::expand(*this, shape); }
Tensor Tensor::squeeze(const std::vector<int64_t>& dims) const {
  return tessera::squeeze(*this, dims);
}
Tensor Tensor::unsqueeze(int64_t d) const { return tessera::unsqueeze(*this, d); }
Tensor Tensor::flatten(int64_t s, int64_t e) const { return tessera::flatten(*this, s, e); }
Tensor Tensor::contiguous() const { return tessera::contiguous(*this); }
Tensor Tensor::clone() const { return tessera::clone(*this); }
Tensor Tensor::cast(DType dtype) const { return tessera::cast(*this, dtype); }
Tensor Tensor::to(Device device) const { return tessera::to(*this, device); }
const Tensor& Tensor::copy_(const Tensor& src) const {
  tessera::copy_(*this, src);
  return *this;
}
Tensor Tensor::sum(const std::vector<int64_t>& dims, bool keepdim) const {
  return tessera::sum(*this, dims, keepdim);
}
Tensor Tensor::mean(const std::vector<int64_t>& dims, bool keepdim) const {
  return tessera::mean(*this, dims, keepdim);
}

}  // namespace tessera
