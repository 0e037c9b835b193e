// Learning-rate schedules: lr(step) for the 0-based index of the optimizer step about to be
// taken. The training loop applies them; nothing here holds a reference to an optimizer.
//
//   WarmupCosineLr schedule(/*peak_lr=*/6e-4, /*warmup_steps=*/100, /*total_steps=*/5000,
//                           /*min_lr=*/6e-5);
//   for (int64_t step = 0; step < 5000; ++step) {
//     opt.set_lr(schedule.lr(step));
//     ...; opt.step();
//   }
#pragma once

#include <cstdint>

namespace tessera::optim {

class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  virtual double lr(int64_t step) const = 0;
};

class ConstantLr : public LrSchedule {
 public:
  explicit ConstantLr(double lr);
  double lr(int64_t step) const override;

 private:
  double lr_;
};

// Linear warmup, then a half cosine down to min_lr (nanoGPT's schedule):
//   step <  warmup_steps:                 peak_lr * (step + 1) / warmup_steps
//   warmup_steps <= step < total_steps:   min_lr + (peak_lr - min_lr) * (1 + cos(pi * r)) / 2,
//                                         r = (step - warmup_steps) / (total_steps - warmup_steps)
//   step >= total_steps:                  min_lr
// So the first step already trains (peak / warmup, not 0), the last warmup step and the
// first cosine step both use peak_lr, and the cosine reaches min_lr exactly at total_steps.
// warmup_steps may be 0 (no warmup) and equal to total_steps (no decay phase).
class WarmupCosineLr : public LrSchedule {
 public:
  WarmupCosineLr(double peak_lr, int64_t warmup_steps, int64_t total_steps, double min_lr = 0.0);
  double lr(int64_t step) const override;

 private:
  double peak_lr_;
  int64_t warmup_steps_;
  int64_t total_steps_;
  double min_lr_;
};

}  // namespace tessera::optim
