#include "models/mnist/train.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "kernels/cpu/parallel.h"
#include "models/common/checkpoint.h"
#include "models/common/fault.h"
#include "models/common/flags.h"
#include "models/common/progress.h"
#include "models/common/run_control.h"
#include "models/data/idx.h"
#include "models/data/loader.h"
#include "models/mnist/model.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "tensor/allocator.h"
#include "tensor/autocast.h"

namespace tessera::mnist {
namespace {

using Clock = std::chrono::steady_clock;

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
    const Tensor logits = model.forward(x);
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
}

}  // namespace

MnistResult train_mnist(const MnistConfig& config) {
  validate(config);
  const DType low = models::precision_dtype(config.precision, "mnist");
  const Device device = Device::parse(config.device);
  if (!config.save.empty()) models::check_checkpoint_path(config.save, "mnist: --save");
  if (!config.metrics.empty()) models::check_output_file(config.metrics, "mnist: --metrics");
  const models::MemoryLimitScope memory_limit(config.memory_limit);
  models::StopSignals signals;  // SIGTERM/SIGINT: finish the step, save, stop
  if (config.threads > 0) cpu::set_num_threads(static_cast<int>(config.threads));
  models::Progress progress;
  auto say = [&](const std::string& line) {
    if (config.verbose) progress.print(line);
  };

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

  manual_seed(static_cast<uint64_t>(config.seed));
  auto model = make_model(config.model);
  // Initialised on the CPU (the same values everywhere), then moved before the optimizer
  // sees the parameters.
  if (!device.is_cpu()) model->to(device);
  const int64_t epochs = config.epochs > 0 ? config.epochs
                         : config.model == "cnn" ? kDefaultEpochs.cnn
                                                 : kDefaultEpochs.mlp;
  data::LoaderOptions lopt;
  lopt.batch_size = config.batch;
  lopt.shuffle = true;
  lopt.seed = static_cast<uint64_t>(config.seed);
  lopt.drop_last = true;  // equal batches: every step has the same shape and cost
  data::Loader loader(train.images, train.labels, lopt);
  TS_CHECK(loader.batches_per_epoch() > 0, "mnist: batch {} is larger than the {} training images",
           config.batch, loader.num_samples());
  const int64_t total_steps = epochs * loader.batches_per_epoch();
  const int64_t stop_at = config.max_steps > 0 ? std::min(config.max_steps, total_steps) : total_steps;

  optim::AdamWOptions aopt;
  aopt.lr = config.lr;
  aopt.weight_decay = config.weight_decay;
  optim::AdamW opt(optim::decay_groups(model->named_parameters(), config.lr, config.weight_decay),
                   aopt);
  optim::LossScalerOptions sopt;
  sopt.enabled = low == DType::f16;
  optim::DynamicLossScaler scaler(sopt);
  const optim::WarmupCosineLr schedule(config.lr, std::min(config.warmup, total_steps / 2),
                                       total_steps, config.lr * config.min_lr_ratio);

  int64_t step = 0;
  if (!config.resume.empty()) {
    const models::TrainingState s = models::load_checkpoint(config.resume, *model, opt, scaler);
    auto it = s.info.find("model");
    TS_CHECK(it == s.info.end() || it->second == config.model,
             "mnist: {} holds a '{}' model but --model is '{}'", config.resume, it->second,
             config.model);
    step = s.step;
    TS_CHECK(step < stop_at,
             "mnist: --resume={} is at step {}, at or past the end of this run ({} steps{}): "
             "nothing to train; raise --epochs or --max_steps",
             config.resume, step, stop_at,
             config.max_steps > 0 ? fmt::format(", --max_steps {}", config.max_steps) : "");
    if (!s.fallback_reason.empty()) {
      std::fprintf(stderr, "mnist: warning: %s\n", s.fallback_reason.c_str());
    }
    loader.set_position(s.epoch, s.batch_index);
    default_generator().set_state(s.rng_seed, s.rng_offset);
    say(fmt::format("resumed from {} at step {} (epoch {}, batch {})", s.loaded_from, step,
                    s.epoch + 1, s.batch_index));
  }
  models::MetricsWriter metrics;
  if (!config.metrics.empty()) metrics = models::MetricsWriter(config.metrics, !config.resume.empty());
  say(fmt::format("mnist: {} ({} parameters), {} train / {} test images, batch {}, {} epochs "
                  "({} steps), AdamW lr {}, precision {}{}",
                  config.model, model->num_parameters(), loader.num_samples(),
                  test.labels.numel(), config.batch, epochs, total_steps, config.lr,
                  config.precision,
                  device.is_cpu() ? std::string() : fmt::format(", on {}", device)));

  auto save = [&] {
    models::TrainingState s;
    s.step = step;
    s.epoch = loader.epoch();
    s.batch_index = loader.batch_index();
    s.rng_seed = default_generator().seed();
    s.rng_offset = default_generator().offset();
    s.info = {{"model", config.model}, {"precision", config.precision}};
    if (device.is_cpu()) {
      models::save_checkpoint(config.save, *model, opt, scaler, s);
    } else {  // from host copies (load_checkpoint copies back onto the device)
      nn::StateDict weights = model->state_dict();
      optim::Optimizer::StateDict state = opt.state_dict();
      for (auto& [name, t] : weights) t = t.to(kCPU);
      for (auto& [name, t] : state) t = t.to(kCPU);
      models::save_checkpoint(config.save, weights, state, scaler, s);
    }
    say(fmt::format("saved {} and {}", config.save, models::state_path(config.save)));
  };

  MnistResult result;
  const std::vector<Tensor> params = model->parameters();
  const Clock::time_point run_start = Clock::now();
  double train_seconds = 0.0, epoch_seconds = 0.0, window_seconds = 0.0;
  int64_t epoch_steps = 0, window_steps = 0, run_steps = 0;
  double window_loss = 0.0;

  auto end_of_epoch = [&](int64_t epoch) {
    // Only whole epochs trained in this run give a throughput figure.
    if (epoch_steps == loader.batches_per_epoch()) {
      result.epoch_samples_per_s.push_back(epoch_steps * config.batch / epoch_seconds);
    }
    nlohmann::json rec = {{"step", step}, {"epoch", epoch + 1}};
    if (epoch_steps > 0) rec["samples_per_s"] = epoch_steps * config.batch / epoch_seconds;
    if (config.eval_each_epoch) {
      const Eval e = evaluate(*model, test, low);
      rec["accuracy"] = e.accuracy;
      rec["test_loss"] = e.loss;
      if (config.verbose) {
        progress.update(fmt::format("epoch {}/{}  step {}  test accuracy {:.2f}%  test loss {:.4f}"
                                    "  {:.0f} samples/s", epoch + 1, epochs, step,
                                    100 * e.accuracy, e.loss,
                                    epoch_steps > 0 ? epoch_steps * config.batch / epoch_seconds : 0.0),
                        /*force=*/true);
        progress.finish();
      }
    }
    metrics.write(rec);
    epoch_steps = 0;
    epoch_seconds = 0.0;
  };

  model->train();
  data::Batch batch;
  while (step < stop_at) {
    const Clock::time_point t0 = Clock::now();
    if (!loader.next(batch)) {
      end_of_epoch(loader.epoch() - 1);
      continue;
    }
    const double lr = schedule.lr(step);
    opt.set_lr(lr);
    opt.zero_grad();
    Tensor loss;
    {
      AutocastGuard amp(low);
      loss = cross_entropy(model->forward(batch.inputs.to(device)), batch.targets.to(device));
    }
    scaler.scale(loss).backward();
    const double loss_value = loss.item<double>();
    if (!std::isfinite(loss_value)) {
      TS_CHECK(config.nonfinite == "skip",
               "mnist: the loss is {} at step {} (the run diverged); stopped before saving "
               "anything{}. Lower --lr, set --clip, or pass --nonfinite=skip to drop such steps",
               loss_value, step + 1,
               config.resume.empty() ? std::string()
                                     : fmt::format(" ({} is unchanged)", config.resume));
      ++result.nonfinite_skipped;  // the update is dropped; the loader has moved on
    } else {
      if (config.clip > 0) {
        if (scaler.unscale_and_check(params)) optim::clip_grad_norm(params, config.clip);
      }
      scaler.step(opt);
      scaler.update();
    }
    ++step;
    models::fault_point("train.step");
    const double dt = models::seconds_since(t0);
    train_seconds += dt;
    epoch_seconds += dt;
    window_seconds += dt;
    ++epoch_steps;
    ++window_steps;
    ++run_steps;
    window_loss += loss_value;
    result.losses.push_back(loss_value);

    if (step % config.log_every == 0 || step == stop_at) {
      const double sps = window_steps * config.batch / window_seconds;
      metrics.write({{"step", step}, {"epoch", batch.epoch + 1}, {"loss", loss_value},
                     {"lr", lr}, {"samples_per_s", sps}});
      if (config.verbose) {
        const double eta = (stop_at - step) * (train_seconds / run_steps);
        std::string line = fmt::format(
            "epoch {}/{}  step {}/{}  loss {:.4f}  {:.0f} samples/s  ETA {}", batch.epoch + 1,
            epochs, step, stop_at, window_loss / window_steps, sps, models::format_duration(eta));
        if (scaler.enabled()) {
          line += fmt::format("  loss scale {:g} (skipped {})", scaler.scale_value(),
                              scaler.skipped_steps());
        }
        progress.update(line);
      }
      window_seconds = 0.0;
      window_steps = 0;
      window_loss = 0.0;
    }
    if (const int sig = models::stop_signal()) {
      if (!config.save.empty()) save();
      if (config.verbose) progress.finish();
      throw models::stop_requested("mnist", sig, step, stop_at, config.save,
                                   "no --save was given");
    }
  }
  // A run that stopped on the last batch of an epoch closes that epoch too.
  if (stop_at == total_steps && epoch_steps > 0) end_of_epoch(epochs - 1);

  if (!config.save.empty()) save();

  const Eval final_eval = evaluate(*model, test, low);
  result.test_accuracy = final_eval.accuracy;
  result.test_loss = final_eval.loss;
  result.steps = step;
  result.skipped_steps = scaler.skipped_steps();
  result.samples_per_s = run_steps > 0 ? run_steps * config.batch / train_seconds : 0.0;
  if (!device.is_cpu()) result.peak_device_bytes = allocator_for(device).stats().peak_bytes;
  if (config.verbose) {
    say(fmt::format("final test accuracy {:.2f}% (loss {:.4f}) after {} steps; {:.0f} training "
                    "samples/s; {} in all{}",
                    100 * final_eval.accuracy, final_eval.loss, step, result.samples_per_s,
                    models::format_duration(models::seconds_since(run_start)),
                    scaler.enabled() ? fmt::format("; {} f16 steps skipped", scaler.skipped_steps())
                                     : std::string()));
    if (!device.is_cpu()) {
      say(fmt::format("{}: peak allocated {:.1f} MiB", device,
                      static_cast<double>(result.peak_device_bytes) / (1 << 20)));
    }
  }
  return result;
}

}  // namespace tessera::mnist
