// GPT training that fails cleanly (docs/RELIABILITY.md): every flag out of range is an Error
// naming it, a resume past the end is refused, a diverged run stops before it writes
// anything (or skips the diverged steps, --nonfinite=skip), and the memory predictor that
// refuses runs up front stays within 25% of the measured peak on every layout family.
// Signals, kills and MPI failures need whole processes: fault_injection_test.sh.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "models/common/checkpoint.h"
#include "models/gpt/run_checks.h"
#include "models/gpt/train.h"
#include "tensor/allocator.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

using testing::contains;
using testing::error_of;
using testing::temp_dir;

namespace fs = std::filesystem;

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

GptTrainConfig tiny() {
  GptTrainConfig c;
  c.layers = 1;
  c.heads = 2;
  c.width = 32;
  c.context = 16;
  c.batch = 8;
  c.steps = 6;
  c.lr = 1e-2;
  c.warmup = 0;
  c.val_every = 0;
  c.val_batches = 1;
  c.sample_length = 0;
  c.verbose = false;
  c.threads = 2;
  return c;
}

TEST_CASE("every flag out of range is an Error naming the flag, before any work") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::function<void(GptTrainConfig&)> set;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](auto& c) { c.layers = 0; }, "--layers must be >= 1, got 0"},
      {[](auto& c) { c.heads = -1; }, "--heads must be >= 1, got -1"},
      {[](auto& c) { c.width = 0; }, "--width must be >= 1, got 0"},
      {[](auto& c) { c.heads = 3; }, "--width 32 must be divisible by --heads 3"},
      {[](auto& c) { c.context = -5; }, "--context must be >= 1, got -5"},
      {[](auto& c) { c.vocab = 0; }, "--vocab must be >= 1, got 0"},
      {[](auto& c) { c.dropout = 1.0; }, "--dropout must be in [0, 1), got 1"},
      {[=](auto& c) { c.dropout = nan; }, "--dropout must be in [0, 1), got nan"},
      {[](auto& c) { c.batch = 0; }, "--batch must be >= 1, got 0"},
      {[](auto& c) { c.steps = 0; }, "--steps must be >= 1, got 0"},
      {[](auto& c) { c.max_steps = -1; }, "--max_steps must be >= 0, got -1"},
      {[](auto& c) { c.lr = 0; }, "--lr must be a finite number > 0, got 0"},
      {[=](auto& c) { c.lr = inf; }, "--lr must be a finite number > 0, got inf"},
      {[](auto& c) { c.min_lr_ratio = 1.5; }, "--min_lr_ratio must be in [0, 1], got 1.5"},
      {[](auto& c) { c.warmup = -1; }, "--warmup must be >= 0, got -1"},
      {[](auto& c) { c.weight_decay = -0.1; }, "--weight_decay must be a finite number >= 0"},
      {[](auto& c) { c.beta1 = 1.0; }, "--beta1 must be in [0, 1), got 1"},
      {[](auto& c) { c.beta2 = -0.5; }, "--beta2 must be in [0, 1), got -0.5"},
      {[=](auto& c) { c.clip = nan; }, "--clip must be a finite number >= 0 (0: no clipping), got nan"},
      {[](auto& c) { c.clip = -1; }, "--clip must be a finite number >= 0 (0: no clipping), got -1"},
      {[](auto& c) { c.precision = "f8"; }, "unknown --precision 'f8'"},
      {[](auto& c) { c.seed = -1; }, "--seed must be >= 0, got -1"},
      {[](auto& c) { c.val_every = -1; }, "--val_every must be >= 0, got -1"},
      {[](auto& c) { c.val_batches = -2; }, "--val_batches must be >= 0, got -2"},
      {[](auto& c) { c.log_every = 0; }, "--log_every must be >= 1, got 0"},
      {[](auto& c) { c.save_every = -1; }, "--save_every must be >= 0, got -1"},
      {[](auto& c) { c.save_every = 5; }, "--save_every 5 needs --save"},
      {[](auto& c) { c.sample_length = -1; }, "--sample must be >= 0, got -1"},
      {[](auto& c) { c.temperature = -1; }, "--temperature must be a finite number >= 0"},
      {[](auto& c) { c.top_k = -1; }, "--top_k must be >= 0, got -1"},
      {[](auto& c) { c.threads = -1; }, "--threads must be >= 0, got -1"},
      {[](auto& c) { c.device = "tpu"; }, "tpu"},
      {[](auto& c) { c.timing_skip = -1; }, "--timing_skip must be >= 0, got -1"},
      {[](auto& c) { c.nonfinite = "ignore"; }, "--nonfinite must be error or skip, got 'ignore'"},
      {[](auto& c) { c.comm_timeout = -1; }, "--comm_timeout must be a finite number of seconds"},
      {[](auto& c) { c.memory_limit = -1; }, "--memory_limit must be >= 0, got -1"},
      {[](auto& c) { c.dp = 0; }, "--dp must be >= 1, got 0"},
      {[](auto& c) { c.zero = 4; }, "--zero must be 0, 1, 2 or 3, got 4"},
      {[](auto& c) { c.accum = 0; }, "--accum must be >= 1, got 0"},
      {[](auto& c) { c.pp = 0; }, "--pp must be >= 1, got 0"},
      {[](auto& c) { c.tp = 0; }, "--tp must be >= 1, got 0"},
      {[](auto& c) { c.tp = -2; }, "--tp must be >= 1, got -2"},
      {[](auto& c) { c.microbatches = 0; }, "--microbatches must be >= 1, got 0"},
      {[](auto& c) { c.chunks = 0; }, "--chunks must be >= 1, got 0"},
      {[](auto& c) { c.schedule = "zb"; }, "--schedule must be gpipe, 1f1b or interleaved"},
      {[](auto& c) { c.sp = true; }, "--sp splits the sequence"},
      {[](auto& c) { c.batch = int64_t{1} << 40, c.context = int64_t{1} << 40; },
       "--batch 1099511627776 x --context 1099511627776 tokens overflow int64"},
      {[](auto& c) { c.vocab = int64_t{1} << 62; }, "parameter count"},
      {[](auto& c) { c.width = int64_t{1} << 62, c.heads = 1; }, "parameter count"},
      {[](auto& c) { c.batch = 1000000; }, "this run needs about"},
      {[](auto& c) { c.memory_limit = 1 << 10; }, "more than the --memory_limit of 1.0 KiB"},
      {[](auto& c) { c.save = temp_dir() + "/"; }, "/ names a directory"},
      {[](auto& c) { c.save = "/nonexistent/d/x.safetensors"; },
       "--save=/nonexistent/d/x.safetensors: directory '/nonexistent/d' does not exist"},
      {[](auto& c) { c.metrics = "/nonexistent/m.jsonl"; }, "directory '/nonexistent' does not exist"},
  };
  CHECK(cases.size() == 54);
  for (size_t i = 0; i < cases.size(); ++i) {
    GptTrainConfig c = tiny();
    c.data = temp_dir() + "/no_such_corpus";  // never reached: the checks come first
    cases[i].set(c);
    CAPTURE(i);
    const std::string msg = error_of([&] { train_gpt(c); });
    CHECK_MESSAGE(contains(msg, cases[i].message), msg);
    CHECK_MESSAGE(!contains(msg, "no_such_corpus"), msg);
  }
}

TEST_CASE("a resume at or past the end is refused instead of training 0 steps") {
  const std::string path = temp_dir() + "/gpt_done.safetensors";
  GptTrainConfig c = tiny();
  c.save = path;
  train_gpt(c);
  c.save = "";
  c.resume = path;
  CHECK(contains(error_of([&] { train_gpt(c); }),
                 "--resume=" + path + " is at step 6, at or past the end of this run (--steps 6"));
  c.steps = 10;
  c.max_steps = 6;
  CHECK(contains(error_of([&] { train_gpt(c); }), "--max_steps 6): nothing to train"));
  c.max_steps = 8;
  CHECK(train_gpt(c).steps == 8);
}

TEST_CASE("a diverged run stops before writing anything; the checkpoint on disk stays") {
  const std::string path = temp_dir() + "/gpt_good.safetensors";
  for (const std::string& p : {path, models::state_path(path), models::previous_path(path),
                               models::state_path(models::previous_path(path))}) {
    fs::remove(p);  // a run outside Bazel shares /tmp with earlier runs
  }
  GptTrainConfig c = tiny();
  c.save = path;
  c.max_steps = 3;
  train_gpt(c);
  const std::string model = bytes_of(path), state = bytes_of(models::state_path(path));
  // --lr=1e30 --resume=P --save=P: the first step's update blows the weights up, the next
  // step's loss is not finite, and the run ends there with an Error, P untouched.
  c.lr = 1e30;
  c.max_steps = 0;
  c.resume = path;
  const std::string msg = error_of([&] { train_gpt(c); });
  CHECK(contains(msg, "gpt: the loss is "));
  CHECK(contains(msg, "at step 5 (the run diverged); stopped before saving anything more: " +
                          path + " holds the last good checkpoint"));
  CHECK(bytes_of(path) == model);
  CHECK(bytes_of(models::state_path(path)) == state);
  CHECK(!fs::exists(models::previous_path(path)));
}

TEST_CASE("--nonfinite=skip drops exactly the diverged steps, on one rank, under ZeRO and 3-D") {
  for (const auto& layout : {std::tuple{1, 1, 1}, std::tuple{1, 2, 1}, std::tuple{2, 1, 2}}) {
    GptTrainConfig c = tiny();
    std::tie(c.pp, c.dp, c.tp) = layout;
    CAPTURE(c.pp);
    CAPTURE(c.dp);
    CAPTURE(c.tp);
    c.lr = 1e30;  // step 1 updates the weights to ~1e30; every later loss overflows
    c.nonfinite = "skip";
    c.zero = c.dp > 1 ? 2 : 0;
    c.save = temp_dir() + fmt::format("/gpt_skip_{}_{}_{}.safetensors", c.pp, c.dp, c.tp);
    const GptResult r = train_gpt(c);
    REQUIRE(r.losses.size() == 6);
    CHECK(std::isfinite(r.losses[0]));
    int nonfinite = 0;
    for (double l : r.losses) nonfinite += std::isfinite(l) ? 0 : 1;
    CHECK(nonfinite == 5);
    CHECK(r.nonfinite_skipped == 5);
    CHECK(r.steps == 6);
    // Skipped steps leave the weights as step 1 left them: finite, so they were saved.
    CHECK(fs::exists(c.save));
  }
}

TEST_CASE("the memory prediction is within 25% of the measured peak on every layout family") {
  struct Layout {
    const char* name;
    std::function<void(GptTrainConfig&)> set;
  };
  const std::vector<Layout> layouts = {
      {"one rank", [](auto&) {}},
      {"attention-heavy", [](auto& c) { c.width = 128, c.heads = 8, c.context = 128; }},
      {"large vocabulary", [](auto& c) { c.synthetic_data = true, c.vocab = 4096; }},
      {"dropout", [](auto& c) { c.dropout = 0.1; }},
      {"dropout, recompute selective", [](auto& c) { c.dropout = 0.1, c.recompute = "selective"; }},
      {"dropout, recompute full", [](auto& c) { c.dropout = 0.1, c.recompute = "full"; }},
      {"dp 2", [](auto& c) { c.dp = 2; }},
      {"dp 2 ZeRO 1 accum 2", [](auto& c) { c.dp = 2, c.zero = 1, c.accum = 2; }},
      {"dp 2 ZeRO 3", [](auto& c) { c.dp = 2, c.zero = 3; }},
      {"pp 2 1f1b", [](auto& c) { c.layers = 2, c.pp = 2, c.microbatches = 4; }},
      {"pp 2 gpipe", [](auto& c) { c.layers = 2, c.pp = 2, c.microbatches = 4, c.schedule = "gpipe"; }},
      {"tp 2", [](auto& c) { c.tp = 2; }},
      {"experts 4 top-2", [](auto& c) { c.experts = 4, c.moe_every = 1; }},
      {"experts 4 over dp 2 ep 2", [](auto& c) { c.experts = 4, c.moe_every = 1, c.dp = 2, c.ep = 2; }},
  };
  CHECK(layouts.size() == 14);
  for (const Layout& l : layouts) {
    GptTrainConfig c = tiny();
    c.layers = 2;
    c.width = 64;
    c.heads = 4;
    c.context = 64;
    c.batch = 16;
    c.steps = 2;
    l.set(c);
    const GptResult r = train_gpt(c);
    const double ratio = r.predicted_bytes / static_cast<double>(r.peak_host_bytes);
    const std::string name = l.name;
    CAPTURE(name);
    CAPTURE(r.predicted_bytes);
    CAPTURE(r.peak_host_bytes);
    CHECK(r.peak_host_bytes > 0);
    CHECK(ratio > 0.75);
    CHECK(ratio < 1.25);
    // And the refusal uses it: a --memory_limit below the prediction (for every rank of
    // the process together) stops the run before it starts.
    c.memory_limit = static_cast<int64_t>(r.predicted_bytes * 0.75);
    CHECK(contains(error_of([&] { train_gpt(c); }), "more than the --memory_limit"));
  }
}

TEST_CASE("--memory_limit caps the CPU allocator for the run and lifts the cap after") {
  GptTrainConfig c = tiny();
  const GptResult r = train_gpt(c);
  // Room to spare: the same run, bit for bit, under a cap (the cap's Error past it is
  // //tests/tensor:error_test's "allocator budget" case).
  c.memory_limit = static_cast<int64_t>(r.predicted_bytes * 3);
  const GptResult capped = train_gpt(c);
  CHECK(capped.losses == r.losses);
  CHECK(allocator_for(kCPU).limit() == 0);
}

}  // namespace
}  // namespace tessera::gpt
