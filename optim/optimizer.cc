#include "optim/optimizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "optim/clip.h"
#include "optim/internal/state_dict.h"
#include "tensor/grad_mode.h"
#include "tensor/op.h"
#include "tensor/ops.h"

namespace tessera::optim {

using internal::KeySpec;
using internal::scalar_f64;
using internal::scalar_i64;

std::vector<ParamGroup> decay_groups(const std::vector<std::pair<std::string, Tensor>>& named_params,
                                     double lr, double weight_decay) {
  ParamGroup decay, no_decay;
  decay.lr = no_decay.lr = lr;
  decay.weight_decay = weight_decay;
  no_decay.weight_decay = 0.0;
  for (const auto& [name, p] : named_params) {
    TS_CHECK(p.defined(), "decay_groups: parameter '{}' is an undefined tensor", name);
    ParamGroup& g = p.dim() >= 2 ? decay : no_decay;
    g.params.push_back(p);
    g.names.push_back(name);
  }
  return {std::move(decay), std::move(no_decay)};
}

Optimizer::Optimizer(std::string kind, std::vector<ParamGroup> groups, double default_lr,
                     double default_weight_decay)
    : kind_(std::move(kind)), groups_(std::move(groups)) {
  TS_CHECK(!groups_.empty(), "{}: no parameter groups", kind_);
  std::set<const TensorImpl*> seen;
  int64_t total = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    ParamGroup& group = groups_[g];
    TS_CHECK(group.names.empty() || group.names.size() == group.params.size(),
             "{}: group {} has {} names for {} params", kind_, g, group.names.size(),
             group.params.size());
    if (std::isnan(group.lr)) group.lr = default_lr;
    if (std::isnan(group.weight_decay)) group.weight_decay = default_weight_decay;
    check_group_values(group.lr, group.weight_decay);
    for (size_t k = 0; k < group.params.size(); ++k) {
      const Tensor& p = group.params[k];
      const std::string name = group.names.empty() ? "" : " (" + group.names[k] + ")";
      TS_CHECK(p.defined(), "{}: group {} param {}{} is an undefined tensor", kind_, g, k, name);
      TS_CHECK(is_floating(p.dtype()),
               "{}: group {} param {}{} is {} {}; only floating tensors can be optimized",
               kind_, g, k, name, p.dtype(), shape_str(p.shape()));
      TS_CHECK(p.is_leaf(),
               "{}: group {} param {}{} {} is not a leaf (an op computed it); optimize the "
               "tensor it was computed from",
               kind_, g, k, name, shape_str(p.shape()));
      TS_CHECK(seen.insert(p.impl()).second,
               "{}: group {} param {}{} {} appears more than once in the parameter groups",
               kind_, g, k, name, shape_str(p.shape()));
      ++total;
    }
  }
  TS_CHECK(total > 0, "{}: got an empty parameter list", kind_);
  state_.resize(static_cast<size_t>(total));
}

void Optimizer::check_group_values(double lr, double weight_decay) const {
  TS_CHECK(std::isfinite(lr) && lr >= 0.0, "{}: invalid learning rate {} (must be finite, >= 0)",
           kind_, lr);
  TS_CHECK(std::isfinite(weight_decay) && weight_decay >= 0.0,
           "{}: invalid weight_decay {} (must be finite, >= 0)", kind_, weight_decay);
}

void Optimizer::zero_grad() {
  for (const ParamGroup& group : groups_) {
    for (const Tensor& p : group.params) {
      if (p.grad().defined()) p.set_grad(Tensor());
    }
  }
  grad_scale_ = 1.0;
}

void Optimizer::scale_grads(double scale) {
  TS_CHECK(std::isfinite(scale), "{}: scale_grads: the scale must be finite, got {}", kind_, scale);
  if (!fuses_grad_scale()) {
    grad_scale_ = scale;
    apply_pending_grad_scale();
    return;
  }
  apply_pending_grad_scale();
  grad_scale_ = scale;
}

void Optimizer::apply_pending_grad_scale() {
  if (grad_scale_ == 1.0) return;
  std::vector<Tensor> params;
  for (const ParamGroup& group : groups_) params.insert(params.end(), group.params.begin(), group.params.end());
  scale_gradients(params, take_grad_scale());
}

void Optimizer::set_lr(double lr) {
  for (const ParamGroup& group : groups_) check_group_values(lr, group.weight_decay);
  for (ParamGroup& group : groups_) group.lr = lr;
}

void Optimizer::set_group_lr(size_t g, double lr) {
  TS_CHECK(g < groups_.size(), "{}.set_group_lr: group {} out of range [0, {})", kind_, g, groups_.size());
  check_group_values(lr, groups_[g].weight_decay);
  groups_[g].lr = lr;
}

int64_t Optimizer::step_count(int64_t i) const {
  TS_CHECK(i >= 0 && i < num_params(), "{}.step_count: param index {} out of range [0, {})",
           kind_, i, num_params());
  return state_[static_cast<size_t>(i)].step;
}

const std::map<std::string, Tensor>& Optimizer::state(int64_t i) const {
  TS_CHECK(i >= 0 && i < num_params(), "{}.state: param index {} out of range [0, {})", kind_, i,
           num_params());
  return state_[static_cast<size_t>(i)].tensors;
}

int64_t Optimizer::state_bytes() const {
  int64_t total = 0;
  for (const ParamState& s : state_) {
    for (const auto& [name, t] : s.tensors) total += t.nbytes();
  }
  return total;
}

void Optimizer::call_update(OpId op, std::vector<Tensor> inputs, const Attrs& attrs, size_t width,
                            std::initializer_list<size_t> written) {
  const size_t tuples = inputs.size() / width;
  TS_CHECK(inputs.size() % width == 0 && tuples <= kMaxTuplesPerCall,
           "{}: {} inputs are not at most {} tuples of {}", op_name(op), inputs.size(),
           kMaxTuplesPerCall, width);
  std::vector<size_t> index;
  for (size_t j = 0; j < tuples; ++j) {
    for (size_t w : written) index.push_back(j * width + w);
  }
  call_inplace(op, std::move(inputs), attrs, index);
}

std::string Optimizer::describe_param(int64_t i) const {
  int64_t first = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroup& group = groups_[g];
    const int64_t n = static_cast<int64_t>(group.params.size());
    if (i < first + n) {
      const size_t k = static_cast<size_t>(i - first);
      const std::string name = group.names.empty() ? "" : " (" + group.names[k] + ")";
      return fmt::format("param {}{} {} {} in group {}", i, name, group.params[k].dtype(),
                         shape_str(group.params[k].shape()), g);
    }
    first += n;
  }
  return fmt::format("param {}", i);
}

Optimizer::StateDict Optimizer::state_dict() const {
  NoGradGuard no_grad;
  StateDict d;
  int64_t first = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroup& group = groups_[g];
    const std::string prefix = fmt::format("group.{}.", g);
    d[prefix + "lr"] = scalar_f64(group.lr);
    d[prefix + "weight_decay"] = scalar_f64(group.weight_decay);
    std::vector<int64_t> indices(group.params.size());
    for (size_t k = 0; k < indices.size(); ++k) indices[k] = first + static_cast<int64_t>(k);
    d[prefix + "params"] =
        Tensor::from_vector<int64_t>(indices, {static_cast<int64_t>(indices.size())});
    first += static_cast<int64_t>(indices.size());
  }
  for (const auto& [name, value] : hyperparameters()) d["hparam." + name] = scalar_f64(value);
  for (size_t i = 0; i < state_.size(); ++i) {
    const ParamState& s = state_[i];
    if (s.step == 0) continue;
    const std::string prefix = fmt::format("state.{}.", i);
    d[prefix + "step"] = scalar_i64(s.step);
    for (const auto& [name, t] : s.tensors) d[prefix + name] = clone(t);
  }
  return d;
}

namespace {

// The global index i of a key "state.<i>.<name>", or -1.
int64_t state_index(const std::string& key, int64_t num_params) {
  constexpr std::string_view kPrefix = "state.";
  if (key.rfind(kPrefix, 0) != 0) return -1;
  const size_t dot = key.find('.', kPrefix.size());
  if (dot == std::string::npos || dot == kPrefix.size()) return -1;
  int64_t i = 0;
  for (size_t c = kPrefix.size(); c < dot; ++c) {
    if (key[c] < '0' || key[c] > '9' || i > num_params) return -1;
    i = i * 10 + (key[c] - '0');
  }
  return i < num_params ? i : -1;
}

}  // namespace

void Optimizer::load_state_dict(const StateDict& dict) {
  NoGradGuard no_grad;
  // Hyperparameters first: which state a parameter has (SGD's momentum buffer) depends on
  // them. They are put back if anything after fails.
  const std::map<std::string, double> old_hparams = hyperparameters();
  const std::map<std::string, double> before = hyperparameters_before();
  std::map<std::string, double> new_hparams;
  for (const auto& [name, value] : old_hparams) {
    const std::string key = "hparam." + name;
    const auto it = dict.find(key);
    if (it == dict.end() && before.count(name) != 0) {  // an older dict: the value it stood for
      new_hparams[name] = before.at(name);
      continue;
    }
    TS_CHECK(it != dict.end(), "{}.load_state_dict: missing key '{}'", kind_, key);
    internal::check_keys(kind_, {*it}, {{key, KeySpec{{}, DType::f64}}});
    new_hparams[name] = it->second.item<double>();
  }
  set_hyperparameters(new_hparams);
  try {
    std::map<std::string, KeySpec> expected;
    for (const auto& [name, value] : old_hparams) {
      if (dict.count("hparam." + name) != 0 || before.count(name) == 0) {
        expected["hparam." + name] = {{}, DType::f64};
      }
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      const std::string prefix = fmt::format("group.{}.", g);
      expected[prefix + "lr"] = {{}, DType::f64};
      expected[prefix + "weight_decay"] = {{}, DType::f64};
      expected[prefix + "params"] = {{static_cast<int64_t>(groups_[g].params.size())}, DType::i64};
    }
    std::vector<Tensor> params;
    for (const ParamGroup& group : groups_) {
      params.insert(params.end(), group.params.begin(), group.params.end());
    }
    std::set<int64_t> stepped;
    for (const auto& [key, t] : dict) {
      const int64_t i = state_index(key, num_params());
      if (i >= 0) stepped.insert(i);
    }
    for (int64_t i : stepped) {
      const std::string prefix = fmt::format("state.{}.", i);
      expected[prefix + "step"] = {{}, DType::i64};
      for (const StateSpec& s : state_specs(params[i])) {
        expected[prefix + s.name] = {s.shape, s.dtype};
      }
    }
    internal::check_keys(kind_, dict, expected);

    // Values: group layout, group hyperparameters, step counts.
    int64_t first = 0;
    for (size_t g = 0; g < groups_.size(); ++g) {
      const std::string prefix = fmt::format("group.{}.", g);
      const std::vector<int64_t> saved = dict.at(prefix + "params").to_vector<int64_t>();
      std::vector<int64_t> mine(groups_[g].params.size());
      for (size_t k = 0; k < mine.size(); ++k) mine[k] = first + static_cast<int64_t>(k);
      TS_CHECK(saved == mine,
               "{}.load_state_dict: '{}params' holds params [{}] but this optimizer's group {} "
               "holds [{}]",
               kind_, prefix, fmt::join(saved, ", "), g, fmt::join(mine, ", "));
      check_group_values(internal::get_f64(dict, prefix + "lr"),
                         internal::get_f64(dict, prefix + "weight_decay"));
      first += static_cast<int64_t>(mine.size());
    }
    std::vector<ParamState> state(state_.size());
    for (int64_t i : stepped) {
      const std::string prefix = fmt::format("state.{}.", i);
      ParamState& s = state[static_cast<size_t>(i)];
      s.step = internal::get_i64(dict, prefix + "step");
      TS_CHECK(s.step >= 1, "{}.load_state_dict: '{}step' is {}; a saved state has step >= 1",
               kind_, prefix, s.step);
      for (const StateSpec& spec : state_specs(params[i])) {
        Tensor t = Tensor::empty(spec.shape, spec.dtype, params[i].device());
        copy_(t, dict.at(prefix + spec.name));
        s.tensors[spec.name] = t;
      }
    }

    // Commit (nothing below throws).
    for (size_t g = 0; g < groups_.size(); ++g) {
      const std::string prefix = fmt::format("group.{}.", g);
      groups_[g].lr = internal::get_f64(dict, prefix + "lr");
      groups_[g].weight_decay = internal::get_f64(dict, prefix + "weight_decay");
    }
    state_ = std::move(state);
  } catch (...) {
    set_hyperparameters(old_hparams);
    throw;
  }
}

}  // namespace tessera::optim
