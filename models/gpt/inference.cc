// The trained model in eval mode, without gradients: the validation loss every layout's
// run reports (evaluate), sampling bytes from a prompt (sample, models/gpt/train.h), and the
// closing sample of a run that must not lose the run's results when it fails (sample_into).
// Apart from train.cc, whose loop calls them, because none of them trains.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include "models/gpt/data.h"
#include "models/gpt/model.h"
#include "models/gpt/train.h"
#include "models/gpt/train_internal.h"
#include "tensor/autocast.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace tessera::gpt {
namespace {

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

}  // namespace

namespace train_internal {

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

// The sample at the end of a run. It comes after the checkpoint and the final validation,
// so a failure here (out of memory, say) must not lose them: it is kept in sample_error
// (the program reports it after the result) instead of unwinding the run. A collective
// sample (`collective`: with --ep every forward exchanges rows with the other ranks) rethrows
// instead: a rank that stopped sampling alone would leave its peers waiting in an exchange.
void sample_into(GptResult& result, Gpt& model, const GptTrainConfig& config, DType low,
                 const std::function<void(const std::string&)>& say, bool collective) {
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
    if (collective) throw;
    result.sample_error = fmt::format("gpt: sampling after training failed: {}", e.what());
    return;
  } catch (const std::bad_alloc&) {
    if (collective) throw;
    result.sample_error = "gpt: sampling after training failed: out of memory";
    return;
  }
  say(fmt::format("sample (temperature {:g}, top-k {}, seed {}):\n{}{}\n", config.temperature,
                  config.top_k, config.seed, prompt, result.sample));
}

}  // namespace train_internal

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

}  // namespace tessera::gpt
