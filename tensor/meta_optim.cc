// Shape inference for the fused optimizer updates (adamw_, adamw8bit_[segments_], sgd_). They
// write into their inputs, so these only validate and return no outputs (see call_inplace in
// tensor/op.h).
//
// Multi-tensor form (what optim/ issues, one call per bucket of like parameters): the inputs
// are k consecutive tuples, adamw_ (param, grad, exp_avg, exp_avg_sq, master-or-undefined)
// and sgd_ (param, grad, momentum_buffer-or-undefined, master-or-undefined), all sharing
// the Attrs. Each tuple is checked as a single call would be; errors name the tuple. The
// short single-tensor forms (4/5 and 3/4 inputs) stay as they were. Tuples must not share
// memory with each other (not checked here; optim/ never passes a tensor twice).
#include <cmath>
#include <string>

#include "tensor/internal/meta_util.h"
#include "tensor/quant8.h"

namespace tessera {
namespace {

using namespace internal;

// Names the op in errors: "adamw_", or "adamw_ tuple 3 of 8" in the multi-tensor form.
// Formatted only when a check fails (TS_CHECK's arguments are), as calls may carry
// thousands of tuples.
struct Label {
  OpId op;
  size_t j = 0, k = 0;  // tuple j of k; k == 0: the single-tensor form
  std::string str() const {
    return k == 0 ? std::string(name_of(op)) : fmt::format("{} tuple {} of {}", name_of(op), j, k);
  }
};

// param, grad: same float dtype and shape. `state` tensors: the param's shape in the
// state dtype (f64 for f64 params, else f32). An optional f32 master for f32/f16/bf16
// params. Everything on the param's device.
void check_update_operands(const Label& label, std::span<const TensorSpec> in,
                           std::initializer_list<std::pair<size_t, const char*>> state,
                           size_t master_index) {
  TS_CHECK(in[0].defined, "{}: param (input 0) is an undefined tensor", label.str());
  const TensorSpec& param = in[0];
  TS_CHECK(is_floating(param.dtype), "{}: param must be floating (f32, f64, f16, bf16), got {} {}",
           label.str(), param.dtype, shape_str(param.shape));
  TS_CHECK(in[1].defined, "{}: grad (input 1) is an undefined tensor", label.str());
  const TensorSpec& grad = in[1];
  TS_CHECK(grad.dtype == param.dtype && grad.shape == param.shape,
           "{}: grad {} {} does not match param {} {}", label.str(), grad.dtype,
           shape_str(grad.shape), param.dtype, shape_str(param.shape));
  auto same_device = [&](const TensorSpec& t, const char* what) {
    TS_CHECK(t.device == param.device, "{}: {} is on {} but param {} is on {}", label.str(), what,
             t.device, shape_str(param.shape), param.device);
  };
  same_device(grad, "grad");
  const DType state_dt = stats_dtype(param.dtype);
  for (auto [i, what] : state) {
    if (i >= in.size() || !in[i].defined) continue;  // the caller checks presence
    const TensorSpec& s = in[i];
    TS_CHECK(s.dtype == state_dt && s.shape == param.shape,
             "{}: {} must be {} {} (the state dtype of a {} param), got {} {}", label.str(), what,
             state_dt, shape_str(param.shape), param.dtype, s.dtype, shape_str(s.shape));
    same_device(s, what);
  }
  if (master_index < in.size() && in[master_index].defined) {
    const TensorSpec& m = in[master_index];
    TS_CHECK(param.dtype != DType::f64,
             "{}: an f32 master copy of an f64 param {} would lose precision; pass none",
             label.str(), shape_str(param.shape));
    TS_CHECK(m.dtype == DType::f32 && m.shape == param.shape,
             "{}: master must be f32 {}, got {} {}", label.str(), shape_str(param.shape), m.dtype,
             shape_str(m.shape));
    same_device(m, "master");
  }
}

// Runs check(label, tuple) on each tuple of `width` inputs: the single-tensor form (fewer
// than 2 * width inputs) is one tuple labelled with the op's name.
template <typename Check>
void for_each_tuple(OpId op, std::span<const TensorSpec> in, size_t width, Check&& check) {
  if (in.size() < 2 * width) return check(Label{op}, in);
  const size_t k = in.size() / width;
  for (size_t j = 0; j < k; ++j) check(Label{op, j, k}, in.subspan(j * width, width));
}

void check_finite(OpId op, double v, const char* what) {
  TS_CHECK(std::isfinite(v), "{}: {} must be finite, got {}", name_of(op), what, v);
}

// The attributes of AdamW's step (adamw_, adamw8bit_[segments_]): a 1-based step, betas in
// [0, 1) (beta == 1 makes the bias correction 1 - beta^t zero), finite lr, eps, decay and
// grad_scale.
void check_adam_attrs(OpId op, const Attrs& a) {
  TS_CHECK(a.step_count >= 1, "{}: step_count must be >= 1 (1-based), got {}", name_of(op),
           a.step_count);
  TS_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
           "{}: betas must be in [0, 1), got ({}, {})", name_of(op), a.beta1, a.beta2);
  check_finite(op, a.lr, "lr");
  check_finite(op, a.eps, "eps");
  check_finite(op, a.weight_decay, "weight_decay");
  check_finite(op, a.grad_scale, "grad_scale");
}

// Inputs: param, grad, exp_avg, exp_avg_sq, [master]; or k such tuples of 5 (master
// undefined where there is none).
std::vector<TensorSpec> adamw_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::adamw_;
  TS_CHECK(in.size() == 4 || (in.size() >= 5 && in.size() % 5 == 0),
           "adamw_: expected 4 or 5 inputs (param, grad, exp_avg, exp_avg_sq[, master]), or "
           "5k for k such tuples, got {}",
           in.size());
  for_each_tuple(op, in, 5, [&](const Label& label, std::span<const TensorSpec> t) {
    TS_CHECK(t[2].defined, "{}: exp_avg (input 2) is an undefined tensor", label.str());
    TS_CHECK(t[3].defined, "{}: exp_avg_sq (input 3) is an undefined tensor", label.str());
    check_update_operands(label, t, {{2, "exp_avg"}, {3, "exp_avg_sq"}}, 4);
  });
  check_adam_attrs(op, a);
  return {};
}

// Inputs: param, grad, exp_avg (u8), exp_avg_sq (u8), exp_avg_absmax, exp_avg_sq_absmax,
// [master]; or k such tuples of 7 (master undefined where there is none).
std::vector<TensorSpec> adamw8bit_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::adamw8bit_;
  TS_CHECK(in.size() == 6 || (in.size() >= 7 && in.size() % 7 == 0),
           "adamw8bit_: expected 6 or 7 inputs (param, grad, exp_avg, exp_avg_sq, "
           "exp_avg_absmax, exp_avg_sq_absmax[, master]), or 7k for k such tuples, got {}",
           in.size());
  for_each_tuple(op, in, 7, [&](const Label& label, std::span<const TensorSpec> t) {
    static constexpr const char* kNames[] = {"param", "grad", "exp_avg", "exp_avg_sq",
                                             "exp_avg_absmax", "exp_avg_sq_absmax"};
    for (size_t i = 2; i < 6; ++i) {
      TS_CHECK(t[i].defined, "{}: {} (input {}) is an undefined tensor", label.str(), kNames[i], i);
    }
    check_update_operands(label, t, {}, 6);
    const TensorSpec& p = t[0];
    for (size_t i : {size_t{2}, size_t{3}}) {
      TS_CHECK(t[i].dtype == DType::u8 && t[i].shape == p.shape,
               "{}: {} must be u8 {} (codes shaped like param), got {} {}", label.str(), kNames[i],
               shape_str(p.shape), t[i].dtype, shape_str(t[i].shape));
      TS_CHECK(t[i].device == p.device, "{}: {} is on {} but param {} is on {}", label.str(),
               kNames[i], t[i].device, shape_str(p.shape), p.device);
    }
    const Shape blocks = {quant8_blocks(numel_of(p.shape))};
    for (size_t i : {size_t{4}, size_t{5}}) {
      TS_CHECK(t[i].dtype == stats_dtype(p.dtype) && t[i].shape == blocks,
               "{}: {} must be {} {} (one scale per block of {} elements of a {} param {}), got "
               "{} {}",
               label.str(), kNames[i], stats_dtype(p.dtype), shape_str(blocks), kQuant8Block,
               p.dtype, shape_str(p.shape), t[i].dtype, shape_str(t[i].shape));
      TS_CHECK(t[i].device == p.device, "{}: {} is on {} but param {} is on {}", label.str(),
               kNames[i], t[i].device, shape_str(p.shape), p.device);
    }
  });
  check_adam_attrs(op, a);
  return {};
}

// Inputs: param, grad, exp_avg (u8), exp_avg_sq (u8), exp_avg_absmax, exp_avg_sq_absmax,
// master (maybe undefined), segments (i64 [S, 2]), new_absmax, new_sq_absmax; attrs.k the
// pass (1 or 2). The scales are any length (the blocks of a larger tensor); the segments'
// values are the kernel's to check.
std::vector<TensorSpec> adamw8bit_segments_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::adamw8bit_segments_;
  static constexpr const char* kNames[] = {
      "param", "grad", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
      "master", "segments", "new_absmax", "new_sq_absmax"};
  TS_CHECK(in.size() == 10,
           "adamw8bit_segments_: expected 10 inputs (param, grad, exp_avg, exp_avg_sq, "
           "exp_avg_absmax, exp_avg_sq_absmax, master or undefined, segments, new_absmax, "
           "new_sq_absmax), got {}",
           in.size());
  for (size_t i : {2, 3, 4, 5, 7, 8, 9}) {
    TS_CHECK(in[i].defined, "adamw8bit_segments_: {} (input {}) is an undefined tensor",
             kNames[i], i);
  }
  const Label label{op};
  check_update_operands(label, in, {}, 6);
  const TensorSpec& p = in[0];
  for (size_t i : {size_t{2}, size_t{3}}) {
    TS_CHECK(in[i].dtype == DType::u8 && in[i].shape == p.shape,
             "adamw8bit_segments_: {} must be u8 {} (codes shaped like param), got {} {}",
             kNames[i], shape_str(p.shape), in[i].dtype, shape_str(in[i].shape));
  }
  const Shape blocks = in[4].shape;
  for (size_t i : {size_t{4}, size_t{5}, size_t{8}, size_t{9}}) {
    TS_CHECK(in[i].dtype == stats_dtype(p.dtype) && in[i].shape.size() == 1 &&
                 in[i].shape == blocks,
             "adamw8bit_segments_: {} must be {} {} (one scale per block, as exp_avg_absmax; a "
             "{} param), got {} {}",
             kNames[i], stats_dtype(p.dtype), shape_str(blocks), p.dtype, in[i].dtype,
             shape_str(in[i].shape));
  }
  const TensorSpec& seg = in[7];
  TS_CHECK(seg.dtype == DType::i64 && seg.shape.size() == 2 && seg.shape[1] == 2,
           "adamw8bit_segments_: segments must be i64 [S, 2] (each segment's end and block), "
           "got {} {}",
           seg.dtype, shape_str(seg.shape));
  for (size_t i : {2, 3, 4, 5, 7, 8, 9}) {
    TS_CHECK(in[i].device == p.device, "adamw8bit_segments_: {} is on {} but param {} is on {}",
             kNames[i], in[i].device, shape_str(p.shape), p.device);
  }
  TS_CHECK(a.k == 1 || a.k == 2,
           "adamw8bit_segments_: the pass must be 1 (update) or 2 (requantize), got {}", a.k);
  check_adam_attrs(op, a);
  return {};
}

// Inputs: param, grad, momentum_buffer (undefined iff momentum == 0), [master]; or k tuples
// of 4 (master undefined where there is none).
std::vector<TensorSpec> sgd_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::sgd_;
  TS_CHECK(in.size() == 3 || (in.size() >= 4 && in.size() % 4 == 0),
           "sgd_: expected 3 or 4 inputs (param, grad, momentum_buffer[, master]), or 4k for "
           "k such tuples, got {}",
           in.size());
  for_each_tuple(op, in, 4, [&](const Label& label, std::span<const TensorSpec> t) {
    const bool has_buffer = t[2].defined;
    TS_CHECK(has_buffer == (a.momentum != 0.0),
             "{}: momentum {} {} a momentum_buffer, but it is {}", label.str(), a.momentum,
             a.momentum != 0.0 ? "needs" : "takes no", has_buffer ? "defined" : "undefined");
    check_update_operands(label, t, {{2, "momentum_buffer"}}, 3);
  });
  TS_CHECK(a.step_count >= 1, "sgd_: step_count must be >= 1 (1-based), got {}", a.step_count);
  TS_CHECK(!a.nesterov || (a.momentum > 0 && a.dampening == 0),
           "sgd_: nesterov needs momentum > 0 and dampening 0, got momentum {} dampening {}",
           a.momentum, a.dampening);
  check_finite(op, a.lr, "lr");
  check_finite(op, a.momentum, "momentum");
  check_finite(op, a.dampening, "dampening");
  check_finite(op, a.weight_decay, "weight_decay");
  check_finite(op, a.grad_scale, "grad_scale");
  return {};
}

// Adafactor's passes (tensor/ops.h): grad [B, M, N] f32/f64; a [B, M], b [B, N] and (apply)
// param and exp_avg in its dtype; everything on grad's device.
void check_adafactor_matrix(OpId op, const TensorSpec& grad, const char* what) {
  TS_CHECK(grad.defined, "{}: {} is an undefined tensor", name_of(op), what);
  TS_CHECK(grad.dtype == DType::f32 || grad.dtype == DType::f64,
           "{}: {} must be f32 or f64 (the optimizer casts other dtypes), got {} {}", name_of(op),
           what, grad.dtype, shape_str(grad.shape));
  TS_CHECK(grad.shape.size() == 3, "{}: {} must be [matrices, rows, columns], got {}", name_of(op),
           what, shape_str(grad.shape));
}
void check_like(OpId op, const TensorSpec& grad, const TensorSpec& t, const Shape& shape,
                const char* what) {
  TS_CHECK(t.defined, "{}: {} is an undefined tensor", name_of(op), what);
  TS_CHECK(t.dtype == grad.dtype && t.shape == shape,
           "{}: {} must be {} {} for grad {}, got {} {}", name_of(op), what, grad.dtype,
           shape_str(shape), shape_str(grad.shape), t.dtype, shape_str(t.shape));
  TS_CHECK(t.device == grad.device, "{}: {} is on {} but grad is on {}", name_of(op), what,
           t.device, grad.device);
}
// The row and column factors (a, b) of grad g, and the update's form.
void check_factors(OpId op, const TensorSpec& g, const TensorSpec& row, const TensorSpec& col,
                   const Attrs& a) {
  const Shape& s = g.shape;
  check_like(op, g, row, {s[0], s[1]}, "a (the row factors)");
  check_like(op, g, col, {s[0], s[2]}, "b (the column factors)");
  TS_CHECK(a.k == 0 || a.k == 1, "{}: k (1: the product form, 0: the floored one) must be 0 or "
           "1, got {}", name_of(op), a.k);
  check_finite(op, a.eps, "floor");
  TS_CHECK(a.k == 1 || (std::isfinite(a.value) && a.value > 0),
           "{}: the floored form's divisor must be finite and > 0, got {}", name_of(op), a.value);
}

// Inputs: grad [B, M, N], out [B, M + N].
std::vector<TensorSpec> adafactor_stats_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::adafactor_stats_;
  TS_CHECK(in.size() == 2, "adafactor_stats_: expected 2 inputs (grad, out), got {}", in.size());
  check_adafactor_matrix(op, in[0], "grad");
  const Shape& s = in[0].shape;
  check_like(op, in[0], in[1], {s[0], s[1] + s[2]}, "out");
  check_finite(op, a.eps, "eps");
  return {};
}

// Inputs: grad [B, M, N], a [B, M], b [B, N], out [1] f64.
std::vector<TensorSpec> adafactor_norm_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::adafactor_norm_;
  TS_CHECK(in.size() == 4, "adafactor_norm_: expected 4 inputs (grad, a, b, out), got {}",
           in.size());
  check_adafactor_matrix(op, in[0], "grad");
  check_factors(op, in[0], in[1], in[2], a);
  const TensorSpec& out = in[3];
  TS_CHECK(out.defined && out.dtype == DType::f64 && out.shape == Shape{1},
           "adafactor_norm_: out must be f64 [1], got {} {}", out.dtype, shape_str(out.shape));
  TS_CHECK(out.device == in[0].device, "adafactor_norm_: out is on {} but grad is on {}",
           out.device, in[0].device);
  return {};
}

// Inputs: param [B, M, N], grad, a [B, M], b [B, N], exp_avg (undefined iff beta1 == 0).
std::vector<TensorSpec> adafactor_apply_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::adafactor_apply_;
  TS_CHECK(in.size() == 4 || in.size() == 5,
           "adafactor_apply_: expected 4 or 5 inputs (param, grad, a, b[, exp_avg]), got {}",
           in.size());
  check_adafactor_matrix(op, in[1], "grad");
  check_like(op, in[1], in[0], in[1].shape, "param");
  check_factors(op, in[1], in[2], in[3], a);
  const bool moment = in.size() == 5 && in[4].defined;
  TS_CHECK(moment == (a.beta1 > 0),
           "adafactor_apply_: beta1 {} {} an exp_avg, but it is {}", a.beta1,
           a.beta1 > 0 ? "needs" : "takes no", moment ? "defined" : "undefined");
  if (moment) check_like(op, in[1], in[4], in[1].shape, "exp_avg");
  TS_CHECK(a.beta1 >= 0 && a.beta1 < 1, "adafactor_apply_: beta1 must be in [0, 1), got {}",
           a.beta1);
  TS_CHECK(a.dim >= 0 && a.dim <= 2, "adafactor_apply_: form must be 0 (hf), 1 (torch) or 2 "
           "(optax), got {}", a.dim);
  check_finite(op, a.scale, "scale");
  check_finite(op, a.weight_decay, "c");
  return {};
}

// scale_(x1, ..., xk): floating tensors on one device, each written in place; a finite scale.
std::vector<TensorSpec> scale_meta(std::span<const TensorSpec> in, const Attrs& a) {
  require_floats_on_one_device(OpId::scale_, in);
  check_finite(OpId::scale_, a.scale, "the scale");
  return {};
}

TS_REGISTER_META(adamw_, adamw_meta);
TS_REGISTER_META(scale_, scale_meta);
TS_REGISTER_META(adafactor_stats_, adafactor_stats_meta);
TS_REGISTER_META(adafactor_norm_, adafactor_norm_meta);
TS_REGISTER_META(adafactor_apply_, adafactor_apply_meta);
TS_REGISTER_META(adamw8bit_, adamw8bit_meta);
TS_REGISTER_META(adamw8bit_segments_, adamw8bit_segments_meta);
TS_REGISTER_META(sgd_, sgd_meta);

}  // namespace
}  // namespace tessera
