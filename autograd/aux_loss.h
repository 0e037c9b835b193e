// Auxiliary losses attached to an activation (Mixture of Experts' load-balancing and router
// z-losses; Megatron's MoEAuxLossAutoScaler): `attach_loss(x, aux)` returns x (the same data)
// and, in backward, passes x's gradient through and gives `aux` the gradient `scale`: the
// factor the program multiplies its loss by before backward (1 / micro-batches x ranks, the
// loss scale). The auxiliary loss then takes part in training as if it were added to the
// loss, wherever the layer runs: under activation recomputation (the recomputed graph
// attaches it again), on a pipeline stage that never sees the loss, in every micro-batch.
//
//   AuxLossScale scale(1.0 / accum);            // around forward and backward
//   y = attach_loss(y, 0.01 * balance_loss);    // inside the layer
//   (loss / accum).backward();                  // balance_loss's inputs get 0.01 / accum
#pragma once

#include "tensor/tensor.h"

namespace tessera::autograd {

// x itself when grad mode is off or neither requires grad; else a tensor sharing x's data
// whose backward sends (grad, scale) to (x, aux). aux must be a 0-d floating tensor.
Tensor attach_loss(const Tensor& x, const Tensor& aux);

// The gradient attached losses receive on this thread (read when attach_loss is called);
// 1 outside any scope. Scopes nest; the innermost wins.
double aux_loss_scale();
class AuxLossScale {
 public:
  explicit AuxLossScale(double scale);
  ~AuxLossScale();
  AuxLossScale(const AuxLossScale&) = delete;
  AuxLossScale& operator=(const AuxLossScale&) = delete;

 private:
  double previous_;
};

}  // namespace tessera::autograd
