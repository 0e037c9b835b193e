// The one training loop of the example programs (gpt on one rank, data parallel, ZeRO and
// 3-D; mnist): steps over a Replica (one rank's model, optimizer and data) with gradient
// accumulation, clipping, --nonfinite=error|skip, SIGTERM/SIGINT stop-and-save, periodic
// validation and checkpoints, the "train.step" fault point, and one StepMeter for the
// progress line and the metrics. The programs keep what is theirs: building the replica,
// resuming, the final evaluation and summary.
//
//   class MnistReplica final : public models::Replica { ... };   // zero_grad, forward, ...
//   models::LoopOptions o;  o.program = "mnist";  o.stop_at = 500;  o.save = config.save;
//   models::LoopResult r = models::run_loop(replica, o, meter, progress, metrics);
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/common/progress.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/communicator.h"
#include "tensor/tensor.h"

namespace tessera::models {

// One rank's part of training, as the loop drives it. Per step: before_step (untimed),
// zero_grad, forward_backward per micro-batch, grad_norm (when clipping or checking), step.
class Replica {
 public:
  virtual ~Replica() = default;

  // Sets the learning rate of step `step` and drops every gradient.
  virtual void zero_grad(int64_t step, double lr) = 0;
  // Forward and backward of micro-batch `micro` (of LoopOptions::accum) of step `step`:
  // backward of the loss divided by accum (and scaled by a loss scaler). Returns the loss,
  // which may still be on a device: the loop reads it after the update, so a device's queue
  // is not drained mid-step. A replica whose schedule interleaves micro-batches and updates
  // itself (the pipeline) runs its whole step here and returns the global batch's loss.
  virtual Tensor forward_backward(int64_t step, int micro) = 0;
  // After the last micro-batch: unscales the gradients and returns their global norm,
  // clipped to max_norm when max_norm > 0 (else only measured); nullopt when it is not
  // known here: the loss scaler found inf/NaN (it then skips the step), or the replica
  // clips inside its own step.
  virtual std::optional<double> grad_norm(double max_norm) = 0;
  // The optimizer update (the loss scaler may skip it), or none when `skip` (a non-finite
  // step dropped); then the loss scaler's update.
  virtual void step(bool skip) = 0;

  // The ranks that train together (null: this one alone): their losses are averaged and a
  // stop request on any of them stops all after the same step.
  virtual parallel::Communicator* group() { return nullptr; }
  // Whether forward_backward's loss is already the global batch's (the same on each rank).
  virtual bool loss_is_global() const { return false; }

  // Collective where the replica is: writes a checkpoint of the state after `step` steps.
  virtual void save(int64_t step) = 0;
  // The validation loss after `step` steps (collective where the replica is); the loop
  // writes it to the metrics.
  virtual double evaluate(int64_t step) = 0;

  // Hooks, by default nothing. Before each step, outside its timing (mnist closes an epoch).
  virtual void before_step(int64_t /*step*/, const StepMeter& /*meter*/) {}
  // After each step: `run_step` counts this run's steps from 0; `log` holds the step's
  // collectives for run_step 1 (the first creates optimizer state), else nothing.
  virtual void after_step(int64_t /*run_step*/, const parallel::CommLog& /*log*/) {}
  // What the progress line starts with ("epoch 2/8  ") and ends with ("  loss scale ...").
  virtual std::string line_prefix() const { return ""; }
  virtual std::string line_suffix() const { return ""; }
  // Extra fields of a metrics record ("epoch").
  virtual void annotate(nlohmann::json& /*record*/) const {}
};

struct LoopOptions {
  std::string program;             // "gpt", "mnist": names the run in messages
  int64_t start_step = 0;          // steps already taken (a resume)
  int64_t stop_at = 0;             // the step to stop after
  // The learning rate of a step (the schedule).
  std::function<double(int64_t step)> lr;
  int64_t accum = 1;               // micro-batches per step
  // With accum > 1, the micro-batches share autocast's casts of the parameters (one
  // WeightCastCache over the step's forwards and backwards: tensor/autocast.h), which keeps
  // those casts alive until the step's last backward ends.
  bool share_casts = true;
  double clip = 0.0;               // max global gradient norm; 0: no clipping
  bool skip_nonfinite = false;     // --nonfinite=skip (else error)
  int64_t log_every = 10;          // steps between progress / metrics lines
  int64_t val_every = 0;           // steps between validations (0: none in the loop)
  std::string save;                // checkpoint path (empty: none), saved at the end
  int64_t save_every = 0;          // and every this many steps (0: only at the end)
  std::string why_no_save = "no --save was given";  // a stop without --save says so
  // The advice after a diverged step.
  std::string divergence_advice =
      "Lower --lr, keep --clip on, or pass --nonfinite=skip to drop such steps";
  bool show_lr = true;             // the progress line shows the learning rate
  int fault_rank = -1;             // this rank at the "train.step" fault point
  bool verbose = true;             // progress lines on stdout
};

struct LoopResult {
  int64_t step = 0;                // steps taken in all (start_step included)
  std::vector<double> losses;      // each step's loss, in this run
  std::vector<std::pair<int64_t, double>> val_losses;  // (step, loss) of evaluate()
  double train_loss = 0.0;         // the mean over the last logged window
  int64_t nonfinite_skipped = 0;   // steps dropped by skip_nonfinite
};

// Runs steps start_step + 1 .. stop_at, then saves (when `save` is set). Throws
// StopRequested (after saving) on SIGTERM/SIGINT, and Error on a diverged step when not
// skipping, before anything more is saved.
LoopResult run_loop(Replica& replica, const LoopOptions& options, StepMeter& meter,
                    Progress& progress, MetricsWriter& metrics);

}  // namespace tessera::models
