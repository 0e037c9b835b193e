#include "optim/schedule.h"

#include <cmath>
#include <numbers>

#include "tensor/error.h"

namespace tessera::optim {

ConstantLr::ConstantLr(double lr) : lr_(lr) {
  TS_CHECK(std::isfinite(lr) && lr >= 0, "ConstantLr: invalid learning rate {} (must be >= 0)",
           lr);
}

double ConstantLr::lr(int64_t step) const {
  TS_CHECK(step >= 0, "ConstantLr: step {} is negative", step);
  return lr_;
}

WarmupCosineLr::WarmupCosineLr(double peak_lr, int64_t warmup_steps, int64_t total_steps,
                               double min_lr)
    : peak_lr_(peak_lr), warmup_steps_(warmup_steps), total_steps_(total_steps), min_lr_(min_lr) {
  TS_CHECK(std::isfinite(peak_lr) && peak_lr >= 0,
           "WarmupCosineLr: invalid peak_lr {} (must be >= 0)", peak_lr);
  TS_CHECK(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= peak_lr,
           "WarmupCosineLr: min_lr {} must be in [0, peak_lr {}]", min_lr, peak_lr);
  TS_CHECK(warmup_steps >= 0 && warmup_steps <= total_steps,
           "WarmupCosineLr: need 0 <= warmup_steps <= total_steps, got warmup_steps {} and "
           "total_steps {}",
           warmup_steps, total_steps);
}

double WarmupCosineLr::lr(int64_t step) const {
  TS_CHECK(step >= 0, "WarmupCosineLr: step {} is negative", step);
  if (step < warmup_steps_) {
    return peak_lr_ * static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
  }
  if (step >= total_steps_) return min_lr_;
  const double r = static_cast<double>(step - warmup_steps_) /
                   static_cast<double>(total_steps_ - warmup_steps_);
  return min_lr_ + (peak_lr_ - min_lr_) * 0.5 * (1.0 + std::cos(std::numbers::pi * r));
}

}  // namespace tessera::optim
