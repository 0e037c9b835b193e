#include "models/gpt/check.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "models/gpt/data.h"
#include "models/common/optimizers.h"
#include "optim/optimizer.h"
#include "optim/clip.h"
#include "optim/schedule.h"
#include "parallel/equivalence.h"
#include "tensor/error.h"
#include "tensor/random.h"

namespace tessera::gpt {

GptCheckResult check_gpt(const GptTrainConfig& c, parallel::CommPtr world) {
  TS_CHECK(c.precision == "f32",
           "gpt --check: the check runs in f64 (rounding would hide or fake differences); "
           "drop --precision={}", c.precision);
  TS_CHECK(world != nullptr && world->size() == c.pp * c.dp * c.tp,
           "gpt --check: --pp {} x --dp {} x --tp {} ranks, but the world has {}", c.pp, c.dp,
           c.tp, world != nullptr ? world->size() : 1);
  const GptData data(c);
  const uint64_t seed = static_cast<uint64_t>(c.seed);
  // One device: the plain model (no recomputation: it changes nothing but memory).
  GptConfig one_config = c.model_config();
  one_config.recompute = GptConfig::Recompute::none;
  manual_seed(seed);
  Gpt one(one_config);
  one.to(DType::f64);
  uint64_t one_offset = default_generator().offset();
  // The optimizer the layout runs (--optimizer), on the whole parameters.
  const std::unique_ptr<optim::Optimizer> one_opt = models::make_optimizer(
      "gpt --check", c.optimizer_choice(),
      optim::decay_groups(one.named_parameters(), c.lr, c.weight_decay));
  const std::vector<Tensor> one_params = one.parameters();
  // The layout, from the same seed.
  manual_seed(seed);
  Gpt model(c.model_config());
  model.to(DType::f64);
  uint64_t layout_offset = default_generator().offset();
  Gpt3dOptions o = gpt3d_options(c);
  o.capture = true;
  o.inject = c.inject;
  Gpt3d g(model, world, o);

  const optim::WarmupCosineLr schedule(c.lr, std::min(c.warmup, c.steps / 2), c.steps,
                                       c.lr * c.min_lr_ratio);
  const int64_t stop = c.max_steps > 0 ? std::min(c.max_steps, c.steps) : c.steps;
  parallel::EquivalenceChecker check(g.describe() + (c.inject.empty() ? "" : ", injected: " + c.inject),
                                     c.check_tolerance);
  GptCheckResult result;
  for (int64_t step = 0; step < stop && check.ok(); ++step) {
    const data::TextBatch b = data.train(step);
    const double lr = schedule.lr(step);
    // One device.
    default_generator().set_state(seed, one_offset);
    std::vector<std::pair<std::string, Tensor>> one_outputs;
    one.set_layer_observer([&](const std::string& layer, const Tensor& out) {
      one_outputs.emplace_back(layer, out.detach().clone());
    });
    one_opt->set_lr(lr);
    one_opt->zero_grad();
    const nn::MoeStatsScope one_routing;  // the experts' counts, for the selection bias
    const Tensor one_loss = Gpt::loss(one(b.idx), b.targets);
    one_loss.backward();
    std::map<std::string, Tensor> one_grads;
    for (const auto& [name, t] : one.named_parameters()) one_grads[name] = t.grad().clone();
    if (c.clip > 0) optim::clip_grad_norm(one_params, c.clip);
    one_opt->step();
    // Aux-loss-free balancing: each block's bias moves by the step's counts.
    for (const nn::MoeLayerStats& l : c.moe_bias_rate > 0 ? one_routing.layers()
                                                           : std::vector<nn::MoeLayerStats>{}) {
      const int64_t i = std::stoll(l.name.substr(2));  // "h.<i>"
      nn::update_selection_bias(static_cast<Block&>(*(*one.h)[static_cast<size_t>(i)]).moe->selection_bias,
                                l.counts, c.moe_bias_rate);
    }
    one_offset = default_generator().offset();
    // The layout.
    default_generator().set_state(seed, layout_offset);
    const double loss = g.train_step(b.idx, b.targets, lr);
    layout_offset = default_generator().offset();
    const std::vector<std::pair<std::string, Tensor>> outputs = g.activations();
    const std::map<std::string, Tensor> grads = g.full_gradients();
    const std::map<std::string, Tensor> params = g.full_parameters();
    result.steps = step + 1;

    using parallel::CheckPhase;
    TS_CHECK(outputs.size() == one_outputs.size(), "gpt --check: {} layer outputs, one device {}",
             outputs.size(), one_outputs.size());
    for (size_t l = 0; l < outputs.size(); ++l) {
      const auto& [name, got] = outputs[l];
      const int64_t per_row = got.numel() / std::max<int64_t>(got.size(0), 1);
      check.compare(step, CheckPhase::forward, name + " output", got, one_outputs[l].second,
                    [&, l](int64_t i) { return g.where_row(static_cast<int>(l), i / per_row); });
    }
    check.compare(step, CheckPhase::forward, "loss", Tensor::from_vector<double>({loss}, {1}),
                  Tensor::from_vector<double>({one_loss.item<double>()}, {1}));
    // (Plain variables, not structured bindings: the lambdas capture them; clang < 16
    // rejects capturing a binding.)
    const nn::NamedTensors named = one.named_parameters();
    for (const auto& entry : named) {
      const std::string& name = entry.first;
      check.compare(step, CheckPhase::backward, "gradient of " + name, grads.at(name),
                    one_grads.at(name), [&](int64_t) { return g.where_param(name); });
    }
    for (const auto& entry : named) {
      const std::string& name = entry.first;
      check.compare(step, CheckPhase::update, name, params.at(name), entry.second.detach(),
                    [&](int64_t) { return g.where_param(name); });
    }
  }
  result.ok = check.ok();
  result.compared = check.compared();
  result.worst = check.worst();
  result.report = check.ok()
                      ? fmt::format("check: {} steps of {} equal one device's: {} tensors "
                                    "compared, largest relative error {:.3g} (tolerance {:g})",
                                    result.steps, check.layout(), result.compared, result.worst,
                                    check.tolerance())
                      : "check: " + check.mismatch()->str();
  return result;
}

}  // namespace tessera::gpt
