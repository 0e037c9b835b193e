// Dynamic loss scaling for f16 training (torch.cuda.amp.GradScaler's algorithm): the loss is
// multiplied by a large scale so small gradients survive f16, the gradients are divided by
// it before the step, and a step whose gradients overflowed is skipped and the scale halved.
// Disabled (f32/bf16 training), it is the identity, so a loop has one code path:
//
//   DynamicLossScaler scaler({.enabled = dtype == DType::f16});
//   opt.zero_grad();
//   scaler.scale(loss).backward();
//   scaler.unscale_and_check(params);        // optional: only to clip the true gradients
//   clip_grad_norm(params, 1.0);
//   scaler.step(opt);                         // skipped when a gradient is inf/NaN
//   scaler.update();                          // once per iteration, after step()
//
// With several ranks whose gradients differ (ZeRO shards, tensor and pipeline parallel
// blocks), the overflow check must be global so that every rank skips the same steps:
//
//   scaler.reduce_found_inf_with([&](bool here) { /* all-reduce max over the ranks */ });
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "tensor/tensor.h"

namespace tessera::optim {

struct LossScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;     // after growth_interval good steps in a row
  double backoff_factor = 0.5;    // after a step with inf/NaN gradients
  int64_t growth_interval = 2000;
  bool enabled = true;
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerOptions options = {});

  // loss * scale (in loss's dtype; losses are normally f32). Disabled: loss itself.
  Tensor scale(const Tensor& loss) const;
  // Divides every gradient of `params` by the scale in place and returns whether all of
  // them are finite (on every rank, with reduce_found_inf_with): scale_gradients, then
  // whether grad_norm is finite (f64 gradients: a max |g| each). The check reads
  // the stored gradients, so a 16-bit one that the unscale overflowed counts. At most once
  // per iteration (Error on a second call before update()). Disabled: touches nothing and
  // returns true.
  bool unscale_and_check(const std::vector<Tensor>& params);
  // The same for the optimizer's parameters (under ZeRO: this rank's shards).
  bool unscale_and_check(const Optimizer& optimizer);
  // Unscales the optimizer's gradients unless unscale_and_check already did, then steps the
  // optimizer if they are all finite. Returns whether it stepped; a skipped step counts in
  // skipped_steps(). Disabled: optimizer.step(), true.
  bool step(Optimizer& optimizer);
  // The same, with `update` run instead of optimizer.step() (a wrapper's step, e.g. ZeRO's,
  // which steps the optimizer and gathers the parameters).
  bool step(Optimizer& optimizer, const std::function<void()>& update);
  // Makes the overflow check global: `any_rank(found_inf_here)` must return whether any rank
  // sharing the step found inf/NaN (an all-reduce), so every rank skips the same steps and
  // backs off to the same scale. Every rank then calls unscale_and_check / step together.
  using FoundInfReduction = std::function<bool(bool found_inf_here)>;
  void reduce_found_inf_with(FoundInfReduction any_rank) { any_rank_ = std::move(any_rank); }
  // Adjusts the scale from this iteration's check: backoff_factor on inf/NaN (resetting the
  // good-step count), growth_factor after growth_interval good steps in a row. Call once per
  // iteration after step() (Error if nothing was checked since the last update()).
  void update();

  double scale_value() const { return options_.enabled ? scale_ : 1.0; }
  int64_t skipped_steps() const { return skipped_steps_; }
  // Good steps in a row since the last change of scale.
  int64_t growth_tracker() const { return growth_tracker_; }
  bool enabled() const { return options_.enabled; }

  // scale, growth_factor, backoff_factor (0-d f64), growth_interval, growth_tracker,
  // skipped_steps (0-d i64).
  std::map<std::string, Tensor> state_dict() const;
  // Validates (Error naming a missing, unexpected or mis-shaped key, or a bad value) and
  // restores. Only between iterations (after update()).
  void load_state_dict(const std::map<std::string, Tensor>& dict);

 private:
  static LossScalerOptions checked(LossScalerOptions options);

  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_steps_ = 0;
  bool checked_ = false;    // unscaled and checked in this iteration
  bool found_inf_ = false;  // ... and found an inf/NaN gradient (on any rank)
  FoundInfReduction any_rank_;
};

}  // namespace tessera::optim
