// The GPT training loop (models/gpt/train.h) end to end on a tiny model and the fortunes
// corpus: it learns (loss far below the uniform ln 256), validation runs on schedule,
// sampling gives the requested bytes reproducibly, resuming from a checkpoint continues
// bitwise identically (losses, parameters and optimizer state), every layout (dp, ZeRO,
// offload, pp, tp, sp) gives one rank's losses with dropout, accumulation and mixed
// precision, and bad configurations fail with clear errors. The optimizers and gradient
// compression through the program: gpt_optimizers_test.cc; recomputation and compressed
// activations: gpt_activation_memory_test.cc.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "models/common/checkpoint.h"
#include "models/gpt/model.h"
#include "models/gpt/pipeline.h"
#include "models/gpt/train.h"
#include "tensor/ops.h"
#include "nn/safetensors.h"
#include "tensor/error.h"
#include "tensor/random.h"
#include "tests/models/gpt_test_configs.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

using testing::contains;
using testing::error_of;
using testing::temp_dir;

namespace fs = std::filesystem;

// short_run(8) on pp 2 x dp 2 x tp 2 with dropout, accumulation, selective recomputation
// and ZeRO `zero` (4 heads: tp 4 divides them too).
GptTrainConfig everything_on(int zero) {
  GptTrainConfig c = short_run(8);
  c.layers = 2;
  c.heads = 4;
  c.dropout = 0.1;
  c.accum = 2;
  c.recompute = "selective";
  c.pp = 2;
  c.dp = 2;
  c.tp = 2;
  c.zero = zero;
  return c;
}

// Every tensor of two safetensors files, bitwise (f32 compared as f64 values: exact).
void check_same_tensors(const std::string& a, const std::string& b) {
  const nn::SafetensorsFile fa = nn::load_safetensors(a), fb = nn::load_safetensors(b);
  REQUIRE(fa.tensors.size() == fb.tensors.size());
  // Plain variables, not a structured binding: CAPTURE captures them (clang < 16 rejects that).
  for (const auto& entry : fa.tensors) {
    const std::string& name = entry.first;
    const Tensor& t = entry.second;
    CAPTURE(name);
    REQUIRE(fb.tensors.count(name) == 1);
    const Tensor& u = fb.tensors.at(name);
    REQUIRE(t.shape() == u.shape());
    CHECK(t.dtype() == u.dtype());
    CHECK(t.to_vector<double>() == u.to_vector<double>());
  }
}

TEST_CASE("a tiny GPT learns fortunes: 60 steps take the loss from ln 256 to well below it") {
  // Uniform over bytes is ln 256 = 5.55. This run reaches a train loss of about 3.35 and a
  // val loss of about 3.41 (unigram byte statistics are ~3.3 nats on English text); the
  // bounds leave ~0.35 for other seeds and summation orders, not for a model that stalls.
  const GptTrainConfig c = tiny();
  const GptResult r = train_gpt(c);
  REQUIRE(r.losses.size() == 60);
  CHECK(r.steps == 60);
  CHECK(r.losses.front() > 5.0);  // about ln 256 at GPT-2's small init
  CHECK(r.losses.front() < 6.0);
  CHECK(r.train_loss < 3.7);
  CHECK(r.val_loss < 3.8);
  CHECK(std::isfinite(r.val_loss));
  // Validation at steps 20 and 40, then the final one at 60.
  REQUIRE(r.val_losses.size() == 3);
  CHECK(r.val_losses[0].first == 20);
  CHECK(r.val_losses[1].first == 40);
  CHECK(r.val_losses[2].first == 60);
  CHECK(r.val_losses[2].second == r.val_loss);
  CHECK(r.val_losses[0].second > r.val_losses[2].second);
  CHECK(r.tokens_per_s > 0);
  CHECK(r.sample.size() == 50);
}

TEST_CASE("sampling: the requested number of bytes, reproducible for a seed, greedy = top-1") {
  manual_seed(3);
  Gpt model(tiny().model_config());
  model.train();
  SampleOptions o;
  o.length = 40;  // longer than the context (32): the window is cropped
  o.seed = 7;
  const std::string a = sample(model, "Hello", o);
  CHECK(a.size() == 40);
  CHECK(model.is_training());  // the mode is restored
  CHECK(sample(model, "Hello", o) == a);
  o.seed = 8;
  CHECK(sample(model, "Hello", o) != a);
  // Temperature 0 is argmax; top-1 sampling at any temperature is the same thing.
  o.temperature = 0.0;
  const std::string greedy = sample(model, "Hello", o);
  o.temperature = 1.5;
  o.top_k = 1;
  CHECK(sample(model, "Hello", o) == greedy);
  // A prompt longer than the context is cropped to its last 32 bytes.
  o.length = 5;
  CHECK(sample(model, std::string(100, 'x'), o) == sample(model, std::string(32, 'x'), o));
  // Sampling does not draw from the default generator.
  const uint64_t offset = default_generator().offset();
  sample(model, "\n", o);
  CHECK(default_generator().offset() == offset);

  CHECK(contains(error_of([&] { sample(model, "", o); }), "at least one byte"));
  o.temperature = -1;
  CHECK(contains(error_of([&] { sample(model, "a", o); }), "temperature"));
}

TEST_CASE("resume continues bitwise: 20 steps straight == 10, save, resume, 10") {
  // Dropout on, so the restored RNG state matters too; bf16 runs the autocast path.
  for (const char* precision : {"f32", "bf16"}) {
    CAPTURE(precision);
    const std::string dir = temp_dir() + "/gpt_resume_" + precision;
    fs::create_directories(dir);
    GptTrainConfig c = tiny();
    c.precision = precision;
    c.dropout = 0.1;
    c.steps = 20;
    c.val_every = 5;
    c.val_batches = 2;
    c.sample_length = 20;
    c.save = dir + "/straight.safetensors";
    const GptResult straight = train_gpt(c);

    c.max_steps = 10;
    c.save = dir + "/split.safetensors";
    const GptResult first = train_gpt(c);
    c.max_steps = 0;
    c.resume = c.save;
    const GptResult second = train_gpt(c);

    REQUIRE(straight.losses.size() == 20);
    REQUIRE(first.losses.size() == 10);
    REQUIRE(second.losses.size() == 10);
    for (size_t i = 0; i < 10; ++i) {
      CHECK(first.losses[i] == straight.losses[i]);
      CHECK(second.losses[i] == straight.losses[10 + i]);  // exact, not approximate
    }
    CHECK(first.steps == 10);
    CHECK(second.steps == 20);
    CHECK(second.val_loss == straight.val_loss);
    CHECK(second.sample == straight.sample);
    // Parameters, and the optimizer moments, step and RNG state, bitwise.
    check_same_tensors(dir + "/straight.safetensors", dir + "/split.safetensors");
    check_same_tensors(models::state_path(dir + "/straight.safetensors"),
                       models::state_path(dir + "/split.safetensors"));
  }
}

TEST_CASE("--dp --zero --accum: the same losses as one rank; checkpoints move between layouts") {
  // f32 on simulated ranks (threads): the global batch and its slices are the single-rank
  // run's, so the losses agree to f32 summation order (dp_harness.h's 1e-5 relative).
  const std::string dir = temp_dir() + "/gpt_dp";
  fs::create_directories(dir);
  GptTrainConfig c = tiny();
  c.steps = 12;
  c.val_every = 0;
  c.val_batches = 2;
  c.sample_length = 20;
  c.threads = 1;
  c.save = dir + "/one.safetensors";
  const GptResult one = train_gpt(c);
  CHECK(one.memory_report.empty());
  for (const auto& layout : {std::tuple{2, 3, 1}, std::tuple{2, 1, 2}, std::tuple{4, 2, 1}}) {
    const int dp = std::get<0>(layout), zero = std::get<1>(layout), accum = std::get<2>(layout);
    CAPTURE(dp);
    CAPTURE(zero);
    CAPTURE(accum);
    c.dp = dp;
    c.zero = zero;
    c.accum = accum;
    c.save = fmt::format("{}/dp{}_zero{}.safetensors", dir, dp, zero);
    const GptResult r = train_gpt(c);
    REQUIRE(r.losses.size() == one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) {
      CHECK(std::abs(r.losses[i] - one.losses[i]) <= 1e-5 * std::abs(one.losses[i]));
    }
    CHECK(std::abs(r.val_loss - one.val_loss) <= 1e-5 * one.val_loss);
    CHECK(contains(r.memory_report, fmt::format("ZeRO stage {}, {} ranks", zero, dp)));
    CHECK(r.comm_per_step > (zero == 3 ? 2.5 : 1.99));
    CHECK(r.comm_per_step < (zero == 3 ? 3.01 : 2.01));
  }
  // Saved by dp=2 stage 3 after 6 of 12 steps, resumed by one rank without ZeRO (and the
  // other way round): the next losses are the uninterrupted run's.
  for (const auto& layouts : {std::tuple{2, 3, 1, 0}, std::tuple{1, 0, 4, 3}}) {
    const int save_dp = std::get<0>(layouts), save_zero = std::get<1>(layouts);
    const int load_dp = std::get<2>(layouts), load_zero = std::get<3>(layouts);
    CAPTURE(save_dp);
    CAPTURE(load_dp);
    c = short_run(12);
    c.dp = save_dp;
    c.zero = save_zero;
    c.max_steps = 6;
    c.save = dir + "/half.safetensors";
    train_gpt(c);
    c.dp = load_dp;
    c.zero = load_zero;
    c.max_steps = 0;
    c.resume = c.save;
    c.save = "";
    const GptResult rest = train_gpt(c);
    REQUIRE(rest.losses.size() == 6);
    for (size_t i = 0; i < 6; ++i) {
      CHECK(std::abs(rest.losses[i] - one.losses[6 + i]) <= 1e-5 * std::abs(one.losses[6 + i]));
    }
  }
  c = tiny();
  c.dp = 3;  // batch 8 does not split in 3
  CHECK(contains(error_of([&] { train_gpt(c); }),
                 "--batch 8 must divide into --dp 3 x --accum 1 equal micro-batches"));
  c = tiny();
  c.zero = 4;
  CHECK(contains(error_of([&] { train_gpt(c); }), "--zero must be 0, 1, 2 or 3, got 4"));
}

TEST_CASE("--offload_optimizer/--offload_params: the in-memory run's losses and checkpoint "
          "bitwise; a budget the model exceeds; refused layouts") {
  const std::string dir = temp_dir() + "/gpt_offload";
  fs::create_directories(dir);
  GptTrainConfig c = short_run(6);
  c.layers = 2;
  c.dp = 2;
  c.zero = 3;
  c.accum = 2;
  c.save = dir + "/memory.safetensors";
  const GptResult memory = train_gpt(c);
  int runs = 0;
  for (const auto& tiers : {std::pair{"host", "none"}, std::pair{"nvme", "none"},
                            std::pair{"host", "host"}, std::pair{"nvme", "nvme"}}) {
    CAPTURE(tiers.first);
    CAPTURE(tiers.second);
    GptTrainConfig o = c;
    o.offload.optimizer = tiers.first;
    o.offload.params = tiers.second;
    o.offload.dir = dir;
    o.save = fmt::format("{}/{}_{}.safetensors", dir, tiers.first, tiers.second);
    const GptResult r = train_gpt(o);
    CHECK(r.losses == memory.losses);
    CHECK(r.val_loss == memory.val_loss);
    check_same_tensors(o.save, c.save);  // parameters and optimizer state, bitwise
    CHECK(contains(r.memory_report, fmt::format("offload optimizer={} params={}", tiers.first,
                                                tiers.second)));
    ++runs;
  }
  CHECK(runs == 4);
  // An in-memory checkpoint resumes offloaded, and the rest of the run is the same.
  {
    GptTrainConfig a = c;
    a.max_steps = 3;
    a.save = dir + "/half.safetensors";
    train_gpt(a);
    GptTrainConfig b = c;
    b.resume = a.save;
    b.save = "";
    b.offload.optimizer = "nvme";
    b.offload.params = "nvme";
    b.offload.dir = dir;
    const GptResult rest = train_gpt(b);
    REQUIRE(rest.losses.size() == 3);
    for (size_t i = 0; i < 3; ++i) CHECK(rest.losses[i] == memory.losses[3 + i]);
  }
  // Refused, naming the flags.
  GptTrainConfig bad = c;
  bad.offload.optimizer = "disk";
  CHECK(contains(error_of([&] { train_gpt(bad); }),
                 "gpt: --offload_optimizer: unknown offload tier 'disk' (expected none, host or nvme)"));
  bad = c;
  bad.zero = 0;
  bad.offload.optimizer = "host";
  CHECK(contains(error_of([&] { train_gpt(bad); }), "it needs --zero 1-3 on the --dp layout"));
  bad = c;
  bad.zero = 2;
  bad.offload.optimizer = "host";
  bad.offload.params = "host";
  CHECK(contains(error_of([&] { train_gpt(bad); }), "--offload_params=host needs --zero 3"));
  bad = c;
  bad.offload.params = "nvme";
  CHECK(contains(error_of([&] { train_gpt(bad); }), "set --offload_optimizer too"));
  bad = c;
  bad.offload.optimizer = "host";
  bad.optimizer = "adafactor";
  CHECK(contains(error_of([&] { train_gpt(bad); }), "--optimizer=adamw or sgd"));
}

TEST_CASE("--dropout with --dp --zero --accum: one device's masks, so one device's losses") {
  // Each rank and micro-batch draws its rows of the masks one device draws for the whole
  // batch (BatchSliceScope), so dropout is independent of the split: the losses agree to
  // f32 summation order, as without dropout.
  GptTrainConfig c = short_run(12);
  c.dropout = 0.1;
  const GptResult one = train_gpt(c);
  for (const auto& layout : {std::tuple{1, 0, 2}, std::tuple{2, 0, 1}, std::tuple{2, 3, 2},
                             std::tuple{4, 1, 1}}) {
    const int dp = std::get<0>(layout), zero = std::get<1>(layout), accum = std::get<2>(layout);
    CAPTURE(dp);
    CAPTURE(zero);
    CAPTURE(accum);
    c.dp = dp;
    c.zero = zero;
    c.accum = accum;
    const GptResult r = train_gpt(c);
    REQUIRE(r.losses.size() == one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) {
      CHECK(std::abs(r.losses[i] - one.losses[i]) <= 1e-5 * std::abs(one.losses[i]));
    }
    CHECK(std::abs(r.val_loss - one.val_loss) <= 1e-5 * one.val_loss);
  }
}

TEST_CASE("--precision=f16 with --dp --zero: every rank skips the same overflowed steps") {
  GptTrainConfig c = short_run(12);
  c.precision = "f16";
  auto max_rel = [](const GptResult& a, const GptResult& b) {
    REQUIRE(a.losses.size() == b.losses.size());
    double m = 0;
    for (size_t i = 0; i < a.losses.size(); ++i) {
      m = std::max(m, std::abs(a.losses[i] - b.losses[i]) / std::abs(b.losses[i]));
    }
    return m;
  };
  // Without overflow (the default initial scale, here): one rank's f16 run. Every rank runs
  // each sample's forward and backward in the same f16 arithmetic as one device (each
  // backpropagates its share of the global mean: ZeroOptions::average false); the layouts
  // differ only in the f32 order of the gradient reduction, which moves the f32 master
  // weights by f32 roundings and can flip a weight's f16 rounding (2^-11 relative) in a
  // later forward. Measured: at most 9.4e-6 relative over 12 steps; bound 1e-4.
  const GptResult one = train_gpt(c);
  CHECK(one.skipped_steps == 0);
  for (const auto& layout : {std::pair{2, 0}, std::pair{2, 2}, std::pair{4, 3}}) {
    CAPTURE(layout.first);
    CAPTURE(layout.second);
    c.dp = layout.first;
    c.zero = layout.second;
    const GptResult r = train_gpt(c);
    CHECK(r.skipped_steps == 0);
    CHECK(max_rel(r, one) <= 1e-4);
  }
  // With overflow (initial scale 2^24: the first steps overflow and are skipped until the
  // scale backs off). Under ZeRO each rank holds other gradient shards, so only a global
  // check (an all-reduce of found-inf) makes every rank skip the same steps; with a per-rank
  // check the ranks' steps, and then their collectives, part ways (the run throws).
  // Overflow depends on how the batch is split (an f16 weight gradient sums its rank's
  // samples), so ZeRO 1-3 are compared with plain data parallelism on the same 2 ranks, where
  // every rank holds the whole reduced gradient: the same skipped steps and losses.
  c.loss_scale = 0x1p24;
  c.dp = 2;
  c.zero = 0;
  const GptResult ddp = train_gpt(c);
  CHECK(ddp.skipped_steps > 0);
  CHECK(ddp.skipped_steps < c.steps);
  for (int zero : {1, 2, 3}) {
    CAPTURE(zero);
    c.zero = zero;
    const GptResult r = train_gpt(c);
    CHECK(r.skipped_steps == ddp.skipped_steps);
    CHECK(max_rel(r, ddp) <= 1e-5);
  }
}

TEST_CASE("--pp --dp --tp: the same losses as one rank; layouts that cannot work are errors") {
  GptTrainConfig c = short_run(8);
  c.layers = 2;
  c.sample_length = 10;
  const GptResult one = train_gpt(c);
  for (const auto& layout : {std::tuple{2, 2, 2, "1f1b"}, std::tuple{2, 1, 2, "interleaved"},
                             std::tuple{4, 1, 1, "gpipe"}}) {
    const int pp = std::get<0>(layout), dp = std::get<1>(layout), tp = std::get<2>(layout);
    const char* schedule = std::get<3>(layout);
    CAPTURE(pp);
    CAPTURE(dp);
    CAPTURE(tp);
    CAPTURE(schedule);
    c.pp = pp;
    c.dp = dp;
    c.tp = tp;
    c.schedule = schedule;
    c.chunks = std::string(schedule) == "interleaved" ? 2 : 1;
    c.microbatches = 4 / dp;
    c.recompute = pp == 4 ? "full" : "none";
    const GptResult r = train_gpt(c);
    REQUIRE(r.losses.size() == one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) {
      CHECK(std::abs(r.losses[i] - one.losses[i]) <= 1e-5 * std::abs(one.losses[i]));
    }
    CHECK(std::abs(r.val_loss - one.val_loss) <= 1e-5 * one.val_loss);
    CHECK(r.sample.size() == 10);
  }
  c = tiny();
  c.tp = 4;  // 2 heads
  CHECK(contains(error_of([&] { train_gpt(c); }), "heads (2) must be divisible by tp (4)"));
  c = tiny();
  c.pp = 4;  // 1 block: 3 pipeline layers
  CHECK(contains(error_of([&] { train_gpt(c); }), "4 stages for 3 layers"));
}

TEST_CASE("--precision=bf16|f16 with --pp --dp --tp --sp: one rank's losses in that precision") {
  // Autocast's policy applies to sharded tensors as to tensors (parallel::call casts the
  // global inputs), so every layout runs the same ops in the low precision. They differ where
  // tensor parallelism splits a row-wise product's inner dimension: each rank's partial
  // product is rounded (bf16 2^-9, f16 2^-11 relative) before the all-reduce, where one
  // device rounds the whole sum once. The loss, a mean over every token, moves much less:
  // measured at most 9.5e-5 (bf16) and 2.0e-5 (f16) relative over 8 steps; bound 1e-3.
  // f16 scales the loss; without overflow (the default scale, here) no step is skipped.
  for (const char* precision : {"bf16", "f16"}) {
    CAPTURE(precision);
    GptTrainConfig c = short_run(8);
    c.layers = 2;
    c.heads = 4;
    c.precision = precision;
    const GptResult one = train_gpt(c);
    CHECK(one.skipped_steps == 0);
    struct L {
      int pp, dp, tp;
      bool sp;
      const char* schedule;
    };
    double worst = 0;
    for (const L& l : {L{2, 1, 1, false, "1f1b"}, L{1, 1, 2, false, "1f1b"}, L{1, 1, 2, true, "1f1b"},
                       L{2, 1, 2, false, "interleaved"}, L{1, 2, 2, true, "1f1b"}}) {
      CAPTURE(l.pp);
      CAPTURE(l.dp);
      CAPTURE(l.tp);
      CAPTURE(l.sp);
      c.pp = l.pp;
      c.dp = l.dp;
      c.tp = l.tp;
      c.sp = l.sp;
      c.schedule = l.schedule;
      c.chunks = std::string(l.schedule) == "interleaved" ? 2 : 1;
      c.microbatches = 4 / l.dp;
      const GptResult r = train_gpt(c);
      CHECK(r.skipped_steps == 0);
      REQUIRE(r.losses.size() == one.losses.size());
      for (size_t i = 0; i < one.losses.size(); ++i) {
        const double rel = std::abs(r.losses[i] - one.losses[i]) / std::abs(one.losses[i]);
        worst = std::max(worst, rel);
        CHECK(rel <= 1e-3);
      }
    }
    MESSAGE(std::string(precision) << ", largest relative loss difference from one rank: " << worst);
  }
  // f16 with overflow (initial scale 2^24): the overflow check is reduced over the world, so
  // every rank of a pipeline and tensor-parallel layout skips the same steps (with a check per
  // rank their collectives part ways); the run skips some steps and trains on.
  GptTrainConfig c = short_run(8);
  c.layers = 2;
  c.heads = 4;
  c.precision = "f16";
  c.loss_scale = 0x1p24;
  c.pp = 2;
  c.tp = 2;
  c.microbatches = 2;
  const GptResult r = train_gpt(c);
  CHECK(r.skipped_steps > 0);
  CHECK(r.skipped_steps < c.steps);
  CHECK(std::isfinite(r.val_loss));
}

TEST_CASE("checkpoints across layouts: pp x dp x tp with everything on resumes under tp x dp and on one rank") {
  // The command, on tiny(): --pp=2 --dp=2 --tp=2 --dropout=0.1 --accum=2
  // --recompute=selective --zero=2, saved after 4 of 8 steps, resumed under --tp=4 --dp=2 and
  // on one rank. The file holds the single-device layout (gathered by the 3-D run), so the
  // resumed runs continue from the same parameters, optimizer state, loader position (the
  // step) and generator (dropout's next masks): their next losses are the uninterrupted
  // run's, up to the summation order of the layout they continue in.
  for (const char* precision : {"f32", "bf16"}) {
    CAPTURE(precision);
    const std::string dir = temp_dir() + "/gpt_layouts_" + precision;
    fs::create_directories(dir);
    GptTrainConfig c = everything_on(2);
    c.precision = precision;
    const GptResult straight = train_gpt(c);
    c.max_steps = 4;
    c.save = dir + "/a.safetensors";
    const GptResult first = train_gpt(c);
    REQUIRE(first.losses.size() == 4);
    for (size_t i = 0; i < 4; ++i) CHECK(first.losses[i] == straight.losses[i]);
    // The single-device layout, whatever wrote it.
    const nn::SafetensorsFile file = nn::load_safetensors(c.save);
    CHECK(file.tensors.at("h.0.attn.c_attn.weight").shape() == Shape{3 * 32, 32});
    CHECK(file.tensors.at("wte.weight").shape() == Shape{256, 32});
    // f32: the summation order of another layout moves the losses by rounding only; bf16:
    // by up to one bf16 rounding (2^-9) of the split products, as between layouts from
    // scratch (tests/models/gpt_3d_cases.h).
    const double bound = std::string(precision) == "f32" ? 1e-6 : 0x1p-9;
    for (const auto& layout : {std::tuple{1, 2, 4, 0}, std::tuple{1, 1, 1, 0}}) {
      std::tie(c.pp, c.dp, c.tp, c.zero) = layout;
      CAPTURE(c.tp);
      CAPTURE(c.dp);
      c.max_steps = 0;
      c.resume = dir + "/a.safetensors";
      c.save = "";
      const GptResult rest = train_gpt(c);
      REQUIRE(rest.losses.size() == 4);
      double worst = 0;
      for (size_t i = 0; i < 4; ++i) {
        const double rel = std::abs(rest.losses[i] - straight.losses[4 + i]) / straight.losses[4 + i];
        worst = std::max(worst, rel);
        CHECK(rel <= bound);
      }
      MESSAGE(std::string(precision) << ", resumed under pp " << c.pp << " dp " << c.dp << " tp " << c.tp
                        << ": largest relative loss difference " << worst);
    }
    c.resume = "";
  }
}

TEST_CASE("--save_sharded: each rank writes its shards; any layout resumes from them") {
  // The 3-D run writes one file per writing rank (dp rank 0 of each stage and tp shard), no
  // rank gathering the model; tp 4 x dp 2 reads the regions of its shards, one rank the
  // whole tensors; and a one-rank run's sharded checkpoint resumes under pp x dp x tp.
  const std::string dir = temp_dir() + "/gpt_sharded";
  fs::create_directories(dir);
  GptTrainConfig c = everything_on(3);
  const GptResult straight = train_gpt(c);
  c.max_steps = 4;
  c.save = dir + "/a";
  c.save_sharded = true;
  train_gpt(c);
  // Writers: stage 0 and stage 1, each tp rank 0 and 1 of dp rank 0.
  int files = 0;
  for (const auto& e : fs::directory_iterator(c.save)) files += e.path().extension() == ".safetensors";
  CHECK(files == 4);
  auto check_rest = [&](const GptResult& rest) {
    REQUIRE(rest.losses.size() == 4);
    for (size_t i = 0; i < 4; ++i) {
      CHECK(std::abs(rest.losses[i] - straight.losses[4 + i]) <= 1e-6 * straight.losses[4 + i]);
    }
  };
  c.max_steps = 0;
  c.resume = dir + "/a";
  c.save = "";
  c.save_sharded = false;
  for (const auto& layout : {std::tuple{1, 2, 4, 1}, std::tuple{1, 1, 1, 0}}) {
    std::tie(c.pp, c.dp, c.tp, c.zero) = layout;
    CAPTURE(c.tp);
    check_rest(train_gpt(c));
  }
  // One rank writes a sharded checkpoint (one file) that pp x dp x tp resumes.
  c.resume = "";
  c.max_steps = 4;
  c.save = dir + "/one";
  c.save_sharded = true;
  train_gpt(c);
  c.max_steps = 0;
  c.resume = dir + "/one";
  c.save = "";
  c.save_sharded = false;
  std::tie(c.pp, c.dp, c.tp, c.zero) = std::tuple{2, 2, 2, 2};
  check_rest(train_gpt(c));
  c = tiny();
  c.save_sharded = true;
  CHECK(contains(error_of([&] { train_gpt(c); }), "--save_sharded needs --save"));
}

TEST_CASE("--data=FILE, and errors: bad flags, too little text, mismatched checkpoints") {
  const std::string file = temp_dir() + "/gpt_small.txt";
  {
    std::ofstream out(file, std::ios::binary);
    for (int i = 0; i < 200; ++i) out << "the quick brown fox jumps over the lazy dog\n";
  }
  GptTrainConfig c = tiny();
  c.data = file;
  c.steps = 30;
  const GptResult r = train_gpt(c);
  CHECK(r.losses.size() == 30);
  CHECK(r.val_loss < r.losses.front());

  c = tiny();
  c.precision = "f8";
  CHECK(contains(error_of([&] { train_gpt(c); }), "unknown --precision 'f8'"));
  c = tiny();
  c.heads = 3;
  CHECK(contains(error_of([&] { train_gpt(c); }), "heads"));
  c = tiny();
  c.log_every = 0;
  CHECK(contains(error_of([&] { train_gpt(c); }), "--log_every must be >= 1, got 0"));
  c = tiny();
  c.data = temp_dir() + "/no_such_file";
  CHECK(contains(error_of([&] { train_gpt(c); }), "no_such_file"));
  c = tiny();
  c.data = file;
  c.context = 1000;  // the validation split holds ~900 bytes
  CHECK(contains(error_of([&] { train_gpt(c); }), "--context 1000 needs more bytes"));

  // A checkpoint of a 2-head model does not resume with 4 heads (the shapes alone would fit).
  const std::string path = temp_dir() + "/gpt_heads.safetensors";
  c = tiny();
  c.steps = 2;
  c.sample_length = 0;
  c.save = path;
  train_gpt(c);
  c.save = "";
  c.resume = path;
  c.heads = 4;
  const std::string msg = error_of([&] { train_gpt(c); });
  CHECK(contains(msg, path));
  CHECK(contains(msg, "heads = 2 but --heads is 4"));
}

}  // namespace
}  // namespace tessera::gpt
