#include "parallel/onebit_adam.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "optim/adamw.h"
#include "parallel/comm/comm_log.h"
#include "parallel/onebit.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {

namespace {
constexpr const char* kName = "OnebitAdam";
}  // namespace

// ---- the hook ---------------------------------------------------------------------------------

WorkHandle OnebitAdamHook::reduce(Communicator& comm, const GradBucket& b) {
  TS_CHECK(opt_ != nullptr, "{}: its comm hook reduced a bucket before an OnebitAdam was built "
           "with it", kName);
  current_.uncompressed += b.buffer.numel();
  if (opt_->steps_done() < opt_->options().freeze_step) {  // the next step warms up: exact
    current_.sent += b.buffer.numel();
    return comm.all_reduce_async(b.buffer, b.average ? ReduceOp::avg : ReduceOp::sum);
  }
  // Each rank keeps its own estimate of the reduction: its gradient (the mean's), times the
  // group size where DDP sums (gpt's ranks backpropagate shares of the mean), so a clip
  // before the step measures what the optimizer takes, on the exact reduction's scale.
  if (!b.average) scale_({b.buffer}, static_cast<double>(comm.size()));  // in place, no copy
  // The step after this round sends each momentum through
  // onebit_all_reduce, whose bytes (onebit.h: padded / 4 (W - 1) / W + 8 (W - 1)) are an f32
  // all-reduce's of padded / 32 + W elements, counted here so the round reports them.
  for (const Tensor& g : b.gradients) {
    current_.sent += onebit_padded(g.numel(), comm.size()) / 32 + comm.size();
  }
  return completed_work();
}

void OnebitAdamHook::end_round() {
  last_ = current_;
  current_ = {};
}

std::map<std::string, Tensor> OnebitAdamHook::state_dict() const {
  std::map<std::string, Tensor> out;
  for (const auto& [i, e] : errors_) {
    out[fmt::format("worker.{}", i)] = e.first.clone();
    out[fmt::format("server.{}", i)] = e.second.clone();
  }
  return out;
}

void OnebitAdamHook::load_state_dict(const std::map<std::string, Tensor>& dict) {
  std::map<int64_t, std::pair<Tensor, Tensor>> errors;
  for (const auto& [key, v] : dict) {
    long long i = -1;
    char tail = 0;
    if (std::sscanf(key.c_str(), "worker.%lld%c", &i, &tail) == 1 && i >= 0 && v.dim() == 1) {
      errors[i].first = v.contiguous().clone();
    } else if (std::sscanf(key.c_str(), "server.%lld%c", &i, &tail) == 1 && i >= 0 && v.dim() == 1) {
      errors[i].second = v.contiguous().clone();
    } else {
      fail("{}: unexpected key '{}' {} in the hook's state dict (expected worker.<i>, server.<i>)",
           kName, key, shape_str(v.shape()));
    }
  }
  for (const auto& [i, e] : errors) {
    TS_CHECK(e.first.defined() && e.second.defined(),
             "{}: the hook's state dict has parameter {}'s {} error but not its {} error", kName,
             i, e.first.defined() ? "worker" : "server", e.first.defined() ? "server" : "worker");
  }
  errors_ = std::move(errors);
  current_ = {};
}

// ---- the optimizer ----------------------------------------------------------------------------

OnebitAdam::OnebitAdam(std::vector<optim::ParamGroup> groups, Communicator& comm,
                       OnebitAdamOptions options, std::shared_ptr<OnebitAdamHook> hook)
    : Optimizer(kName, std::move(groups), options.lr, options.weight_decay),
      comm_(comm),
      options_(options),
      hook_(hook ? std::move(hook) : std::make_shared<OnebitAdamHook>()) {
  optim::check_adamw_values(kName, options.lr, options.betas, options.eps, options.weight_decay);
  TS_CHECK(options.freeze_step >= 1,
           "{}: freeze_step must be >= 1 (the variance is frozen after a warm-up), got {}", kName,
           options.freeze_step);
  TS_CHECK(hook_->opt_ == nullptr, "{}: its comm hook already belongs to another OnebitAdam",
           kName);
  hook_->opt_ = this;  // last: nothing below throws, so the destructor will detach it
}

OnebitAdam::~OnebitAdam() {
  if (hook_->opt_ == this) hook_->opt_ = nullptr;
}

double OnebitAdam::update_bound() const {
  const double b1 = options_.betas.first, b2 = options_.betas.second;
  if (b1 * b1 >= b2) return std::numeric_limits<double>::infinity();
  return (1.0 - b1) / std::sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2));
}

int64_t OnebitAdam::steps_done() const {
  int64_t most = 0;
  for (int64_t i = 0; i < num_params(); ++i) most = std::max(most, step_count(i));
  return most;
}

std::vector<optim::Optimizer::StateSpec> OnebitAdam::state_specs(const Tensor& p) const {
  TS_CHECK(p.dtype() == DType::f32 || p.dtype() == DType::f64,
           "{}: parameters must be f32 or f64 (mixed precision through autocast), got {} {}",
           kName, p.dtype(), shape_str(p.shape()));
  return {{"exp_avg", p.shape(), p.dtype()}, {"exp_avg_sq", p.shape(), p.dtype()}};
}

std::map<std::string, double> OnebitAdam::hyperparameters_before() const {
  // Dicts saved before these existed were the paper's: the momentum, l2 scales, no bound.
  return {{"precondition", 0.0}, {"scale_l2", 1.0}, {"bound_update", 0.0}};
}

std::map<std::string, double> OnebitAdam::hyperparameters() const {
  return {{"beta1", options_.betas.first},
          {"beta2", options_.betas.second},
          {"eps", options_.eps},
          {"freeze_step", static_cast<double>(options_.freeze_step)},
          {"bias_correction", options_.bias_correction ? 1.0 : 0.0},
          {"precondition", options_.precondition ? 1.0 : 0.0},
          {"scale_l2", options_.scale == OnebitScale::l2 ? 1.0 : 0.0},
          {"bound_update", options_.bound_update ? 1.0 : 0.0}};
}

void OnebitAdam::set_hyperparameters(const std::map<std::string, double>& values) {
  OnebitAdamOptions o = options_;
  o.betas = {values.at("beta1"), values.at("beta2")};
  o.eps = values.at("eps");
  // What the steps after the freeze depend on (the bound only when the update is sent).
  const auto settings = [](double freeze, bool correct, bool update, bool l2, bool bound) {
    return fmt::format("freeze_step {}, bias_correction {}, and sends the {} with {} scales{}",
                       freeze, correct, update ? "update" : "momentum", l2 ? "l2" : "l1",
                       update ? (bound ? ", bounded" : ", unbounded") : "");
  };
  const bool update = values.at("precondition") != 0.0;
  const std::string saved =
      settings(values.at("freeze_step"), values.at("bias_correction") != 0.0, update,
               values.at("scale_l2") != 0.0, values.at("bound_update") != 0.0);
  const std::string mine =
      settings(static_cast<double>(o.freeze_step), o.bias_correction, o.precondition,
               o.scale == OnebitScale::l2, o.bound_update);
  TS_CHECK(saved == mine,
           "{}: the state dict was saved with {}; this optimizer has {} (gpt, mnist: "
           "--onebit_freeze, --onebit_send, --onebit_scale, --onebit_bound)",
           kName, saved, mine);
  optim::check_adamw_values(kName, o.lr, o.betas, o.eps, o.weight_decay);
  options_ = o;
}

void OnebitAdam::step() {
  NoGradGuard no_grad;
  for_each_bucket_with_grad(
      [&](const Tensor& p) {
        std::map<std::string, Tensor> s;
        for (const StateSpec& spec : state_specs(p)) s[spec.name] = zeros(spec.shape, spec.dtype, p.device());
        return s;
      },
      [&](const optim::ParamGroup& group, std::span<const Pending> bucket) {
        // Everything that can refuse, before anything changes (the bucket is retried one
        // parameter at a time after an Error).
        for (const Pending& item : bucket) {
          TS_CHECK(item.grad.dtype() == item.param.dtype() && item.grad.shape() == item.param.shape(),
                   "{}: the gradient {} {} does not match its parameter {} {}", kName,
                   item.grad.dtype(), shape_str(item.grad.shape()), item.param.dtype(),
                   shape_str(item.param.shape()));
          if (item.state->step + 1 > options_.freeze_step) check_errors(item);
        }
        // The bucket's compressed parameters: their momenta through one 1-bit all-reduce.
        std::vector<Tensor> momenta, worker_errors, server_errors, denominators;
        for (const Pending& item : bucket) {
          if (item.state->step + 1 > options_.freeze_step) {
            Local local = local_momentum(item);
            momenta.push_back(std::move(local.sent));
            worker_errors.push_back(std::move(local.worker_error));
            server_errors.push_back(std::move(local.server_error));
            denominators.push_back(std::move(local.denominator));
          }
        }
        if (!momenta.empty()) {
          onebit_all_reduce_many(comm_, momenta, worker_errors, server_errors, options_.scale);
        }
        size_t compressed = 0;
        for (const Pending& item : bucket) {
          const int64_t t = item.state->step + 1;
          std::map<std::string, Tensor>& s = item.state->tensors;
          if (t > options_.freeze_step) {
            compressed_update(group, item, momenta[compressed], denominators[compressed]);
            ++compressed;
          } else if (options_.bias_correction) {  // AdamW's step, on the exactly reduced gradient
            adamw_(item.param, item.grad, s.at("exp_avg"), s.at("exp_avg_sq"), t, group.lr,
                   options_.betas.first, options_.betas.second, options_.eps, group.weight_decay);
          } else {  // DeepSpeed's: m / (sqrt(v) + eps), no bias correction
            const Tensor& m = s.at("exp_avg");
            const Tensor& v = s.at("exp_avg_sq");
            const Tensor& g = item.grad;
            m.copy_(m + (1.0 - options_.betas.first) * (g - m));
            v.copy_(v * options_.betas.second + (1.0 - options_.betas.second) * (g * g));
            item.param.copy_(item.param * (1.0 - group.lr * group.weight_decay) -
                             group.lr * (m / (sqrt(v) + options_.eps)));
          }
          ++item.state->step;
        }
      });
}

void OnebitAdam::check_errors(const Pending& item) const {
  auto it = hook_->errors_.find(item.index);
  if (it == hook_->errors_.end()) return;  // made at its first compressed step
  const int w = comm_.size();
  const int64_t padded = onebit_padded(item.param.numel(), w);
  TS_CHECK(it->second.first.numel() == padded && it->second.second.numel() == padded / w,
           "{}: parameter {}'s error feedback holds {} and {} elements, {} ranks need {} and {} "
           "(resumed on another number of ranks?)",
           kName, item.index, it->second.first.numel(), it->second.second.numel(), w, padded,
           padded / w);
}

OnebitAdam::Local OnebitAdam::local_momentum(const Pending& item) {
  std::map<std::string, Tensor>& s = item.state->tensors;
  const Tensor& m = s.at("exp_avg");
  const double b1 = options_.betas.first;
  const int w = comm_.size();
  // This rank's gradient on the scale of the reduced one (the hook scaled a summing DDP's
  // share).
  const Tensor& g = item.grad;
  m.copy_(m + (1.0 - b1) * (g - m));
  // Padded for the 1-bit all-reduce, with this parameter's error feedback.
  const int64_t n = m.numel(), padded = onebit_padded(n, w);
  // AdamW's denominator with the variance of the last warm-up step (frozen).
  const double frozen = static_cast<double>(options_.freeze_step);
  const double bc2 = options_.bias_correction ? 1.0 - std::pow(options_.betas.second, frozen) : 1.0;
  Tensor denom = sqrt(s.at("exp_avg_sq")) / std::sqrt(bc2) + options_.eps;
  auto [it, fresh] = hook_->errors_.try_emplace(item.index);
  if (fresh) {
    it->second = {zeros({padded}, m.dtype(), m.device()), zeros({padded / w}, m.dtype(), m.device())};
  } else if (it->second.first.device() != m.device()) {  // loaded from a checkpoint on the CPU
    it->second = {it->second.first.to(m.device()), it->second.second.to(m.device())};
  }
  const Tensor buf = zeros({padded}, m.dtype(), m.device());
  Tensor sent = m;
  if (options_.precondition) {
    sent = m / denom;
    // Within the largest |m| / sqrt(v) AdamW can reach, on u's scale (u carries sqrt(bc2)).
    const double bound = update_bound() * std::sqrt(bc2);
    if (options_.bound_update && std::isfinite(bound)) {
      sent = minimum(maximum(sent, scalar_like(-bound, sent, kName)),
                     scalar_like(bound, sent, kName));
    }
  }
  buf.narrow(0, 0, n).copy_(sent.reshape({n}));
  return {buf, it->second.first, it->second.second, std::move(denom)};
}

void OnebitAdam::compressed_update(const optim::ParamGroup& group, const Pending& item,
                                   const Tensor& reduced, const Tensor& denom) {
  const Tensor& m = item.state->tensors.at("exp_avg");
  const double b1 = options_.betas.first;
  // AdamW's update u = m / denominator. Sent preconditioned, the mean of u came back, 1 bit
  // an element (m = u x denominator); otherwise the momenta's mean (u = m / denominator).
  const Tensor mean = reduced.narrow(0, 0, m.numel()).view(m.shape());
  const Tensor u = options_.precondition ? mean : mean / denom;
  m.copy_(options_.precondition ? mean * denom : mean);
  const double t = static_cast<double>(item.state->step + 1);
  const double bc1 = options_.bias_correction ? 1.0 - std::pow(b1, t) : 1.0;
  item.param.copy_(item.param * (1.0 - group.lr * group.weight_decay) - (group.lr / bc1) * u);
}

}  // namespace tessera::parallel
