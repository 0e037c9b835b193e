#include "optim/loss_scaler.h"

#include <cmath>
#include <vector>

#include "optim/clip.h"
#include "optim/internal/state_dict.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::optim {

using internal::KeySpec;

LossScalerOptions DynamicLossScaler::checked(LossScalerOptions o) {
  TS_CHECK(std::isfinite(o.init_scale) && o.init_scale > 0,
           "DynamicLossScaler: init_scale must be finite and > 0, got {}", o.init_scale);
  TS_CHECK(std::isfinite(o.growth_factor) && o.growth_factor > 1,
           "DynamicLossScaler: growth_factor must be > 1, got {}", o.growth_factor);
  TS_CHECK(o.backoff_factor > 0 && o.backoff_factor < 1,
           "DynamicLossScaler: backoff_factor must be in (0, 1), got {}", o.backoff_factor);
  TS_CHECK(o.growth_interval >= 1, "DynamicLossScaler: growth_interval must be >= 1, got {}",
           o.growth_interval);
  return o;
}

DynamicLossScaler::DynamicLossScaler(LossScalerOptions options)
    : options_(checked(options)), scale_(options.init_scale) {}

Tensor DynamicLossScaler::scale(const Tensor& loss) const {
  TS_CHECK(loss.defined(), "DynamicLossScaler.scale: the loss is an undefined tensor");
  if (!options_.enabled) return loss;
  return loss * scale_;
}

bool DynamicLossScaler::unscale_and_check(const std::vector<Tensor>& params) {
  if (!options_.enabled) return true;
  TS_CHECK(!checked_,
           "DynamicLossScaler.unscale_and_check: the gradients were already unscaled in this "
           "iteration; call update() after step() to start the next one");
  NoGradGuard no_grad;
  const double inv = 1.0 / scale_;
  // Every gradient unscaled by one scale_ per device (clip.h's scale_gradients: 16-bit ones
  // in f32, rounded once, the bits of copy_(g, cast(g, f32) * inv); a parameter listed twice
  // once), then checked on the stored values by grad_norm: its f64 sum of squares cannot
  // overflow for f32 and 16-bit values (squares at most ~1.2e77), so the norm is non-finite
  // exactly when some element is (one op and one host read on one device). f64 gradients, whose
  // squares can overflow, are checked one by one with max(|g|) (max propagates NaN).
  std::vector<Tensor> narrow_or_f32, wide;
  for (const Tensor& p : params) {
    TS_CHECK(p.defined(), "DynamicLossScaler.unscale_and_check: a parameter is undefined");
    const Tensor g = p.grad();
    if (g.defined() && g.numel() > 0) (g.dtype() == DType::f64 ? wide : narrow_or_f32).push_back(p);
  }
  scale_gradients(params, inv);
  bool finite = std::isfinite(grad_norm(narrow_or_f32));
  for (const Tensor& p : wide) {
    if (finite && !std::isfinite(max(abs(p.grad())).item<double>())) finite = false;
  }
  checked_ = true;
  found_inf_ = any_rank_ ? any_rank_(!finite) : !finite;
  return !found_inf_;
}

bool DynamicLossScaler::unscale_and_check(const Optimizer& optimizer) {
  std::vector<Tensor> params;
  for (const ParamGroup& g : optimizer.param_groups()) {
    params.insert(params.end(), g.params.begin(), g.params.end());
  }
  return unscale_and_check(params);
}

bool DynamicLossScaler::step(Optimizer& optimizer) { return step(optimizer, nullptr); }

bool DynamicLossScaler::step(Optimizer& optimizer, const std::function<void()>& update) {
  auto run = [&] { update ? update() : optimizer.step(); };
  if (!options_.enabled) {
    run();
    return true;
  }
  if (!checked_) unscale_and_check(optimizer);
  if (found_inf_) {
    ++skipped_steps_;
    // The gradients stay (a caller may keep accumulating): clipping's pending coefficient is
    // written into them, as an in-place clip would have left them, not carried to a later step.
    optimizer.apply_pending_grad_scale();
    return false;
  }
  run();
  return true;
}

void DynamicLossScaler::update() {
  if (!options_.enabled) return;
  TS_CHECK(checked_,
           "DynamicLossScaler.update: no gradients were checked in this iteration; call "
           "step() (or unscale_and_check()) first");
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    scale_ *= options_.growth_factor;
    growth_tracker_ = 0;
  }
  checked_ = false;
  found_inf_ = false;
}

std::map<std::string, Tensor> DynamicLossScaler::state_dict() const {
  return {{"scale", internal::scalar_f64(scale_)},
          {"growth_factor", internal::scalar_f64(options_.growth_factor)},
          {"backoff_factor", internal::scalar_f64(options_.backoff_factor)},
          {"growth_interval", internal::scalar_i64(options_.growth_interval)},
          {"growth_tracker", internal::scalar_i64(growth_tracker_)},
          {"skipped_steps", internal::scalar_i64(skipped_steps_)}};
}

void DynamicLossScaler::load_state_dict(const std::map<std::string, Tensor>& dict) {
  TS_CHECK(!checked_,
           "DynamicLossScaler.load_state_dict: called mid-iteration (after unscaling, before "
           "update())");
  const KeySpec f64{{}, DType::f64}, i64{{}, DType::i64};
  internal::check_keys("DynamicLossScaler", dict,
                       {{"scale", f64},
                        {"growth_factor", f64},
                        {"backoff_factor", f64},
                        {"growth_interval", i64},
                        {"growth_tracker", i64},
                        {"skipped_steps", i64}});
  LossScalerOptions o = options_;
  o.init_scale = internal::get_f64(dict, "scale");
  o.growth_factor = internal::get_f64(dict, "growth_factor");
  o.backoff_factor = internal::get_f64(dict, "backoff_factor");
  o.growth_interval = internal::get_i64(dict, "growth_interval");
  o = checked(o);
  const int64_t tracker = internal::get_i64(dict, "growth_tracker");
  const int64_t skipped = internal::get_i64(dict, "skipped_steps");
  TS_CHECK(tracker >= 0 && tracker < o.growth_interval,
           "DynamicLossScaler.load_state_dict: growth_tracker {} must be in [0, growth_interval "
           "{})",
           tracker, o.growth_interval);
  TS_CHECK(skipped >= 0, "DynamicLossScaler.load_state_dict: skipped_steps {} is negative",
           skipped);
  options_.growth_factor = o.growth_factor;
  options_.backoff_factor = o.backoff_factor;
  options_.growth_interval = o.growth_interval;
  scale_ = o.init_scale;
  growth_tracker_ = tracker;
  skipped_steps_ = skipped;
}

}  // namespace tessera::optim
