#include "optim/sgd.h"

#include <cmath>

#include "tensor/grad_mode.h"
#include "tensor/op.h"
#include "tensor/op_attrs.h"
#include "tensor/ops.h"

namespace tessera::optim {

SGD::SGD(std::vector<Tensor> params, SGDOptions options)
    : SGD(std::vector<ParamGroup>{ParamGroup{std::move(params), {}}}, options) {}

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions options)
    : Optimizer("SGD", std::move(groups), options.lr, options.weight_decay),
      options_(checked(options)) {}

SGDOptions SGD::checked(SGDOptions o) {
  TS_CHECK(std::isfinite(o.lr) && o.lr >= 0, "SGD: invalid learning rate {} (must be >= 0)",
           o.lr);
  TS_CHECK(std::isfinite(o.momentum) && o.momentum >= 0,
           "SGD: invalid momentum {} (must be >= 0)", o.momentum);
  TS_CHECK(std::isfinite(o.dampening), "SGD: invalid dampening {} (must be finite)",
           o.dampening);
  TS_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0,
           "SGD: invalid weight_decay {} (must be >= 0)", o.weight_decay);
  TS_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
           "SGD: nesterov momentum requires momentum > 0 and dampening 0, got momentum {} and "
           "dampening {}",
           o.momentum, o.dampening);
  return o;
}

std::vector<Optimizer::StateSpec> SGD::state_specs(const Tensor& p) const {
  std::vector<StateSpec> specs;
  if (options_.momentum != 0) {
    specs.push_back(
        {"momentum_buffer", p.shape(), p.dtype() == DType::f64 ? DType::f64 : DType::f32});
  }
  if (options_.master_weights && (p.dtype() == DType::f16 || p.dtype() == DType::bf16)) {
    specs.push_back({"master", p.shape(), DType::f32});
  }
  return specs;
}

std::map<std::string, double> SGD::hyperparameters() const {
  return {{"momentum", options_.momentum},
          {"dampening", options_.dampening},
          {"nesterov", options_.nesterov ? 1.0 : 0.0}};
}

void SGD::set_hyperparameters(const std::map<std::string, double>& values) {
  SGDOptions o = options_;
  o.momentum = values.at("momentum");
  o.dampening = values.at("dampening");
  const double nesterov = values.at("nesterov");
  TS_CHECK(nesterov == 0.0 || nesterov == 1.0, "SGD: hparam.nesterov must be 0 or 1, got {}",
           nesterov);
  o.nesterov = nesterov == 1.0;
  options_ = checked(o);
}

// One multi-tensor sgd_ call per bucket of like parameters (see for_each_bucket_with_grad):
// each tensor is updated exactly as a call of its own would.
void SGD::step() {
  NoGradGuard no_grad;
  const double grad_scale = pending_grad_scale();
  for_each_bucket_with_grad(
      [&](const Tensor& p) {
        std::map<std::string, Tensor> s;
        for (const StateSpec& spec : state_specs(p)) {
          // The buffer's first values are never read: sgd_ seeds it at step 1.
          s[spec.name] = spec.name == "master" ? cast(p, DType::f32).contiguous()
                                               : Tensor::empty(spec.shape, spec.dtype, p.device());
        }
        return s;
      },
      [&](const ParamGroup& group, std::span<const Pending> bucket) {
        std::vector<Tensor> in;
        in.reserve(4 * bucket.size());
        for (const Pending& item : bucket) {
          const std::map<std::string, Tensor>& s = item.state->tensors;
          const auto buffer = s.find("momentum_buffer");
          const auto master = s.find("master");
          in.insert(in.end(), {item.param, item.grad,
                               buffer == s.end() ? Tensor() : buffer->second,
                               master == s.end() ? Tensor() : master->second});
        }
        Attrs a = op_attrs::sgd(bucket.front().state->step + 1, group.lr, options_.momentum,
                                options_.dampening, group.weight_decay, options_.nesterov);
        a.grad_scale = grad_scale;
        call_update(OpId::sgd_, std::move(in), a, 4, {0, 2, 3});
        for (const Pending& item : bucket) ++item.state->step;
      });
  take_grad_scale();
}

}  // namespace tessera::optim
