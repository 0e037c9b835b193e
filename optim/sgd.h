// Stochastic gradient descent with momentum, dampening, Nesterov momentum and (coupled, L2)
// weight decay, with PyTorch's torch.optim.SGD semantics. step() issues one fused
// multi-tensor sgd_ call (tensor/ops.h) per bucket of like parameters.
//
//   SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9, .nesterov = true});
//   loss.backward();
//   opt.step();
//
// State per parameter: "momentum_buffer" when momentum != 0 (f32; f64 for f64 params), set
// to the first step's gradient; "master" (f32) for f16/bf16 params when master_weights is on.
#pragma once

#include "optim/optimizer.h"

namespace tessera::optim {

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;       // needs momentum > 0 and dampening == 0
  bool master_weights = true;  // f32 master copies of f16/bf16 params
};

class SGD : public Optimizer {
 public:
  explicit SGD(std::vector<Tensor> params, SGDOptions options = {});
  // Groups holding ParamGroup::kInherit take lr / weight_decay from options.
  explicit SGD(std::vector<ParamGroup> groups, SGDOptions options = {});

  void step() override;
  bool elementwise() const override { return true; }
  bool fuses_grad_scale() const override { return true; }
  const SGDOptions& options() const { return options_; }

 protected:
  std::vector<StateSpec> state_specs(const Tensor& param) const override;
  std::map<std::string, double> hyperparameters() const override;
  void set_hyperparameters(const std::map<std::string, double>& values) override;

 private:
  static SGDOptions checked(SGDOptions options);

  SGDOptions options_;
};

}  // namespace tessera::optim
