#include "models/gpt/train.h"

#include <fmt/format.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <functional>
#include <new>
#include <thread>

#include "kernels/cpu/parallel.h"
#include "models/common/checkpoint.h"
#include "models/common/fault.h"
#include "models/common/flags.h"
#include "models/common/progress.h"
#include "models/common/run_control.h"
#include "models/data/text.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/mpi.h"
#include "parallel/comm/threads.h"
#include "parallel/zero.h"
#include "models/gpt/data.h"
#include "models/gpt/parallel3d.h"
#include "models/gpt/run_checks.h"
#include "tensor/allocator.h"
#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/random.h"

namespace tessera::gpt {
namespace {

using Clock = std::chrono::steady_clock;

// Restores a module's train/eval mode on scope exit.
class ModeGuard {
 public:
  ModeGuard(nn::Module& m, bool training) : m_(m), was_(m.is_training()) { m_.train(training); }
  ~ModeGuard() { m_.train(was_); }
  ModeGuard(const ModeGuard&) = delete;
  ModeGuard& operator=(const ModeGuard&) = delete;

 private:
  nn::Module& m_;
  bool was_;
};

// The device the model's parameters are on (every model here has parameters).
Device device_of(const nn::Module& model) { return model.parameters().front().device(); }

// The mean loss over the first `max_batches` (0: all) validation batches, on the model's
// device; all batches have one shape, so the mean of their means is the mean over every
// scored token.
double evaluate(Gpt& model, const GptData& batches, int64_t max_batches, DType low) {
  NoGradGuard no_grad;
  ModeGuard mode(model, /*training=*/false);
  AutocastGuard amp(low);
  const Device device = device_of(model);
  int64_t n = batches.num_eval_batches();
  if (max_batches > 0) n = std::min(n, max_batches);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const data::TextBatch b = batches.eval(i);
    total += Gpt::loss(model(b.idx.to(device)), b.targets.to(device)).item<double>();
  }
  return total / static_cast<double>(n);
}

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
}

// A state dict with every tensor on the CPU (checkpoints are written from host memory).
template <typename Dict>
Dict on_cpu(Dict dict) {
  for (auto& [name, t] : dict) t = t.to(kCPU);
  return dict;
}

// The sample at the end of a run. It comes after the checkpoint and the final validation,
// so a failure here (out of memory, say) must not lose them: it is kept in sample_error
// (the program reports it after the result) instead of unwinding the run.
void sample_into(GptResult& result, Gpt& model, const GptTrainConfig& config, DType low,
                 const std::function<void(const std::string&)>& say) {
  SampleOptions so;
  so.length = config.sample_length;
  so.temperature = config.temperature;
  so.top_k = config.top_k;
  so.seed = static_cast<uint64_t>(config.seed);
  so.precision = low;
  const std::string prompt = config.prompt.empty() ? std::string("\n") : config.prompt;
  try {
    result.sample = sample(model, prompt, so);
  } catch (const Error& e) {
    result.sample_error = fmt::format("gpt: sampling after training failed: {}", e.what());
    return;
  } catch (const std::bad_alloc&) {
    result.sample_error = "gpt: sampling after training failed: out of memory";
    return;
  }
  say(fmt::format("sample (temperature {:g}, top-k {}, seed {}):\n{}{}\n", config.temperature,
                  config.top_k, config.seed, prompt, result.sample));
}

// clip_grad_norm's max_norm that never clips (it must be finite): --nonfinite=skip needs the
// norm with clipping off.
constexpr double kNoClip = std::numeric_limits<double>::max();

// The global batch's mean loss (the ranks' slices are equal, so the mean of their means) and
// whether any rank was asked to stop (its signal, else 0), in one all-reduce: every rank
// then stops after the same step.
std::pair<double, int> mean_over_ranks(parallel::Communicator* comm, double loss, int stop) {
  if (comm == nullptr) return {loss, stop};
  Tensor t = Tensor::from_vector<double>({loss, static_cast<double>(stop)}, {2});
  {
    parallel::CommCause cause("gpt loss");
    comm->all_reduce(t, parallel::ReduceOp::sum);
  }
  const std::vector<double> v = t.to_vector<double>();
  return {v[0] / comm->size(), v[1] == 0 ? 0 : (stop != 0 ? stop : SIGTERM)};
}

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
  m.dropout = dropout;
  return m;
}

std::string sample(Gpt& model, const std::string& prompt, const SampleOptions& options) {
  TS_CHECK(!prompt.empty(), "gpt sample: the prompt must hold at least one byte");
  TS_CHECK(options.length >= 0, "gpt sample: length must not be negative, got {}",
           options.length);
  TS_CHECK(options.temperature >= 0 && std::isfinite(options.temperature),
           "gpt sample: temperature must be finite and >= 0, got {}", options.temperature);
  TS_CHECK(options.top_k >= 0, "gpt sample: top_k must not be negative, got {}", options.top_k);
  NoGradGuard no_grad;
  ModeGuard mode(model, /*training=*/false);
  AutocastGuard amp(options.precision);
  const Device device = device_of(model);
  const int64_t context = model.config().context, vocab = model.config().vocab;
  std::vector<int64_t> tokens(prompt.begin(), prompt.end());
  for (int64_t& t : tokens) t = static_cast<uint8_t>(t);  // char may be signed
  std::string out;
  out.reserve(static_cast<size_t>(options.length));
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::vector<double> probs(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < options.length; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(tokens.size()), context);
    const std::vector<int64_t> window(tokens.end() - T, tokens.end());
    const Tensor logits = model(Tensor::from_vector(window, {1, T}).to(device));
    const std::vector<float> last = narrow(logits, 1, T - 1, 1).to_vector<float>();
    // Candidates by logit, highest first; equal logits keep the lower byte first.
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return last[a] > last[b]; });
    int64_t next = order[0];
    if (options.temperature > 0) {
      const int64_t k = options.top_k > 0 ? std::min(options.top_k, vocab) : vocab;
      const double top = last[order[0]];
      double total = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        probs[j] = std::exp((last[order[j]] - top) / options.temperature);
        total += probs[j];
      }
      const double u = philox::uniform_f64(options.seed, static_cast<uint64_t>(i)) * total;
      double acc = 0.0;
      next = order[k - 1];  // u rounding up to the total lands on the last candidate
      for (int64_t j = 0; j < k; ++j) {
        acc += probs[j];
        if (u < acc) {
          next = order[j];
          break;
        }
      }
    }
    tokens.push_back(next);
    out.push_back(static_cast<char>(next));
  }
  return out;
}

namespace {

// One rank's training (comm null: the plain single-process loop, no wrapper).
GptResult train_rank(const GptTrainConfig& config, parallel::Communicator* comm) {
  const DType low = models::precision_dtype(config.precision, "gpt");
  const bool lead = comm == nullptr || comm->rank() == 0;  // prints, writes files
  const GptConfig mconfig = config.model_config();
  mconfig.validate();
  const int64_t rank = comm != nullptr ? comm->rank() : 0;
  const int64_t ranks = comm != nullptr ? comm->size() : 1;
  TS_CHECK(config.batch % (ranks * config.accum) == 0,
           "gpt: --batch {} must divide into --dp {} x --accum {} equal micro-batches",
           config.batch, ranks, config.accum);
  if (config.threads > 0) cpu::set_num_threads(static_cast<int>(config.threads));
  const bool verbose = config.verbose && lead;
  models::Progress progress;
  auto say = [&](const std::string& line) {
    if (verbose) progress.print(line);
  };

  const uint64_t seed = static_cast<uint64_t>(config.seed);
  const GptData batches(config);
  const Device device = Device::parse(config.device);

  manual_seed(seed);
  Gpt model(mconfig);
  // Initialised on the CPU (the same values everywhere), then moved before the optimizer
  // sees the parameters.
  if (!device.is_cpu()) model.to(device);
  std::unique_ptr<parallel::ZeroDataParallel> zero;
  if (comm != nullptr) {
    parallel::ZeroOptions zopt;
    zopt.stage = static_cast<int>(config.zero);
    for (int64_t l = 0; l < config.layers; ++l) zopt.units.push_back(fmt::format("h.{}", l));
    zero = std::make_unique<parallel::ZeroDataParallel>(model, *comm, zopt);
  }
  const int64_t stop_at = config.max_steps > 0 ? std::min(config.max_steps, config.steps)
                                               : config.steps;
  optim::AdamWOptions aopt;
  aopt.lr = config.lr;
  aopt.betas = {config.beta1, config.beta2};
  aopt.weight_decay = config.weight_decay;
  optim::AdamW opt(zero ? zero->param_groups(config.lr, config.weight_decay)
                        : optim::decay_groups(model.named_parameters(), config.lr,
                                              config.weight_decay),
                   aopt);
  optim::LossScalerOptions sopt;
  sopt.enabled = low == DType::f16;
  optim::DynamicLossScaler scaler(sopt);
  const optim::WarmupCosineLr schedule(config.lr, std::min(config.warmup, config.steps / 2),
                                       config.steps, config.lr * config.min_lr_ratio);

  int64_t step = 0;
  if (!config.resume.empty()) {
    // A data-parallel run loads the single-device layout every run saves, whatever its own.
    const models::TrainingState s =
        zero ? models::load_checkpoint(
                   config.resume,
                   [&](const nn::StateDict& weights, const optim::Optimizer::StateDict& state) {
                     zero->load_model_state_dict(weights);
                     zero->load_optimizer_state_dict(opt, state);
                   },
                   scaler)
             : models::load_checkpoint(config.resume, model, opt, scaler);
    check_same_model(config.resume, s, config);
    step = s.step;  // the data windows are a pure function of the step
    TS_CHECK(step < stop_at,
             "gpt: --resume={} is at step {}, at or past the end of this run (--steps {}, "
             "--max_steps {}): nothing to train; raise --max_steps or --steps",
             config.resume, step, config.steps, config.max_steps);
    default_generator().set_state(s.rng_seed, s.rng_offset);
    if (lead && !s.fallback_reason.empty()) {
      std::fprintf(stderr, "gpt: warning: %s\n", s.fallback_reason.c_str());
    }
    say(fmt::format("resumed from {} at step {}", s.loaded_from, step));
  }
  models::MetricsWriter metrics;
  if (!config.metrics.empty() && lead) {
    metrics = models::MetricsWriter(config.metrics, !config.resume.empty());
  }
  const int64_t tokens_per_step = config.batch * config.context;
  say(fmt::format("gpt: {} layers, {} heads, width {}, context {}{} ({} parameters); {}; batch {} "
                  "({} tokens/step), {} steps, AdamW lr {}, precision {}{}",
                  config.layers, config.heads, config.width, config.context,
                  config.vocab != data::kByteVocab ? fmt::format(", vocab {}", config.vocab)
                                                   : std::string(),
                  model.num_parameters(), batches.str(), config.batch, tokens_per_step,
                  config.steps, config.lr, config.precision,
                  device.is_cpu() ? std::string() : fmt::format(", on {}", device)));
  if (comm != nullptr) {
    say(fmt::format("data parallel: {} ranks ({} backend), ZeRO stage {}, {} micro-batch(es) of "
                    "{} sequences per rank per step",
                    comm->size(), comm->backend(), config.zero, config.accum,
                    config.batch / (comm->size() * config.accum)));
  }

  auto save = [&] {
    models::TrainingState s;
    s.step = step;
    s.rng_seed = default_generator().seed();
    s.rng_offset = default_generator().offset();
    s.info = {{"model", "gpt"},
              {"layers", std::to_string(config.layers)},
              {"heads", std::to_string(config.heads)},
              {"width", std::to_string(config.width)},
              {"context", std::to_string(config.context)},
              {"precision", config.precision}};
    if (!zero && device.is_cpu()) {
      models::save_checkpoint(config.save, model, opt, scaler, s);
      return;
    }
    if (!zero) {  // from host copies (load_checkpoint copies back onto the device)
      models::save_checkpoint(config.save, on_cpu(model.state_dict()), on_cpu(opt.state_dict()),
                              scaler, s);
      return;
    }
    // Every rank gathers (collective); rank 0 writes the single-device layout.
    const nn::StateDict weights = zero->model_state_dict();
    const optim::Optimizer::StateDict state = zero->optimizer_state_dict(opt);
    if (lead) models::save_checkpoint(config.save, weights, state, scaler, s);
    comm->barrier();  // nobody reads the files before they exist
  };
  auto validate = [&] {
    const double loss = evaluate(model, batches, config.val_batches, low);
    metrics.write({{"step", step}, {"val_loss", loss}});
    return loss;
  };

  GptResult result;
  const std::vector<Tensor> params = model.parameters();
  const bool skip_nonfinite = config.nonfinite == "skip";
  const Clock::time_point run_start = Clock::now();
  double train_seconds = 0.0, window_seconds = 0.0, window_loss = 0.0, timed_seconds = 0.0;
  int64_t window_steps = 0, run_steps = 0;
  // Losses read after the update on a device (see below).
  std::vector<Tensor> pending_losses;

  model.train();
  while (step < stop_at) {
    const Clock::time_point t0 = Clock::now();
    const double lr = schedule.lr(step);
    opt.set_lr(lr);
    // One step's communication (the second of the run: the first creates optimizer state).
    parallel::CommLog step_log;
    std::optional<parallel::CommLogScope> log_scope;
    if (comm != nullptr && run_steps == 1) log_scope.emplace(step_log);
    if (zero) {
      zero->zero_grad();
    } else {
      opt.zero_grad();
    }
    const int parts = static_cast<int>(ranks * config.accum);
    double local_loss = 0.0;
    for (int64_t micro = 0; micro < config.accum; ++micro) {
      const int part = static_cast<int>(rank * config.accum + micro);
      const data::TextBatch batch = batches.train(step, part, parts);
      Tensor loss;
      {
        AutocastGuard amp(low);
        loss = Gpt::loss(model(batch.idx.to(device)), batch.targets.to(device));
      }
      if (device.is_cpu()) {
        local_loss += loss.item<double>();
      } else {
        pending_losses.push_back(loss.detach());
      }
      Tensor scaled = scaler.scale(config.accum > 1 ? loss / static_cast<double>(config.accum)
                                                    : loss);
      if (!zero) {
        scaled.backward();
      } else if (micro + 1 < config.accum) {
        auto guard = zero->no_sync();  // reduce once per step
        zero->backward(scaled);
      } else {
        zero->backward(scaled);
      }
    }
    // This rank's mean loss over its micro-batches. On a device the losses are read only
    // here, after the update in the default mode: the queue is not drained mid-step, and
    // the read waits for the whole step (the legacy default stream orders it after the
    // update), so each step's time is the device's.
    auto rank_loss = [&] {
      for (const Tensor& l : pending_losses) local_loss += l.item<double>();
      pending_losses.clear();
      return local_loss / static_cast<double>(config.accum);
    };
    double norm = std::numeric_limits<double>::quiet_NaN();
    bool skipped = false, norm_poisoned = false;  // poisoned: an inf/NaN norm was applied
    if (skip_nonfinite) {
      // Decided before the update, on values every rank shares: the global batch's loss
      // and the gradients' global norm (which clipping computes anyway).
      const double loss_now = mean_over_ranks(comm, rank_loss(), 0).first;
      if (zero) {
        norm = zero->clip_grad_norm(config.clip > 0 ? config.clip : kNoClip);
      } else if (scaler.unscale_and_check(params)) {
        norm = config.clip > 0 ? optim::clip_grad_norm(params, config.clip)
                               : optim::grad_norm(params);
      } else {
        norm = std::numeric_limits<double>::infinity();  // f16: the scaler found inf/NaN
      }
      skipped = !std::isfinite(loss_now) || !std::isfinite(norm);
    }
    if (skipped) {
      ++result.nonfinite_skipped;
    } else if (zero) {
      if (config.clip > 0 && !skip_nonfinite) {
        norm = zero->clip_grad_norm(config.clip);
        norm_poisoned = !std::isfinite(norm);
      }
      zero->step(opt);
    } else {
      // (An f16 overflow is not poison: the scaler skips that step and backs off.)
      if (config.clip > 0 && !skip_nonfinite && scaler.unscale_and_check(params)) {
        norm = optim::clip_grad_norm(params, config.clip);
        norm_poisoned = !std::isfinite(norm);
      }
      scaler.step(opt);
    }
    scaler.update();
    models::fault_point("train.step", static_cast<int>(rank));
    const auto [loss_value, stop] = mean_over_ranks(comm, rank_loss(), models::stop_signal());
    // A diverged step stops the run before anything more is saved (--nonfinite=skip dropped
    // it instead). With clipping the norm is known: an inf/NaN gradient poisoned the update.
    if (!skip_nonfinite && (!std::isfinite(loss_value) || norm_poisoned)) {
      fail("gpt: the {} is {} at step {} (the run diverged); stopped before saving anything "
           "more{}. Lower --lr, keep --clip on, or pass --nonfinite=skip to drop such steps",
           std::isfinite(loss_value) ? "gradient norm" : "loss",
           std::isfinite(loss_value) ? norm : loss_value, step + 1,
           config.save.empty() ? std::string()
                               : fmt::format(": {} holds the last good checkpoint", config.save));
    }
    log_scope.reset();
    if (zero && run_steps == 0) {
      result.memory_report = zero->memory_report().str();
      say(result.memory_report);
    }
    if (zero && run_steps == 1) {
      int64_t bytes = 0;
      for (const parallel::CommRecord& r : step_log.records) {
        if (r.cause.rfind("zero", 0) == 0 || r.cause.rfind("DistributedDataParallel", 0) == 0 ||
            r.cause.rfind("ddp", 0) == 0) {
          bytes += r.bytes;
        }
      }
      const double ring = 4.0 * static_cast<double>(model.num_parameters()) *
                          static_cast<double>(ranks - 1) / static_cast<double>(ranks);
      result.comm_per_step = ranks > 1 ? static_cast<double>(bytes) / ring : 0.0;
      say(fmt::format("communication per step (rank 0): {} collectives, {:.2f} MiB of "
                      "gradients and parameters = {:.3f} x 4 Psi (n-1)/n",
                      step_log.records.size(), static_cast<double>(bytes) / (1 << 20),
                      result.comm_per_step));
    }
    ++step;
    const double dt = models::seconds_since(t0);
    train_seconds += dt;
    if (run_steps >= config.timing_skip) timed_seconds += dt;
    window_seconds += dt;
    ++window_steps;
    ++run_steps;
    window_loss += loss_value;
    result.losses.push_back(loss_value);

    if (step % config.log_every == 0 || step == stop_at) {
      const double tps = window_steps * tokens_per_step / window_seconds;
      nlohmann::json rec = {{"step", step}, {"loss", loss_value}, {"lr", lr},
                            {"tokens_per_s", tps}};
      if (std::isfinite(norm)) rec["grad_norm"] = norm;
      metrics.write(rec);
      result.train_loss = window_loss / window_steps;
      if (verbose) {
        const double eta = (stop_at - step) * (train_seconds / run_steps);
        std::string line = fmt::format("step {}/{}  loss {:.4f}  lr {:.2e}  {:.0f} tokens/s  ETA {}",
                                       step, stop_at, result.train_loss, lr, tps,
                                       models::format_duration(eta));
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
    if (stop != 0) {  // every rank saw the same flag: all save (collective) and stop together
      if (!config.save.empty()) save();
      if (verbose) progress.finish();
      throw models::stop_requested("gpt", stop, step, stop_at, config.save,
                                   "no --save was given");
    }
    // The final step's validation is the result's, below.
    if (config.val_every > 0 && step % config.val_every == 0 && step < stop_at) {
      const double v = validate();
      result.val_losses.emplace_back(step, v);
      if (verbose) {
        progress.update(fmt::format("step {}/{}  val loss {:.4f}", step, stop_at, v),
                        /*force=*/true);
        progress.finish();
      }
    }
    if (!config.save.empty() && config.save_every > 0 && step % config.save_every == 0 &&
        step < stop_at) {
      save();
    }
  }
  // Saved before the final evaluation and the sample: neither changes what resume needs,
  // and the checkpoint then holds exactly the state a longer run has at this step.
  if (!config.save.empty()) {
    save();
    say(fmt::format("saved {} and {}", config.save, models::state_path(config.save)));
  }

  result.val_loss = validate();
  result.val_losses.emplace_back(step, result.val_loss);
  result.steps = step;
  result.skipped_steps = scaler.skipped_steps();
  if (config.timing_skip == 0) {
    result.tokens_per_s = run_steps > 0 ? run_steps * tokens_per_step / train_seconds : 0.0;
  } else if (run_steps > config.timing_skip) {
    result.tokens_per_s = (run_steps - config.timing_skip) * tokens_per_step / timed_seconds;
  }
  if (!device.is_cpu()) result.peak_device_bytes = allocator_for(device).stats().peak_bytes;
  result.peak_host_bytes = rank_memory_peak();
  if (verbose) {
    say(fmt::format("final val loss {:.4f} (train {:.4f}) after {} steps; {:.0f} training "
                    "tokens/s{}; {} in all{}",
                    result.val_loss, result.train_loss, step, result.tokens_per_s,
                    config.timing_skip > 0
                        ? fmt::format(" (steps after the first {})", config.timing_skip)
                        : std::string(),
                    models::format_duration(models::seconds_since(run_start)),
                    scaler.enabled() ? fmt::format("; {} f16 steps skipped", scaler.skipped_steps())
                                     : std::string()));
    if (!device.is_cpu()) {
      say(fmt::format("{}: peak allocated {:.1f} MiB", device,
                      static_cast<double>(result.peak_device_bytes) / (1 << 20)));
    } else {
      say(fmt::format("tensor memory: peak {} on rank 0 (predicted {})",
                      models::format_bytes(static_cast<double>(result.peak_host_bytes)),
                      models::format_bytes(estimate_gpt_memory(config, 1).per_rank())));
    }
  }
  if (config.sample_length > 0 && config.synthetic_data) {
    say("no sample: the model was trained on random tokens");
  } else if (config.sample_length > 0) {
    sample_into(result, model, config, low, say);
  }
  return result;
}

// One rank's part of a pipeline / tensor-parallel run (Gpt3d). Validation and the sample
// use the full parameters, gathered into a single-device model on rank 0.
GptResult train_rank_3d(const GptTrainConfig& config, parallel::CommPtr world) {
  TS_CHECK(config.precision == "f32", "gpt: --pp/--tp run in f32 for now, got --precision={}",
           config.precision);
  TS_CHECK(config.save.empty() && config.resume.empty(),
           "gpt: --save/--resume are not yet supported with --pp/--tp");
  TS_CHECK(config.accum == 1, "gpt: with --pp/--tp use --microbatches, not --accum");
  TS_CHECK(config.dropout == 0.0, "gpt: --dropout is not yet supported with --pp/--tp");
  const GptConfig mconfig = config.model_config();
  mconfig.validate();
  if (config.threads > 0) cpu::set_num_threads(static_cast<int>(config.threads));
  const bool lead = world->rank() == 0, verbose = config.verbose && lead;
  models::Progress progress;
  auto say = [&](const std::string& line) {
    if (verbose) progress.print(line);
  };
  const uint64_t seed = static_cast<uint64_t>(config.seed);
  const GptData batches(config);
  manual_seed(seed);
  Gpt model(mconfig);
  Gpt3dOptions o;
  o.pp = config.pp;
  o.dp = config.dp;
  o.tp = config.tp;
  o.zero = config.zero;
  o.schedule = config.schedule;
  o.chunks = config.chunks;
  o.microbatches = config.microbatches;
  o.recompute = config.recompute;
  o.sequence_parallel = config.sp;
  o.clip = config.clip;
  o.lr = config.lr;
  o.weight_decay = config.weight_decay;
  o.beta1 = config.beta1;
  o.beta2 = config.beta2;
  Gpt3d g(model, world, o);
  const optim::WarmupCosineLr schedule(config.lr, std::min(config.warmup, config.steps / 2),
                                       config.steps, config.lr * config.min_lr_ratio);
  const int64_t stop_at = config.max_steps > 0 ? std::min(config.max_steps, config.steps)
                                               : config.steps;
  const int64_t tokens_per_step = config.batch * config.context;
  say(fmt::format("gpt: {} layers, {} heads, width {}, context {} ({} parameters); batch {}, {} "
                  "steps, AdamW lr {}; {} ({} backend)",
                  config.layers, config.heads, config.width, config.context,
                  model.num_parameters(), config.batch, config.steps, config.lr, g.describe(),
                  world->backend()));
  models::MetricsWriter metrics;
  if (!config.metrics.empty() && lead) metrics = models::MetricsWriter(config.metrics, false);
  // Rank 0 evaluates a single-device copy of the gathered parameters (collective gather).
  Gpt eval_model(mconfig);
  auto gathered = [&] {
    const std::map<std::string, Tensor> full = g.full_parameters();
    if (lead) eval_model.load_state_dict(nn::StateDict(full.begin(), full.end()));
  };
  auto validate = [&](int64_t step) {
    gathered();
    if (!lead) return 0.0;
    const double loss = evaluate(eval_model, batches, config.val_batches, DType::f32);
    metrics.write({{"step", step}, {"val_loss", loss}});
    return loss;
  };
  GptResult result;
  double train_seconds = 0.0, window_seconds = 0.0, window_loss = 0.0;
  int64_t window_steps = 0, step = 0;
  while (step < stop_at) {
    const Clock::time_point t0 = Clock::now();
    const double lr = schedule.lr(step);
    const data::TextBatch batch = batches.train(step);
    const double loss = g.train_step(batch.idx, batch.targets, lr);
    ++step;
    models::fault_point("train.step", world->rank());
    // Every rank stops after the same step (one all-reduce of the flag); a diverged step
    // stops the run (the loss is the global batch's, the same on every rank).
    const int stop = mean_over_ranks(world.get(), 0.0, models::stop_signal()).second;
    TS_CHECK(std::isfinite(loss),
             "gpt: the loss is {} at step {} (the run diverged); stopped. Lower --lr or keep "
             "--clip on",
             loss, step);
    if (stop != 0) {
      if (verbose) progress.finish();
      throw models::stop_requested("gpt", stop, step, stop_at, "",
                                   "--pp/--tp runs do not write checkpoints yet");
    }
    const double dt = models::seconds_since(t0);
    train_seconds += dt;
    window_seconds += dt;
    window_loss += loss;
    ++window_steps;
    result.losses.push_back(loss);
    if (step % config.log_every == 0 || step == stop_at) {
      const double tps = window_steps * tokens_per_step / window_seconds;
      metrics.write({{"step", step}, {"loss", loss}, {"lr", lr}, {"tokens_per_s", tps}});
      result.train_loss = window_loss / window_steps;
      if (verbose) {
        progress.update(fmt::format("step {}/{}  loss {:.4f}  lr {:.2e}  {:.0f} tokens/s  ETA {}",
                                    step, stop_at, result.train_loss, lr, tps,
                                    models::format_duration((stop_at - step) * train_seconds / step)));
      }
      window_seconds = window_loss = 0.0;
      window_steps = 0;
    }
    if (config.val_every > 0 && step % config.val_every == 0 && step < stop_at) {
      const double v = validate(step);
      result.val_losses.emplace_back(step, v);
      if (verbose) {
        progress.update(fmt::format("step {}/{}  val loss {:.4f}", step, stop_at, v), true);
        progress.finish();
      }
    }
  }
  result.val_loss = validate(step);
  result.val_losses.emplace_back(step, result.val_loss);
  result.steps = step;
  result.tokens_per_s = step > 0 ? step * tokens_per_step / train_seconds : 0.0;
  result.peak_host_bytes = rank_memory_peak();
  say(fmt::format("final val loss {:.4f} (train {:.4f}) after {} steps; {:.0f} training tokens/s",
                  result.val_loss, result.train_loss, step, result.tokens_per_s));
  say(fmt::format("tensor memory: peak {} on rank 0 (predicted {})",
                  models::format_bytes(static_cast<double>(result.peak_host_bytes)),
                  models::format_bytes(estimate_gpt_memory(config, 1).per_rank())));
  if (config.sample_length > 0 && lead && !config.synthetic_data) {
    sample_into(result, eval_model, config, DType::f32, say);
  }
  return result;
}

}  // namespace

GptResult train_gpt(const GptTrainConfig& config) {
  validate_train_config(config);
  if (!Device::parse(config.device).is_cpu()) {
    TS_CHECK(config.dp == 1 && config.zero == 0 && config.pp == 1 && config.tp == 1 &&
                 !parallel::mpi_launched(),
             "gpt: --device={} runs a single rank for now; it cannot be combined with --dp {}, "
             "--zero {}, --pp {}, --tp {} or mpirun",
             config.device, config.dp, config.zero, config.pp, config.tp);
  }
  const bool three_d = config.pp > 1 || config.tp > 1;
  TS_CHECK(!three_d || config.nonfinite == "error",
           "gpt: --nonfinite=skip is not yet supported with --pp/--tp (a diverged step stops "
           "the run there)");
  TS_CHECK(three_d || config.precision != "f16" || (config.dp == 1 && config.zero == 0),
           "gpt: --precision=f16 runs on one rank only (the loss scaler's overflow check is "
           "not yet global); use bf16 with --dp > 1 or --zero > 0");
  const bool mpi = parallel::mpi_launched();
  const int64_t ranks = three_d ? config.pp * config.dp * config.tp : config.dp;
  const GptMemoryEstimate estimate = preflight(config, mpi, mpi ? 1 : static_cast<int>(ranks));
  const models::MemoryLimitScope memory_limit(config.memory_limit);
  models::StopSignals signals;  // SIGTERM/SIGINT: finish the step, save, stop
  if (mpi) parallel::set_comm_timeout(config.comm_timeout);  // the MPI watchdog
  auto rank_main = [&](parallel::CommPtr world) {
    return three_d ? train_rank_3d(config, world) : train_rank(config, world.get());
  };
  GptResult result;
  if (mpi) {
    parallel::CommPtr world = parallel::mpi_world();
    TS_CHECK(world->size() == ranks,
             "gpt: started by mpirun with {} processes but {}; they must be equal",
             world->size(),
             three_d ? fmt::format("--pp {} x --dp {} x --tp {} = {}", config.pp, config.dp,
                                   config.tp, ranks)
                     : fmt::format("--dp is {}", config.dp));
    if (config.threads <= 0) {  // the processes share the machine's cores
      cpu::set_num_threads(
          std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world->size()));
    }
    process_memory().reset_peak();  // this run's peak, not the process's whole history
    result = rank_main(world);
  } else if (!three_d && config.dp == 1 && config.zero == 0) {
    // Not a MemoryScope of its own: a storage that outlives the run (a cache) would keep a
    // pointer to a tracker gone out of scope.
    process_memory().reset_peak();
    result = train_rank(config, nullptr);
  } else {
    parallel::ThreadsOptions topt;
    topt.kernel_threads = static_cast<int>(config.threads);
    topt.timeout_seconds = config.comm_timeout > 0 ? config.comm_timeout : 1e9;
    parallel::run_threads(
        static_cast<int>(ranks),
        [&](parallel::CommPtr world) {
          MemoryTracker tracker;  // this rank's memory, for the report and the peak
          MemoryScope scope(&tracker);
          GptResult r = rank_main(world);
          if (world->rank() == 0) result = std::move(r);
        },
        topt);
  }
  result.predicted_bytes = estimate.per_rank();
  return result;
}

}  // namespace tessera::gpt
