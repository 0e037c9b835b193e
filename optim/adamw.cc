#include "optim/adamw.h"

#include <cmath>

#include "tensor/grad_mode.h"
#include "tensor/op.h"
#include "tensor/op_attrs.h"
#include "tensor/ops.h"

namespace tessera::optim {

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions options)
    : AdamW(std::vector<ParamGroup>{ParamGroup{std::move(params), {}}}, options) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions options)
    : Optimizer("AdamW", std::move(groups), options.lr, options.weight_decay),
      options_(checked(options)) {}

void check_adamw_values(const char* kind, double lr, std::pair<double, double> betas, double eps,
                        double weight_decay) {
  TS_CHECK(std::isfinite(lr) && lr >= 0, "{}: invalid learning rate {} (must be >= 0)", kind, lr);
  TS_CHECK(std::isfinite(eps) && eps >= 0, "{}: invalid eps {} (must be >= 0)", kind, eps);
  auto [b1, b2] = betas;
  TS_CHECK(b1 >= 0 && b1 < 1, "{}: invalid beta1 {} (must be in [0, 1))", kind, b1);
  TS_CHECK(b2 >= 0 && b2 < 1, "{}: invalid beta2 {} (must be in [0, 1))", kind, b2);
  TS_CHECK(std::isfinite(weight_decay) && weight_decay >= 0,
           "{}: invalid weight_decay {} (must be >= 0)", kind, weight_decay);
}

bool wants_master(bool master_weights, const Tensor& p) {
  return master_weights && (p.dtype() == DType::f16 || p.dtype() == DType::bf16);
}

AdamWOptions AdamW::checked(AdamWOptions o) {
  check_adamw_values("AdamW", o.lr, o.betas, o.eps, o.weight_decay);
  return o;
}

bool AdamW::uses_master(const Tensor& p) const { return wants_master(options_.master_weights, p); }

std::vector<Optimizer::StateSpec> AdamW::state_specs(const Tensor& p) const {
  const DType moments = p.dtype() == DType::f64 ? DType::f64 : DType::f32;
  std::vector<StateSpec> specs = {{"exp_avg", p.shape(), moments},
                                  {"exp_avg_sq", p.shape(), moments}};
  if (uses_master(p)) specs.push_back({"master", p.shape(), DType::f32});
  return specs;
}

std::map<std::string, double> AdamW::hyperparameters() const {
  return {{"beta1", options_.betas.first},
          {"beta2", options_.betas.second},
          {"eps", options_.eps}};
}

void AdamW::set_hyperparameters(const std::map<std::string, double>& values) {
  AdamWOptions o = options_;
  o.betas = {values.at("beta1"), values.at("beta2")};
  o.eps = values.at("eps");
  options_ = checked(o);
}

// One multi-tensor adamw_ call per bucket of like parameters (see
// for_each_bucket_with_grad): each tensor is updated exactly as a call of its own would.
void AdamW::step() {
  NoGradGuard no_grad;
  const double grad_scale = pending_grad_scale();
  for_each_bucket_with_grad(
      [&](const Tensor& p) {
        std::map<std::string, Tensor> s;
        for (const StateSpec& spec : state_specs(p)) {
          s[spec.name] = spec.name == "master" ? cast(p, DType::f32).contiguous()
                                               : zeros(spec.shape, spec.dtype, p.device());
        }
        return s;
      },
      [&](const ParamGroup& group, std::span<const Pending> bucket) {
        std::vector<Tensor> in;
        in.reserve(5 * bucket.size());
        for (const Pending& item : bucket) {
          const std::map<std::string, Tensor>& s = item.state->tensors;
          const auto master = s.find("master");
          in.insert(in.end(), {item.param, item.grad, s.at("exp_avg"), s.at("exp_avg_sq"),
                               master == s.end() ? Tensor() : master->second});
        }
        Attrs a = op_attrs::adamw(bucket.front().state->step + 1, group.lr, options_.betas.first,
                                  options_.betas.second, options_.eps, group.weight_decay);
        a.grad_scale = grad_scale;
        call_update(OpId::adamw_, std::move(in), a, 5, {0, 2, 3, 4});
        for (const Pending& item : bucket) ++item.state->step;
      });
  take_grad_scale();
}

}  // namespace tessera::optim
