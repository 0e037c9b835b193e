// The derivative table: one entry per differentiable op, written with ops, so it runs on
// every device and under every sharding.
//
//   TS_REGISTER_DERIVATIVE(mul, kSaveInput0 | kSaveInput1, 0, [](const GradCtx& c) {
//     return grads{sum_to(c.grad(0) * c.input(1), c.in_shape(0)), ...};
//   });
//
// An entry names which inputs/outputs it reads; only those are kept alive by the graph.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/op.h"

namespace tessera::autograd {

struct GradCtx {
  OpId op;
  const Attrs& attrs;
  const std::vector<Tensor>& inputs;       // saved inputs (undefined where not saved)
  const std::vector<Tensor>& outputs;      // saved outputs (undefined where not saved)
  const std::vector<TensorSpec>& in_specs;  // every input's shape/dtype/device
  const std::vector<TensorSpec>& out_specs;
  const std::vector<Tensor>& grads;        // gradient per output (undefined = zero)
  const std::vector<bool>& needs_grad;     // per input: does anything want its gradient

  const Tensor& input(size_t i) const { return inputs[i]; }
  const Tensor& output(size_t i) const { return outputs[i]; }
  const Tensor& grad(size_t i = 0) const { return grads[i]; }
  const Shape& in_shape(size_t i) const { return in_specs[i].shape; }
  bool needs(size_t i) const { return needs_grad[i]; }
};

using DerivativeFn = std::vector<Tensor> (*)(const GradCtx& ctx);

struct Derivative {
  DerivativeFn fn = nullptr;
  uint32_t save_inputs = 0;   // bit i: ctx.input(i) is read
  uint32_t save_outputs = 0;  // bit i: ctx.output(i) is read
  // bit i: output i carries gradients. Auxiliary outputs that only feed the backward
  // (layer_norm's mean/rstd, cross_entropy's logsumexp) are left out of the graph.
  uint32_t differentiable_outputs = ~0u;
};

inline constexpr uint32_t kIn0 = 1u << 0, kIn1 = 1u << 1, kIn2 = 1u << 2, kIn3 = 1u << 3,
                          kIn4 = 1u << 4, kIn5 = 1u << 5, kAllInputs = ~0u;
inline constexpr uint32_t kOut0 = 1u << 0, kOut1 = 1u << 1, kOut2 = 1u << 2, kOut3 = 1u << 3;

void register_derivative(OpId op, Derivative d);
const Derivative* derivative_for(OpId op);  // null if none is registered

}  // namespace tessera::autograd

// The function comes last (variadic) so commas inside a lambda body need no parentheses.
#define TS_REGISTER_DERIVATIVE(op, save_inputs, save_outputs, ...)                           \
  TS_REGISTER_DERIVATIVE_OUTPUTS(op, save_inputs, save_outputs, ~0u, __VA_ARGS__)
// As above, for ops with auxiliary outputs: only outputs in `diff_outputs` get a grad_fn.
#define TS_REGISTER_DERIVATIVE_OUTPUTS(op, save_inputs, save_outputs, diff_outputs, ...)     \
  static const bool TS_CONCAT(ts_derivative_registered_, __LINE__) =                         \
      (::tessera::autograd::register_derivative(                                             \
           ::tessera::OpId::op, ::tessera::autograd::Derivative{                             \
                                    __VA_ARGS__, save_inputs, save_outputs, diff_outputs}),  \
       true)
