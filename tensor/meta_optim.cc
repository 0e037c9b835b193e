// Shape inference for the fused optimizer updates (adamw_, sgd_). They write into their
// inputs, so these only validate and return no outputs (see call_inplace in tensor/op.h).
#include <cmath>

#include "tensor/internal/meta_util.h"

namespace tessera {
namespace {

using namespace internal;

// param, grad: same float dtype and shape. `state` tensors: the param's shape in the
// state dtype (f64 for f64 params, else f32). An optional f32 master for f32/f16/bf16
// params. Everything on the param's device.
void check_update_operands(OpId op, std::span<const TensorSpec> in,
                           std::initializer_list<std::pair<size_t, const char*>> state,
                           size_t master_index) {
  const TensorSpec& param = required(op, in, 0, "param");
  require_float(op, param, "param");
  const TensorSpec& grad = required(op, in, 1, "grad");
  TS_CHECK(grad.dtype == param.dtype && grad.shape == param.shape,
           "{}: grad {} {} does not match param {} {}", name_of(op), grad.dtype,
           shape_str(grad.shape), param.dtype, shape_str(param.shape));
  auto same_device = [&](const TensorSpec& t, const char* what) {
    TS_CHECK(t.device == param.device, "{}: {} is on {} but param {} is on {}", name_of(op),
             what, t.device, shape_str(param.shape), param.device);
  };
  same_device(grad, "grad");
  const DType state_dt = stats_dtype(param.dtype);
  for (auto [i, what] : state) {
    if (i >= in.size() || !in[i].defined) continue;  // the caller checks presence
    const TensorSpec& s = in[i];
    TS_CHECK(s.dtype == state_dt && s.shape == param.shape,
             "{}: {} must be {} {} (the state dtype of a {} param), got {} {}", name_of(op),
             what, state_dt, shape_str(param.shape), param.dtype, s.dtype, shape_str(s.shape));
    same_device(s, what);
  }
  if (master_index < in.size() && in[master_index].defined) {
    const TensorSpec& m = in[master_index];
    TS_CHECK(param.dtype != DType::f64,
             "{}: an f32 master copy of an f64 param {} would lose precision; pass none",
             name_of(op), shape_str(param.shape));
    TS_CHECK(m.dtype == DType::f32 && m.shape == param.shape,
             "{}: master must be f32 {}, got {} {}", name_of(op), shape_str(param.shape),
             m.dtype, shape_str(m.shape));
    same_device(m, "master");
  }
}

void check_finite(OpId op, double v, const char* what) {
  TS_CHECK(std::isfinite(v), "{}: {} must be finite, got {}", name_of(op), what, v);
}

// Inputs: param, grad, exp_avg, exp_avg_sq, [master].
std::vector<TensorSpec> adamw_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::adamw_;
  TS_CHECK(in.size() == 4 || in.size() == 5,
           "adamw_: expected 4 or 5 inputs (param, grad, exp_avg, exp_avg_sq[, master]), got {}",
           in.size());
  required(op, in, 2, "exp_avg");
  required(op, in, 3, "exp_avg_sq");
  check_update_operands(op, in, {{2, "exp_avg"}, {3, "exp_avg_sq"}}, 4);
  TS_CHECK(a.step_count >= 1, "adamw_: step_count must be >= 1 (1-based), got {}", a.step_count);
  // beta == 1 makes the bias correction 1 - beta^t zero.
  TS_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
           "adamw_: betas must be in [0, 1), got ({}, {})", a.beta1, a.beta2);
  check_finite(op, a.lr, "lr");
  check_finite(op, a.eps, "eps");
  check_finite(op, a.weight_decay, "weight_decay");
  return {};
}

// Inputs: param, grad, momentum_buffer (undefined iff momentum == 0), [master].
std::vector<TensorSpec> sgd_meta(std::span<const TensorSpec> in, const Attrs& a) {
  constexpr OpId op = OpId::sgd_;
  TS_CHECK(in.size() == 3 || in.size() == 4,
           "sgd_: expected 3 or 4 inputs (param, grad, momentum_buffer[, master]), got {}",
           in.size());
  const bool has_buffer = in[2].defined;
  TS_CHECK(has_buffer == (a.momentum != 0.0),
           "sgd_: momentum {} {} a momentum_buffer, but it is {}", a.momentum,
           a.momentum != 0.0 ? "needs" : "takes no", has_buffer ? "defined" : "undefined");
  check_update_operands(op, in, {{2, "momentum_buffer"}}, 3);
  TS_CHECK(a.step_count >= 1, "sgd_: step_count must be >= 1 (1-based), got {}", a.step_count);
  TS_CHECK(!a.nesterov || (a.momentum > 0 && a.dampening == 0),
           "sgd_: nesterov needs momentum > 0 and dampening 0, got momentum {} dampening {}",
           a.momentum, a.dampening);
  check_finite(op, a.lr, "lr");
  check_finite(op, a.momentum, "momentum");
  check_finite(op, a.dampening, "dampening");
  check_finite(op, a.weight_decay, "weight_decay");
  return {};
}

TS_REGISTER_META(adamw_, adamw_meta);
TS_REGISTER_META(sgd_, sgd_meta);

}  // namespace
}  // namespace tessera
