#include "models/gpt/train.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <thread>

#include "kernels/cpu/parallel.h"
#include "models/common/checkpoint.h"
#include "models/common/flags.h"
#include "models/common/progress.h"
#include "models/data/text.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/mpi.h"
#include "parallel/comm/threads.h"
#include "parallel/zero.h"
#include "models/gpt/parallel3d.h"
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

// Uniform random tokens in [0, vocab) for --synthetic_data: global row r of batch `index` of
// `stream` (0: training, 1: validation) is Philox (seed, counter) over counters
// stream << 62 | (index * batch + r) * (context + 1) + t; targets are the next token, as in
// text windows. Rows [part * batch / parts, (part + 1) * batch / parts) make this part.
data::TextBatch synthetic_batch(uint64_t seed, uint64_t stream, int64_t index, int64_t batch,
                                int64_t context, int64_t vocab, int part, int parts) {
  const int64_t rows = batch / parts, first = part * rows, width = context + 1;
  std::vector<int64_t> idx(static_cast<size_t>(rows * context)),
      targets(static_cast<size_t>(rows * context));
  std::vector<int64_t> window(static_cast<size_t>(width));
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t base = stream << 62 | static_cast<uint64_t>((index * batch + first + r) * width);
    for (int64_t t = 0; t < width; ++t) {
      const double u = philox::uniform_f64(seed, base + static_cast<uint64_t>(t));
      window[t] = std::min(static_cast<int64_t>(u * static_cast<double>(vocab)), vocab - 1);
    }
    std::copy(window.begin(), window.end() - 1, idx.begin() + r * context);
    std::copy(window.begin() + 1, window.end(), targets.begin() + r * context);
  }
  return {Tensor::from_vector(idx, {rows, context}), Tensor::from_vector(targets, {rows, context})};
}

// Where batches come from: the corpus's training and validation windows, checked to hold a
// context, or random tokens (--synthetic_data). Batches are built on the CPU.
class GptData {
 public:
  explicit GptData(const GptTrainConfig& config) : c_(config) {
    if (c_.synthetic_data) return;
    TS_CHECK(c_.vocab >= data::kByteVocab,
             "gpt: --vocab {} is smaller than the {} byte values of text; use --synthetic_data "
             "for other vocabularies",
             c_.vocab, data::kByteVocab);
    source_ = c_.data.empty() ? data::kFortunesDir : c_.data;
    const data::TextCorpus corpus = data::load_text(source_);
    const uint64_t seed = static_cast<uint64_t>(c_.seed);
    train_.emplace(corpus, data::TextSplit::train, seed);
    val_.emplace(corpus, data::TextSplit::val, seed);
    TS_CHECK(c_.context < train_->size() && c_.context < val_->size(),
             "gpt: --context {} needs more bytes than the {} training / {} validation bytes of {}",
             c_.context, train_->size(), val_->size(), source_);
  }

  // This part's rows of the training batch at `step` (as TextWindows::get).
  data::TextBatch train(int64_t step, int part = 0, int parts = 1) const {
    if (!train_) {
      TS_CHECK(c_.batch % parts == 0, "gpt: batch {} does not split into {} parts", c_.batch,
               parts);
      return synthetic_batch(static_cast<uint64_t>(c_.seed), 0, step, c_.batch, c_.context,
                             c_.vocab, part, parts);
    }
    return train_->get(step, c_.batch, c_.context, part, parts);
  }
  // Validation batches, at least one.
  int64_t num_eval_batches() const {
    if (!val_) return kSyntheticEvalBatches;
    const int64_t n = val_->num_eval_batches(c_.batch, c_.context);
    TS_CHECK(n > 0, "gpt: the validation split ({} bytes) holds no batch of {} x {} bytes",
             val_->size(), c_.batch, c_.context);
    return n;
  }
  data::TextBatch eval(int64_t i) const {
    if (!val_) {
      return synthetic_batch(static_cast<uint64_t>(c_.seed), 1, i, c_.batch, c_.context,
                             c_.vocab, 0, 1);
    }
    return val_->eval_batch(i, c_.batch, c_.context);
  }
  std::string str() const {
    if (!train_) return fmt::format("random tokens in [0, {})", c_.vocab);
    return fmt::format("{} train / {} val bytes", train_->size(), val_->size());
  }

 private:
  const GptTrainConfig& c_;
  std::string source_;
  std::optional<data::TextWindows> train_, val_;
};

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
  TS_CHECK(config.batch > 0, "gpt: --batch must be positive, got {}", config.batch);
  TS_CHECK(config.steps > 0, "gpt: --steps must be positive, got {}", config.steps);
  TS_CHECK(config.lr > 0, "gpt: --lr must be positive, got {}", config.lr);
  TS_CHECK(config.log_every > 0, "gpt: --log_every must be positive, got {}", config.log_every);
  TS_CHECK(config.max_steps >= 0 && config.warmup >= 0 && config.val_every >= 0 &&
               config.val_batches >= 0 && config.save_every >= 0,
           "gpt: --max_steps ({}), --warmup ({}), --val_every ({}), --val_batches ({}) and "
           "--save_every ({}) must not be negative",
           config.max_steps, config.warmup, config.val_every, config.val_batches,
           config.save_every);
  const GptConfig mconfig = config.model_config();
  mconfig.validate();
  const int64_t rank = comm != nullptr ? comm->rank() : 0;
  const int64_t ranks = comm != nullptr ? comm->size() : 1;
  TS_CHECK(config.accum > 0, "gpt: --accum must be positive, got {}", config.accum);
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
    default_generator().set_state(s.rng_seed, s.rng_offset);
    say(fmt::format("resumed from {} at step {}", config.resume, step));
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
    double norm = std::numeric_limits<double>::quiet_NaN();
    if (zero) {
      if (config.clip > 0) norm = zero->clip_grad_norm(config.clip);
      zero->step(opt);
    } else {
      if (config.clip > 0 && scaler.unscale_and_check(params)) {
        norm = optim::clip_grad_norm(params, config.clip);
      }
      scaler.step(opt);
    }
    scaler.update();
    // On a device the losses are read only now: the queue is not drained mid-step, and the
    // read waits for the whole step (the legacy default stream orders it after the
    // update), so each step's time is the device's.
    for (const Tensor& l : pending_losses) local_loss += l.item<double>();
    pending_losses.clear();
    double loss_value = local_loss / static_cast<double>(config.accum);
    if (comm != nullptr) {  // the global batch's mean: the ranks' slices are equal
      Tensor t = Tensor::from_vector<double>({loss_value}, {1});
      parallel::CommCause cause("gpt loss");
      comm->all_reduce(t, parallel::ReduceOp::avg);
      loss_value = t.item<double>();
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
    }
  }
  if (config.sample_length > 0 && config.synthetic_data) {
    say("no sample: the model was trained on random tokens");
  } else if (config.sample_length > 0) {
    SampleOptions so;
    so.length = config.sample_length;
    so.temperature = config.temperature;
    so.top_k = config.top_k;
    so.seed = seed;
    so.precision = low;
    const std::string prompt = config.prompt.empty() ? std::string("\n") : config.prompt;
    result.sample = sample(model, prompt, so);
    if (verbose) {
      say(fmt::format("sample (temperature {:g}, top-k {}, seed {}):\n{}{}\n", config.temperature,
                      config.top_k, config.seed, prompt, result.sample));
    }
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
  say(fmt::format("final val loss {:.4f} (train {:.4f}) after {} steps; {:.0f} training tokens/s",
                  result.val_loss, result.train_loss, step, result.tokens_per_s));
  if (config.sample_length > 0 && lead && !config.synthetic_data) {
    SampleOptions so;
    so.length = config.sample_length;
    so.temperature = config.temperature;
    so.top_k = config.top_k;
    so.seed = seed;
    const std::string prompt = config.prompt.empty() ? std::string("\n") : config.prompt;
    result.sample = sample(eval_model, prompt, so);
    say(fmt::format("sample (temperature {:g}, top-k {}, seed {}):\n{}{}\n", config.temperature,
                    config.top_k, config.seed, prompt, result.sample));
  }
  return result;
}

}  // namespace

GptResult train_gpt(const GptTrainConfig& config) {
  TS_CHECK(config.dp >= 1, "gpt: --dp must be at least 1, got {}", config.dp);
  TS_CHECK(config.vocab > 0, "gpt: --vocab must be positive, got {}", config.vocab);
  TS_CHECK(config.timing_skip >= 0, "gpt: --timing_skip must not be negative, got {}",
           config.timing_skip);
  if (!Device::parse(config.device).is_cpu()) {
    TS_CHECK(config.dp == 1 && config.zero == 0 && config.pp == 1 && config.tp == 1 &&
                 !parallel::mpi_launched(),
             "gpt: --device={} runs a single rank for now; it cannot be combined with --dp {}, "
             "--zero {}, --pp {}, --tp {} or mpirun",
             config.device, config.dp, config.zero, config.pp, config.tp);
  }
  TS_CHECK(config.zero >= 0 && config.zero <= 3, "gpt: --zero must be 0, 1, 2 or 3, got {}",
           config.zero);
  TS_CHECK(!config.sp || config.tp > 1, "gpt: --sp splits the sequence over tensor-parallel "
           "ranks; it needs --tp > 1");
  if (config.pp > 1 || config.tp > 1) {
    const int64_t ranks = config.pp * config.dp * config.tp;
    if (parallel::mpi_launched()) {
      parallel::CommPtr world = parallel::mpi_world();
      TS_CHECK(world->size() == ranks,
               "gpt: started by mpirun with {} processes but --pp {} x --dp {} x --tp {} = {}",
               world->size(), config.pp, config.dp, config.tp, ranks);
      if (config.threads <= 0) {
        cpu::set_num_threads(
            std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world->size()));
      }
      return train_rank_3d(config, world);
    }
    GptResult result;
    parallel::ThreadsOptions topt;
    topt.kernel_threads = static_cast<int>(config.threads);
    parallel::run_threads(
        static_cast<int>(ranks),
        [&](parallel::CommPtr world) {
          GptResult r = train_rank_3d(config, world);
          if (world->rank() == 0) result = std::move(r);
        },
        topt);
    return result;
  }
  TS_CHECK(config.precision != "f16" || (config.dp == 1 && config.zero == 0),
           "gpt: --precision=f16 runs on one rank only (the loss scaler's overflow check is "
           "not yet global); use bf16 with --dp > 1 or --zero > 0");
  if (parallel::mpi_launched()) {
    parallel::CommPtr world = parallel::mpi_world();
    TS_CHECK(world->size() == config.dp,
             "gpt: started by mpirun with {} processes but --dp is {}; they must be equal",
             world->size(), config.dp);
    if (config.threads <= 0) {  // the processes share the machine's cores
      cpu::set_num_threads(
          std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world->size()));
    }
    return train_rank(config, world.get());
  }
  if (config.dp == 1 && config.zero == 0) return train_rank(config, nullptr);
  GptResult result;
  parallel::ThreadsOptions topt;
  topt.kernel_threads = static_cast<int>(config.threads);
  parallel::run_threads(
      static_cast<int>(config.dp),
      [&](parallel::CommPtr world) {
        MemoryTracker tracker;  // this rank's memory, for the report
        MemoryScope scope(&tracker);
        GptResult r = train_rank(config, world.get());
        if (world->rank() == 0) result = std::move(r);
      },
      topt);
  return result;
}

}  // namespace tessera::gpt
