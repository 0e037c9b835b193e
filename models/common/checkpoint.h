// Training checkpoints: the model's weights in one safetensors file (loadable by PyTorch as
// a plain state dict) and, beside it, everything else exact resume needs in a second one:
// optimizer state, loss scaler, step, the RNG's (seed, offset) and the loader position.
// Both are written to a temporary file and renamed, and both carry the same checkpoint id,
// so a crash between the two renames is detected on load instead of mixing two saves.
//
//   save_checkpoint("run/mnist.safetensors", model, opt, scaler, state);
//   // -> run/mnist.safetensors and run/mnist.state.safetensors
//   TrainingState state = load_checkpoint("run/mnist.safetensors", model, opt, scaler);
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "nn/module.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"

namespace tessera::models {

struct TrainingState {
  int64_t step = 0;         // optimizer steps taken
  int64_t epoch = 0;        // loader position: the next batch to draw
  int64_t batch_index = 0;
  uint64_t rng_seed = 0;    // this thread's default generator (dropout masks)
  uint64_t rng_offset = 0;
  // Free-form strings stored in the model file's metadata (model name, flags); returned on
  // load so a program can check it resumes the same configuration.
  std::map<std::string, std::string> info;
};

// "x.safetensors" -> "x.state.safetensors"; any other name gets ".state.safetensors" added.
std::string state_path(const std::string& path);

void save_checkpoint(const std::string& path, const nn::Module& model,
                     const optim::Optimizer& optimizer, const optim::DynamicLossScaler& scaler,
                     const TrainingState& state);

// The same files from state dicts: what a sharded run gathers (parallel/zero.h) in the
// single-device layout, so it resumes under any other layout.
void save_checkpoint(const std::string& path, const nn::StateDict& model,
                     const optim::Optimizer::StateDict& optimizer,
                     const optim::DynamicLossScaler& scaler, const TrainingState& state);

// Reads both files, checks that they come from one save, loads the scaler and hands the
// model's and the optimizer's dicts to `apply` (which throws on a mismatch).
using ApplyCheckpoint = std::function<void(const nn::StateDict& model,
                                           const optim::Optimizer::StateDict& optimizer)>;
TrainingState load_checkpoint(const std::string& path, const ApplyCheckpoint& apply,
                              optim::DynamicLossScaler& scaler);

// Loads both files into the given (already constructed) objects; Error naming the file on a
// missing, corrupt or mismatched file, and on weights that do not fit the model.
TrainingState load_checkpoint(const std::string& path, nn::Module& model,
                              optim::Optimizer& optimizer, optim::DynamicLossScaler& scaler);

}  // namespace tessera::models
