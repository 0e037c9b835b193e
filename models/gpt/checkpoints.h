// Checkpoints of a GPT run, shared by every layout's replica (models/gpt/train.cc and
// train_3d.cc): the training state saved beside the weights, what a resume restores, and
// sharded checkpoints (models/common/sharded_checkpoint.h) in the single-device keys the
// 3-D writer uses too ("model/<param>", "optim/<param>/<field>", "optim/hparam.<name>",
// "scaler/<key>").
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/common/checkpoint.h"
#include "models/common/sharded_checkpoint.h"
#include "models/gpt/model.h"
#include "models/gpt/train.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "parallel/comm/communicator.h"

namespace tessera::gpt {

// The step, the generator (dropout's next masks) and the model's shape; the data windows
// are a function of the step.
models::TrainingState training_state(const GptTrainConfig& c, int64_t step);
// After any layout's load: checks the model (Error naming a mismatched field), restores the
// generator, reports (`lead`: this rank warns); returns the step the run continues from.
int64_t resumed(const GptTrainConfig& c, const models::TrainingState& s, bool lead,
                const std::function<void(const std::string&)>& say);
// A sharded checkpoint at c.save (collective over `comm`; null: one rank). `fill` adds this
// rank's blocks; rank 0 adds the loss scaler and the training state.
void save_sharded(const GptTrainConfig& c, parallel::Communicator* comm, int64_t step,
                  const optim::DynamicLossScaler& scaler,
                  const std::function<void(models::ShardedCheckpointWriter&)>& fill);
// A sharded checkpoint's training state; loads its loss scaler into `scaler`.
models::TrainingState sharded_state(models::ShardedCheckpointReader& r,
                                    optim::DynamicLossScaler& scaler);
// The single-device dicts as sharded-checkpoint keys, whole (`order`: the optimizer's global
// order of parameter names), and back for a single-device model (`whole`, when given, the
// single-device shape of a parameter the model holds part of: expert parallelism's experts).
void add_single_device(models::ShardedCheckpointWriter& w, const nn::StateDict& weights,
                       const optim::Optimizer::StateDict& optimizer,
                       const std::vector<std::string>& order);
std::pair<nn::StateDict, optim::Optimizer::StateDict> read_single_device(
    models::ShardedCheckpointReader& r, const Gpt& model, const std::vector<std::string>& order,
    const std::function<Shape(const std::string& name, const Shape& here)>& whole = nullptr);
// The optimizer's global order on a single-device model: optim::decay_groups' (decayed first).
std::vector<std::string> optimizer_order(const Gpt& model);

}  // namespace tessera::gpt
