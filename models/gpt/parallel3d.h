// GPT on a 3-D mesh {pp, dp, tp}: pipeline stages over pp (parallel/pipeline: any schedule,
// optional recomputation), Megatron tensor parallelism inside each stage over tp (sharding
// specs, models/gpt/tensor_parallel.h), and data parallelism with ZeRO 0-3 over dp
// (parallel/zero.h) on each rank's local shards (stage 3: a stage's shards are one unit,
// gathered on its dp group when the step begins and freed when it ends). Dropout draws the
// single-device masks (each layer from its own offset, each micro-batch its rows: forward.h);
// accumulation runs the pipeline `accum` times per step; checkpoints are in the single-device
// layout (state_dicts / load_state_dicts), so a run resumes under any layout.
//
//   Gpt model(config);                                   // same seed on every rank
//   Gpt3d g(model, world, {.pp = 2, .dp = 2, .tp = 2, .schedule = "1f1b", .microbatches = 4});
//   double loss = g.train_step(idx, targets, lr);        // the global batch, every rank
//
// Rank r sits at mesh coordinates (r / (dp tp), r / tp % dp, r % tp). Each pipeline stage's
// ranks hold only that stage's layers. The tied token embedding's gradient is summed over
// the ranks of the first and last stages with the same (dp, tp) coordinates.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/gpt/model.h"
#include "models/gpt/moe_step.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "parallel/comm_hook.h"
#include "parallel/comm/communicator.h"

namespace tessera::gpt {

struct Gpt3dOptions {
  int64_t pp = 1, dp = 1, tp = 1;
  int64_t zero = 0;                // over dp: 0, 1, 2 or 3
  std::string schedule = "1f1b";   // gpipe, 1f1b or interleaved
  int64_t chunks = 1;              // model chunks per pipeline rank (interleaved)
  int64_t microbatches = 1;        // per dp rank and pipeline run
  int64_t accum = 1;               // pipeline runs per step (gradient accumulation)
  bool recompute = false;          // activation recomputation per pipeline chunk
  double clip = 0.0;               // max global gradient norm (over every rank); 0: off
  // f16: dynamic loss scaling from this initial scale, the overflow check reduced over the
  // world (every rank skips the same steps); 0: off.
  double loss_scale = 0.0;
  bool sequence_parallel = false;  // the residual stream split along the sequence on tp
  double lr = 1e-3, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95;
  // The gradient reduction over dp replaced by this rank's hook (ZeroOptions::comm_hook:
  // PowerSGD on the stages' and shards' own tensors); null: exact.
  std::shared_ptr<parallel::CommHook> comm_hook = nullptr;
  // The optimizer over this rank's shards' groups, given this rank's dp group and
  // comm_hook; null: AdamW with the values above. It must be elementwise, cut at its blocks
  // or rows (block_shards, row_shards), or reduce over dp itself with a hook that is not a
  // full reduction (1-bit Adam at ZeRO 0: its per-tensor scales are then per stage tensor
  // and per tp shard, the tensors this rank holds); an Error otherwise.
  std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>,
                                                  parallel::Communicator& dp,
                                                  std::shared_ptr<parallel::CommHook> hook)>
      make_optimizer = nullptr;
  // ZeroOptions::block_shards over dp, for an optimizer with per-block state (8-bit AdamW:
  // 256). (The stages hold c_attn's weight as [3, C, C], the single device's [3C, C] in the
  // same memory order, so the blocks are the same elements.) On tp each shard must hold whole
  // blocks of the single device's parameter (optim::RowShard::run; the optimizer names a
  // parameter whose shard would cut them), and its scales are laid out by those blocks.
  int64_t block_shards = 0;
  // ZeroOptions::row_shards over dp (also at ZeRO 0), for an optimizer with per-matrix state
  // (Adafactor). The optimizer sees each parameter as its block of the single device's
  // (c_attn's weight as [3C, C], not the stages' [3, C, C]; a tp shard as some of the rows
  // or some of the columns), with the statistics of the rest summed over tp.
  bool row_shards = false;
  // For the equivalence checker (models/gpt/check.h): keep each layer's output and the
  // reduced gradients of a step, for activations() and full_gradients().
  bool capture = false;
  // A bug to inject, to show that the checker catches it (empty: none): "skip_tied_allreduce"
  // (the tied embedding's gradient is not summed over the first and last stages),
  // "grad_times_dp" (gradients summed over dp instead of averaged), "swap_microbatches" (the
  // first stage feeds micro-batch 1's tokens as micro-batch 0's and the other way round) or
  // "drop_dropout_offset" (every micro-batch draws the first rows of the dropout masks).
  std::string inject = {};
  // Expert parallelism (Mixture-of-Experts blocks): the experts split over groups of ep
  // consecutive dp ranks (models/gpt/moe_step.h).
  int64_t ep = 1;
};

// The region [starts, starts + shape) of `whole` viewed as `global` (same size; Error naming
// `key` otherwise): how a block source cuts a shard from a whole tensor.
Tensor region_of(const Tensor& whole, const std::string& key, const Shape& global,
                 const std::vector<int64_t>& starts, const Shape& shape);

class Gpt3d {
 public:
  // Collective over `world` (size pp x dp x tp). Validates the layout before any work
  // (heads by tp, stages by layers, micro-batches by pp for interleaving, ZeRO stage).
  Gpt3d(Gpt& model, parallel::CommPtr world, Gpt3dOptions options);
  ~Gpt3d();
  Gpt3d(const Gpt3d&) = delete;
  Gpt3d& operator=(const Gpt3d&) = delete;

  // One optimizer step on the global batch idx/targets [B, T] (the same on every rank; each
  // dp rank takes its slice, split into micro-batches). Returns the mean loss. The same as
  // forward_backward, unscale_and_clip(options.clip), update(false).
  double train_step(const Tensor& idx, const Tensor& targets, double lr);
  // The step in three collectives, for a loop that decides in between (skipping a step with a
  // NaN/inf loss or gradient norm): the pipeline runs and the reduced gradients (returns the
  // global mean loss); f16's unscaling (nullopt when any rank overflowed) and the global
  // gradient norm, clipped to max_norm when > 0; the optimizer step unless `skip` (or the
  // scaler found an overflow), then the scaler's update.
  double forward_backward(const Tensor& idx, const Tensor& targets, double lr);
  std::optional<double> unscale_and_clip(double max_norm);
  void update(bool skip);
  // Collective (after the reduction): the norm of the whole model's gradient, each element
  // counted once over the world; scales the gradients to at most max_norm when max_norm > 0.
  double clip_grad_norm(double max_norm);
  // Steps skipped for inf/NaN gradients, and the current loss scale (f16; else 0 and 1).
  int64_t skipped_steps() const;
  double loss_scale() const;
  // Collective: every parameter of the single-device model, in full, on every rank, and its
  // buffers (the experts' selection biases, the same on every rank).
  std::map<std::string, Tensor> full_parameters();
  // Collective: the model's and the optimizer's state in the single-device layout (the dict
  // an AdamW on optim::decay_groups(model.named_parameters()) would hold), on every rank.
  std::pair<nn::StateDict, optim::Optimizer::StateDict> state_dicts();
  // Collective (ZeRO's loads are): loads single-device dicts into this rank's shards.
  void load_state_dicts(const nn::StateDict& weights, const optim::Optimizer::StateDict& optimizer);

  // Sharded checkpoints (models/common/sharded_checkpoint.h), through callbacks, so that no
  // rank holds more than its own shards. Keys: "model/<param>" and "optim/<param>/<field>"
  // (exp_avg, ...: blocks of the plan's global shape, e.g. attn.c_attn's grouped [3, C, C]),
  // "optim/<param>/step", "optim/hparam.<name>", "optim/group.<g>.lr|weight_decay" (whole).
  using AddBlock = std::function<void(const std::string& key, const Tensor& block,
                                      const Shape& global, const std::vector<int64_t>& starts)>;
  // Collective: calls add() for each block this rank writes (dp rank 0 of each stage and tp
  // shard; tensors whole on tp from tp rank 0 only; the optimizer's hyperparameters from
  // world rank 0).
  void write_blocks(const AddBlock& add);
  struct BlockSource {
    // The region [starts, starts + shape) of a tensor viewed with shape `global` (the plan's;
    // a writer may have used the single-device shape, of the same size); a whole tensor; the
    // keys under a prefix.
    std::function<Tensor(const std::string& key, const Shape& global,
                         const std::vector<int64_t>& starts, const Shape& shape)>
        region;
    std::function<Tensor(const std::string&)> whole;
    std::function<std::vector<std::string>(const std::string&)> keys;
  };
  // Collective: loads this rank's shards from `source` (any layout wrote it).
  void read_blocks(const BlockSource& source);
  optim::DynamicLossScaler& scaler();
  // The optimizer over this rank's shards.
  const optim::Optimizer& optimizer() const;
  // The last step's routing of this rank's Mixture-of-Experts blocks (over its dp group).
  const MoeStep& moe() const;
  // "pp 2 x dp 2 x tp 2, 1f1b, 4 micro-batches: stage 0: embed h.0 h.1 | stage 1: ..."
  std::string describe() const;

  // With capture, after train_step. Collective: each pipeline layer's output over the whole
  // batch, in layer order ("embed", "h.0", ..., "head": the logits), gathered on every rank.
  std::vector<std::pair<std::string, Tensor>> activations();
  // Collective: the step's reduced gradient of every parameter (before clipping), in full.
  std::map<std::string, Tensor> full_gradients();
  // Which ranks computed batch row `row` at pipeline layer `layer`, and which hold parameter
  // `name` (for the checker's reports).
  std::string where_row(int layer, int64_t row) const;
  std::string where_param(const std::string& name) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::gpt
