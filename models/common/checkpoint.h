// Training checkpoints: the model's weights in one safetensors file (loadable by PyTorch as
// a plain state dict) and, beside it, everything else exact resume needs in a second one:
// optimizer state, loss scaler, step, the RNG's (seed, offset) and the loader position. Both
// carry the same checkpoint id and step.
//
//   save_checkpoint("run/mnist.safetensors", model, opt, scaler, state);
//   // -> run/mnist.safetensors and run/mnist.state.safetensors (the newest checkpoint),
//   //    run/mnist.prev.safetensors and run/mnist.prev.state.safetensors (the one before)
//   TrainingState state = load_checkpoint("run/mnist.safetensors", model, opt, scaler);
//
// Saving is atomic as a whole: both new files are written and fsync'd under temporary names
// first; the current pair is kept (hard links) as the previous pair; only then are the new
// files renamed into place. A save killed at any moment leaves at least one complete pair,
// and loading picks the newest complete pair among the four files (the id inside each file
// is the "latest" pointer), saying so when it falls back. The next save removes temporary
// files a killed save left. Weights or state holding NaN or inf are never written.
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
  // Set by load_checkpoint: the model file the state came from, and why it is not the path
  // asked for (empty when it is).
  std::string loaded_from;
  std::string fallback_reason;
};

// Whether every element of `t` is finite (what a checkpoint may hold).
bool all_values_finite(const Tensor& t);

// "x.safetensors" -> "x.state.safetensors"; any other name gets ".state.safetensors" added.
std::string state_path(const std::string& path);
// "x.safetensors" -> "x.prev.safetensors" (the previous checkpoint's model file; its state is
// state_path() of that); any other name gets ".prev" added.
std::string previous_path(const std::string& path);

// Checks up front that a checkpoint can be written at `path` (named `flag` in errors, e.g.
// "gpt: --save"): not a directory, its directory exists and accepts a new file (probed by
// creating and removing one), existing checkpoint files are regular files.
void check_checkpoint_path(const std::string& path, const std::string& flag);

void save_checkpoint(const std::string& path, const nn::Module& model,
                     const optim::Optimizer& optimizer, const optim::DynamicLossScaler& scaler,
                     const TrainingState& state);

// The same files from state dicts: what a sharded run gathers (parallel/zero.h) in the
// single-device layout, so it resumes under any other layout. Device tensors are written
// from host copies (load_checkpoint copies the values back onto the model's device).
void save_checkpoint(const std::string& path, const nn::StateDict& model,
                     const optim::Optimizer::StateDict& optimizer,
                     const optim::DynamicLossScaler& scaler, const TrainingState& state);

// Finds the newest complete checkpoint at `path` (see above), loads the scaler and hands the
// model's and the optimizer's dicts to `apply` (which throws on a mismatch).
using ApplyCheckpoint = std::function<void(const nn::StateDict& model,
                                           const optim::Optimizer::StateDict& optimizer)>;
TrainingState load_checkpoint(const std::string& path, const ApplyCheckpoint& apply,
                              optim::DynamicLossScaler& scaler);

// Loads into the given (already constructed) objects; Error naming the files when no
// complete checkpoint is there, and on weights that do not fit the model.
TrainingState load_checkpoint(const std::string& path, nn::Module& model,
                              optim::Optimizer& optimizer, optim::DynamicLossScaler& scaler);

}  // namespace tessera::models
