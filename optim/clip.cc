#include "optim/clip.h"

#include <cmath>

#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::optim {

double grad_norm(const std::vector<Tensor>& params) {
  NoGradGuard no_grad;
  // Each gradient's sum of squares (in f64) is added to a 0-d f64 tensor on the gradients'
  // device, in parameter order, and read once at the end: the same additions as summing
  // item()s on the host, without one device synchronisation per parameter on a GPU.
  Tensor sum_sq;
  for (const Tensor& p : params) {
    TS_CHECK(p.defined(), "grad_norm: a parameter is an undefined tensor");
    const Tensor g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    const Tensor g64 = cast(g, DType::f64);
    const Tensor s = sum(g64 * g64);
    sum_sq = sum_sq.defined() ? sum_sq + s.to(sum_sq.device()) : s;
  }
  return sum_sq.defined() ? std::sqrt(sum_sq.item<double>()) : 0.0;
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  TS_CHECK(std::isfinite(max_norm) && max_norm > 0,
           "clip_grad_norm: max_norm must be finite and > 0, got {}", max_norm);
  return clip_grads_to_norm(params, grad_norm(params), max_norm);
}

double clip_grads_to_norm(const std::vector<Tensor>& params, double norm, double max_norm) {
  TS_CHECK(std::isfinite(max_norm) && max_norm > 0,
           "clip_grad_norm: max_norm must be finite and > 0, got {}", max_norm);
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return norm;
  NoGradGuard no_grad;
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    // 16-bit gradients are scaled in f32 and rounded once, not by a coefficient that was
    // itself rounded to 16 bits.
    const bool narrow = g.dtype() == DType::f16 || g.dtype() == DType::bf16;
    copy_(g, (narrow ? cast(g, DType::f32) : g) * coef);
  }
  return norm;
}

}  // namespace tessera::optim
