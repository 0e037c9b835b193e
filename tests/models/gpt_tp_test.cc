// GPT with tensor parallelism from sharding specs (models/gpt/tensor_parallel.h): on meshes
// {tp: 2}, {tp: 4} and {dp: 2, tp: 2} the loss and every parameter's gradient equal the
// single-device model's (f64, 1e-12); the comm log shows Megatron's pattern on tp (one
// all-reduce per attention and per MLP in forward, one each in backward), the vocab-parallel
// embedding and head, and a cross-entropy that never moves the full logits; heads that do
// not divide are a clear error.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>
#include <tuple>
#include <string>

#include "models/data/text.h"
#include "models/gpt/tensor_parallel.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "tensor/allocator.h"
#include "tensor/random.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

constexpr int64_t kBatch = 4, kContext = 8;

std::shared_ptr<Gpt> make_gpt(int64_t heads = 4, double dropout = 0.0, int64_t width = 16) {
  manual_seed(0);
  auto m = std::make_shared<Gpt>(GptConfig{.layers = 2, .heads = heads, .width = width,
                                           .context = kContext, .vocab = 256, .dropout = dropout});
  m->to(DType::f64);
  return m;
}

data::TextBatch batch() {
  std::vector<uint8_t> bytes;
  for (int i = 0; i < 2048; ++i) bytes.push_back(static_cast<uint8_t>("tensor parallel "[i % 16]));
  return data::TextWindows(std::move(bytes), data::TextSplit::train, 4).get(0, kBatch, kContext);
}

TEST_CASE("tensor parallel GPT: loss and every gradient equal one device") {
  const data::TextBatch b = batch();
  const auto ref = make_gpt();
  const Tensor ref_loss = Gpt::loss((*ref)(b.idx), b.targets);
  ref_loss.backward();
  // Plain variables, not a structured binding: lambdas capture them (clang < 16 rejects that).
  for (const auto& shape : {std::pair<int64_t, int64_t>{1, 2}, {1, 4}, {2, 2}, {1, 1}}) {
    const int64_t dp = shape.first, tp = shape.second;
    CAPTURE(dp);
    CAPTURE(tp);
    parallel::run_threads(static_cast<int>(dp * tp), [&](parallel::CommPtr world) {
      const auto model = make_gpt();
      auto mesh = parallel::make_mesh(world, {{"dp", dp}, {"tp", tp}});
      TpGpt tpg(*model, mesh);
      parallel::CommLog log;
      parallel::ShardedTensor loss;
      {
        parallel::CommLogScope scope(log);
        loss = tpg.loss(b.idx, b.targets);
        loss.backward();
      }
      CHECK(std::abs(loss.full_tensor().item<double>() - ref_loss.item<double>()) <= 1e-12);
      for (const auto& entry : ref->named_parameters()) {
        const std::string& name = entry.first;
        const Tensor& t = entry.second;
        CAPTURE(name);
        CHECK(max(abs(tpg.full_grad(name) - t.grad())).item<double>() <= 1e-12);
      }
      if (tp > 1) {
        // Megatron's pattern on tp: in forward one all-reduce per attention and per MLP (their
        // row-parallel products, as the residual stream's layout asks) plus one for the
        // vocab-parallel embedding's Partial lookup; in backward one per column-parallel
        // product (the stream's gradient), the vocab-parallel head's included. The rest are
        // the cross-entropy's row statistics (max, sum of exponentials, target logit): at
        // most B x T elements each, never the [B, T, vocab] logits.
        int forward = 0, backward = 0, other = 0;
        int64_t largest_other = 0;
        for (const parallel::CommRecord& r : log.records) {
          if (r.group != "tp") continue;
          if (r.op == "all_reduce" && r.cause == "with_sharding_constraint" && r.elements > kBatch * kContext) {
            ++forward;
          } else if (r.op == "all_reduce" && (r.cause == "matmul backward (replicated input)" ||
                                              r.cause == "linear backward (replicated input)")) {
            ++backward;
          } else {
            ++other;
            largest_other = std::max(largest_other, r.elements);
          }
        }
        CAPTURE(log.str());
        CHECK(forward == 2 * 2 + 1);   // 2 blocks x (attention, MLP) + the embedding
        CHECK(backward == 2 * 2 + 1);  // 2 blocks x (qkv's matmul, MLP up's linear) + the head
        CHECK(other >= 1);
        CHECK(largest_other <= kBatch * kContext);
      }
    });
  }
}

TEST_CASE("sequence parallel GPT: one device's gradients, all-gather in and reduce-scatter out, "
          "LayerNorm and residual memory divided by tp") {
  const data::TextBatch b = batch();
  const auto ref = make_gpt();
  const Tensor ref_loss = Gpt::loss((*ref)(b.idx), b.targets);
  ref_loss.backward();
  std::map<int64_t, int64_t> sp_bytes;  // tp -> rank 0's region bytes with SP (dp = 1)
  for (const auto& shape : {std::pair<int64_t, int64_t>{1, 2}, {1, 4}, {2, 2}}) {
    const int64_t dp = shape.first, tp = shape.second;
    CAPTURE(dp);
    CAPTURE(tp);
    parallel::run_threads(static_cast<int>(dp * tp), [&](parallel::CommPtr world) {
      auto mesh = parallel::make_mesh(world, {{"dp", dp}, {"tp", tp}});
      // The region memory alive after forward (what backward keeps), without and with SP.
      int64_t region_bytes[2] = {0, 0};
      for (bool sp : {false, true}) {
        const auto model = make_gpt();
        TpGpt tpg(*model, mesh);
        MemoryTracker regions;
        tpg.set_sequence_parallel(sp, &regions);
        parallel::CommLog log;
        parallel::ShardedTensor loss;
        {
          parallel::CommLogScope scope(log);
          loss = tpg.loss(b.idx, b.targets);
          region_bytes[sp] = regions.current();
          loss.backward();
        }
        CHECK(std::abs(loss.full_tensor().item<double>() - ref_loss.item<double>()) <= 1e-12);
        for (const auto& entry : ref->named_parameters()) {
          const std::string& name = entry.first;
          const Tensor& t = entry.second;
          CAPTURE(name);
          CHECK(max(abs(tpg.full_grad(name) - t.grad())).item<double>() <= 1e-12);
        }
        if (!sp) continue;
        // Forward on tp: per block an all-gather into the attention's and the MLP's
        // column-parallel product and a reduce-scatter out of each row-parallel one; the
        // embedding's Partial lookup is reduce-scattered and the head's input all-gathered.
        // No activation all-reduce.
        int gathers = 0, scatters = 0, big_reduces = 0;
        for (const parallel::CommRecord& r : log.records) {
          if (r.group != "tp" || r.cause != "with_sharding_constraint") continue;
          gathers += r.op == "all_gather";
          scatters += r.op == "reduce_scatter";
          big_reduces += r.op == "all_reduce" && r.elements > kBatch * kContext;
        }
        CAPTURE(log.str());
        CHECK(gathers == 2 * 2 + 1);
        CHECK(scatters == 2 * 2 + 1);
        CHECK(big_reduces == 0);
      }
      MESSAGE(fmt::format("dp={} tp={}: LayerNorm/residual bytes alive after forward {} without "
                          "SP, {} with", dp, tp, region_bytes[0], region_bytes[1]));
      CHECK(region_bytes[1] > 0);
      // Without SP the regions also keep the LayerNorm outputs the column-parallel products
      // save; with SP those are kept gathered, outside the regions: at least a tp-fold drop.
      CHECK(region_bytes[0] >= tp * region_bytes[1]);
      if (dp == 1 && world->rank() == 0) sp_bytes[tp] = region_bytes[1];
    });
  }
  // With SP the regions keep what backward needs of them, split along the sequence: per
  // block the two residual-stream tensors they produce (the LayerNorm inputs h and the
  // block's output) and both LayerNorms' mean and rstd, plus the final LayerNorm's
  // statistics; in f64, divided by tp exactly.
  const int64_t BT = kBatch * kContext, C = 16;
  const int64_t whole = (2 * (2 * BT * C + 2 * 2 * BT) + 2 * BT) * 8;
  CHECK(sp_bytes.at(2) * 2 == whole);
  CHECK(sp_bytes.at(4) * 4 == whole);
}

TEST_CASE("dropout under TP and SP draws the single-device masks; uneven vocabulary blocks") {
  const data::TextBatch b = batch();
  // heads 3, width 24: tp = 3 splits whole heads, and the 256-row vocabulary unevenly (86, 85,
  // 85); dropout 0.2 everywhere the single-device model has it.
  for (const auto& c : {std::tuple<int64_t, int64_t, int64_t, double>{2, 4, 16, 0.2},
                        {3, 3, 24, 0.2}, {3, 3, 24, 0.0}}) {
    const int64_t tp = std::get<0>(c), heads = std::get<1>(c), width = std::get<2>(c);
    const double p = std::get<3>(c);
    CAPTURE(tp);
    CAPTURE(p);
    const auto ref = make_gpt(heads, p, width);
    manual_seed(42);  // the dropout draws
    const Tensor ref_loss = Gpt::loss((*ref)(b.idx), b.targets);
    ref_loss.backward();
    for (bool sp : {false, true}) {
      CAPTURE(sp);
      parallel::run_threads(static_cast<int>(tp), [&](parallel::CommPtr world) {
        const auto model = make_gpt(heads, p, width);
        auto mesh = parallel::make_mesh(world, {{"tp", tp}});
        TpGpt tpg(*model, mesh);
        tpg.set_sequence_parallel(sp);
        manual_seed(42);
        const parallel::ShardedTensor loss = tpg.loss(b.idx, b.targets);
        loss.backward();
        CHECK(std::abs(loss.full_tensor().item<double>() - ref_loss.item<double>()) <= 1e-12);
        for (const auto& entry : ref->named_parameters()) {
          const std::string& name = entry.first;
          const Tensor& t = entry.second;
          CAPTURE(name);
          CHECK(max(abs(tpg.full_grad(name) - t.grad())).item<double>() <= 1e-12);
        }
      });
    }
  }
}

TEST_CASE("selective recomputation under TP: one device's gradients, 1/tp of its memory kept less") {
  // With dropout the attention core is the composite: selective recomputation reruns it and
  // the MLP activation from each rank's local blocks (TpLayout::recompute) in backward. The
  // gradients are the plain run's; each rank's peak of untagged bytes (activations and
  // temporaries) drops by at least its share of what one device's drops: per layer the f64
  // [B, H/tp, T, T] probabilities and the [B, T, 4C/tp] GELU output.
  constexpr int64_t tp = 2, heads = 4, width = 16, L = 2;
  const data::TextBatch b = batch();
  const auto ref = make_gpt(heads, 0.1, width);
  manual_seed(42);
  Gpt::loss((*ref)(b.idx), b.targets).backward();
  std::vector<int64_t> peak[2];  // per mode (none, selective), per rank
  for (int mode = 0; mode < 2; ++mode) {
    peak[mode].assign(tp, 0);
    parallel::run_threads(static_cast<int>(tp), [&](parallel::CommPtr world) {
      GptConfig config = make_gpt(heads, 0.1, width)->config();
      config.recompute = mode == 1 ? GptConfig::Recompute::selective : GptConfig::Recompute::none;
      manual_seed(0);
      Gpt model(config);
      model.to(DType::f64);
      auto mesh = parallel::make_mesh(world, {{"tp", tp}});
      TpGpt tpg(model, mesh);
      MemoryTracker tracker;
      {
        MemoryScope scope(&tracker);
        manual_seed(42);
        tpg.loss(b.idx, b.targets).backward();
      }
      peak[mode][world->rank()] = tracker.peak(MemoryTag::untagged);
      for (const auto& entry : ref->named_parameters()) {
        const std::string& name = entry.first;
        CAPTURE(name);
        CHECK(max(abs(tpg.full_grad(name) - entry.second.grad())).item<double>() <= 1e-12);
      }
    });
  }
  const int64_t kept_less = (kBatch * heads / tp * kContext * kContext + kBatch * kContext * 4 * width / tp) * 8;
  for (int64_t r = 0; r < tp; ++r) {
    CAPTURE(r);
    MESSAGE(fmt::format("rank {}: untagged peak none {} B, selective {} B ({} B less per layer)", r,
                        peak[0][r], peak[1][r], (peak[0][r] - peak[1][r]) / L));
    CHECK(peak[0][r] - peak[1][r] >= L * kept_less);
  }
}

TEST_CASE("tensor parallel GPT: heads must divide by tp") {
  parallel::run_threads(2, [&](parallel::CommPtr world) {
    const auto model = make_gpt(/*heads=*/1);
    auto mesh = parallel::make_mesh(world, {{"tp", 2}});
    CHECK(testing::contains(testing::error_of([&] { TpGpt t(*model, mesh); }),
                            "heads (1) must be divisible by the tp size (2)"));
  });
}

}  // namespace
}  // namespace tessera::gpt
