#include "optim/clip.h"

#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>
#include <vector>

#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::optim {

double grad_norm(const std::vector<Tensor>& params) {
  NoGradGuard no_grad;
  // The gradients' squares summed in f64 by one sum_squares per device (in parameter order
  // within it), read once at the end: the additions of summing each gradient's
  // sum(cast(g, f64) ^ 2) in parameter order, in one op instead of four per parameter, and
  // without a device synchronisation per parameter on a GPU.
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    TS_CHECK(p.defined(), "grad_norm: a parameter is an undefined tensor");
    const Tensor g = p.grad();
    if (g.defined() && g.numel() > 0) grads.push_back(g);
  }
  if (grads.empty()) return 0.0;
  const bool one_device = std::all_of(grads.begin(), grads.end(), [&](const Tensor& g) {
    return g.device() == grads[0].device();
  });
  if (one_device) return std::sqrt(sum_squares(grads).item<double>());
  Tensor sum_sq;  // gradients on several devices: one op per gradient, added in order
  for (const Tensor& g : grads) {
    const Tensor s = sum_squares({g});
    sum_sq = sum_sq.defined() ? sum_sq + s.to(sum_sq.device()) : s;
  }
  return std::sqrt(sum_sq.item<double>());
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  TS_CHECK(std::isfinite(max_norm) && max_norm > 0,
           "clip_grad_norm: max_norm must be finite and > 0, got {}", max_norm);
  return clip_grads_to_norm(params, grad_norm(params), max_norm);
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, Optimizer& opt) {
  TS_CHECK(std::isfinite(max_norm) && max_norm > 0,
           "clip_grad_norm: max_norm must be finite and > 0, got {}", max_norm);
  // The gradients opt scales are those the norm sums: the same parameters with a gradient.
  std::set<const TensorImpl*> listed, held;
  for (const Tensor& p : params) {
    TS_CHECK(p.defined(), "clip_grad_norm: a parameter is an undefined tensor");
    if (p.grad().defined()) listed.insert(p.impl());
  }
  for (const ParamGroup& group : opt.param_groups()) {
    for (const Tensor& p : group.params) {
      if (p.grad().defined()) held.insert(p.impl());
    }
  }
  TS_CHECK(listed == held,
           "clip_grad_norm: the {} parameters with a gradient given are not {}'s {} with a "
           "gradient (it applies the clipping coefficient to its own)",
           listed.size(), opt.kind(), held.size());
  // A coefficient still pending (clipped twice before a step) is written first, so the norm
  // is of the gradients the step would read, as clipping in place twice measures it.
  opt.apply_pending_grad_scale();
  const double norm = grad_norm(params);
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) opt.scale_grads(coef);
  return norm;
}

double clip_grad_norm(Optimizer& opt, double max_norm) {
  std::vector<Tensor> params;
  for (const ParamGroup& group : opt.param_groups()) {
    params.insert(params.end(), group.params.begin(), group.params.end());
  }
  return clip_grad_norm(params, max_norm, opt);
}

double clip_grads_to_norm(const std::vector<Tensor>& params, double norm, double max_norm) {
  TS_CHECK(std::isfinite(max_norm) && max_norm > 0,
           "clip_grad_norm: max_norm must be finite and > 0, got {}", max_norm);
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return norm;
  scale_gradients(params, coef);
  return norm;
}

void scale_gradients(const std::vector<Tensor>& params, double scale) {
  NoGradGuard no_grad;
  // One scale_ per device: 16-bit gradients are scaled in f32 and rounded once, not by a
  // coefficient that was itself rounded to 16 bits.
  std::vector<std::pair<Device, std::vector<Tensor>>> by_device;
  std::set<std::pair<const void*, int64_t>> seen;  // a parameter listed twice is scaled once
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    if (!seen.insert({g.storage().get(), g.offset()}).second) continue;
    auto it = std::find_if(by_device.begin(), by_device.end(),
                           [&](const auto& e) { return e.first == g.device(); });
    if (it == by_device.end()) it = by_device.insert(by_device.end(), {g.device(), {}});
    it->second.push_back(g);
  }
  for (const auto& [device, grads] : by_device) scale_(grads, scale);
}

}  // namespace tessera::optim
