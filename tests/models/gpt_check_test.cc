// The equivalence checker (`gpt --check`, models/gpt/check.h): a layout and one device side by
// side in f64, every layer output, the loss, every gradient and every parameter compared at
// each step. It raises no false alarm on correct layouts (each comparison counted exactly),
// and names each injected bug: the step, the phase, the tensor and who computed it.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "models/gpt/model.h"
#include "models/gpt/train.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

using testing::contains;
using testing::error_of;

GptTrainConfig tiny_check() {
  GptTrainConfig c;
  c.layers = 2;
  c.heads = 2;
  c.width = 16;
  c.context = 16;
  c.batch = 8;
  c.steps = 2;
  c.lr = 1e-2;
  c.warmup = 0;
  c.check = true;
  c.verbose = false;
  c.threads = 1;
  return c;
}

// Per step: the layer outputs (embed, each block, head), the loss, then each parameter's
// gradient and its updated value.
int64_t comparisons(const GptTrainConfig& c) {
  const int64_t params = static_cast<int64_t>(Gpt(c.model_config()).named_parameters().size());
  return c.steps * ((c.layers + 2) + 1 + 2 * params);
}

TEST_CASE("--check: correct layouts equal one device at every tensor of every step") {
  struct L {
    int pp, dp, tp, zero, accum, microbatches;
    bool sp;
    const char* schedule;
    const char* recompute;
    double dropout;
  };
  for (const L& l : {L{2, 2, 1, 1, 1, 2, false, "1f1b", "none", 0.0},
                     L{1, 2, 2, 3, 2, 1, true, "1f1b", "selective", 0.1},
                     L{2, 1, 2, 2, 2, 2, false, "interleaved", "full", 0.1},
                     L{1, 4, 1, 0, 1, 1, false, "1f1b", "none", 0.1}}) {
    GptTrainConfig c = tiny_check();
    c.pp = l.pp;
    c.dp = l.dp;
    c.tp = l.tp;
    c.zero = l.zero;
    c.accum = l.accum;
    c.microbatches = l.microbatches;
    c.sp = l.sp;
    c.schedule = l.schedule;
    c.chunks = std::string(l.schedule) == "interleaved" ? 2 : 1;
    c.recompute = l.recompute;
    c.dropout = l.dropout;
    const GptResult r = train_gpt(c);
    MESSAGE(r.check_report);
    CHECK(r.check_ok);
    CHECK(r.steps == c.steps);
    CHECK(contains(r.check_report, fmt::format("{} tensors compared", comparisons(c))));
  }
}

TEST_CASE("--check --optimizer=adamw8bit: ZeRO's block shards on pp x dp equal one device") {
  // Width 64: the blocks' c_attn and MLP weights (>= 4096 elements) hold 8-bit state, the
  // rest f32. The checker's single-device side runs the same optimizer; in f64 the layouts'
  // gradients differ by rounding only, too little to move a code across a threshold.
  struct L {
    int pp, dp, zero, accum, microbatches;
    const char* recompute;
    double dropout;
  };
  for (const L& l : {L{2, 2, 3, 2, 2, "selective", 0.1}, L{1, 4, 1, 1, 1, "none", 0.0},
                     L{2, 1, 0, 1, 2, "full", 0.0}}) {
    GptTrainConfig c = tiny_check();
    c.width = 64;
    c.optimizer = "adamw8bit";
    c.pp = l.pp;
    c.dp = l.dp;
    c.zero = l.zero;
    c.accum = l.accum;
    c.microbatches = l.microbatches;
    c.recompute = l.recompute;
    c.dropout = l.dropout;
    int64_t eight_bit = 0;
    for (const auto& entry : Gpt(c.model_config()).named_parameters()) {
      eight_bit += entry.second.numel() >= 4096;
    }
    // wte, and each block's c_attn, attn.c_proj, c_fc and mlp.c_proj.
    CHECK(eight_bit == 4 * c.layers + 1);
    const GptResult r = train_gpt(c);
    MESSAGE(r.check_report);
    CHECK(r.check_ok);
    CHECK(contains(r.check_report, fmt::format("{} tensors compared", comparisons(c))));
  }
}

// Adafactor's layouts at the default tolerance 1e-9: the first mismatch is the attention key
// bias (c_attn's bias, elements [C, 2C) of the gathered [3C]) at step 0's update, so every
// tensor compared before it agrees to 1e-9 (see the Adafactor case below for why that bias
// differs).
void check_key_bias_first(GptTrainConfig c) {
  c.check_tolerance = 1e-9;
  const GptResult tight = train_gpt(c);
  CHECK_FALSE(tight.check_ok);
  CHECK(contains(tight.check_report, "mismatch at step 0, update: h.0.attn.c_attn.bias"));
  const size_t at = tight.check_report.find("at element [");
  REQUIRE(at != std::string::npos);
  const int64_t element = std::stoll(tight.check_report.substr(at + 12));
  CHECK(element >= c.width);
  CHECK(element < 2 * c.width);
}

TEST_CASE("--check --optimizer=adamw8bit on tp: shards of whole blocks, and shards that cut blocks, equal one device") {
  // A tp shard holds runs of consecutive elements of the whole parameter: a column-parallel
  // weight rows / tp x columns, a row-parallel one columns / tp. At width 512 on tp 2 every
  // run of an 8-bit tensor is a multiple of 256 (attn.c_proj: 256; mlp.c_proj: 1024;
  // c_attn and c_fc longer), so each shard's blocks are the whole's and the fused step runs
  // on them unchanged. At width 128 attn.c_proj's runs are 64 on tp 2 (32 on tp 4), at width
  // 64 32: its blocks lie on both tp ranks (and, under ZeRO, on several dp ranks), so its
  // step takes two passes around a max all-reduce of the blocks' scales. Its 8-bit moments
  // differ from f32 ones by ~1e-3 relative, so equality at 1e-9 says the step is 8-bit.
  struct L {
    int width, pp, dp, tp, zero, microbatches;
    const char* recompute;
  };
  int layouts = 0;
  for (const L& l : {L{512, 1, 2, 2, 2, 1, "none"}, L{512, 2, 1, 2, 0, 2, "full"},
                     L{128, 1, 2, 2, 2, 1, "none"}, L{128, 1, 2, 2, 3, 1, "none"},
                     L{128, 2, 1, 2, 1, 2, "selective"}, L{128, 1, 1, 4, 0, 1, "none"},
                     L{64, 1, 1, 2, 0, 1, "none"}}) {
    GptTrainConfig c = tiny_check();
    c.width = l.width;
    c.heads = 4;
    c.optimizer = "adamw8bit";
    c.pp = l.pp;
    c.dp = l.dp;
    c.tp = l.tp;
    c.zero = l.zero;
    c.microbatches = l.microbatches;
    c.recompute = l.recompute;
    CAPTURE(l.width);
    CAPTURE(l.pp);
    CAPTURE(l.dp);
    CAPTURE(l.tp);
    CAPTURE(l.zero);
    const GptResult r = train_gpt(c);
    MESSAGE(r.check_report);
    CHECK(r.check_ok);
    CHECK(contains(r.check_report, fmt::format("{} tensors compared", comparisons(c))));
    ++layouts;
  }
  CHECK(layouts == 7);
  // --f32_state=attn.c_proj keeps that parameter's state in f32 on both sides.
  GptTrainConfig c = tiny_check();
  c.width = 128;
  c.heads = 4;
  c.optimizer = "adamw8bit";
  c.f32_state = "attn.c_proj";
  c.tp = c.dp = 2;
  c.zero = 2;
  const GptResult r = train_gpt(c);
  MESSAGE(r.check_report);
  CHECK(r.check_ok);
}

TEST_CASE("--check --optimizer=adafactor: ZeRO's row shards on pp x dp x tp equal one device") {
  // The stages hold c_attn's weight as [3, C, C]; ZeRO's row shards present it to Adafactor
  // as the single device's [3C, C] (its row and column statistics span q, k and v), cut by
  // rows over dp; ZeRO 0 steps it whole. On tp a column-parallel weight is some of the rows
  // (the columns' statistics summed over tp), a row-parallel one some of the columns (the
  // rows' statistics summed over tp). With the first moment (beta1 0.9) in the state.
  //
  // Tolerance 1e-5, not 1e-9, for one tensor's sake: the attention key bias (c_attn's bias,
  // elements [C, 2C)) has an exact gradient of zero (softmax ignores a constant per query
  // row), so each layout's is its own f64 rounding noise (~1e-17), and Adafactor divides it
  // by sqrt(eps1) = 1e-15 (hf: u = g^2 + eps1): a step of ~1e-2 of the step size, different
  // per layout. Measured: 4.1e-6 relative on that bias after one step. So each layout is
  // also checked at 1e-9, where the first mismatch must be that bias's key part at step 0's
  // update: every layer output, the loss and every gradient of step 0 (compared before the
  // updates) agree to 1e-9. A misfactored c_attn weight ([3, C, C] per q/k/v instead of
  // [3C, C]) moves its update by O(1).
  struct L {
    int pp, dp, tp, zero, accum, microbatches;
    const char* recompute;
    double dropout;
    bool sp;
  };
  int layouts = 0;
  for (const L& l : {L{2, 2, 1, 3, 2, 2, "selective", 0.1, false},
                     L{1, 4, 1, 1, 1, 1, "none", 0.0, false}, L{2, 1, 1, 0, 1, 2, "full", 0.0, false},
                     L{2, 2, 1, 2, 1, 2, "none", 0.0, false}, L{1, 2, 2, 1, 1, 1, "none", 0.0, false},
                     L{2, 2, 2, 3, 2, 2, "selective", 0.1, false},
                     L{1, 1, 4, 0, 1, 1, "none", 0.0, false}, L{1, 1, 2, 0, 1, 1, "full", 0.0, true}}) {
    GptTrainConfig c = tiny_check();
    c.heads = 4;  // (tp 4 splits heads)
    c.optimizer = "adafactor";
    c.adafactor_beta1 = 0.9;
    c.pp = l.pp;
    c.dp = l.dp;
    c.tp = l.tp;
    c.sp = l.sp;
    c.zero = l.zero;
    c.accum = l.accum;
    c.microbatches = l.microbatches;
    c.recompute = l.recompute;
    c.dropout = l.dropout;
    c.check_tolerance = 1e-5;
    const GptResult r = train_gpt(c);
    MESSAGE(r.check_report);
    CHECK(r.check_ok);
    CHECK(contains(r.check_report, fmt::format("{} tensors compared", comparisons(c))));
    check_key_bias_first(c);
    ++layouts;
  }
  CHECK(layouts == 8);
}

TEST_CASE("--check --adafactor_mode=optax: taller-than-wide matrices factored columns first, on every layout") {
  // At width 128 optax factors wte [256, 128], c_attn [384, 128] and c_fc [512, 128]
  // columns first (the smaller dim's statistic is the normalised one); the row shards keep
  // the per-row statistic and sum the per-column one. Tolerance 1e-4 for the key bias (see
  // above: 3.9e-5 here); at 1e-9 the first mismatch is that bias at step 0's update, after
  // wte's and c_attn's weights, whose updates therefore agree to 1e-9.
  struct L {
    int pp, dp, tp, zero;
  };
  int layouts = 0;
  for (const L& l : {L{1, 2, 1, 2}, L{2, 1, 1, 0}, L{2, 2, 2, 3}}) {
    GptTrainConfig c = tiny_check();
    c.width = 128;
    c.heads = 4;
    c.optimizer = "adafactor";
    c.adafactor_mode = "optax";
    c.adafactor_beta1 = 0.9;
    c.pp = l.pp;
    c.dp = l.dp;
    c.tp = l.tp;
    c.zero = l.zero;
    c.check_tolerance = 1e-4;
    const GptResult r = train_gpt(c);
    MESSAGE(r.check_report);
    CHECK(r.check_ok);
    check_key_bias_first(c);
    ++layouts;
  }
  CHECK(layouts == 3);
}

TEST_CASE("--check --inject: each injected bug is named by step, phase, tensor and ranks") {
  struct Bug {
    const char* inject;
    int pp, dp, microbatches;
    double dropout;
    const char* expected;  // what the report must say
  };
  // skip_tied_allreduce: the first stage's embedding lacks the head's gradient.
  // grad_times_dp: every gradient is dp x too large (relative error dp - 1 = 1); the first
  // parameter, wte, is named. swap_microbatches: micro-batch 0 embeds micro-batch 1's tokens.
  // drop_dropout_offset: dp rank 1 draws rank 0's rows of the masks (rank 0's are right).
  const std::vector<Bug> bugs = {
      {"skip_tied_allreduce", 2, 1, 2, 0.0,
       "step 0, backward: gradient of wte.weight (held by pp rank 0, tied to the head on pp rank "
       "1)"},
      {"grad_times_dp", 1, 2, 1, 0.0,
       "step 0, backward: gradient of wte.weight (held by pp rank 0): max abs error"},
      {"swap_microbatches", 2, 1, 2, 0.0,
       ": micro-batch 0 of dp rank 0, accumulation run 0 (rows 0-3); pipeline stage 0 on pp rank "
       "0)"},
      {"drop_dropout_offset", 1, 2, 1, 0.1,
       ": micro-batch 0 of dp rank 1, accumulation run 0 (rows 4-7); pipeline stage 0 on pp rank "
       "0)"},
  };
  for (const Bug& b : bugs) {
    GptTrainConfig c = tiny_check();
    c.pp = b.pp;
    c.dp = b.dp;
    c.microbatches = b.microbatches;
    c.dropout = b.dropout;
    c.inject = b.inject;
    const GptResult r = train_gpt(c);
    MESSAGE(std::string(b.inject) << ": " << r.check_report);
    CAPTURE(r.check_report);
    CHECK_FALSE(r.check_ok);
    CHECK(contains(r.check_report, b.expected));
    if (std::string(b.inject) == "grad_times_dp") CHECK(contains(r.check_report, "max rel error 1 "));
    if (std::string(b.inject).find("dropout") != std::string::npos ||
        std::string(b.inject) == "swap_microbatches") {
      CHECK(contains(r.check_report, "step 0, forward: embed output (batch row "));
    }
    CHECK(contains(r.check_report, std::string("injected: ") + b.inject));
  }
  GptTrainConfig c = tiny_check();
  c.inject = "everything";
  CHECK(contains(error_of([&] { train_gpt(c); }), "--inject must be skip_tied_allreduce, grad_times_dp, swap_microbatches or drop_dropout_offset"));
  c = tiny_check();
  c.check = false;
  c.inject = "grad_times_dp";
  CHECK(contains(error_of([&] { train_gpt(c); }), "it needs --check"));
  c = tiny_check();
  c.precision = "bf16";
  CHECK(contains(error_of([&] { train_gpt(c); }), "the check runs in f64"));
}

}  // namespace
}  // namespace tessera::gpt
