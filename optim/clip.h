// Gradient clipping by the global L2 norm (torch.nn.utils.clip_grad_norm_).
//
//   loss.backward();
//   const double norm = clip_grad_norm(model.parameters(), /*max_norm=*/1.0);
//   if (std::isfinite(norm)) opt.step();
//
// With a loss scaler, unscale first (DynamicLossScaler::unscale_and_check), then clip.
#pragma once

#include <vector>

#include "tensor/tensor.h"

namespace tessera::optim {

class Optimizer;

// The L2 norm over the gradients of all `params` together (params without a gradient are
// skipped), summed in f64 whatever the gradients' dtype: relative error about n * 2^-53 for
// n elements, far below any clipping threshold's meaning. When the norm exceeds max_norm,
// scales every gradient in place by max_norm / (norm + 1e-6) (the 1e-6 as PyTorch, so the
// clipped norm lands just below max_norm). Returns the norm before clipping. A non-finite
// norm (an inf or NaN gradient) is returned without scaling anything: the caller decides
// (skip the step, as DynamicLossScaler does).
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm);

// clip_grad_norm's scaling for a norm computed elsewhere (ZeRO: over every rank's shards):
// scales the gradients of `params` by max_norm / (norm + 1e-6) when norm > max_norm; a
// non-finite norm scales nothing. Returns norm.
double clip_grads_to_norm(const std::vector<Tensor>& params, double norm, double max_norm);

// The same global L2 norm without clipping.
double grad_norm(const std::vector<Tensor>& params);

// clip_grad_norm with the scaling left to `opt`'s next step() (Optimizer::scale_grads):
// AdamW, AdamW8bit and SGD read each gradient times the coefficient in their update, so the
// step is bitwise what clip_grad_norm(params) then step() gives, without a pass that writes
// the gradients; .grad keeps the unclipped values until then. Other optimizers scale the
// gradients here. `params` are opt's parameters (every one with a gradient, in any order:
// the norm sums in this order); Error otherwise. Returns the norm before clipping; a
// non-finite norm scales nothing (the caller skips the step and calls zero_grad()).
//
//   loss.backward();
//   if (std::isfinite(clip_grad_norm(params, 1.0, opt))) opt.step();
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, Optimizer& opt);
// The same over opt's parameters, in its groups' order.
double clip_grad_norm(Optimizer& opt, double max_norm);

// Each gradient of `params` (each storage once) times `scale`, in place: one scale_ per
// device.
void scale_gradients(const std::vector<Tensor>& params, double scale);

}  // namespace tessera::optim
