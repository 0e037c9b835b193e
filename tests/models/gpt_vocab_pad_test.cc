// GPT with a padded vocabulary (GptConfig::vocab_pad): the embedding's padded rows start at
// zero and stay there, their logits are kPaddedLogit, and the model computes what the
// unpadded model with the same seed computes: logits, loss and every gradient on one device
// (f64, 1e-12), then AdamW steps on one device (f32) and on tensor-parallel, pipelined,
// data-parallel and ZeRO layouts (f64, 1e-10), all against the unpadded single-device run,
// and one step under bf16 and f16 autocast.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>
#include <string>
#include <vector>

#include "models/data/text.h"
#include "models/gpt/parallel3d.h"
#include "models/gpt/tensor_parallel.h"
#include "optim/adamw.h"
#include "tensor/autocast.h"
#include "parallel/comm/threads.h"
#include "tensor/random.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

constexpr int64_t kVocab = 250, kBatch = 8, kContext = 8;

std::shared_ptr<Gpt> make_gpt(int64_t vocab_pad, DType dtype = DType::f64) {
  manual_seed(0);
  auto m = std::make_shared<Gpt>(GptConfig{.layers = 2, .heads = 4, .width = 16, .context = kContext,
                                           .vocab = kVocab, .vocab_pad = vocab_pad});
  m->to(dtype);
  return m;
}

data::TextBatch batch(int64_t step = 0) {
  static const data::TextWindows w = [] {
    std::vector<uint8_t> bytes;
    for (int i = 0; i < 4096; ++i) bytes.push_back(static_cast<uint8_t>("padded vocabulary "[i % 18]));
    return data::TextWindows(std::move(bytes), data::TextSplit::train, 4);
  }();
  return w.get(step, kBatch, kContext);
}

double max_abs(const Tensor& t) { return max(abs(t)).item<double>(); }

std::map<std::string, Tensor> params_of(const Gpt& m) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : m.named_parameters()) out[name] = t;
  return out;
}

// The padded model's wte (or its gradient) [padded, C] against the unpadded one's [vocab, C]:
// the vocabulary's rows within `tol`, the padding exactly zero.
void check_wte(const Tensor& padded, const Tensor& ref, double tol, const std::string& what) {
  CAPTURE(what);
  REQUIRE(padded.size(0) > kVocab);
  CHECK(max_abs(padded.narrow(0, 0, kVocab) - ref) <= tol);
  CHECK(max_abs(padded.narrow(0, kVocab, padded.size(0) - kVocab)) == 0.0);
}

TEST_CASE("padded vocabulary: rows, parameter count and flag errors") {
  for (auto [pad, rows] : {std::pair<int64_t, int64_t>{1, 250}, {64, 256}, {12, 252}, {250, 250}, {256, 256}}) {
    const GptConfig c{.width = 16, .vocab = kVocab, .vocab_pad = pad};
    CAPTURE(pad);
    CHECK(c.padded_vocab() == rows);
    CHECK(c.num_parameters() == GptConfig{.width = 16, .vocab = kVocab}.num_parameters() + (rows - kVocab) * 16);
  }
  CHECK(testing::contains(testing::error_of([] { GptConfig{.vocab_pad = 0}.validate(); }),
                          "GptConfig: vocab_pad must be in [1, 2^20] (1: no padding), got 0"));
  CHECK(testing::contains(testing::error_of([] { GptConfig{.vocab_pad = (int64_t{1} << 20) + 1}.validate(); }),
                          "vocab_pad must be in [1, 2^20] (1: no padding), got 1048577"));
}

TEST_CASE("padded vocabulary: one device's logits, loss and gradients equal the unpadded model's") {
  const data::TextBatch b = batch();
  const auto ref = make_gpt(1);
  const Tensor ref_logits = (*ref)(b.idx);
  const Tensor ref_loss = Gpt::loss(ref_logits, b.targets);
  ref_loss.backward();
  for (const int64_t pad : {64, 12}) {
    CAPTURE(pad);
    const auto m = make_gpt(pad);
    const int64_t padded = m->config().padded_vocab();
    const std::map<std::string, Tensor> params = params_of(*m);
    // The same draws: the vocabulary's rows and every other parameter equal, the padding 0.
    for (const auto& [name, t] : ref->named_parameters()) {
      CAPTURE(name);
      const Tensor p = params.at(name);
      if (name == "wte.weight") check_wte(p, t, 0.0, "wte at init");
      else CHECK(max_abs(p - t) == 0.0);
    }
    const Tensor logits = (*m)(b.idx);
    REQUIRE(logits.shape() == Shape{kBatch, kContext, padded});
    CHECK(max_abs(logits.narrow(2, 0, kVocab) - ref_logits) <= 1e-12);
    CHECK(max_abs(logits.narrow(2, kVocab, padded - kVocab) - kPaddedLogit) == 0.0);
    const Tensor loss = Gpt::loss(logits, b.targets);
    CHECK(std::abs(loss.item<double>() - ref_loss.item<double>()) <= 1e-12);
    loss.backward();
    for (const auto& [name, t] : ref->named_parameters()) {
      CAPTURE(name);
      const Tensor g = params.at(name).grad();
      if (name == "wte.weight") check_wte(g, t.grad(), 1e-12, "wte's gradient");
      else CHECK(max_abs(g - t.grad()) <= 1e-12);
    }
  }
}

// AdamW with weight decay, in f32: the loss curves within 1e-5 relative, the padding still 0.
TEST_CASE("padded vocabulary: AdamW steps in f32 keep the padding at zero and the unpadded losses") {
  std::vector<double> losses[2];
  std::shared_ptr<Gpt> models[2];
  for (int k = 0; k < 2; ++k) {
    models[k] = make_gpt(k == 0 ? 1 : 64, DType::f32);
    optim::AdamW opt(optim::decay_groups(models[k]->named_parameters(), 1e-2, 0.1),
                     {.lr = 1e-2, .betas = {0.9, 0.95}, .weight_decay = 0.1});
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      const data::TextBatch b = batch(step);
      Tensor loss = Gpt::loss((*models[k])(b.idx), b.targets);
      losses[k].push_back(loss.item<double>());
      loss.backward();
      opt.step();
    }
  }
  for (size_t i = 0; i < losses[0].size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(losses[1][i] - losses[0][i]) <= 1e-5 * std::abs(losses[0][i]));
  }
  check_wte(models[1]->wte->weight, models[0]->wte->weight, 1e-4, "wte after 5 steps");
}

// Every layout against the unpadded single-device run (f64): tp splits the padded vocabulary
// (256 or 252 rows: 64 or 63 per rank on 4), the pipeline's last stage holds the head and
// its first the embedding, ZeRO shards the padded table over dp.
TEST_CASE("padded vocabulary: tensor, pipeline and data parallel runs equal the unpadded single device") {
  constexpr int kSteps = 3;
  const auto ref = make_gpt(1);
  optim::AdamW opt(optim::decay_groups(ref->named_parameters(), 1e-2, 0.1),
                   {.lr = 1e-2, .betas = {0.9, 0.95}, .weight_decay = 0.1});
  std::vector<double> ref_losses;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    const data::TextBatch b = batch(step);
    Tensor loss = Gpt::loss((*ref)(b.idx), b.targets);
    ref_losses.push_back(loss.item<double>());
    loss.backward();
    opt.step();
  }
  // Detached: the ranks' threads read them at once (no autograd state shared between them).
  std::map<std::string, Tensor> want;
  for (const auto& [name, t] : ref->named_parameters()) want[name] = t.detach();
  struct Layout {
    int64_t pp, dp, tp, zero;
    bool sp;
  };
  const std::vector<Layout> layouts{{1, 1, 4, 0, false}, {1, 2, 2, 1, true}, {2, 1, 2, 0, false},
                                    {2, 2, 1, 3, false}, {4, 1, 1, 0, false}};
  for (const int64_t pad : {64, 12}) {
    for (const Layout& l : layouts) {
      const std::string what = fmt::format("pad {} pp{} dp{} tp{} zero{}{}", pad, l.pp, l.dp, l.tp,
                                           l.zero, l.sp ? " sp" : "");
      CAPTURE(what);
      parallel::run_threads(static_cast<int>(l.pp * l.dp * l.tp), [&](parallel::CommPtr world) {
        const auto model = make_gpt(pad);
        Gpt3d g(*model, world,
                {.pp = l.pp, .dp = l.dp, .tp = l.tp, .zero = l.zero, .microbatches = 2,
                 .sequence_parallel = l.sp, .lr = 1e-2, .weight_decay = 0.1});
        for (int step = 0; step < kSteps; ++step) {
          const data::TextBatch b = batch(step);
          const double loss = g.train_step(b.idx, b.targets, 1e-2);
          CHECK(std::abs(loss - ref_losses[static_cast<size_t>(step)]) <= 1e-10);
        }
        NoGradGuard no_grad;
        const std::map<std::string, Tensor> params = g.full_parameters();
        for (const auto& [name, t] : want) {
          CAPTURE(name);
          REQUIRE(params.count(name) == 1);
          if (name == "wte.weight") check_wte(params.at(name), t, 1e-10, "wte");
          else CHECK(max_abs(params.at(name) - t) <= 1e-10);
        }
      });
    }
  }
}

// Under bf16 and f16 autocast (the masked logit finite in both): one step's loss equals the
// unpadded model's and the padding's gradient is exactly zero.
TEST_CASE("padded vocabulary: bf16 and f16 autocast give the unpadded loss, a zero padding gradient") {
  const data::TextBatch b = batch();
  for (const DType low : {DType::bf16, DType::f16}) {
    CAPTURE(low);
    double losses[2];
    Tensor grads[2];
    for (int k = 0; k < 2; ++k) {
      const auto m = make_gpt(k == 0 ? 1 : 64, DType::f32);
      Tensor loss;
      {
        AutocastGuard amp(low);
        loss = Gpt::loss((*m)(b.idx), b.targets);
      }
      loss.backward();
      losses[k] = loss.item<double>();
      grads[k] = m->wte->weight.grad();
    }
    CHECK(std::isfinite(losses[1]));
    CHECK(std::abs(losses[1] - losses[0]) <= 1e-6 * std::abs(losses[0]));
    check_wte(grads[1], grads[0], 1e-6 * max_abs(grads[0]), "wte's gradient");
  }
}

}  // namespace
}  // namespace tessera::gpt
