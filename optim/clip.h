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

}  // namespace tessera::optim
