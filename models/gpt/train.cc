// train_gpt (models/gpt/train.h) and one rank of a single-device, data-parallel or ZeRO run
// (GptReplica, train_rank), with the loop's options and the run's summary every layout
// shares (train_internal.h). Pipeline and tensor-parallel runs are train_3d.cc's;
// validation and sampling, inference.cc's.
#include "models/gpt/train.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <memory>
#include <optional>

#include "autograd/aux_loss.h"
#include "autograd/saved_compression.h"
#include "models/common/checkpoint.h"
#include "models/common/comm_hooks.h"
#include "models/common/flags.h"
#include "models/common/progress.h"
#include "models/common/run_control.h"
#include "models/common/sharded_checkpoint.h"
#include "models/common/train_loop.h"
#include "models/data/text.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "parallel/comm/launch.h"
#include "parallel/comm/mpi.h"
#include "parallel/zero.h"
#include "tensor/allocator.h"
#include "models/gpt/check.h"
#include "models/gpt/checkpoints.h"
#include "models/gpt/data.h"
#include "models/gpt/moe_step.h"
#include "models/gpt/run_checks.h"
#include "models/gpt/train_internal.h"
#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/random.h"

namespace tessera::gpt {
namespace {

using Clock = std::chrono::steady_clock;

// This rank's tensor-memory high-water mark: its MemoryScope's (the threads backend's ranks
// have one), else the process's (whose peak train_gpt resets when the run starts).
int64_t rank_memory_peak() {
  const MemoryTracker* t = MemoryScope::current();
  return t != nullptr ? t->peak() : process_memory().peak();
}

}  // namespace

GptConfig GptTrainConfig::model_config() const {
  GptConfig m;
  m.layers = layers;
  m.heads = heads;
  m.width = width;
  m.context = context;
  m.vocab = vocab;
  m.vocab_pad = vocab_pad;
  m.dropout = dropout;
  m.recompute = recompute == "full"        ? GptConfig::Recompute::full
                : recompute == "selective" ? GptConfig::Recompute::selective
                                           : GptConfig::Recompute::none;
  m.experts = experts;
  m.moe_every = moe_every;
  m.moe.top_k = moe_top_k;
  m.moe.hidden = moe_hidden;
  m.moe.capacity_factor = capacity_factor;
  m.moe.groups = moe_groups;
  m.moe.drop_policy = drop_policy == "score" ? nn::MoeOptions::DropPolicy::score
                                             : nn::MoeOptions::DropPolicy::position;
  m.moe.score = moe_score == "sigmoid" ? nn::MoeOptions::Score::sigmoid : nn::MoeOptions::Score::softmax;
  m.moe.aux_loss = aux_loss;
  m.moe.z_loss = z_loss;
  m.moe.bias_rate = moe_bias_rate;
  return m;
}

models::OptimizerChoice GptTrainConfig::optimizer_choice() const {
  models::OptimizerChoice o;
  o.name = optimizer;
  o.lr = lr;
  o.weight_decay = weight_decay;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.adafactor_mode = adafactor_mode;
  o.adafactor_beta1 = adafactor_beta1;
  o.adafactor_scale_parameter = adafactor_scale_parameter;
  o.momentum = momentum;
  if (stable_embedding) o.f32_state_names = {"wte", "wpe"};
  for (size_t at = 0; at <= f32_state.size();) {
    const size_t comma = std::min(f32_state.find(',', at), f32_state.size());
    if (comma > at) o.f32_state_names.push_back(f32_state.substr(at, comma - at));
    at = comma + 1;
  }
  return o;
}

namespace train_internal {

// The optimizer in the run's first line ("AdamW8bit", "Adafactor (hf)").
std::string optimizer_label(const optim::Optimizer& opt, const GptTrainConfig& c) {
  if (opt.kind() != "Adafactor") return opt.kind();
  return fmt::format("Adafactor ({})", c.adafactor_mode);
}

// What the loop takes from the configuration, the same for every layout.
models::LoopOptions loop_options(const GptTrainConfig& config, int64_t start, bool verbose) {
  const auto schedule = std::make_shared<optim::WarmupCosineLr>(
      config.lr, std::min(config.warmup, config.steps / 2), config.steps,
      config.lr * config.min_lr_ratio);
  models::LoopOptions o;
  o.program = "gpt";
  o.start_step = start;
  o.stop_at = config.max_steps > 0 ? std::min(config.max_steps, config.steps) : config.steps;
  TS_CHECK(o.start_step < o.stop_at,
           "gpt: --resume={} is at step {}, at or past the end of this run (--steps {}, "
           "--max_steps {}): nothing to train; raise --max_steps or --steps",
           config.resume, o.start_step, config.steps, config.max_steps);
  o.lr = [schedule](int64_t step) { return schedule->lr(step); };
  o.accum = config.accum;
  // Recomputation is there to hold less across the backward: not every weight's cast too.
  o.share_casts = config.recompute == "none";
  o.clip = config.clip;
  o.skip_nonfinite = config.nonfinite == "skip";
  o.log_every = config.log_every;
  o.val_every = config.val_every;
  o.save = config.save;
  o.save_every = config.save_every;
  o.verbose = verbose;
  return o;
}

// After the loop, for every layout: the final validation (collective), the result's
// fields from the loop, and the summary (`detail()` follows the tokens/s).
void finish_run(GptResult& result, const GptTrainConfig& config, models::Replica& replica,
                const models::LoopResult& loop, const models::StepMeter& meter,
                models::MetricsWriter& metrics, Device device,
                const std::function<std::string()>& detail, bool verbose,
                const std::function<void(const std::string&)>& say) {
  result.val_loss = replica.evaluate(loop.step);
  metrics.write({{"step", loop.step}, {"val_loss", result.val_loss}});
  result.val_losses = loop.val_losses;
  result.val_losses.emplace_back(loop.step, result.val_loss);
  result.losses = loop.losses;
  result.train_loss = loop.train_loss;
  result.nonfinite_skipped = loop.nonfinite_skipped;
  result.steps = loop.step;
  result.tokens_per_s = meter.rate();
  if (!device.is_cpu()) result.peak_device_bytes = allocator_for(device).stats().peak_bytes;
  result.peak_host_bytes = rank_memory_peak();
  if (!verbose) return;
  say(fmt::format("final val loss {:.4f} (train {:.4f}) after {} steps; {:.0f} training "
                  "tokens/s{}",
                  result.val_loss, result.train_loss, loop.step, result.tokens_per_s, detail()));
  if (!device.is_cpu()) {
    say(fmt::format("{}: peak allocated {:.1f} MiB", device,
                    static_cast<double>(result.peak_device_bytes) / (1 << 20)));
  } else {
    say(fmt::format("tensor memory: peak {} on rank 0 (predicted {})",
                    models::format_bytes(static_cast<double>(result.peak_host_bytes)),
                    models::format_bytes(estimate_gpt_memory(config, 1).per_rank())));
  }
}

}  // namespace train_internal

namespace {

// clip_grad_norm's max_norm that never clips (it must be finite): a norm without clipping.
constexpr double kNoClip = std::numeric_limits<double>::max();

// One rank of a single-device, data-parallel or ZeRO run (comm null: one rank, no wrapper),
// as the training loop (models/common/train_loop.h) drives it.
class GptReplica final : public models::Replica {
 public:
  GptReplica(const GptTrainConfig& config, parallel::Communicator* comm, GptResult& result,
             const std::function<void(const std::string&)>& say)
      : c_(config), comm_(comm), result_(result), say_(say),
        low_(models::precision_dtype(config.precision, "gpt")),
        device_(Device::parse(config.device)), batches_(config),
        rank_(comm != nullptr ? comm->rank() : 0), ranks_(comm != nullptr ? comm->size() : 1),
        moe_(config.model_config(), comm, config.ep), scaler_(scaler_options(low_, config.loss_scale)) {
    TS_CHECK(config.batch % (ranks_ * config.accum) == 0,
             "gpt: --batch {} must divide into --dp {} x --accum {} equal micro-batches",
             config.batch, ranks_, config.accum);
    const GptConfig mconfig = config.model_config();
    mconfig.validate();
    manual_seed(static_cast<uint64_t>(config.seed));
    {
      // Expert parallelism: each rank builds and keeps its experts' parameters only, with one
      // device's values (the other experts' draws are skipped).
      std::optional<nn::MoeBuildScope> only_mine;
      if (moe_.groups() != nullptr) only_mine.emplace(moe_.groups()->first(), moe_.groups()->local());
      // Parameters offloaded: the model is built in host memory (a device budget may be
      // smaller than the whole model); ZeroDataParallel then takes a segment at a time.
      std::optional<HostTierScope> host;
      if (comm != nullptr && config.offload.params != "none") host.emplace();
      model_ = std::make_unique<Gpt>(mconfig);
    }
    if (moe_.groups() != nullptr) moe_.groups()->keep(*model_);
    // Initialised on the CPU (the same values everywhere), then moved before the optimizer
    // sees the parameters.
    if (!device_.is_cpu()) model_->to(device_);
    hook_ = models::make_comm_hook("gpt", config.compress, static_cast<uint64_t>(config.seed));
    TS_CHECK(!hook_ || comm != nullptr,
             "gpt: --compress={} compresses the data-parallel gradient reduction; it needs "
             "--dp >= 2 (or mpirun)",
             config.compress.name);
    if (comm != nullptr) {
      parallel::ZeroOptions zopt;
      zopt.comm_hook = hook_;
      zopt.stage = static_cast<int>(config.zero);
      zopt.average = false;  // each rank backpropagates its share of the global mean
      zopt.offload = models::offload_options(
          "gpt", config.offload,
          {.zero = config.zero, .optimizer = config.optimizer, .compress = config.compress.name, .ep = config.ep});
      // An optimizer with per-matrix state (Adafactor) gets whole rows of each parameter, one
      // with per-block state (8-bit AdamW) whole blocks.
      zopt.row_shards = models::optimizer_needs_row_shards(config.optimizer);
      zopt.block_shards = models::optimizer_shard_block(config.optimizer);
      for (int64_t l = 0; l < config.layers; ++l) zopt.units.push_back(fmt::format("h.{}", l));
      // The experts' parameters reduce (and shard) over the ranks holding the same experts.
      if (moe_.groups() != nullptr) zopt.subgroup = moe_.groups()->subgroup(zopt.average);
      zero_ = std::make_unique<parallel::ZeroDataParallel>(*model_, *comm, zopt);
      offload_last_ = zero_->offload_report();  // (construction's writes are no step's)
      // The optimizer's state bytes per element, by its own formula (the swap formula's).
      offload_state_bytes_ = std::llround(
          models::optimizer_state_formula_bytes(config.optimizer_choice(), model_->named_parameters(), false) /
          static_cast<double>(model_->num_parameters()));
    }
    if (config.compress.name == "onebit_adam") {  // 1-bit Adam in AdamW's place, with its hook
      opt_ = models::make_onebit_adam(config.compress,
                                      zero_->param_groups(config.lr, config.weight_decay), *comm,
                                      hook_, config.lr, {config.beta1, config.beta2},
                                      config.weight_decay, config.steps);
    } else {
      opt_ = models::make_optimizer(
          "gpt", config.optimizer_choice(),
          zero_ ? zero_->param_groups(config.lr, config.weight_decay)
                : optim::decay_groups(model_->named_parameters(), config.lr, config.weight_decay));
    }
    params_ = model_->parameters();
    if (comm != nullptr) {
      // Every rank skips the same f16 steps: under ZeRO each holds different gradient shards.
      scaler_.reduce_found_inf_with([comm](bool here) {
        Tensor t = Tensor::from_vector<double>({here ? 1.0 : 0.0}, {1});
        parallel::CommCause cause("loss scaler overflow check", parallel::CommKind::control);
        comm->all_reduce(t, parallel::ReduceOp::max);
        return t.to_vector<double>()[0] > 0;
      });
    }
  }

  Gpt& model() { return *model_; }
  const GptData& batches() const { return batches_; }
  int64_t optimizer_state_bytes() const { return opt_->state_bytes(); }
  std::string optimizer_kind() const { return optimizer_label(*opt_, c_); }
  DType low() const { return low_; }
  const optim::DynamicLossScaler& scaler() const { return scaler_; }

  // The step a --resume continues from (0 without one).
  int64_t resume() {
    if (c_.resume.empty()) return 0;
    // A data-parallel run loads the single-device layout every run saves, whatever its own.
    const auto apply = [&](const nn::StateDict& weights, const optim::Optimizer::StateDict& saved) {
      // The gradient compression's state (per rank) goes to the hook, the rest to the
      // optimizer.
      optim::Optimizer::StateDict state = saved;
      models::load_hook_state("gpt", hook_.get(), comm_, state, c_.zero);
      if (parallel::ExpertGroups* experts = moe_.groups()) {  // this rank's experts' rows
        nn::StateDict mine = weights;
        experts->slice(mine);
        experts->slice(state, optimizer_order(*model_));
        zero_->load_model_state_dict(mine);
        zero_->load_optimizer_state_dict(*opt_, state);
      } else if (zero_) {
        zero_->load_model_state_dict(weights);
        zero_->load_optimizer_state_dict(*opt_, state);
      } else {
        model_->load_state_dict(weights);
        opt_->load_state_dict(state);
      }
    };
    if (models::is_sharded_checkpoint(c_.resume)) {
      // Any layout's shards, assembled whole (this layout holds every parameter).
      models::ShardedCheckpointReader reader(c_.resume);
      parallel::ExpertGroups* experts = moe_.groups();
      const auto [weights, state] = read_single_device(
          reader, *model_, optimizer_order(*model_),
          [experts](const std::string& name, const Shape& here) {
            return experts != nullptr ? experts->whole_shape(name, here) : here;
          });
      apply(weights, state);
      return resumed(c_, sharded_state(reader, scaler_), rank_ == 0, say_);
    }
    return resumed(c_, models::load_checkpoint(c_.resume, apply, scaler_), rank_ == 0, say_);
  }

  void zero_grad(int64_t /*step*/, double lr) override {
    step_rng_offset_ = default_generator().offset();
    opt_->set_lr(lr);
    if (zero_) {
      zero_->zero_grad();
    } else {
      opt_->zero_grad();
    }
  }

  // Micro-batch `micro`'s batch and logits, its dropout drawing its rows of the masks one
  // device draws for the whole batch (every micro-batch starts from the step's generator
  // state and takes its block).
  std::pair<data::TextBatch, Tensor> forward(int64_t step, int micro) {
    const int parts = static_cast<int>(ranks_ * c_.accum);
    const int part = static_cast<int>(rank_ * c_.accum + micro);
    data::TextBatch batch = batches_.train(step, part, parts);
    const int64_t rows = c_.batch / parts;
    default_generator().set_state(default_generator().seed(), step_rng_offset_);
    const BatchSliceScope slice({c_.batch, part * rows, rows});
    AutocastGuard amp(low_);
    Tensor logits = (*model_)(batch.idx.to(device_));
    return {std::move(batch), std::move(logits)};
  }

  Tensor forward_backward(int64_t step, int micro) override {
    // This micro-batch's share of the global batch's mean loss (ranks x accum micro-batches
    // of equal size), so backward sees one device's per-sample gradient magnitudes (what f16
    // loss scaling is sized for), and the ranks' gradients are summed. The experts' attached
    // losses get the same factor; their routing counts are summed over the dp group (also
    // when recomputation reruns a block in backward).
    const int64_t shares = ranks_ * c_.accum;
    const autograd::AuxLossScale aux_scale(scaler_.scale_value() / static_cast<double>(shares));
    const std::unique_ptr<nn::MoeCountReduction> moe_counts = moe_.reduction();
    const nn::MoeDispatchScope experts_where(moe_.dispatch());
    const nn::MoeBatchParts parts(shares);  // each forward its share of the capacity groups
    if (micro == 0) {
      moe_.begin_step();
      step_counts_.reset();
      if (moe_.on() && c_.accum > 1 && c_.aux_loss > 0) {
        // The balancing loss's f_i are the whole batch's, as on one device: a routing pass
        // (forwards without grad) over the step's micro-batches counts them first.
        const nn::MoeStatsScope routing;
        const NoGradGuard no_grad;
        for (int j = 0; j < c_.accum; ++j) forward(step, j);
        step_counts_ = std::make_unique<nn::MoeStepCounts>(routing.layers());
      }
    }
    Tensor loss;
    {
      const nn::MoeStatsScope routing;
      auto [batch, logits] = forward(step, micro);
      AutocastGuard amp(low_);
      loss = Gpt::loss(logits, batch.targets.to(device_));
      if (moe_.on()) moe_.add(routing);
    }
    Tensor scaled = scaler_.scale(shares > 1 ? loss / static_cast<double>(shares) : loss);
    if (!zero_) {
      scaled.backward();
    } else if (micro + 1 < c_.accum) {
      auto guard = zero_->no_sync();  // reduce once per step
      zero_->backward(scaled);
    } else {
      zero_->backward(scaled);
    }
    return loss;
  }

  std::optional<double> grad_norm(double max_norm) override {
    // Under ZeRO the optimizer's parameters are this rank's shards, holding its gradients.
    if (!(zero_ ? scaler_.unscale_and_check(*opt_) : scaler_.unscale_and_check(params_))) {
      return std::nullopt;
    }
    if (zero_) return zero_->clip_grad_norm(max_norm > 0 ? max_norm : kNoClip);
    // The coefficient is applied by the optimizer's step (one pass less over the gradients).
    return max_norm > 0 ? optim::clip_grad_norm(params_, max_norm, *opt_) : optim::grad_norm(params_);
  }

  void step(bool skip) override {
    if (!skip && zero_) {
      scaler_.step(*opt_, [&] { zero_->step(*opt_); });
    } else if (!skip) {
      scaler_.step(*opt_);
    }
    scaler_.update();
    step_counts_.reset();
    if (!skip) moe_.update_bias(*model_);
    if (moe_.on()) {
      result_.moe_stats = moe_.layers();
      result_.moe_loss = moe_.loss();
    }
  }

  parallel::Communicator* group() override { return comm_; }

  void save(int64_t step) override {
    const models::TrainingState s = training_state(c_, step);
    if (c_.save_sharded) {
      // This layout's ranks each hold the whole model (ZeRO gathers it, and the experts are
      // gathered over ep): rank 0 writes it.
      nn::StateDict weights = zero_ ? zero_->model_state_dict() : model_->state_dict();
      optim::Optimizer::StateDict state =
          zero_ ? zero_->optimizer_state_dict(*opt_) : opt_->state_dict();
      gather_experts(weights, state);
      if (hook_) state.merge(models::gather_hook_state(*hook_, *comm_, c_.zero));
      save_sharded(c_, comm_, step, scaler_, [&](models::ShardedCheckpointWriter& w) {
        if (rank_ == 0) add_single_device(w, weights, state, optimizer_order(*model_));
      });
      return;
    }
    if (!zero_) {
      models::save_checkpoint(c_.save, *model_, *opt_, scaler_, s);
      return;
    }
    // Every rank gathers (collective); rank 0 writes the single-device layout.
    nn::StateDict weights = zero_->model_state_dict();
    optim::Optimizer::StateDict state = zero_->optimizer_state_dict(*opt_);
    gather_experts(weights, state);
    if (hook_) state.merge(models::gather_hook_state(*hook_, *comm_, c_.zero));
    if (rank_ == 0) models::save_checkpoint(c_.save, weights, state, scaler_, s);
    comm_->barrier();  // nobody reads the files before they exist
  }

  double evaluate(int64_t /*step*/) override {
    const nn::MoeDispatchScope experts_where(moe_.dispatch());  // (every rank evaluates)
    return train_internal::evaluate(*model_, batches_, c_.val_batches, low_);
  }

  const MoeStep& moe() const { return moe_; }

  // ZeRO's memory after the first step and its traffic in the second (rank 0 reports).
  void after_step(int64_t run_step, const parallel::CommLog& log) override {
    if (zero_ && zero_->options().offload.any()) {
      // The swap file's traffic and busy time in this step (and its forward/backward).
      const parallel::ZeroOffloadReport now = zero_->offload_report();
      // Against the layout's formula (ZeroOffloadReport); the first update has no state to
      // read. At stage 3 on the file tier a step's update runs in the next step's forward,
      // so its traffic is that step's (and pages read ahead during a backward move reads
      // from one step to the one before: the formula holds on average).
      const int64_t step_io = now.step_io_formula(offload_state_bytes_);
      const bool deferred = zero_->stage() == 3 && now.optimizer == parallel::OffloadTier::file;
      const int64_t update = deferred ? run_step - 1 : run_step;  // the update in this step
      offload_step_ = {now.read_bytes - offload_last_.read_bytes,
                       now.written_bytes - offload_last_.written_bytes,
                       now.io_seconds - offload_last_.io_seconds,
                       (update < 0 ? 0 : update == 0 ? now.step_io_formula(0) : step_io) +
                           now.gather_read_formula(c_.accum, run_step > 0),
                       update < 0 ? 0 : step_io,
                       now.update_seconds - offload_last_.update_seconds,
                       now.gather_wait_seconds - offload_last_.gather_wait_seconds};
      offload_last_ = now;
    }
    if (hook_) {
      const parallel::CommHook::Traffic t = hook_->last_round();
      if (t.uncompressed > 0) {
        result_.compress_ratio = static_cast<double>(t.sent) / static_cast<double>(t.uncompressed);
      }
    }
    if (zero_ && run_step == 0) {
      parallel::ZeroMemory m = zero_->memory_report();
      m.state_per_param = models::optimizer_state_formula_bytes(
                              c_.optimizer_choice(), model_->named_parameters(), false) /
                          static_cast<double>(model_->num_parameters());
      result_.memory_report = m.str();
      if (zero_->options().offload.any()) result_.memory_report += "\n" + zero_->offload_report().str();
      say_(result_.memory_report);
    }
    if (!zero_ || run_step != 1) return;
    // The gradients' and parameters' traffic, in units of a ring pass over the parameters.
    const int64_t bytes =
        log.bytes({parallel::CommKind::gradients, parallel::CommKind::parameters});
    const double ring = 4.0 * static_cast<double>(model_->num_parameters()) *
                        static_cast<double>(ranks_ - 1) / static_cast<double>(ranks_);
    result_.comm_per_step = ranks_ > 1 ? static_cast<double>(bytes) / ring : 0.0;
    say_(fmt::format("communication per step (rank 0): {} collectives, {:.2f} MiB of "
                     "gradients and parameters = {:.3f} x 4 Psi (n-1)/n",
                     log.records.size(), static_cast<double>(bytes) / (1 << 20),
                     result_.comm_per_step));
  }

  std::string line_suffix() const override {
    std::string out;
    if (scaler_.enabled()) {
      out += fmt::format("  loss scale {:g} (skipped {})", scaler_.scale_value(),
                         scaler_.skipped_steps());
    }
    // The last step's gradient elements on the wire against an exact all-reduce's.
    if (hook_) out += models::hook_traffic(*hook_);
    if (!offload_last_.file.empty()) {
      const double bytes = static_cast<double>(offload_step_.read + offload_step_.written);
      out += fmt::format("  swap {:.1f}+{:.1f} MiB (formula {:.1f}+{:.1f}) in {:.0f} ms ({:.0f} MB/s)",
                         offload_step_.read / 1048576.0, offload_step_.written / 1048576.0,
                         offload_step_.formula_read / 1048576.0,
                         offload_step_.formula_written / 1048576.0, offload_step_.seconds * 1e3,
                         offload_step_.seconds > 0 ? bytes / offload_step_.seconds / 1e6 : 0.0);
    }
    return out + moe_.line();
  }

  void annotate(nlohmann::json& record) const override {
    moe_.annotate(record);
    // The host tier's high-water mark (the process's).
    if (zero_ && zero_->options().offload.any()) {
      record["offload_host_peak_bytes"] = host_tier_allocator().stats().peak_bytes;
    }
    if (!offload_last_.file.empty()) {
      record["offload_read_bytes"] = offload_step_.read;
      record["offload_written_bytes"] = offload_step_.written;
      record["offload_io_seconds"] = offload_step_.seconds;
      record["offload_formula_read_bytes"] = offload_step_.formula_read;
      record["offload_formula_written_bytes"] = offload_step_.formula_written;
      record["offload_update_seconds"] = offload_step_.update_seconds;
      record["offload_window_peak_bytes"] = offload_last_.window_peak_bytes;
      record["offload_gather_wait_seconds"] = offload_step_.gather_wait_seconds;
    }
  }

 private:
  // With expert parallelism: the experts' parameters and optimizer state whole, as one device
  // holds them (collective over the ep group).
  void gather_experts(nn::StateDict& weights, optim::Optimizer::StateDict& state) const {
    if (parallel::ExpertGroups* experts = moe_.groups()) {
      experts->gather(weights);
      experts->gather(state, optimizer_order(*model_));
    }
  }

  static optim::LossScalerOptions scaler_options(DType low, double init_scale) {
    optim::LossScalerOptions o;
    o.enabled = low == DType::f16;  // f16 needs dynamic loss scaling; bf16 does not
    o.init_scale = init_scale;
    return o;
  }

  const GptTrainConfig& c_;
  parallel::Communicator* comm_;
  GptResult& result_;
  const std::function<void(const std::string&)>& say_;
  DType low_;
  Device device_;
  const GptData batches_;
  int64_t rank_, ranks_;
  MoeStep moe_;
  std::unique_ptr<nn::MoeStepCounts> step_counts_;  // with --accum: the step's routing
  std::unique_ptr<Gpt> model_;
  std::shared_ptr<parallel::CommHook> hook_;  // --compress (null: none)
  std::unique_ptr<parallel::ZeroDataParallel> zero_;
  parallel::ZeroOffloadReport offload_last_;  // the offload report after the last step
  int64_t offload_state_bytes_ = 0;           // optimizer state bytes per parameter element
  struct {
    int64_t read = 0, written = 0;
    double seconds = 0;
    int64_t formula_read = 0, formula_written = 0;
    double update_seconds = 0, gather_wait_seconds = 0;
  } offload_step_;  // the swap file's bytes, busy seconds and formula in the last step
  std::unique_ptr<optim::Optimizer> opt_;
  optim::DynamicLossScaler scaler_;
  std::vector<Tensor> params_;
  uint64_t step_rng_offset_ = 0;  // the generator's offset when this step began
};

// One rank's training (comm null: the plain single-process loop, no wrapper).
GptResult train_rank(const GptTrainConfig& config, parallel::Communicator* comm) {
  const bool lead = comm == nullptr || comm->rank() == 0;  // prints, writes files
  const bool verbose = config.verbose && lead;
  models::Progress progress;
  auto say = std::function<void(const std::string&)>([&](const std::string& line) {
    if (verbose) progress.print(line);
  });
  GptResult result;
  GptReplica replica(config, comm, result, say);
  Gpt& model = replica.model();
  const Device device = Device::parse(config.device);
  models::LoopOptions o = loop_options(config, replica.resume(), verbose);
  o.fault_rank = comm != nullptr ? comm->rank() : 0;
  models::MetricsWriter metrics;
  if (!config.metrics.empty() && lead) {
    metrics = models::MetricsWriter(config.metrics, !config.resume.empty());
  }
  const int64_t tokens_per_step = config.batch * config.context;
  const int64_t padded_vocab = config.model_config().padded_vocab();
  say(fmt::format("gpt: {} layers, {} heads, width {}, context {}{} ({} parameters); {}; batch {} "
                  "({} tokens/step), {} steps, {} lr {}, precision {}{}",
                  config.layers, config.heads, config.width, config.context,
                  config.vocab != data::kByteVocab || padded_vocab != config.vocab
                      ? fmt::format(", vocab {}{}", config.vocab,
                                    padded_vocab != config.vocab
                                        ? fmt::format(" (padded to {})", padded_vocab)
                                        : std::string())
                      : std::string(),
                  config.model_config().num_parameters(), replica.batches().str(), config.batch,
                  tokens_per_step,
                  config.steps, replica.optimizer_kind(), config.lr, config.precision,
                  device.is_cpu() ? std::string() : fmt::format(", on {}", device)));
  if (comm != nullptr) {
    say(fmt::format("data parallel: {} ranks ({} backend), ZeRO stage {}, {} micro-batch(es) of "
                    "{} sequences per rank per step",
                    comm->size(), comm->backend(), config.zero, config.accum,
                    config.batch / (comm->size() * config.accum)));
  }

  const Clock::time_point run_start = Clock::now();
  models::StepMeter meter(static_cast<double>(tokens_per_step), "tokens", config.timing_skip);
  model.train();
  const autograd::SavedCompressionGuard saved_compression(
      {.mode = autograd::parse_saved_compression(config.act_compress, "gpt: --act_compress")});
  const models::LoopResult loop = models::run_loop(replica, o, meter, progress, metrics);

  result.skipped_steps = replica.scaler().skipped_steps();
  result.optimizer_state_bytes = replica.optimizer_state_bytes();
  result.optimizer_state_formula = models::optimizer_state_formula_bytes(
      config.optimizer_choice(), model.named_parameters(), replica.low() != DType::f32);
  finish_run(result, config, replica, loop, meter, metrics, device, [&] {
    return fmt::format("{}; {} in all{}",
                       config.timing_skip > 0
                           ? fmt::format(" (steps after the first {})", config.timing_skip)
                           : std::string(),
                       models::format_duration(models::seconds_since(run_start)),
                       replica.scaler().enabled()
                           ? fmt::format("; {} f16 steps skipped", result.skipped_steps)
                           : std::string()) +
           fmt::format("; {} state {} ({:.3g} bytes per parameter{}; formula {:.3g} for the "
                       "{})",
                       replica.optimizer_kind(),
                       models::format_bytes(static_cast<double>(result.optimizer_state_bytes)),
                       static_cast<double>(result.optimizer_state_bytes) /
                           static_cast<double>(model.num_parameters()),
                       comm != nullptr && config.zero > 0 ? ", this rank's shards" : "",
                       result.optimizer_state_formula /
                           static_cast<double>(model.num_parameters()),
                       config.ep > 1 ? "parameters this rank holds" : "whole model");
  }, verbose, say);
  if (config.sample_length > 0 && config.synthetic_data) {
    say("no sample: the model was trained on random tokens");
  } else if (config.sample_length > 0) {
    const nn::MoeDispatchScope experts_where(replica.moe().dispatch());  // (every rank samples)
    sample_into(result, model, config, replica.low(), say, replica.moe().dispatch() != nullptr);
  }
  return result;
}
}  // namespace

GptResult train_gpt(const GptTrainConfig& config) {
  validate_train_config(config);
  const bool mpi = parallel::mpi_launched();
  if (!Device::parse(config.device).is_cpu()) {
    TS_CHECK(config.dp == 1 && config.zero == 0 && config.pp == 1 && config.tp == 1 && !mpi,
             "gpt: --device={} runs a single rank for now; it cannot be combined with --dp {}, "
             "--zero {}, --pp {}, --tp {} or mpirun",
             config.device, config.dp, config.zero, config.pp, config.tp);
  }
  const bool three_d = config.pp > 1 || config.tp > 1;
  const int64_t ranks = three_d ? config.pp * config.dp * config.tp : config.dp;
  const GptMemoryEstimate estimate = preflight(config, mpi, mpi ? 1 : static_cast<int>(ranks));
  const models::MemoryLimitScope memory_limit(config.memory_limit);
  models::StopSignals signals;  // SIGTERM/SIGINT: finish the step, save, stop
  parallel::LaunchOptions launch;
  launch.program = "gpt";
  launch.ranks_from = three_d ? fmt::format("--pp {} x --dp {} x --tp {} = {}", config.pp,
                                            config.dp, config.tp, ranks)
                              : fmt::format("--dp is {}", config.dp);
  launch.kernel_threads = static_cast<int>(config.threads);
  launch.timeout_seconds = config.comm_timeout;
  launch.world_for_one = three_d || config.zero > 0;  // else the plain loop, no wrapper
  GptResult result;
  if (config.check) launch.world_for_one = true;  // the check runs every layout as 3-D
  parallel::launch(
      static_cast<int>(ranks),
      [&](parallel::CommPtr world) {
        if (config.check) {
          const GptCheckResult c = check_gpt(config, world);
          if (world->rank() == 0 || mpi) {
            result.check_ok = c.ok;
            result.check_report = c.report;
            result.steps = c.steps;
          }
          // A mismatch is the program's error (every rank has the same report: under mpirun
          // whichever rank reports first says it).
          if (world->rank() == 0 && config.verbose && c.ok) std::printf("%s\n", c.report.c_str());
          return;
        }
        GptResult r = three_d ? train_rank_3d(config, world) : train_rank(config, world.get());
        // Rank 0's result (under mpirun this process's rank is the only one here).
        if (world == nullptr || world->rank() == 0 || mpi) result = std::move(r);
      },
      launch);
  result.predicted_bytes = estimate.per_rank();
  return result;
}

}  // namespace tessera::gpt
