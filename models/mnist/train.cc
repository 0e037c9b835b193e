#include "models/mnist/train.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>

#include "models/common/checkpoint.h"
#include "models/common/comm_hooks.h"
#include "models/common/flags.h"
#include "models/common/progress.h"
#include "models/common/run_control.h"
#include "models/common/train_loop.h"
#include "models/data/idx.h"
#include "models/data/loader.h"
#include "models/mnist/model.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/launch.h"
#include "parallel/comm/mpi.h"
#include "parallel/zero.h"
#include "tensor/allocator.h"
#include "tensor/autocast.h"

namespace tessera::mnist {
namespace {

using Clock = std::chrono::steady_clock;

// clip_grad_norm's max_norm that never clips (it must be finite): a norm without clipping.
constexpr double kNoClip = std::numeric_limits<double>::max();

struct Eval {
  double accuracy = 0.0, loss = 0.0;
};

// On the test split's device (the model's).
Eval evaluate(nn::Module& model, const data::MnistSplit& test, DType low) {
  NoGradGuard no_grad;
  AutocastGuard amp(low);
  model.eval();
  const int64_t n = test.labels.numel(), chunk = 1000;
  int64_t correct = 0;
  double loss_sum = 0.0;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    const Tensor x = narrow(test.images, 0, start, len);
    const Tensor y = narrow(test.labels, 0, start, len);
    const Tensor logits = model(x);
    loss_sum += cross_entropy(logits, y, Reduction::sum).item<double>();
    correct += sum(cast(eq(argmax(logits, 1), y), DType::i64)).item<int64_t>();
  }
  model.train();
  return Eval{static_cast<double>(correct) / n, loss_sum / n};
}

// Every field, before any work: an Error naming the flag and the value.
void validate(const MnistConfig& c) {
  using models::require_at_least, models::require_finite_at_least, models::require_one_of;
  constexpr const char* mnist = "mnist";
  require_one_of(mnist, "model", c.model, {"mlp", "cnn"});
  models::validate_optimizer(mnist, c.optimizer);
  require_at_least(mnist, "epochs", c.epochs, 0);
  require_at_least(mnist, "batch", c.batch, 1);
  TS_CHECK(std::isfinite(c.lr) && c.lr > 0, "mnist: --lr must be a finite number > 0, got {}",
           c.lr);
  models::require_fraction(mnist, "min_lr_ratio", c.min_lr_ratio, /*include_one=*/true);
  require_at_least(mnist, "warmup", c.warmup, 0);
  require_finite_at_least(mnist, "weight_decay", c.weight_decay, 0);
  TS_CHECK(std::isfinite(c.clip) && c.clip >= 0,
           "mnist: --clip must be a finite number >= 0 (0: no clipping), got {}", c.clip);
  models::precision_dtype(c.precision, mnist);
  require_at_least(mnist, "seed", c.seed, 0);
  require_at_least(mnist, "threads", c.threads, 0);
  require_at_least(mnist, "max_steps", c.max_steps, 0);
  require_at_least(mnist, "train_limit", c.train_limit, 0);
  require_at_least(mnist, "test_limit", c.test_limit, 0);
  require_at_least(mnist, "log_every", c.log_every, 1);
  require_at_least(mnist, "memory_limit", c.memory_limit, 0);
  require_one_of(mnist, "nonfinite", c.nonfinite, {"error", "skip"});
  require_at_least(mnist, "dp", c.dp, 1);
  TS_CHECK(c.zero >= 0 && c.zero <= 3, "mnist: --zero must be 0, 1, 2 or 3, got {}", c.zero);
  TS_CHECK(c.batch % c.dp == 0, "mnist: --batch {} must divide into --dp {} equal slices",
           c.batch, c.dp);
  models::validate_compress(mnist, c.compress, c.optimizer.name);
  models::offload_options(mnist, c.offload,
                          {.zero = c.zero, .optimizer = c.optimizer.name, .compress = c.compress.name});
  if (c.compress.name != "none") {
    models::require_compress_zero(mnist, c.compress, c.zero);
    TS_CHECK(c.precision != "f16",
             "mnist: --compress={} keeps error feedback across steps, which f16's loss scaling "
             "breaks (an overflowing step's inf enters the error for good); use "
             "--precision=bf16 or f32",
             c.compress.name);
  }
}


// The classifier on one rank, as the training loop (models/common/train_loop.h) drives it:
// a batch per step from the shuffling loader; at the end of each epoch the test set's
// accuracy and loss (outside the step's timing).
// With a communicator (--dp, mpirun) each rank trains on its slice of every batch under
// ZeRO (stage 0: DDP, with the --compress hook); rank 0 prints and writes files.
class MnistReplica final : public models::Replica {
 public:
  MnistReplica(const MnistConfig& c, parallel::Communicator* comm, nn::Module& model,
               data::Loader& loader, const data::MnistSplit& test, int64_t epochs,
               int64_t total_steps, DType low, Device device, models::Progress& progress,
               models::MetricsWriter& metrics, MnistResult& result)
      : c_(c), comm_(comm), model_(model), loader_(loader), test_(test), epochs_(epochs),
        low_(low), device_(device), verbose_(c.verbose && (comm == nullptr || comm->rank() == 0)),
        progress_(progress), metrics_(metrics), result_(result), params_(model.parameters()) {
    hook_ = models::make_comm_hook("mnist", c.compress, static_cast<uint64_t>(c.seed));
    TS_CHECK(!hook_ || comm != nullptr,
             "mnist: --compress={} compresses the data-parallel gradient reduction; it needs "
             "--dp >= 2 (or mpirun)",
             c.compress.name);
    if (comm != nullptr) {
      TS_CHECK(c.batch % comm->size() == 0,
               "mnist: --batch {} must divide into {} equal slices, one per rank", c.batch,
               comm->size());
      parallel::ZeroOptions zopt;
      zopt.stage = static_cast<int>(c.zero);
      zopt.comm_hook = hook_;
      zopt.average = true;  // each rank's loss is its slice's mean
      zopt.row_shards = models::optimizer_needs_row_shards(c.optimizer.name);
      zopt.block_shards = models::optimizer_shard_block(c.optimizer.name);
      zopt.offload = models::offload_options(
          "mnist", c.offload, {.zero = c.zero, .optimizer = c.optimizer.name, .compress = c.compress.name});
      zero_ = std::make_unique<parallel::ZeroDataParallel>(model, *comm, zopt);
    }
    std::vector<optim::ParamGroup> groups =
        zero_ ? zero_->param_groups(c.lr, c.weight_decay)
              : optim::decay_groups(model.named_parameters(), c.lr, c.weight_decay);
    if (c.compress.name == "onebit_adam") {  // 1-bit Adam in AdamW's place, with its hook
      opt_ = models::make_onebit_adam(c.compress, std::move(groups), *comm, hook_, c.lr,
                                      {c.optimizer.beta1, c.optimizer.beta2}, c.weight_decay,
                                      total_steps);
    } else {
      models::OptimizerChoice choice = c.optimizer;
      choice.lr = c.lr;
      choice.weight_decay = c.weight_decay;
      opt_ = models::make_optimizer("mnist", choice, std::move(groups));
    }
    optim::LossScalerOptions sopt;
    sopt.enabled = low == DType::f16;
    scaler_ = std::make_unique<optim::DynamicLossScaler>(sopt);
    if (comm != nullptr) {
      // Every rank skips the same f16 steps: under ZeRO each holds different gradient shards.
      scaler_->reduce_found_inf_with([comm](bool here) {
        Tensor t = Tensor::from_vector<double>({here ? 1.0 : 0.0}, {1});
        parallel::CommCause cause("loss scaler overflow check", parallel::CommKind::control);
        comm->all_reduce(t, parallel::ReduceOp::max);
        return t.to_vector<double>()[0] > 0;
      });
    }
  }

  // Loads a checkpoint (any layout's: they are all saved in the single-device layout) and
  // returns its training state; each rank takes its row of the comm hook's state.
  models::TrainingState resume(const std::string& path) {
    return models::load_checkpoint(
        path,
        [&](const nn::StateDict& weights, const optim::Optimizer::StateDict& saved) {
          optim::Optimizer::StateDict state = saved;
          models::load_hook_state("mnist", hook_.get(), comm_, state, c_.zero);
          if (zero_) {
            zero_->load_model_state_dict(weights);
            zero_->load_optimizer_state_dict(*opt_, state);
          } else {
            model_.load_state_dict(weights);
            opt_->load_state_dict(state);
          }
        },
        *scaler_);
  }

  optim::Optimizer& optimizer() { return *opt_; }
  optim::DynamicLossScaler& scaler() { return *scaler_; }

  // Throughput and, with eval_each_epoch, the test set's accuracy at the end of an epoch.
  void end_of_epoch(int64_t epoch, int64_t step, const models::StepMeter& meter) {
    const int64_t steps = meter.steps() - epoch_start_steps_;
    const double seconds = meter.seconds() - epoch_start_seconds_;
    epoch_start_steps_ = meter.steps();
    epoch_start_seconds_ = meter.seconds();
    const double sps = steps > 0 ? static_cast<double>(steps * c_.batch) / seconds : 0.0;
    // Only whole epochs trained in this run give a throughput figure.
    if (steps == loader_.batches_per_epoch()) result_.epoch_samples_per_s.push_back(sps);
    nlohmann::json rec = {{"step", step}, {"epoch", epoch + 1}};
    if (steps > 0) rec["samples_per_s"] = sps;
    if (c_.eval_each_epoch) {
      const Eval e = mnist::evaluate(model_, test_, low_);
      rec["accuracy"] = e.accuracy;
      rec["test_loss"] = e.loss;
      if (verbose_) {
        progress_.update(fmt::format("epoch {}/{}  step {}  test accuracy {:.2f}%  test loss "
                                     "{:.4f}  {:.0f} samples/s",
                                     epoch + 1, epochs_, step, 100 * e.accuracy, e.loss, sps),
                         /*force=*/true);
        progress_.finish();
      }
    }
    metrics_.write(rec);
  }
  // Whether this run trained steps of the current epoch that no end_of_epoch() closed.
  bool epoch_open(const models::StepMeter& meter) const {
    return meter.steps() > epoch_start_steps_;
  }

  void before_step(int64_t step, const models::StepMeter& meter) override {
    if (loader_.next(batch_)) return;
    end_of_epoch(loader_.epoch() - 1, step, meter);
    TS_CHECK(loader_.next(batch_), "mnist: the loader has no batch after epoch {}",
             loader_.epoch());
  }
  void zero_grad(int64_t /*step*/, double lr) override {
    opt_->set_lr(lr);
    if (zero_) {
      zero_->zero_grad();
    } else {
      opt_->zero_grad();
    }
  }
  Tensor forward_backward(int64_t /*step*/, int /*micro*/) override {
    Tensor loss;  // over this rank's rows of the batch (the loader's slice)
    {
      AutocastGuard amp(low_);
      loss = cross_entropy(model_(batch_.inputs.to(device_)), batch_.targets.to(device_));
    }
    const Tensor scaled = scaler_->scale(loss);
    if (zero_) {
      zero_->backward(scaled);  // the mean over ranks of their slices' means: the batch's
    } else {
      scaled.backward();
    }
    return loss;
  }
  std::optional<double> grad_norm(double max_norm) override {
    // Under ZeRO the optimizer's parameters are this rank's shards, holding its gradients.
    if (!(zero_ ? scaler_->unscale_and_check(*opt_) : scaler_->unscale_and_check(params_))) {
      return std::nullopt;
    }
    if (zero_) return zero_->clip_grad_norm(max_norm > 0 ? max_norm : kNoClip);
    // The coefficient is applied by the optimizer's step (one pass less over the gradients).
    return max_norm > 0 ? optim::clip_grad_norm(params_, max_norm, *opt_) : optim::grad_norm(params_);
  }
  void step(bool skip) override {
    if (!skip && zero_) {
      scaler_->step(*opt_, [&] { zero_->step(*opt_); });
    } else if (!skip) {
      scaler_->step(*opt_);
    }
    scaler_->update();
  }
  parallel::Communicator* group() override { return comm_; }
  void after_step(int64_t /*run_step*/, const parallel::CommLog& /*log*/) override {
    if (!hook_) return;
    const parallel::CommHook::Traffic t = hook_->last_round();
    if (t.uncompressed > 0) {
      result_.compress_ratio = static_cast<double>(t.sent) / static_cast<double>(t.uncompressed);
    }
  }

  void save(int64_t step) override {
    models::TrainingState s;
    s.step = step;
    s.epoch = loader_.epoch();
    s.batch_index = loader_.batch_index();
    s.rng_seed = default_generator().seed();
    s.rng_offset = default_generator().offset();
    s.info = {{"model", c_.model}, {"precision", c_.precision}};
    if (!zero_) {
      models::save_checkpoint(c_.save, model_, *opt_, *scaler_, s);
      return;
    }
    // Every rank gathers (collective); rank 0 writes the single-device layout.
    const nn::StateDict weights = zero_->model_state_dict();
    optim::Optimizer::StateDict state = zero_->optimizer_state_dict(*opt_);
    if (hook_) state.merge(models::gather_hook_state(*hook_, *comm_, c_.zero));
    if (comm_->rank() == 0) models::save_checkpoint(c_.save, weights, state, *scaler_, s);
    comm_->barrier();  // nobody reads the files before they exist
  }
  double evaluate(int64_t /*step*/) override { return mnist::evaluate(model_, test_, low_).loss; }

  std::string line_prefix() const override {
    return fmt::format("epoch {}/{}  ", batch_.epoch + 1, epochs_);
  }
  std::string line_suffix() const override {
    std::string out;
    if (scaler_->enabled()) {
      out += fmt::format("  loss scale {:g} (skipped {})", scaler_->scale_value(),
                         scaler_->skipped_steps());
    }
    if (hook_) out += models::hook_traffic(*hook_);
    return out;
  }
  void annotate(nlohmann::json& record) const override { record["epoch"] = batch_.epoch + 1; }

 private:
  const MnistConfig& c_;
  parallel::Communicator* comm_;
  nn::Module& model_;
  data::Loader& loader_;
  const data::MnistSplit& test_;
  int64_t epochs_;
  DType low_;
  Device device_;
  bool verbose_;  // prints (rank 0's, with --verbose)
  models::Progress& progress_;
  models::MetricsWriter& metrics_;
  MnistResult& result_;
  std::vector<Tensor> params_;
  std::shared_ptr<parallel::CommHook> hook_;  // --compress (null: none)
  std::unique_ptr<parallel::ZeroDataParallel> zero_;
  std::unique_ptr<optim::Optimizer> opt_;
  std::unique_ptr<optim::DynamicLossScaler> scaler_;
  data::Batch batch_;
  int64_t epoch_start_steps_ = 0;
  double epoch_start_seconds_ = 0.0;
};

}  // namespace

namespace {

// One rank's training (comm null: the plain single-process loop). `train` and `test` are
// shared read-only by the ranks of this process.
MnistResult train_rank(const MnistConfig& config, parallel::Communicator* comm,
                       const data::MnistSplit& train, const data::MnistSplit& test) {
  const bool lead = comm == nullptr || comm->rank() == 0;  // prints, writes files
  const bool verbose = config.verbose && lead;
  const DType low = models::precision_dtype(config.precision, "mnist");
  const Device device = Device::parse(config.device);
  models::Progress progress;
  auto say = [&](const std::string& line) {
    if (verbose) progress.print(line);
  };

  manual_seed(static_cast<uint64_t>(config.seed));
  auto model = make_model(config.model);
  // Initialised on the CPU (the same values everywhere), then moved before the optimizer
  // sees the parameters.
  if (!device.is_cpu()) model->to(device);
  const int64_t epochs = config.epochs > 0 ? config.epochs
                         : config.model == "cnn" ? kDefaultEpochs.cnn
                                                 : kDefaultEpochs.mlp;
  // Every rank draws the same batches (the same seed) and trains on its slice of each.
  data::LoaderOptions lopt;
  lopt.batch_size = config.batch;
  if (comm != nullptr) {
    lopt.rank = comm->rank();
    lopt.world = comm->size();
  }
  lopt.shuffle = true;
  lopt.seed = static_cast<uint64_t>(config.seed);
  lopt.drop_last = true;  // equal batches: every step has the same shape and cost
  data::Loader loader(train.images, train.labels, lopt);
  TS_CHECK(loader.batches_per_epoch() > 0, "mnist: batch {} is larger than the {} training images",
           config.batch, loader.num_samples());
  const int64_t total_steps = epochs * loader.batches_per_epoch();
  const optim::WarmupCosineLr schedule(config.lr, std::min(config.warmup, total_steps / 2),
                                       total_steps, config.lr * config.min_lr_ratio);
  models::LoopOptions o;
  o.program = "mnist";
  o.stop_at = config.max_steps > 0 ? std::min(config.max_steps, total_steps) : total_steps;
  o.lr = [&](int64_t step) { return schedule.lr(step); };
  o.clip = config.clip;
  o.skip_nonfinite = config.nonfinite == "skip";
  o.log_every = config.log_every;
  o.save = config.save;
  o.divergence_advice =
      "Lower --lr, set --clip, or pass --nonfinite=skip to drop such steps";
  o.show_lr = false;
  o.verbose = verbose;
  o.fault_rank = comm != nullptr ? comm->rank() : 0;

  MnistResult result;
  models::MetricsWriter metrics;
  MnistReplica replica(config, comm, *model, loader, test, epochs, total_steps, low, device,
                       progress, metrics, result);
  if (!config.resume.empty()) {
    const models::TrainingState s = replica.resume(config.resume);
    auto it = s.info.find("model");
    TS_CHECK(it == s.info.end() || it->second == config.model,
             "mnist: {} holds a '{}' model but --model is '{}'", config.resume, it->second,
             config.model);
    o.start_step = s.step;
    TS_CHECK(s.step < o.stop_at,
             "mnist: --resume={} is at step {}, at or past the end of this run ({} steps{}): "
             "nothing to train; raise --epochs or --max_steps",
             config.resume, s.step, o.stop_at,
             config.max_steps > 0 ? fmt::format(", --max_steps {}", config.max_steps) : "");
    if (!s.fallback_reason.empty() && lead) {
      std::fprintf(stderr, "mnist: warning: %s\n", s.fallback_reason.c_str());
    }
    loader.set_position(s.epoch, s.batch_index);
    default_generator().set_state(s.rng_seed, s.rng_offset);
    say(fmt::format("resumed from {} at step {} (epoch {}, batch {})", s.loaded_from, s.step,
                    s.epoch + 1, s.batch_index));
  }
  if (!config.metrics.empty() && lead) {
    metrics = models::MetricsWriter(config.metrics, !config.resume.empty());
  }
  say(fmt::format("mnist: {} ({} parameters), {} train / {} test images, batch {}, {} epochs "
                  "({} steps), {} lr {}, precision {}{}",
                  config.model, model->num_parameters(), loader.num_samples(),
                  test.labels.numel(), config.batch, epochs, total_steps,
                  replica.optimizer().kind(), config.lr,
                  config.precision,
                  device.is_cpu() ? std::string() : fmt::format(", on {}", device)));
  if (comm != nullptr) {
    say(fmt::format("data parallel: {} ranks ({} backend), ZeRO stage {}, {} images per rank "
                    "per step{}",
                    comm->size(), comm->backend(), config.zero, config.batch / comm->size(),
                    config.compress.name != "none" ? ", --compress=" + config.compress.name
                                                   : std::string()));
  }

  const Clock::time_point run_start = Clock::now();
  models::StepMeter meter(static_cast<double>(config.batch), "samples");
  model->train();
  const models::LoopResult loop = models::run_loop(replica, o, meter, progress, metrics);
  // A run that stopped on the last batch of an epoch closes that epoch too.
  if (o.stop_at == total_steps && replica.epoch_open(meter)) {
    replica.end_of_epoch(epochs - 1, loop.step, meter);
  }

  const Eval final_eval = evaluate(*model, test, low);
  result.test_accuracy = final_eval.accuracy;
  result.test_loss = final_eval.loss;
  result.steps = loop.step;
  result.losses = loop.losses;
  result.nonfinite_skipped = loop.nonfinite_skipped;
  result.skipped_steps = replica.scaler().skipped_steps();
  result.samples_per_s = meter.rate();
  if (!device.is_cpu()) result.peak_device_bytes = allocator_for(device).stats().peak_bytes;
  if (verbose) {
    say(fmt::format("final test accuracy {:.2f}% (loss {:.4f}) after {} steps; {:.0f} training "
                    "samples/s; {} in all{}",
                    100 * final_eval.accuracy, final_eval.loss, loop.step, result.samples_per_s,
                    models::format_duration(models::seconds_since(run_start)),
                    replica.scaler().enabled()
                        ? fmt::format("; {} f16 steps skipped", result.skipped_steps)
                        : std::string()));
    if (!device.is_cpu()) {
      say(fmt::format("{}: peak allocated {:.1f} MiB", device,
                      static_cast<double>(result.peak_device_bytes) / (1 << 20)));
    }
  }
  return result;
}

}  // namespace

MnistResult train_mnist(const MnistConfig& config) {
  validate(config);
  const bool mpi = parallel::mpi_launched();
  const Device device = Device::parse(config.device);
  if (!device.is_cpu()) {
    TS_CHECK(config.dp == 1 && config.zero == 0 && !mpi,
             "mnist: --device={} runs a single rank for now; it cannot be combined with --dp {}, "
             "--zero {} or mpirun",
             config.device, config.dp, config.zero);
  }
  if (!config.save.empty()) models::check_checkpoint_path(config.save, "mnist: --save");
  if (!config.metrics.empty()) models::check_output_file(config.metrics, "mnist: --metrics");
  const models::MemoryLimitScope memory_limit(config.memory_limit);
  models::StopSignals signals;  // SIGTERM/SIGINT: finish the step, save, stop

  // Loaded once, shared by this process's ranks.
  const std::string dir = config.data_dir.empty() ? data::kFashionMnistDir : config.data_dir;
  const data::MnistSplit train = data::load_mnist(dir, true, data::kFashionMnistMean,
                                                  data::kFashionMnistStd,
                                                  config.train_limit > 0 ? config.train_limit : -1);
  data::MnistSplit test = data::load_mnist(dir, false, data::kFashionMnistMean,
                                           data::kFashionMnistStd,
                                           config.test_limit > 0 ? config.test_limit : -1);
  if (!device.is_cpu()) {  // evaluated on the device: copied there once
    test.images = test.images.to(device);
    test.labels = test.labels.to(device);
  }

  parallel::set_kernel_threads(static_cast<int>(config.threads));
  parallel::LaunchOptions launch;
  launch.program = "mnist";
  launch.ranks_from = fmt::format("--dp is {}", config.dp);
  launch.kernel_threads = static_cast<int>(config.threads);
  launch.world_for_one = config.zero > 0;  // else the plain loop, no wrapper
  MnistResult result;
  parallel::launch(
      static_cast<int>(config.dp),
      [&](parallel::CommPtr world) {
        MnistResult r = train_rank(config, world.get(), train, test);
        // Rank 0's result (under mpirun this process's rank is the only one here).
        if (world == nullptr || world->rank() == 0 || mpi) result = std::move(r);
      },
      launch);
  return result;
}

}  // namespace tessera::mnist
