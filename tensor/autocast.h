// Mixed precision by op category (PyTorch's autocast): inside an AutocastGuard, matmul,
// linear (its bias too: the output is low-precision, as torch's linear) and conv2d run in
// the low-precision dtype (bf16 or f16), while reductions, softmax, log_softmax, layer_norm,
// exp/log and the loss run in f32; binary elementwise ops with mixed float
// operands run in the wider dtype. Casts are ordinary (differentiable) cast ops inserted by
// call(), so the weights stay f32 (the master copy) and their gradients come back f32.
//
//   { AutocastGuard amp(DType::bf16); loss = cross_entropy(model.forward(x), y); }
//   loss.backward();   // backward never autocasts: each derivative runs in its forward dtype
#pragma once

#include <span>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/op.h"

namespace tessera {

// How autocast treats an op's floating-point inputs.
enum class AutocastRule : uint8_t {
  keep,     // run as given (views, data movement, ops exact in any precision)
  lower,    // cast f32 inputs to the low-precision dtype (GEMM-bound ops)
  to_f32,   // cast f16/bf16 inputs to f32 (reductions, softmax, norms, the loss)
  promote,  // mixed float inputs: cast all to the widest (elementwise)
};

AutocastRule autocast_rule(OpId op);

// The low-precision dtype when autocast is on for this thread, else DType::f32 ("off").
DType autocast_dtype();
inline bool autocast_enabled() { return autocast_dtype() != DType::f32; }

// Turns autocast on with `low` (bf16 or f16), or off with f32, for its lifetime.
class AutocastGuard {
 public:
  explicit AutocastGuard(DType low);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  DType previous_;
};

// The dtypes `op`'s inputs take under autocast with low-precision dtype `low` (undefined
// inputs: unchanged), for any tensor type: tensors (call()) and sharded tensors
// (parallel::call) follow one policy.
std::vector<DType> autocast_dtypes(OpId op, const std::vector<DType>& dtypes, DType low);

// Applies the rule of `op` to its inputs in place (called by call() when autocast is on):
// `cast(t, dtype)` for each input whose dtype changes.
template <class T, class Cast>
void autocast_inputs_with(OpId op, std::vector<T>& inputs, Cast&& cast) {
  std::vector<DType> dtypes;
  for (const T& t : inputs) dtypes.push_back(t.defined() ? t.dtype() : DType::b8);  // (ignored)
  const std::vector<DType> want = autocast_dtypes(op, dtypes, autocast_dtype());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && want[i] != dtypes[i]) inputs[i] = cast(inputs[i], want[i]);
  }
}
void autocast_inputs(OpId op, std::vector<Tensor>& inputs);

}  // namespace tessera
