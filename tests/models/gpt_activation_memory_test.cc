// Activation memory through the GPT program (models/gpt/train.h): --recompute=full|selective
// gives the same gradients while holding fewer saved activations, --act_compress=int8|bf16
// holds less with nearly the same gradients, and both run on every layout (dp, ZeRO, pp,
// tp) with the losses of the run without them. Split from gpt_train_test.cc (the loop,
// layouts, precision, checkpoints).
#include <doctest/doctest.h>

#include <cmath>
#include <deque>
#include <memory>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "autograd/saved_compression.h"
#include "models/gpt/model.h"
#include "models/gpt/train.h"
#include "tensor/allocator.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tests/models/gpt_test_configs.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

using testing::contains;
using testing::error_of;

// A GPT of L layers, H heads, width C and context T in training mode (initialised from seed
// 3), and one batch of B random sequences and targets (seed 5): the memory cases' model.
struct ModelAndBatch {
  std::unique_ptr<Gpt> model;  // modules hold pointers to their parts: never moved
  Tensor idx, targets;
};
ModelAndBatch model_and_batch(GptConfig cfg, int64_t L, int64_t H, int64_t C, int64_t T, int64_t B) {
  cfg.layers = L;
  cfg.heads = H;
  cfg.width = C;
  cfg.context = T;
  manual_seed(3);
  ModelAndBatch m{std::make_unique<Gpt>(cfg), Tensor(), Tensor()};
  m.model->train();
  Generator data(5);
  m.idx = cast(rand({B, T}, DType::f64, kCPU, &data) * 255.0, DType::i64);
  m.targets = cast(rand({B, T}, DType::f64, kCPU, &data) * 255.0, DType::i64);
  return m;
}

TEST_CASE("--recompute=full|selective: the same gradients, less activation memory") {
  // One forward and backward of a 2-layer GPT with dropout (so attention runs the composite
  // whose [B, H, T, T] probabilities selective recomputation drops), per mode, counting the
  // untagged bytes (activations, temporaries, gradients) allocated inside a MemoryScope.
  constexpr int64_t B = 4, T = 32, C = 32, H = 2, L = 2;
  struct Run {
    Tensor loss;
    std::vector<Tensor> grads;
    int64_t peak = 0;
  };
  // Storages made inside a scope report to its tracker when freed: the trackers outlive them.
  std::deque<MemoryTracker> trackers;
  auto run = [&](GptConfig::Recompute mode) {
    GptConfig cfg;
    cfg.dropout = 0.1;
    cfg.recompute = mode;
    auto [model, idx, targets] = model_and_batch(cfg, L, H, C, T, B);
    Run r;
    MemoryTracker& tracker = trackers.emplace_back();
    {
      MemoryScope scope(&tracker);
      r.loss = Gpt::loss((*model)(idx), targets);
      r.loss.backward();
    }
    r.peak = tracker.peak(MemoryTag::untagged);
    for (const Tensor& p : model->parameters()) r.grads.push_back(p.grad());
    return r;
  };
  const Run none = run(GptConfig::Recompute::none);
  const Run full = run(GptConfig::Recompute::full);
  const Run selective = run(GptConfig::Recompute::selective);
  for (const Run* r : {&full, &selective}) {
    // The same ops on the same values and dropout counters: bitwise.
    CHECK(r->loss.item<double>() == none.loss.item<double>());
    REQUIRE(r->grads.size() == none.grads.size());
    for (size_t i = 0; i < none.grads.size(); ++i) {
      CHECK(r->grads[i].to_vector<double>() == none.grads[i].to_vector<double>());
    }
  }
  // Per layer, selective drops at least the f32 [B, H, T, T] probabilities and the [B, T, 4C]
  // GELU output; full keeps only each block's input.
  const int64_t kept_by_selective = (B * H * T * T + B * T * 4 * C) * 4;
  MESSAGE(fmt::format("activation peak per step: none {} B, selective {} B ({} B less per layer), "
                      "full {} B ({} B less per layer)",
                      none.peak, selective.peak, (none.peak - selective.peak) / L, full.peak,
                      (none.peak - full.peak) / L));
  CHECK(none.peak - selective.peak >= L * kept_by_selective);
  CHECK(full.peak < selective.peak);
}

TEST_CASE("--act_compress=int8|bf16: less activation memory, nearly the same gradients") {
  // One forward and backward of a 2-layer GPT per mode, counting the untagged bytes
  // (activations, temporaries, gradients) allocated inside a MemoryScope, as above.
  constexpr int64_t B = 4, T = 64, C = 64, H = 2, L = 2;
  std::deque<MemoryTracker> trackers;
  struct Run {
    double loss = 0;
    std::vector<double> grads;
    int64_t held = 0;  // after the forward: what the graph keeps for backward (and the loss)
    int64_t peak = 0;
  };
  auto run = [&](autograd::SavedCompression::Mode mode) {
    auto [model, idx, targets] = model_and_batch(GptConfig{}, L, H, C, T, B);
    Run r;
    MemoryTracker& tracker = trackers.emplace_back();
    {
      MemoryScope scope(&tracker);
      const autograd::SavedCompressionGuard g({.mode = mode});
      const Tensor loss = Gpt::loss((*model)(idx), targets);
      r.held = tracker.current(MemoryTag::untagged);
      loss.backward();
      r.loss = loss.item<double>();
    }
    r.peak = tracker.peak(MemoryTag::untagged);
    for (const Tensor& p : model->parameters()) {
      for (double v : p.grad().to_vector<double>()) r.grads.push_back(v);
    }
    return r;
  };
  const Run none = run(autograd::SavedCompression::none);
  const Run int8 = run(autograd::SavedCompression::int8);
  const Run bf16 = run(autograd::SavedCompression::bf16);
  // The forward is exact (compression only changes what backward reads).
  CHECK(int8.loss == none.loss);
  CHECK(bf16.loss == none.loss);
  // Every gradient through rounded activations: ||g - g_exact|| / ||g_exact||.
  auto rel = [&](const Run& r) {
    double d = 0, n = 0;
    for (size_t i = 0; i < none.grads.size(); ++i) {
      d += (r.grads[i] - none.grads[i]) * (r.grads[i] - none.grads[i]);
      n += none.grads[i] * none.grads[i];
    }
    return std::sqrt(d / n);
  };
  MESSAGE(fmt::format("held for backward: none {} B, int8 {} B, bf16 {} B; peak: none {} B, "
                      "int8 {} B, bf16 {} B; gradient error int8 {:.2g}, bf16 {:.2g}",
                      none.held, int8.held, bf16.held, none.peak, int8.peak, bf16.peak,
                      rel(int8), rel(bf16)));
  CHECK(int8.held < bf16.held);
  CHECK(bf16.held < none.held);
  // The peak also holds the packing's temporaries (a chunk of the largest saved tensor in f32)
  // and backward's: below the plain run's, in no fixed order between the two modes.
  CHECK(int8.peak < none.peak);
  CHECK(bf16.peak < none.peak);
  // An element of a saved tensor moves by at most 1/254 of its block's largest (int8) or
  // 2^-8 of itself (bf16); gradients are sums of products of a few such factors.
  CHECK(rel(int8) > 0);
  CHECK(rel(int8) < 0.05);
  CHECK(rel(bf16) > 0);
  CHECK(rel(bf16) < 0.02);
}

TEST_CASE("--act_compress on --dp --zero --pp --tp: compressed on every layout, the loss close") {
  // Per layout, the run without compression and with it: the same first loss (the forward
  // is exact), then different (backward read rounded activations) but within 1%.
  int runs = 0;
  for (const auto& layout : {std::tuple{1, 1, 1, 0}, std::tuple{1, 2, 1, 3},
                             std::tuple{2, 1, 2, 2}}) {
    GptTrainConfig c = short_run(6);
    std::tie(c.pp, c.dp, c.tp, c.zero) = layout;
    c.microbatches = c.pp;
    CAPTURE(c.pp);
    CAPTURE(c.dp);
    CAPTURE(c.tp);
    CAPTURE(c.zero);
    const GptResult plain = train_gpt(c);
    for (const char* mode : {"int8", "bf16"}) {
      CAPTURE(mode);
      c.act_compress = mode;
      const GptResult r = train_gpt(c);
      REQUIRE(r.losses.size() == plain.losses.size());
      CHECK(r.losses[0] == plain.losses[0]);
      bool differs = false;
      for (size_t i = 1; i < plain.losses.size(); ++i) {
        differs = differs || r.losses[i] != plain.losses[i];
        CHECK(std::abs(r.losses[i] - plain.losses[i]) <= 1e-2 * std::abs(plain.losses[i]));
      }
      CHECK(differs);
      ++runs;
    }
  }
  CHECK(runs == 6);
  GptTrainConfig c = short_run(2);
  c.act_compress = "int4";
  CHECK(contains(error_of([&] { train_gpt(c); }),
                 "gpt: --act_compress must be none, int8 or bf16, got 'int4'"));
  c.act_compress = "int8";
  c.dp = 2;
  c.check = true;
  CHECK(contains(error_of([&] { train_gpt(c); }), "--act_compress=int8 rounds the activations"));
}

TEST_CASE("--recompute with --dp --zero --pp --tp: the losses of the run without it") {
  // Recomputation replays dropout's masks (each layer keys its draws, forward.h), so with
  // dropout on the losses are the plain run's on every layout.
  GptTrainConfig c = short_run(6);
  c.dropout = 0.1;
  const GptResult plain = train_gpt(c);
  for (const char* mode : {"full", "selective"}) {
    for (const auto& layout : {std::tuple{1, 1, 1, 0}, std::tuple{1, 2, 1, 3},
                               std::tuple{2, 1, 2, 2}}) {
      CAPTURE(mode);
      c.recompute = mode;
      std::tie(c.pp, c.dp, c.tp, c.zero) = layout;
      CAPTURE(c.pp);
      CAPTURE(c.dp);
      CAPTURE(c.tp);
      CAPTURE(c.zero);
      c.microbatches = c.pp;
      const GptResult r = train_gpt(c);
      REQUIRE(r.losses.size() == plain.losses.size());
      for (size_t i = 0; i < plain.losses.size(); ++i) {
        CHECK(std::abs(r.losses[i] - plain.losses[i]) <= 1e-5 * std::abs(plain.losses[i]));
      }
    }
  }
  c = tiny();
  c.recompute = "sometimes";
  CHECK(contains(error_of([&] { train_gpt(c); }), "--recompute"));
}

}  // namespace
}  // namespace tessera::gpt
