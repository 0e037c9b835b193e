// AdamW (Loshchilov & Hutter, decoupled weight decay) with PyTorch's torch.optim.AdamW
// semantics and defaults. step() issues one fused multi-tensor adamw_ call (tensor/ops.h,
// tensor/meta_optim.cc) per bucket of parameters sharing group, step count, device and dtype.
//
//   AdamW opt(model.parameters(), {.lr = 3e-4, .weight_decay = 0.1});
//   loss.backward();
//   opt.step();
//
// State per parameter: exp_avg and exp_avg_sq (f32; f64 for f64 params) and, for f16/bf16
// params when master_weights is on, "master": an f32 copy the update is applied to, the
// param then holding it rounded (small updates are not lost to 16-bit rounding).
#pragma once

#include <utility>

#include "optim/optimizer.h"

namespace tessera::optim {

struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool master_weights = true;  // f32 master copies of f16/bf16 params
};

// The checks AdamW and AdamW8bit share: Error naming `kind` and the value for lr or eps < 0,
// a beta outside [0, 1), weight_decay < 0 or anything non-finite.
void check_adamw_values(const char* kind, double lr, std::pair<double, double> betas, double eps,
                        double weight_decay);
// Whether `param` gets an f32 master copy: f16/bf16 with master weights on.
bool wants_master(bool master_weights, const Tensor& param);

class AdamW : public Optimizer {
 public:
  explicit AdamW(std::vector<Tensor> params, AdamWOptions options = {});
  // Groups holding ParamGroup::kInherit take lr / weight_decay from options.
  explicit AdamW(std::vector<ParamGroup> groups, AdamWOptions options = {});

  void step() override;
  bool elementwise() const override { return true; }
  bool fuses_grad_scale() const override { return true; }
  const AdamWOptions& options() const { return options_; }

 protected:
  std::vector<StateSpec> state_specs(const Tensor& param) const override;
  std::map<std::string, double> hyperparameters() const override;
  void set_hyperparameters(const std::map<std::string, double>& values) override;

 private:
  static AdamWOptions checked(AdamWOptions options);
  bool uses_master(const Tensor& param) const;

  AdamWOptions options_;
};

}  // namespace tessera::optim
