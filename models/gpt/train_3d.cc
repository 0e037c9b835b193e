// Training on a pipeline / tensor-parallel layout (--pp, --tp, with --dp, --zero, --sp, --ep
// beside them): Gpt3dReplica drives Gpt3d (models/gpt/parallel3d.h) through the one training
// loop (models/common/train_loop.h), and gpt3d_options maps the run's flags onto Gpt3d's.
// Kept apart from train.cc (single device, data parallel, ZeRO) for the file's size; both
// share train_internal.h.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "autograd/saved_compression.h"
#include "models/common/checkpoint.h"
#include "models/common/comm_hooks.h"
#include "models/common/optimizers.h"
#include "models/common/progress.h"
#include "models/common/run_control.h"
#include "models/common/sharded_checkpoint.h"
#include "models/common/train_loop.h"
#include "models/gpt/check.h"
#include "models/gpt/checkpoints.h"
#include "models/gpt/data.h"
#include "models/gpt/moe_step.h"
#include "models/gpt/parallel3d.h"
#include "models/gpt/train_internal.h"
#include "tensor/autocast.h"
#include "tensor/random.h"

namespace tessera::gpt {
namespace {

// One rank of a pipeline / tensor-parallel run (Gpt3d), whose step runs its micro-batches
// by the pipeline schedule and updates (and clips) inside. Validation and the sample use
// the full parameters, gathered into a single-device model on rank 0.
class Gpt3dReplica final : public models::Replica {
 public:
  Gpt3dReplica(const GptTrainConfig& config, parallel::CommPtr world,
               const std::function<void(const std::string&)>& say)
      : c_(config), world_(std::move(world)), say_(say), batches_(config),
        model_((manual_seed(static_cast<uint64_t>(config.seed)), config.model_config())),
        after_init_(default_generator().offset()),
        hook_(models::make_comm_hook("gpt", config.compress, static_cast<uint64_t>(config.seed))),
        g_(model_, world_, with_hook(gpt3d_options(config), hook_)),
        eval_model_(config.model_config()) {
    // The generator continues from where one device's is after building its model (dropout
    // draws from there); building the evaluation model drew more.
    default_generator().set_state(default_generator().seed(), after_init_);
  }

  Gpt& eval_model() { return eval_model_; }
  std::string describe() const { return g_.describe(); }
  // --compress: rank 0's last round, elements sent over an exact reduction's (1: none).
  double compress_ratio() const {
    if (!hook_) return 1.0;
    const parallel::CommHook::Traffic t = hook_->last_round();
    return t.uncompressed > 0 ? static_cast<double>(t.sent) / static_cast<double>(t.uncompressed)
                              : 1.0;
  }
  std::string line_suffix() const override {
    return (hook_ ? models::hook_traffic(*hook_) : "") + g_.moe().line();
  }
  void annotate(nlohmann::json& record) const override { g_.moe().annotate(record); }
  const MoeStep& moe() const { return g_.moe(); }
  std::string optimizer_kind() const { return optimizer_label(g_.optimizer(), c_); }
  const optim::Optimizer& optimizer() const { return g_.optimizer(); }
  int64_t skipped_steps() const { return g_.skipped_steps(); }
  // The single-device model's (this rank's model keeps its experts only under --ep).
  int64_t num_parameters() const { return c_.model_config().num_parameters(); }

  // The step a --resume continues from (0 without one): any layout's checkpoint loads.
  int64_t resume() {
    if (c_.resume.empty()) return 0;
    if (models::is_sharded_checkpoint(c_.resume)) {
      // Each rank reads the regions of its own shards, from the files that hold them.
      models::ShardedCheckpointReader reader(c_.resume);
      Gpt3d::BlockSource source;
      source.whole = [&](const std::string& key) { return reader.read(key); };
      source.keys = [&](const std::string& prefix) { return reader.keys(prefix); };
      source.region = [&](const std::string& key, const Shape& global,
                          const std::vector<int64_t>& starts, const Shape& shape) {
        // Written in the plan's shape by a 3-D run: read the region; in the single-device
        // shape by another layout: that tensor whole, then the region.
        if (reader.global_shape(key) == global) return reader.read(key, starts, shape);
        return region_of(reader.read(key), key, global, starts, shape);
      };
      g_.read_blocks(source);
      optim::Optimizer::StateDict comm;  // each rank's gradient compression state, whole
      for (const std::string& key : reader.keys("comm.")) comm[key] = reader.read(key);
      models::load_world_hook_state("gpt", hook_.get(), world_->rank(), comm, layout(),
                                    kLayoutFlags);
      return resumed(c_, sharded_state(reader, g_.scaler()), world_->rank() == 0, say_);
    }
    const models::TrainingState s = models::load_checkpoint(
        c_.resume,
        [&](const nn::StateDict& weights, const optim::Optimizer::StateDict& saved) {
          optim::Optimizer::StateDict state = saved;  // this rank's compression state out
          models::load_world_hook_state("gpt", hook_.get(), world_->rank(), state, layout(),
                                        kLayoutFlags);
          g_.load_state_dicts(weights, state);
        },
        g_.scaler());
    return resumed(c_, s, world_->rank() == 0, say_);
  }

  void zero_grad(int64_t /*step*/, double lr) override { lr_ = lr; }
  // The whole step's micro-batches and accumulation runs at once (the loop's accum is 1).
  Tensor forward_backward(int64_t step, int /*micro*/) override {
    const data::TextBatch batch = batches_.train(step);
    AutocastGuard amp(models::precision_dtype(c_.precision, "gpt"));
    return Tensor::from_vector<double>({g_.forward_backward(batch.idx, batch.targets, lr_)}, {1});
  }
  std::optional<double> grad_norm(double max_norm) override {
    return g_.unscale_and_clip(max_norm);
  }
  void step(bool skip) override { g_.update(skip); }
  parallel::Communicator* group() override { return world_.get(); }
  bool loss_is_global() const override { return true; }

  // Collective: every rank gathers; rank 0 writes the single-device layout. Sharded: the
  // writing ranks each write their own shards (no rank gathers the model).
  void save(int64_t step) override {
    if (c_.save_sharded) {
      save_sharded(c_, world_.get(), step, g_.scaler(), [&](models::ShardedCheckpointWriter& w) {
        g_.write_blocks([&](const std::string& key, const Tensor& block, const Shape& global,
                            const std::vector<int64_t>& starts) { w.add(key, block, global, starts); });
        if (hook_) {  // each rank its own compression state, whole
          for (const auto& [key, t] : models::own_hook_state(*hook_, world_->rank(), layout())) {
            w.add(key, t, t.shape(), std::vector<int64_t>(static_cast<size_t>(t.dim()), 0));
          }
        }
      });
      return;
    }
    auto [weights, state] = g_.state_dicts();
    if (hook_) state.merge(models::world_hook_state(*hook_, *world_, layout()));  // collective
    if (world_->rank() == 0) {
      models::save_checkpoint(c_.save, weights, state, g_.scaler(), training_state(c_, step));
    }
    world_->barrier();  // nobody reads the files before they exist
  }
  // Collective: every rank gathers; rank 0 evaluates (the others return 0).
  double evaluate(int64_t /*step*/) override {
    const std::map<std::string, Tensor> full = g_.full_parameters();
    if (world_->rank() != 0) return 0.0;
    eval_model_.load_state_dict(nn::StateDict(full.begin(), full.end()));
    return train_internal::evaluate(eval_model_, batches_, c_.val_batches, DType::f32);
  }

  // What a compression state is per rank for: the layout's pp, dp, tp and ZeRO stage.
  std::vector<int64_t> layout() const { return {c_.pp, c_.dp, c_.tp, c_.zero}; }
  static constexpr const char* kLayoutFlags = "--pp, --dp, --tp, --zero";

 private:
  static Gpt3dOptions with_hook(Gpt3dOptions o, std::shared_ptr<parallel::CommHook> hook) {
    o.comm_hook = std::move(hook);
    return o;
  }

  const GptTrainConfig& c_;
  parallel::CommPtr world_;
  const std::function<void(const std::string&)>& say_;
  const GptData batches_;
  Gpt model_;
  uint64_t after_init_;
  std::shared_ptr<parallel::CommHook> hook_;  // --compress (null: none)
  Gpt3d g_;
  Gpt eval_model_;
  double lr_ = 0.0;
};

}  // namespace

namespace train_internal {

GptResult train_rank_3d(const GptTrainConfig& config, parallel::CommPtr world) {
  config.model_config().validate();
  const bool lead = world->rank() == 0, verbose = config.verbose && lead;
  models::Progress progress;
  auto say = std::function<void(const std::string&)>([&](const std::string& line) {
    if (verbose) progress.print(line);
  });
  Gpt3dReplica replica(config, world, say);
  say(fmt::format("gpt: {} layers, {} heads, width {}, context {} ({} parameters); batch {}, {} "
                  "steps, {} lr {}; {} ({} backend)",
                  config.layers, config.heads, config.width, config.context,
                  replica.num_parameters(), config.batch, config.steps, replica.optimizer_kind(),
                  config.lr,
                  replica.describe(), world->backend()));
  models::MetricsWriter metrics;
  if (!config.metrics.empty() && lead) {
    metrics = models::MetricsWriter(config.metrics, !config.resume.empty());
  }
  models::LoopOptions o = loop_options(config, replica.resume(), verbose);
  o.fault_rank = world->rank();
  o.accum = 1;  // accumulation and the pipeline's micro-batches are inside its step
  o.divergence_advice = "Lower --lr or keep --clip on";
  // Tokens per second over every step (the pipeline's warm-up is part of its cost).
  models::StepMeter meter(static_cast<double>(config.batch * config.context), "tokens");
  const autograd::SavedCompressionGuard saved_compression(
      {.mode = autograd::parse_saved_compression(config.act_compress, "gpt: --act_compress")});
  const models::LoopResult loop = models::run_loop(replica, o, meter, progress, metrics);

  GptResult result;
  result.skipped_steps = replica.skipped_steps();
  result.compress_ratio = replica.compress_ratio();
  result.moe_stats = replica.moe().layers();
  result.moe_loss = replica.moe().loss();
  // This rank's optimizer state over its shards (a stage's parameters, cut by tp and ZeRO),
  // per element it steps, beside the formula's figure for the whole model.
  const optim::Optimizer& opt = replica.optimizer();
  int64_t stepped = 0;
  for (const optim::ParamGroup& g : opt.param_groups()) {
    for (const Tensor& t : g.params) stepped += t.numel();
  }
  result.optimizer_state_bytes = opt.state_bytes();
  result.optimizer_state_formula = models::optimizer_state_formula_bytes(
      config.optimizer_choice(), replica.eval_model().named_parameters(),
      /*master=*/false);  // (the stages keep f32 parameters and autocast)
  finish_run(result, config, replica, loop, meter, metrics, kCPU, [&] {
    return fmt::format("; {} state {} on rank {} ({:.3g} bytes per parameter of its shards; "
                       "formula {:.3g} for the whole model)",
                       replica.optimizer_kind(),
                       models::format_bytes(static_cast<double>(result.optimizer_state_bytes)),
                       world->rank(),
                       static_cast<double>(result.optimizer_state_bytes) /
                           static_cast<double>(std::max<int64_t>(stepped, 1)),
                       result.optimizer_state_formula /
                           static_cast<double>(replica.num_parameters()));
  }, verbose, say);
  if (config.sample_length > 0 && lead && !config.synthetic_data) {
    sample_into(result, replica.eval_model(), config, DType::f32, say);
  }
  return result;
}

}  // namespace train_internal

Gpt3dOptions gpt3d_options(const GptTrainConfig& c) {
  Gpt3dOptions o;
  o.pp = c.pp;
  o.dp = c.dp;
  o.tp = c.tp;
  o.zero = c.zero;
  o.schedule = c.schedule;
  o.chunks = c.chunks;
  o.microbatches = c.microbatches;
  o.accum = c.accum;
  o.recompute = c.recompute == "full";
  if (c.precision == "f16") o.loss_scale = c.loss_scale;
  o.sequence_parallel = c.sp;
  o.ep = c.ep;
  o.clip = c.clip;
  o.lr = c.lr;
  o.weight_decay = c.weight_decay;
  o.beta1 = c.beta1;
  o.beta2 = c.beta2;
  o.block_shards = models::optimizer_shard_block(c.optimizer);
  o.row_shards = models::optimizer_needs_row_shards(c.optimizer);
  o.make_optimizer = [choice = c.optimizer_choice(), compress = c.compress, lr = c.lr,
                      betas = std::pair(c.beta1, c.beta2), wd = c.weight_decay, steps = c.steps](
                         std::vector<optim::ParamGroup> groups, parallel::Communicator& dp,
                         std::shared_ptr<parallel::CommHook> hook) {
    if (compress.name == "onebit_adam") {  // 1-bit Adam in AdamW's place, with its hook
      return models::make_onebit_adam(compress, std::move(groups), dp, std::move(hook), lr,
                                      betas, wd, steps);
    }
    return models::make_optimizer("gpt", choice, std::move(groups));
  };
  return o;
}

}  // namespace tessera::gpt
