// GPT with Mixture-of-Experts blocks (8 experts, top-2) through the training program
// (models/gpt/train.h):
// one device, data parallelism and expert parallelism give the same losses; the progress
// figures and the metrics file carry the routing; a resume continues bitwise, the selection
// bias included; bad flags are refused naming them. The numerics (one device against the
// layouts in f64) are tests/parallel/zero_test's; the layer is tests/nn/moe_test's.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>
#include <string>

#include "models/gpt/train.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

using testing::contains;
using testing::error_of;
using testing::temp_dir;

GptTrainConfig moe_run(int64_t steps) {
  GptTrainConfig c;
  c.layers = 2;
  c.heads = 2;
  c.width = 32;
  c.context = 32;
  c.batch = 8;
  c.steps = steps;
  c.lr = 1e-2;
  c.warmup = 5;
  c.val_every = 0;
  c.val_batches = 2;
  c.sample_length = 0;
  c.verbose = false;
  c.threads = 1;
  c.experts = 8;
  c.moe_top_k = 2;
  c.moe_every = 1;
  c.aux_loss = 0.01;
  c.z_loss = 0.001;
  return c;
}

double worst_relative(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  return worst;
}

TEST_CASE("--experts: it learns; --dp, --zero and --ep give one device's losses (f32)") {
  const GptTrainConfig base = moe_run(12);
  const GptResult one = train_gpt(base);
  REQUIRE(one.losses.size() == 12);
  CHECK(one.losses.back() < one.losses.front() - 0.5);
  // Both blocks routed every step: 8 experts' counts summing to k x tokens.
  REQUIRE(one.moe_stats.size() == 2);
  for (const nn::MoeLayerStats& s : one.moe_stats) {
    CHECK(s.counts.size() == 8);
    int64_t total = 0;
    for (int64_t n : s.counts) total += n;
    CHECK(total == 2 * base.batch * base.context);
    CHECK(s.tokens == base.batch * base.context);
    CHECK(s.dropped == 0);
  }
  CHECK(one.moe_loss > 0.02);  // two blocks' balancing losses of alpha 0.01, and the z-losses
  struct Layout {
    const char* name;
    int64_t dp, zero, ep, accum, pp, microbatches;
  };
  int ran = 0;
  for (const Layout& l : {Layout{"dp 2", 2, 0, 1, 1, 1, 1}, Layout{"dp 2 ep 2", 2, 0, 2, 1, 1, 1},
                          Layout{"dp 4 ep 2 ZeRO 2", 4, 2, 2, 1, 1, 1}, Layout{"dp 4 ep 4 ZeRO 3", 4, 3, 4, 1, 1, 1},
                          Layout{"accum 2 (routing pass)", 1, 0, 1, 2, 1, 1},
                          Layout{"dp 2 ep 2 accum 2 ZeRO 1", 2, 1, 2, 2, 1, 1},
                          Layout{"pp 2, 2 micro-batches (stats over both stages)", 1, 0, 1, 1, 2, 2}}) {
    CAPTURE(l.name);
    GptTrainConfig c = base;
    c.dp = l.dp;
    c.zero = l.zero;
    c.ep = l.ep;
    c.accum = l.accum;
    c.pp = l.pp;
    c.microbatches = l.microbatches;
    const GptResult r = train_gpt(c);
    // f32 sums in another order: the dp suites' 1e-5 on the loss curve.
    CHECK(worst_relative(r.losses, one.losses) <= 1e-5);
    REQUIRE(r.moe_stats.size() == 2);
    for (size_t b = 0; b < 2; ++b) CHECK(r.moe_stats[b].counts == one.moe_stats[b].counts);
    CHECK(std::abs(r.moe_loss - one.moe_loss) <= 1e-6);
    ++ran;
  }
  CHECK(ran == 7);
}

// A capacity factor with groups of the batch: each rank's micro-batch takes its share of
// them, so the same tokens drop as on one device, on every layout.
TEST_CASE("--experts --capacity_factor: dp, accumulation and pipeline micro-batches drop as one device") {
  GptTrainConfig base = moe_run(6);
  base.capacity_factor = 1.0;
  base.moe_groups = 4;
  base.drop_policy = "score";
  const GptResult one = train_gpt(base);
  REQUIRE(one.moe_stats.size() == 2);
  CHECK(one.moe_stats[0].dropped + one.moe_stats[1].dropped > 0);
  struct Layout {
    const char* name;
    int64_t dp, accum, pp, microbatches;
  };
  int ran = 0;
  for (const Layout& l : {Layout{"dp 2", 2, 1, 1, 1}, Layout{"dp 2 accum 2", 2, 2, 1, 1},
                          Layout{"pp 2 x dp 2, 2 micro-batches", 2, 1, 2, 2}}) {
    CAPTURE(l.name);
    GptTrainConfig c = base;
    c.dp = l.dp;
    c.accum = l.accum;
    c.pp = l.pp;
    c.microbatches = l.microbatches;
    const GptResult r = train_gpt(c);
    CHECK(worst_relative(r.losses, one.losses) <= 1e-5);
    REQUIRE(r.moe_stats.size() == 2);
    for (size_t b = 0; b < 2; ++b) {
      CHECK(r.moe_stats[b].counts == one.moe_stats[b].counts);
      CHECK(r.moe_stats[b].dropped == one.moe_stats[b].dropped);
    }
    ++ran;
  }
  CHECK(ran == 3);
  // --check in f64 on a pipeline with micro-batches and a capacity.
  GptTrainConfig c = base;
  c.steps = 2;
  c.context = 16;
  c.check = true;
  c.pp = 2;
  c.dp = 2;
  c.microbatches = 2;
  const GptResult r = train_gpt(c);
  CHECK_MESSAGE(r.check_ok, r.check_report);
}

// The equivalence checker (models/gpt/check.h) runs the layout beside one device in f64 and
// compares every layer output, gradient and parameter each step: the experts compose with
// tensor, pipeline and sequence parallelism, ZeRO, expert parallelism, recomputation, and
// several micro-batches and accumulation runs (a forward-only routing pass gives each
// micro-batch's balancing loss the whole step's counts, as one device's).
TEST_CASE("--experts on --tp, --pp, --sp, --dp, --ep, ZeRO and recomputation: --check equals one device (f64)") {
  struct Layout {
    const char* name;
    std::function<void(GptTrainConfig&)> set;
  };
  const std::vector<Layout> layouts = {
      {"tp 2", [](auto& c) { c.tp = 2; }},
      {"pp 2 x dp 2, ep 2, ZeRO 2", [](auto& c) { c.pp = 2, c.dp = 2, c.ep = 2, c.zero = 2; }},
      {"dp 2 x tp 2 + sp, ep 2, ZeRO 3", [](auto& c) { c.dp = 2, c.tp = 2, c.sp = true, c.ep = 2, c.zero = 3; }},
      {"pp 2 x tp 2, full recomputation", [](auto& c) { c.pp = 2, c.tp = 2, c.recompute = "full"; }},
      {"pp 2 x dp 2, 2 micro-batches x accum 2, ep 2",
       [](auto& c) { c.pp = 2, c.dp = 2, c.microbatches = 2, c.accum = 2, c.ep = 2; }},
      {"pp 2 interleaved, 4 layers, 2 micro-batches",
       [](auto& c) { c.pp = 2, c.layers = 4, c.schedule = "interleaved", c.chunks = 2, c.microbatches = 2; }},
      // 8 ranks.
      {"pp 2 x dp 2 x tp 2, ep 2, ZeRO 1", [](auto& c) { c.pp = 2, c.dp = 2, c.tp = 2, c.ep = 2, c.zero = 1; }},
      {"dp 8 x ep 8, ZeRO 3", [](auto& c) { c.dp = 8, c.ep = 8, c.zero = 3; }},
      // The selection bias (a buffer every stage reads in place) moved from the counts.
      {"pp 2 x dp 2 x tp 2, ep 2, selection bias",
       [](auto& c) { c.pp = 2, c.dp = 2, c.tp = 2, c.ep = 2, c.moe_bias_rate = 0.05, c.aux_loss = 0; }},
  };
  int ran = 0;
  for (const Layout& l : layouts) {
    CAPTURE(l.name);
    GptTrainConfig c = moe_run(3);
    c.check = true;
    c.context = 16;
    l.set(c);
    const GptResult r = train_gpt(c);
    CHECK_MESSAGE(r.check_ok, r.check_report);
    ++ran;
  }
  CHECK(ran == 9);
}

TEST_CASE("--experts: a capacity factor drops tokens; the metrics file logs each expert's load") {
  const std::string metrics = temp_dir() + "/gpt_moe_metrics.jsonl";
  std::filesystem::remove(metrics);
  GptTrainConfig c = moe_run(4);
  c.capacity_factor = 0.5;  // half the mean load: every step drops
  c.moe_groups = 2;
  c.drop_policy = "score";
  c.log_every = 2;
  c.metrics = metrics;
  const GptResult r = train_gpt(c);
  REQUIRE(r.moe_stats.size() == 2);
  // Capacity per group and expert ceil(128 x 2 x 0.5 / 8) = 16: at most 2 x 8 x 16 kept.
  for (const nn::MoeLayerStats& s : r.moe_stats) CHECK(s.dropped >= 2 * 256 - 2 * 8 * 16);
  std::ifstream in(metrics);
  std::string line;
  int with_moe = 0;
  while (std::getline(in, line)) {
    const nlohmann::json rec = nlohmann::json::parse(line);
    if (!rec.contains("moe")) continue;
    ++with_moe;
    REQUIRE(rec["moe"].size() == 2);
    CHECK(rec["moe"][0]["layer"] == "h.0");
    CHECK(rec["moe"][1]["counts"].size() == 8);
    CHECK(rec["moe"][0]["dropped"].get<int64_t>() > 0);
  }
  CHECK(with_moe == 2);  // steps 2 and 4
}

// The bias lives in every layout: one device, data and expert parallelism (each rank its
// copy, moved by the same global counts), and the pipeline / tensor-parallel stages (read in
// place); a split run resumes bitwise from its own checkpoint, plain or sharded, and every
// layout follows one device's losses (f32 sums in another order: 1e-5).
TEST_CASE("--experts with --moe_bias_rate: the selection bias moves and resumes bitwise on every layout") {
  const std::string dir = temp_dir() + "/gpt_moe_resume";
  std::filesystem::create_directories(dir);
  GptTrainConfig base = moe_run(10);
  base.moe_bias_rate = 0.01;
  base.aux_loss = 0;  // balanced by the bias alone (DeepSeek-V3)
  const GptResult one = train_gpt(base);
  // Without the bias (and without the balancing loss) the run differs: the bias acted.
  GptTrainConfig off = moe_run(10);
  off.aux_loss = 0;
  CHECK(train_gpt(off).losses != one.losses);
  struct Layout {
    const char* name;
    int64_t dp, ep, pp, tp, zero;
    bool sharded;
  };
  int ran = 0;
  for (const Layout& l : {Layout{"one device", 1, 1, 1, 1, 0, false},
                          Layout{"dp 2 ep 2 ZeRO 1, sharded", 2, 2, 1, 1, 1, true},
                          Layout{"pp 2 x tp 2", 1, 1, 2, 2, 0, false},
                          Layout{"pp 2 x dp 2 ep 2 ZeRO 2, sharded", 2, 2, 2, 1, 2, true}}) {
    CAPTURE(l.name);
    GptTrainConfig c = base;
    c.dp = l.dp, c.ep = l.ep, c.pp = l.pp, c.tp = l.tp, c.zero = l.zero;
    c.save_sharded = l.sharded;
    const std::string tag = fmt::format("{}", ran);
    c.save = dir + "/straight" + tag + (l.sharded ? "" : ".safetensors");
    const GptResult straight = train_gpt(c);
    CHECK(worst_relative(straight.losses, one.losses) <= 1e-5);
    c.max_steps = 5;
    c.save = dir + "/split" + tag + (l.sharded ? "" : ".safetensors");
    train_gpt(c);
    c.max_steps = 0;
    c.resume = c.save;
    const GptResult second = train_gpt(c);
    REQUIRE(second.losses.size() == 5);
    for (size_t i = 0; i < 5; ++i) CHECK(second.losses[i] == straight.losses[5 + i]);
    CHECK(second.val_loss == straight.val_loss);
    ++ran;
  }
  CHECK(ran == 4);
}

// With --ep each rank keeps E / ep experts (ZeRO's memory report counts them), and the
// checkpoints hold them whole in the single-device layout: a run saved under one ep resumes
// bitwise under the same, and under another ep or one device as that layout's own run does
// (f32 sums in another order: 1e-5); validation and the sample run through the exchange.
TEST_CASE("--experts --ep: each rank keeps its experts; checkpoints are whole and resume across layouts") {
  const std::string dir = temp_dir() + "/gpt_moe_ep_resume";
  std::filesystem::create_directories(dir);
  GptTrainConfig c = moe_run(8);
  c.dp = 4;
  c.ep = 2;
  c.zero = 2;
  c.val_every = 4;
  c.sample_length = 16;
  const GptResult straight = train_gpt(c);
  CHECK(straight.sample_error.empty());
  CHECK(straight.sample.size() == 16);
  // 2 blocks of 8 experts [32 x 128] + [128] + [128 x 32] + [32], 4 of them on each rank,
  // sharded over the 2 ranks holding them.
  const int64_t experts_here = 2 * 4 * (32 * 128 + 128 + 128 * 32 + 32);
  CHECK_MESSAGE(contains(straight.memory_report, fmt::format("{} of them over 2 ranks", experts_here)),
                straight.memory_report);
  int resumed = 0;
  for (const bool sharded : {false, true}) {
    CAPTURE(sharded);
    GptTrainConfig first = c;
    first.max_steps = 4;
    first.save_sharded = sharded;
    first.save = dir + (sharded ? "/ep2_sharded" : "/ep2.safetensors");
    train_gpt(first);
    GptTrainConfig same = c;
    same.resume = first.save;
    const GptResult again = train_gpt(same);
    REQUIRE(again.losses.size() == 4);
    for (size_t i = 0; i < 4; ++i) CHECK(again.losses[i] == straight.losses[4 + i]);
    CHECK(again.val_loss == straight.val_loss);
    ++resumed;
    struct Other {
      const char* name;
      int64_t dp, ep, zero;
    };
    for (const Other& o : {Other{"dp 4 ep 4 ZeRO 3", 4, 4, 3}, Other{"dp 2 ep 1 ZeRO 1", 2, 1, 1},
                           Other{"one device", 1, 1, 0}}) {
      CAPTURE(o.name);
      GptTrainConfig other = c;
      other.dp = o.dp;
      other.ep = o.ep;
      other.zero = o.zero;
      other.sample_length = 0;
      other.resume = first.save;
      const GptResult r = train_gpt(other);
      REQUIRE(r.losses.size() == 4);
      CHECK(worst_relative(r.losses, {straight.losses.begin() + 4, straight.losses.end()}) <= 1e-5);
      ++resumed;
    }
  }
  CHECK(resumed == 2 * 4);
}

// Expert tensor parallelism: with --tp each rank holds its slice of every expert's hidden
// units (fc [E, C, H] by H, its bias by H, proj [E, H, C] by H), as the dense layers are
// split; the router and the experts' output bias stay whole. Rank 0's AdamW state (8 bytes
// per element it holds) counts them exactly; --check above proves the numbers.
TEST_CASE("--experts --tp: each tp rank holds its slice of every expert") {
  GptTrainConfig c = moe_run(2);
  c.tp = 2;
  Gpt model(c.model_config());
  int64_t here = 0, split = 0;
  for (const auto& [name, t] : model.named_parameters()) {
    const bool by_tp = name.ends_with("mlp.fc_weight") || name.ends_with("mlp.fc_bias") ||
                       name.ends_with("mlp.proj_weight") || name.ends_with("attn.c_attn.weight") ||
                       name.ends_with("attn.c_attn.bias") || name.ends_with("attn.c_proj.weight") ||
                       name == "wte.weight";
    here += by_tp ? t.numel() / 2 : t.numel();
    split += by_tp && name.find("mlp.") != std::string::npos ? 1 : 0;
  }
  CHECK(split == 2 * 3);  // both blocks' three expert tensors
  const GptResult r = train_gpt(c);
  CHECK(r.optimizer_state_bytes == 8 * here);
}

TEST_CASE("--experts: bad flags are refused, naming them") {
  const auto refused = [](const std::function<void(GptTrainConfig&)>& set, const char* what) {
    GptTrainConfig c = moe_run(2);
    set(c);
    const std::string e = error_of([&] { train_gpt(c); });
    CHECK_MESSAGE(contains(e, what), e);
  };
  refused([](auto& c) { c.moe_top_k = 9; }, "--moe_top_k 9 must be at most --experts 8");
  refused([](auto& c) { c.ep = 3; }, "--ep 3 must divide --experts 8");
  refused([](auto& c) { c.ep = 2; }, "--ep 2 splits the experts over groups of dp ranks");
  refused([](auto& c) { c.experts = 0, c.ep = 2; }, "needs --experts > 0");
  refused([](auto& c) { c.dp = 2, c.ep = 2, c.optimizer = "adamw8bit"; },
          "--optimizer=adamw8bit keeps per-row or per-block state");
  refused([](auto& c) { c.pp = 2, c.optimizer = "adafactor"; },
          "--experts with adafactor runs on one device (got --dp 1 --zero 0 --pp 2 --tp 1)");
  refused([](auto& c) { c.dp = 2, c.ep = 2, c.compress.name = "powersgd"; },
          "--compress=powersgd reduces over the whole data-parallel group");
  refused([](auto& c) { c.moe_every = 3; }, "--moe_every 3 leaves no Mixture-of-Experts block");
  refused([](auto& c) { c.drop_policy = "random"; }, "drop_policy");
  refused([](auto& c) { c.capacity_factor = -1; }, "capacity_factor");
  refused([](auto& c) { c.capacity_factor = 1, c.moe_groups = 3, c.dp = 2; },
          "--moe_groups 3 capacity groups must divide among the batch's 2 forwards");
  refused([](auto& c) { c.capacity_factor = 1, c.moe_groups = 2, c.dp = 2, c.microbatches = 2, c.check = true; },
          "--moe_groups 2 capacity groups must divide among the batch's 4 forwards");
  refused([](auto& c) { c.moe_score = "relu"; }, "moe_score");
}

}  // namespace
}  // namespace tessera::gpt
