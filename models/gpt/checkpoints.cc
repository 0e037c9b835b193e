#include "models/gpt/checkpoints.h"

#include <fmt/format.h>

#include <cstdio>
#include <map>

#include "models/gpt/parallel3d.h"
#include "tensor/error.h"
#include "tensor/random.h"

namespace tessera::gpt {

namespace {

// Checks that a checkpoint holds the model being built (heads would load silently: the
// weight shapes do not depend on it).
void check_same_model(const std::string& path, const models::TrainingState& s,
                      const GptTrainConfig& c) {
  const std::pair<const char*, int64_t> fields[] = {
      {"layers", c.layers}, {"heads", c.heads}, {"width", c.width}, {"context", c.context}};
  for (const auto& [name, value] : fields) {
    auto it = s.info.find(name);
    TS_CHECK(it == s.info.end() || it->second == std::to_string(value),
             "gpt: {} holds a model with {} = {} but --{} is {}", path, name, it->second, name,
             value);
  }
  // The embedding's rows: a different --vocab_pad would otherwise fail as a shape mismatch.
  const int64_t rows = c.model_config().padded_vocab();
  auto it = s.info.find("padded_vocab");
  TS_CHECK(it == s.info.end() || it->second == std::to_string(rows),
           "gpt: {} holds an embedding of {} rows but --vocab {} with --vocab_pad {} gives {}",
           path, it->second, c.vocab, c.vocab_pad, rows);
}

}  // namespace

// What every layout saves beside the weights and optimizer state: the step, the generator
// (dropout's next masks) and the model's shape. The data windows are a function of the step.
models::TrainingState training_state(const GptTrainConfig& c, int64_t step) {
  models::TrainingState s;
  s.step = step;
  s.rng_seed = default_generator().seed();
  s.rng_offset = default_generator().offset();
  s.info = {{"model", "gpt"},
            {"layers", std::to_string(c.layers)},
            {"heads", std::to_string(c.heads)},
            {"width", std::to_string(c.width)},
            {"context", std::to_string(c.context)},
            {"padded_vocab", std::to_string(c.model_config().padded_vocab())},
            {"precision", c.precision}};
  return s;
}

// A sharded checkpoint at c.save (collective over `comm`; null: one rank). `fill` adds this
// rank's blocks; rank 0 adds the loss scaler and the training state.
void save_sharded(const GptTrainConfig& c, parallel::Communicator* comm, int64_t step,
                  const optim::DynamicLossScaler& scaler,
                  const std::function<void(models::ShardedCheckpointWriter&)>& fill) {
  const int rank = comm != nullptr ? comm->rank() : 0;
  auto barrier = [&] {
    if (comm != nullptr) comm->barrier();
  };
  if (rank == 0) models::prepare_sharded_checkpoint(c.save);
  barrier();
  models::ShardedCheckpointWriter w(c.save, rank);
  fill(w);
  if (rank == 0) {
    for (const auto& [k, v] : scaler.state_dict()) w.add("scaler/" + k, v);
    const models::TrainingState s = training_state(c, step);
    w.set_metadata("step", std::to_string(s.step));
    w.set_metadata("rng_seed", std::to_string(s.rng_seed));
    w.set_metadata("rng_offset", std::to_string(s.rng_offset));
    for (const auto& [k, v] : s.info) w.set_metadata("info." + k, v);
  }
  w.write();
  barrier();  // every file is complete before the commit
  if (rank == 0) models::commit_sharded_checkpoint(c.save);
  barrier();  // nobody reads it before it is in place
}

// The training state and the loss scaler of a sharded checkpoint.
models::TrainingState sharded_state(models::ShardedCheckpointReader& r,
                                    optim::DynamicLossScaler& scaler) {
  std::map<std::string, Tensor> scaler_state;
  for (const std::string& key : r.keys("scaler/")) scaler_state[key.substr(7)] = r.read(key);
  scaler.load_state_dict(scaler_state);
  models::TrainingState s;
  const auto number = [&](const char* key) -> uint64_t {
    auto it = r.metadata().find(key);
    TS_CHECK(it != r.metadata().end(), "gpt: the sharded checkpoint {} has no '{}'", r.loaded_from(), key);
    return std::stoull(it->second);
  };
  s.step = static_cast<int64_t>(number("step"));
  s.rng_seed = number("rng_seed");
  s.rng_offset = number("rng_offset");
  for (const auto& [k, v] : r.metadata()) {
    if (k.starts_with("info.")) s.info[k.substr(5)] = v;
  }
  s.loaded_from = r.loaded_from();
  s.fallback_reason = r.fallback_reason();
  return s;
}

// The single-device dicts as sharded-checkpoint keys (models/gpt/parallel3d.h), whole:
// parameters by name, the optimizer's state by parameter name (`order`: its global order).
void add_single_device(models::ShardedCheckpointWriter& w, const nn::StateDict& weights,
                       const optim::Optimizer::StateDict& optimizer,
                       const std::vector<std::string>& order) {
  for (const auto& [k, v] : weights) w.add("model/" + k, v);
  for (const auto& [key, v] : optimizer) {
    if (key.starts_with("hparam.") || (key.starts_with("group.") && !key.ends_with(".params"))) {
      w.add("optim/" + key, v);
    } else if (key.starts_with("state.")) {
      const size_t dot = key.find('.', 6);
      const size_t i = static_cast<size_t>(std::stoll(key.substr(6, dot - 6)));
      w.add(fmt::format("optim/{}/{}", order.at(i), key.substr(dot + 1)), v);
    } else if (key.starts_with("comm.")) {  // gradient compression (models/common/comm_hooks.h)
      w.add("comm/" + key.substr(5), v);
    }
  }
}

// And back: the dicts a single-device model (`model`, optimizer order `order`) loads.
std::pair<nn::StateDict, optim::Optimizer::StateDict> read_single_device(
    models::ShardedCheckpointReader& r, const Gpt& model, const std::vector<std::string>& order,
    const std::function<Shape(const std::string& name, const Shape& here)>& whole) {
  nn::StateDict weights;
  for (const auto& [name, t] : model.named_parameters()) {
    const Shape shape = whole ? whole(name, t.shape()) : t.shape();
    weights[name] = region_of(r.read("model/" + name), "model/" + name, shape,
                              std::vector<int64_t>(shape.size(), 0), shape);
  }
  for (const auto& [name, t] : model.named_buffers()) weights[name] = r.read("model/" + name);
  optim::Optimizer::StateDict dict;
  std::vector<int64_t> group[2];
  for (size_t i = 0; i < order.size(); ++i) {
    const std::string prefix = fmt::format("optim/{}/", order[i]);
    const Tensor& p = weights.at(order[i]);
    group[p.dim() >= 2 ? 0 : 1].push_back(static_cast<int64_t>(i));
    for (const std::string& key : r.keys(prefix)) {
      const std::string field = key.substr(prefix.size());
      const Tensor v = r.read(key);
      // State with the parameter's elements takes its shape; per-row or per-block state
      // (Adafactor's row statistics, 8-bit AdamW's scales) and whole state (Adafactor's
      // column statistics) are 1-D (a tensor-parallel run writes the rows of c_attn's
      // [3, C, C] stage weight as [3, C]).
      dict[fmt::format("state.{}.{}", i, field)] =
          field == "step"            ? v
          : v.numel() == p.numel()   ? v.contiguous().view(p.shape())
                                     : v.contiguous().view({v.numel()});
    }
  }
  for (int g = 0; g < 2; ++g) {
    dict[fmt::format("group.{}.params", g)] =
        Tensor::from_vector<int64_t>(group[g], {static_cast<int64_t>(group[g].size())});
  }
  for (const char* prefix : {"optim/hparam.", "optim/group."}) {
    for (const std::string& key : r.keys(prefix)) dict[key.substr(6)] = r.read(key);
  }
  for (const std::string& key : r.keys("comm/")) dict["comm." + key.substr(5)] = r.read(key);
  return {std::move(weights), std::move(dict)};
}

// The optimizer's global order on a single-device model: optim::decay_groups' (decayed first).
std::vector<std::string> optimizer_order(const Gpt& model) {
  std::vector<std::string> order;
  for (const optim::ParamGroup& g : optim::decay_groups(model.named_parameters(), 0.0, 0.0)) {
    order.insert(order.end(), g.names.begin(), g.names.end());
  }
  return order;
}

// After any layout's load_checkpoint: checks the model, restores the generator, reports;
// returns the step the run continues from.
int64_t resumed(const GptTrainConfig& c, const models::TrainingState& s, bool lead,
                const std::function<void(const std::string&)>& say) {
  check_same_model(c.resume, s, c);
  default_generator().set_state(s.rng_seed, s.rng_offset);
  if (lead && !s.fallback_reason.empty()) {
    std::fprintf(stderr, "gpt: warning: %s\n", s.fallback_reason.c_str());
  }
  say(fmt::format("resumed from {} at step {}", s.loaded_from, s.step));
  return s.step;
}

}  // namespace tessera::gpt
