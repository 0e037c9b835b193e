// 8-bit AdamW under ZeRO stages 1-3 on block shards (ZeroOptions::block_shards = 256): each
// rank updates whole quantization blocks of every parameter, so the step is the one every
// rank would take on whole tensors. On dp {2, 4}, in f32 the parameters, losses and the
// gathered optimizer state (codes and scales, in the single-device layout) are bitwise those
// of the same data-parallel run without sharding (stage 0: the same reduced gradients, so the
// same arithmetic); in f64 every stage is within 1e-10 of one device. (In f32 one device's
// gradients round differently from the data-parallel reduction's, and a value that lands on
// the other side of a code threshold moves a moment by a whole map step: measured, the f32
// parameters then differ from one device's by ~1e-3 relative after 20 steps, which is the
// quantization's own noise, not an error of the sharding. In f64 the gradients differ by
// ~1e-16 and no code flips.) The step issues no all-reduce, and one all-gather per parameter
// (stages 1-2), counted from the comm log. Checkpoints gather to the single-device layout
// and resume bitwise under another stage, and load on other dp sizes and on one device.
// Tensor-parallel shards that cut blocks (RowShards built here, with and without ZeRO's
// block shards on top) step in two passes around a max all-reduce, bitwise one device.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "optim/adamw8bit.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/placement.h"
#include "parallel/zero.h"
#include "tests/parallel/dp_harness.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using namespace testing_dp;

struct Result {
  Run run;
  Checkpoint ckpt;
  int64_t all_reduces = 0, param_gathers = 0;
};

std::vector<Result> on_threads(const Task& task, int dp, int stage, const Checkpoint* load = nullptr,
                               int64_t start = 0, int64_t stop = kSteps, DType dtype = DType::f32) {
  std::vector<Result> out(dp);
  run_threads(dp, [&](CommPtr world) {
    Result& r = out[world->rank()];
    CommLog log;
    r.run = train_zero(*world, task, dtype,
                       {.stage = stage, .start = start, .stop = stop, .load = load,
                        .save = &r.ckpt, .opt = Opt::adamw8bit, .step_log = &log});
    for (const CommRecord& c : log.records) {
      r.all_reduces += c.op == "all_reduce";
      r.param_gathers += c.cause == "zero all_gather parameters";
    }
  });
  return out;
}

bool same_state(const Checkpoint& a, const Checkpoint& b) {
  if (a.optimizer.size() != b.optimizer.size()) return false;
  for (const auto& [k, v] : a.optimizer) {
    auto it = b.optimizer.find(k);
    if (it == b.optimizer.end() || it->second.dtype() != v.dtype() || it->second.shape() != v.shape() ||
        cast(it->second, DType::f64).to_vector<double>() != cast(v, DType::f64).to_vector<double>()) {
      MESSAGE("optimizer state differs at " << k);
      return false;
    }
  }
  return true;
}

TEST_CASE("AdamW8bit on ZeRO 1-3 block shards equals unsharded data parallelism bitwise") {
  const Task task = mlp_task();
  const int64_t params = 4;  // the MLP's two weights and two biases
  int runs = 0;
  for (int dp : {2, 4}) {
    const std::vector<Result> base = on_threads(task, dp, 0);
    CAPTURE(dp);
    // The 8-bit state in the single-device layout: u8 codes shaped like the weight.
    CHECK(base[0].ckpt.optimizer.at("state.0.exp_avg").dtype() == DType::u8);
    for (int stage : {1, 2, 3}) {
      CAPTURE(stage);
      const std::vector<Result> r = on_threads(task, dp, stage);
      for (int k = 0; k < dp; ++k) {
        CAPTURE(k);
        CHECK(r[k].run.losses == base[k].run.losses);
        CHECK(r[k].run.params == base[k].run.params);
        CHECK(same_state(r[k].ckpt, base[0].ckpt));
        // No all-reduce in the step: every block's scale is local. Stages 1-2 gather each
        // parameter's updated shards once per step.
        CHECK(r[k].all_reduces == 0);
        CHECK(r[k].param_gathers == (stage == 3 ? 0 : params * kSteps));
      }
      ++runs;
    }
  }
  CHECK(runs == 2 * 3);
}

TEST_CASE("AdamW8bit on ZeRO 0-3 x dp {2, 4} equals one device in f64 (1e-10)") {
  const Task task = mlp_task();
  const Run single = train_reference(task, DType::f64, Opt::adamw8bit);
  int runs = 0;
  for (int dp : {2, 4}) {
    for (int stage : {0, 1, 2, 3}) {
      CAPTURE(dp);
      CAPTURE(stage);
      const std::vector<Result> r = on_threads(task, dp, stage, nullptr, 0, kSteps, DType::f64);
      CHECK(r[0].ckpt.optimizer.at("state.0.exp_avg_absmax").dtype() == DType::f64);
      check_close(task, DType::f64, r[0].run, single,
                  fmt::format("8-bit AdamW, dp {} stage {} vs one device", dp, stage));
      ++runs;
    }
  }
  CHECK(runs == 2 * 4);
}

TEST_CASE("AdamW8bit block-shard checkpoints: single-device layout, bitwise resume, any layout") {
  const Task task = mlp_task();
  const int64_t half = kSteps / 2;
  const std::vector<Result> first = on_threads(task, 2, 2, nullptr, 0, half);
  const Checkpoint& ckpt = first[0].ckpt;
  // [256, 784]: codes like the weight, one scale per 256-element block.
  CHECK(ckpt.optimizer.at("state.0.exp_avg").shape() == Shape{256, 784});
  CHECK(ckpt.optimizer.at("state.0.exp_avg_absmax").shape() == Shape{784});
  CHECK(ckpt.optimizer.at("state.0.exp_avg_sq_absmax").dtype() == DType::f32);
  // Resumed under stages 1 and 3 (and 0) on dp 2: bitwise the uninterrupted dp 2 run.
  const std::vector<Result> whole = on_threads(task, 2, 2);
  for (int stage : {0, 1, 3}) {
    CAPTURE(stage);
    const std::vector<Result> r = on_threads(task, 2, stage, &ckpt, half, kSteps);
    CHECK(r[0].run.params == whole[0].run.params);
    CHECK(same_state(r[0].ckpt, whole[0].ckpt));
  }
  // Loaded on dp 4 and saved again at once: the same dict, bitwise.
  const std::vector<Result> moved = on_threads(task, 4, 3, &ckpt, half, half);
  CHECK(same_state(moved[0].ckpt, ckpt));
  // One device loads it too.
  std::shared_ptr<nn::Module> model = make_model(task, DType::f32);
  std::unique_ptr<optim::Optimizer> opt = make_optimizer(
      Opt::adamw8bit, optim::decay_groups(model->named_parameters(), task.lr, kWeightDecay), task.lr);
  model->load_state_dict(ckpt.model);
  opt->load_state_dict(ckpt.optimizer);
  const optim::Optimizer::StateDict again = opt->state_dict();
  for (const auto& entry : ckpt.optimizer) {
    const std::string& k = entry.first;  // (CAPTURE captures it: no structured binding)
    const Tensor& v = entry.second;
    CAPTURE(k);
    CHECK(cast(again.at(k), DType::f64).to_vector<double>() == cast(v, DType::f64).to_vector<double>());
  }
}

TEST_CASE("AdamW8bit's state per rank on block shards: 1/N of the blocks, bytes by the formula") {
  // Each rank holds whole blocks of every parameter (block_size's split of its blocks; the
  // short last block with its rank): for an 8-bit parameter 2 bytes per element it holds and
  // two f32 scales per block; for one under 4096 elements (f32 state) 8 bytes per element.
  // The ranks' sum is one device's.
  const Task task = mlp_task();
  for (int dp : {2, 4}) {
    CAPTURE(dp);
    std::vector<int64_t> bytes(dp), want(dp);
    int64_t single = 0;
    run_threads(dp, [&](CommPtr world) {
      std::shared_ptr<nn::Module> model = make_model(task, DType::f32);
      ZeroDataParallel zero(*model, *world, {.stage = 2, .block_shards = 256});
      optim::AdamW8bit opt(zero.param_groups(1e-3, 0.0));
      zero.zero_grad();
      zero.backward(task.loss(*model, DType::f32, 0, world->rank(), dp));
      zero.step(opt);
      const int r = world->rank();
      bytes[r] = opt.state_bytes();
      int64_t w = 0, one = 0;
      for (const auto& entry : model->named_parameters()) {
        const int64_t n = entry.second.numel(), blocks = (n + 255) / 256;
        const int64_t mine = block_size(blocks, dp, r);
        int64_t first = 0;
        for (int k = 0; k < r; ++k) first += block_size(blocks, dp, k);
        const int64_t elements = std::min(mine * 256, std::max<int64_t>(0, n - first * 256));
        if (n < 4096) {  // f32 state, on the same block split
          w += 8 * elements;
          one += 8 * n;
        } else {
          w += 2 * elements + 8 * mine;
          one += 2 * n + 8 * blocks;
        }
      }
      want[r] = w;
      if (r == 0) single = one;
    });
    int64_t total = 0;
    for (int r = 0; r < dp; ++r) {
      CAPTURE(r);
      CHECK(bytes[r] == want[r]);
      total += bytes[r];
    }
    CHECK(total == single);
  }
}

// ---- tensor-parallel shards that cut blocks ------------------------------------------------
// A parameter split over tp on dim `dim` (tp even parts), each tp shard cut over dp into
// block shards of 256 of its own elements (as ZeRO's block_shards would), handed to the
// optimizer as RowShards with the max over all tp x dp holders (the world here). Against
// AdamW8bit on the whole tensor: the parameters, codes and scales bitwise after every step.
struct CutCase {
  const char* label;
  Shape shape;
  int64_t dim;
  int tp, dp;
  DType dtype = DType::f32;
};

bool equal_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.numel() != b.numel()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.raw_data(), y.raw_data(),
                     static_cast<size_t>(x.numel() * dtype_size(x.dtype()))) == 0;
}

// Rank (t, q)'s elements of a whole tensor: tp shard t, then its ZeRO block shard q.
Tensor cut_part(const Tensor& whole, const CutCase& c, int t, int q) {
  const int64_t size = whole.size(c.dim) / c.tp;
  const Tensor shard = whole.narrow(c.dim, t * size, size).contiguous().reshape({-1});
  const int64_t blocks = (shard.numel() + 255) / 256;
  const int64_t first = block_start(blocks, c.dp, q) * 256;
  const int64_t end = std::min(shard.numel(), (first / 256 + block_size(blocks, c.dp, q)) * 256);
  return shard.narrow(0, first, end - first);
}

TEST_CASE("AdamW8bit on tp shards that cut blocks (two passes, a max all-reduce) equals one device bitwise") {
  const std::vector<CutCase> cases = {
      {"row-parallel [24, 200] tp 2 (runs of 100)", {24, 200}, 1, 2, 1},
      {"row-parallel [24, 200] tp 2 x dp 2", {24, 200}, 1, 2, 2},
      {"column-parallel [30, 70] tp 3 x dp 2 (runs of 700)", {30, 70}, 0, 3, 2},
      {"[3, 40, 48] split on dim 1, tp 2 (runs of 960, 1920 apart)", {3, 40, 48}, 1, 2, 1},
      {"bf16 with f32 master [16, 96] tp 2 x dp 2 (runs of 48)", {16, 96}, 1, 2, 2, DType::bf16},
  };
  constexpr int kCutSteps = 4;
  int checked = 0;
  for (const CutCase& c : cases) {
    const std::string label = c.label;
    CAPTURE(label);
    const optim::AdamW8bitOptions options{.lr = 1e-2, .weight_decay = 0.1, .min_8bit_numel = 0};
    Generator gen(7);
    const Tensor init = randn(c.shape, DType::f32, kCPU, &gen);
    std::vector<Tensor> grads;
    for (int k = 0; k < kCutSteps; ++k) {
      grads.push_back(cast(randn(c.shape, DType::f32, kCPU, &gen), c.dtype));
    }
    // One device.
    const Tensor whole = cast(init, c.dtype).clone();  // (init stays the initial values)
    optim::AdamW8bit single({whole}, options);
    std::vector<Tensor> params, codes1, codes2, scales1, scales2;
    for (int k = 0; k < kCutSteps; ++k) {
      whole.set_grad(grads[k]);
      single.step();
      params.push_back(whole.clone());
      codes1.push_back(single.state(0).at("exp_avg").clone());
      codes2.push_back(single.state(0).at("exp_avg_sq").clone());
      scales1.push_back(single.state(0).at("exp_avg_absmax").clone());
      scales2.push_back(single.state(0).at("exp_avg_sq_absmax").clone());
    }
    // tp x dp holders.
    const int n = c.tp * c.dp;
    std::vector<int> mismatches(n, 0);
    std::vector<int64_t> max_reduces(n, 0), bytes(n, 0), want(n, -1);
    run_threads(n, [&](CommPtr world) {
      const int t = world->rank() / c.dp, q = world->rank() % c.dp;
      const Tensor mine = cut_part(cast(init, c.dtype), c, t, q).clone();
      int64_t inner = 1;
      for (size_t k = static_cast<size_t>(c.dim) + 1; k < c.shape.size(); ++k) inner *= c.shape[k];
      const int64_t size = c.shape[static_cast<size_t>(c.dim)] / c.tp;
      const int64_t shard_numel = numel_of(c.shape) / c.tp;
      const int64_t blocks = (shard_numel + 255) / 256;
      optim::RowShard rs{c.shape,
                         block_start(blocks, c.dp, q),
                         block_size(blocks, c.dp, q),
                         [](const Tensor&) {},
                         256,
                         "w",
                         nullptr,
                         size * inner,
                         c.shape[static_cast<size_t>(c.dim)] * inner,
                         t * size * inner,
                         [world](const Tensor& x) { world->all_reduce(x, ReduceOp::max); }};
      optim::AdamW8bit opt({mine}, options);
      opt.set_row_shards({{mine.impl(), rs}});
      CommLog log;
      for (int k = 0; k < kCutSteps; ++k) {
        mine.set_grad(cut_part(grads[k], c, t, q).clone());
        {
          CommLogScope scope(log);
          opt.step();
        }
        const auto& st = opt.state(0);
        const bool same =
            equal_bits(mine, cut_part(params[k], c, t, q)) &&
            equal_bits(st.at("exp_avg"), cut_part(codes1[k], c, t, q)) &&
            equal_bits(st.at("exp_avg_sq"), cut_part(codes2[k], c, t, q)) &&
            equal_bits(st.at("exp_avg_absmax"), scales1[k]) &&
            equal_bits(st.at("exp_avg_sq_absmax"), scales2[k]);
        mismatches[world->rank()] += same ? 0 : 1;
      }
      max_reduces[world->rank()] = log.count("all_reduce");
      // Its codes, the whole parameter's scales (two per block) and, for bf16, the master.
      const int64_t local = mine.numel();
      bytes[world->rank()] = opt.state_bytes();
      want[world->rank()] = 2 * local + 8 * ((numel_of(c.shape) + 255) / 256) +
                            (c.dtype == DType::bf16 ? 4 * local : 0);
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(mismatches[r] == 0);
      CHECK(max_reduces[r] == kCutSteps);  // one [2, blocks] max per step
      CHECK(bytes[r] == want[r]);
    }
    ++checked;
  }
  CHECK(checked == 5);
}

TEST_CASE("ZeRO refuses AdamW8bit on shards that cut its blocks") {
  const Task task = mlp_task();
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = make_model(task, DType::f32);
    ZeroDataParallel zero(*model, *world, {.stage = 1});
    optim::AdamW8bit opt(zero.param_groups(1e-3, 0.0));
    zero.zero_grad();
    zero.backward(task.loss(*model, DType::f32, 0, world->rank(), 2));
    CHECK(testing::contains(testing::error_of([&] { zero.step(opt); }),
                            "or ZeroOptions::block_shards = 256"));
  });
}

}  // namespace
}  // namespace tessera::parallel
