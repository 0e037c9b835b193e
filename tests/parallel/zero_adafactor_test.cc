// Adafactor under ZeRO stages 1-3 on row shards (ZeroOptions::row_shards): each rank keeps
// its rows of every parameter with their row statistics, the column statistics after one
// all-reduce per parameter and step (plus one for the update's RMS). The MNIST MLP (2-D
// weights, 1-D biases, some with fewer rows than ranks) trains 6 steps in f64 on dp {2, 4} x
// stage {1, 2, 3} x mode {hf, torch, optax} and equals the single-device run (1e-10); the
// all-reduces are counted from the comm log.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "optim/adafactor.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/zero.h"
#include "tests/parallel/dp_harness.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using namespace testing_dp;

// Every rank's result of the row-shard run on `dp` threads.
std::vector<RowShardResult> on_threads(const Task& task, optim::AdafactorMode mode, int dp,
                                       int stage, const std::vector<std::vector<double>>& want) {
  std::vector<RowShardResult> out(dp);
  run_threads(dp, [&](CommPtr world) {
    out[world->rank()] = adafactor_row_shards(*world, task, mode, stage, want);
  });
  return out;
}

TEST_CASE("Adafactor on ZeRO 1-3 row shards equals one device (f64 1e-10)") {
  const Task task = mlp_task();
  int runs = 0;
  for (optim::AdafactorMode mode :
       {optim::AdafactorMode::hf, optim::AdafactorMode::torch, optim::AdafactorMode::optax}) {
    const std::vector<std::vector<double>> want = adafactor_reference(task, mode);
    for (int dp : {2, 4}) {
      for (int stage : {1, 2, 3}) {
        CAPTURE(std::string(optim::adafactor_mode_name(mode)));
        CAPTURE(dp);
        CAPTURE(stage);
        const std::vector<RowShardResult> r = on_threads(task, mode, dp, stage, want);
        for (int k = 0; k < dp; ++k) {
          CHECK(r[k].worst <= 1e-10);
          // Two all-reduces per parameter and step: [columns + 2] statistics, the update's RMS.
          CHECK(r[k].reduces == 2 * r[k].params * kAdafactorSteps);
        }
        MESSAGE(fmt::format("{} dp {} stage {}: max |param - one device| {:.3g}",
                            optim::adafactor_mode_name(mode), dp, stage, r[0].worst));
        ++runs;
      }
    }
  }
  CHECK(runs == 3 * 2 * 3);
}

TEST_CASE("Adafactor (hf) on ZeRO row shards: GPT-mini equals one device but for the key bias") {
  // The attention key bias's exact gradient is zero (softmax ignores a shift shared by all
  // keys): each layout's rounding noise there, ~1e-18, is what Adafactor normalises, so those
  // elements take steps that depend on the summation order; they are left out, as the data-
  // parallel suites leave them out of their element-wise f64 comparison. (torch mode floors
  // the estimate at eps1^2 only, so that noise reaches the update's RMS and every element of
  // the same tensor; optax factors c_attn's [3C, C] as columns then rows, which row shards
  // refuse.)
  const Task task = gpt_task();
  const std::vector<std::vector<double>> want = adafactor_reference(task, optim::AdafactorMode::hf);
  for (int dp : {2, 4}) {
    CAPTURE(dp);
    const std::vector<RowShardResult> r = on_threads(task, optim::AdafactorMode::hf, dp, 3, want);
    for (int k = 0; k < dp; ++k) CHECK(r[k].worst <= 1e-10);
    MESSAGE(fmt::format("GPT-mini, hf, dp {} stage 3: max |param - one device| {:.3g}", dp,
                        r[0].worst));
  }
}

TEST_CASE("Adafactor row shards' checkpoints gather to the single-device layout and load anywhere") {
  // Saved after 3 steps under one (dp, stage), resumed under another and on one device (the
  // state dict is a single-device optimizer's: rows' statistics [m], columns' [n]); the
  // parameters after 6 steps are the uninterrupted run's (f64 1e-10).
  const Task task = mlp_task();
  for (optim::AdafactorMode mode : {optim::AdafactorMode::hf, optim::AdafactorMode::torch}) {
    CAPTURE(std::string(optim::adafactor_mode_name(mode)));
    const std::vector<std::vector<double>> want = adafactor_reference(task, mode);
    const int half = kAdafactorSteps / 2;
    Checkpoint ckpt;
    run_threads(2, [&](CommPtr world) {
      Checkpoint mine;
      adafactor_row_shards(*world, task, mode, 2, want, nullptr, &mine, 0, half);
      if (world->rank() == 0) ckpt = mine;
    });
    // The single-device layout: per-row state of a [256, 784] weight is [256].
    CHECK(ckpt.optimizer.at("state.0.exp_avg_sq_row").shape() == Shape{256});
    CHECK(ckpt.optimizer.at("state.0.exp_avg_sq_col").shape() == Shape{784});
    for (const auto& layout : {std::pair{4, 3}, std::pair{2, 1}}) {
      const int dp = layout.first, stage = layout.second;  // (captured: no structured binding)
      CAPTURE(dp);
      CAPTURE(stage);
      std::vector<RowShardResult> r(dp);
      run_threads(dp, [&](CommPtr world) {
        r[world->rank()] = adafactor_row_shards(*world, task, mode, stage, want, &ckpt, nullptr,
                                                half, kAdafactorSteps);
      });
      for (int k = 0; k < dp; ++k) CHECK(r[k].worst <= 1e-10);
    }
    // One device (no ZeRO) loads the same dicts.
    std::shared_ptr<nn::Module> model = make_model(task, DType::f64);
    optim::Adafactor opt(optim::decay_groups(model->named_parameters(), 1e-2, kWeightDecay),
                         adafactor_options(mode));
    model->load_state_dict(ckpt.model);
    opt.load_state_dict(ckpt.optimizer);
    for (int64_t step = half; step < kAdafactorSteps; ++step) {
      opt.zero_grad();
      task.loss(*model, DType::f64, step, 0, 1).backward();
      opt.step();
    }
    const std::vector<std::vector<double>> got = values_of(*model);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      for (size_t k = 0; k < got[i].size(); ++k) worst = std::max(worst, std::abs(got[i][k] - want[i][k]));
    }
    CHECK(worst <= 1e-10);
  }
}

TEST_CASE("Adafactor on flat shards is refused") {
  const Task task = mlp_task();
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = make_model(task, DType::f64);
    ZeroDataParallel zero(*model, *world, {.stage = 1, .units = task.units});
    optim::Adafactor opt(zero.param_groups(1e-2, 0.0), adafactor_options(optim::AdafactorMode::hf));
    zero.zero_grad();
    zero.backward(task.loss(*model, DType::f64, 0, world->rank(), 2));
    const std::string msg = testing::error_of([&] { zero.step(opt); });
    CHECK(testing::contains(msg, "Adafactor is not elementwise"));
    CHECK(testing::contains(msg, "or ZeroOptions::row_shards"));
  });
}

TEST_CASE("Adafactor (optax) on row shards of taller-than-wide matrices equals one device") {
  // optax factors GPT-mini's c_attn [3C, C] and c_fc [4C, C] columns first: its statistic
  // over the rows (one per column) is the one divided by its mean, and the row shards keep
  // the one over the columns (one per row) as it is. ZeRO 1-3 on dp 2 against one device
  // (f64, 1e-10); a checkpoint saved on dp 2 resumes on dp 4.
  const Task gpt = gpt_task();
  const std::vector<std::vector<double>> want = adafactor_reference(gpt, optim::AdafactorMode::optax);
  int runs = 0;
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    std::vector<RowShardResult> r(2);
    run_threads(2, [&](CommPtr world) {
      r[world->rank()] =
          adafactor_row_shards(*world, gpt, optim::AdafactorMode::optax, stage, want);
    });
    for (const RowShardResult& k : r) CHECK(k.worst <= 1e-10);
    MESSAGE(fmt::format("optax gpt dp 2 stage {}: max |param - one device| {:.3g}", stage,
                        r[0].worst));
    ++runs;
  }
  CHECK(runs == 3);
  // Saved after 3 steps on dp 2 stage 2, resumed on dp 4 stage 3: the same parameters.
  const int half = kAdafactorSteps / 2;
  Checkpoint ckpt;
  run_threads(2, [&](CommPtr world) {
    Checkpoint mine;
    adafactor_row_shards(*world, gpt, optim::AdafactorMode::optax, 2, want, nullptr, &mine, 0, half);
    if (world->rank() == 0) ckpt = mine;
  });
  std::vector<RowShardResult> r(4);
  run_threads(4, [&](CommPtr world) {
    r[world->rank()] = adafactor_row_shards(*world, gpt, optim::AdafactorMode::optax, 3, want,
                                            &ckpt, nullptr, half, kAdafactorSteps);
  });
  for (const RowShardResult& k : r) CHECK(k.worst <= 1e-10);
}

// A module of one parameter, of `shape`, filled from `values` (its loss: see below).
class OneParam : public nn::Module {
 public:
  OneParam(const Shape& shape, const Tensor& values) : nn::Module("OneParam") {
    w = register_parameter("w", values.reshape(shape).clone());
  }
  Tensor forward(const Tensor&) override { return w; }  // (ZeRO 3 gathers it here)
  Tensor w;
};

// sum(t (w - 0.5)^3) over w's elements in memory order: its gradient depends on the element
// only, so any shape of the same elements has the same gradient, bitwise.
Tensor cubic_loss(const Tensor& w, const Tensor& t) {
  const Tensor d = w.reshape({w.numel()}) - 0.5;
  return sum(t * d * d * d);
}

TEST_CASE("ZeroOptions::row_layout: a [2, 8, 6] parameter stepped as the [16, 6] matrix it holds") {
  // One device: Adafactor on the [16, 6] matrix (rows and columns statistics of the whole).
  // ZeRO 0-3 on dp 2 over a module holding the same elements as [2, 8, 6], presented as
  // [16, 6]: equal within 1e-12 after 4 steps. Without it (and without row shards), ZeRO 0
  // factors each [8, 6] block on its own, which moves the parameter by more than 1e-4 (also
  // asserted).
  manual_seed(7);
  const Tensor init = randn({96}, DType::f64), target = randn({96}, DType::f64);
  const optim::AdafactorOptions ao = adafactor_options(optim::AdafactorMode::hf);
  OneParam one({16, 6}, init);
  optim::Adafactor one_opt(std::vector<Tensor>{one.w}, ao);
  constexpr int kSteps = 4;
  for (int step = 0; step < kSteps; ++step) {
    one_opt.zero_grad();
    cubic_loss(one.w, target).backward();
    one_opt.step();
  }
  const std::vector<double> want = one.w.detach().to_vector<double>();
  int runs = 0;
  for (int stage : {0, 1, 2, 3}) {
    for (bool present : {true, false}) {
      if (!present && stage > 0) continue;  // (row shards refuse a 3-D parameter, below)
      CAPTURE(stage);
      CAPTURE(present);
      std::vector<double> worst(2, 0.0);
      run_threads(2, [&](CommPtr world) {
        auto model = std::make_shared<OneParam>(Shape{2, 8, 6}, init);
        ZeroOptions z{.stage = stage, .row_shards = present};
        if (present) {
          z.row_layout = [](const std::string&, const Shape&) {
            return ZeroOptions::RowLayout{.shape = {16, 6}};
          };
        }
        ZeroDataParallel zero(*model, *world, z);
        optim::Adafactor opt(zero.param_groups(ao.lr, ao.weight_decay), ao);
        for (int step = 0; step < kSteps; ++step) {
          zero.zero_grad();
          zero.backward(cubic_loss((*model)(Tensor()), target));
          zero.step(opt);
        }
        const std::vector<double> got = zero.model_state_dict().at("w").to_vector<double>();
        for (size_t i = 0; i < got.size(); ++i) {
          worst[world->rank()] = std::max(worst[world->rank()], std::abs(got[i] - want[i]));
        }
      });
      for (double w : worst) {
        if (present) {
          CHECK(w <= 1e-12);
        } else {
          CHECK(w > 1e-4);
        }
      }
      ++runs;
    }
  }
  CHECK(runs == 5);
  // A shape that changes the elements or (2-D) the last dim is an error, naming both; no
  // shape at all, the 3-D parameter is.
  run_threads(2, [&](CommPtr world) {
    auto model = std::make_shared<OneParam>(Shape{2, 8, 6}, init);
    CHECK(testing::contains(testing::error_of([&] {
                              ZeroDataParallel zero(*model, *world, {.stage = 2, .row_shards = true});
                            }),
                            "row_shards cover 1-D and 2-D parameters; 'w' has shape [2, 8, 6]"));
    for (const Shape& bad : {Shape{12, 8}, Shape{16, 5}}) {
      ZeroOptions z{.stage = 1, .row_shards = true};
      z.row_layout = [bad](const std::string&, const Shape&) {
        return ZeroOptions::RowLayout{.shape = bad};
      };
      const std::string msg = testing::error_of([&] { ZeroDataParallel zero(*model, *world, z); });
      CHECK(testing::contains(msg, fmt::format("row_layout presents 'w' of shape [2, 8, 6] as {}; "
                                               "it must keep the elements and (2-D) the last dim",
                                               shape_str(bad))));
    }
  });
}

TEST_CASE("Adafactor on 2 x 2 blocks of a matrix (RowShard::cols_sum) equals the whole (f64)") {
  // A matrix cut into 2 x 2 blocks on 4 threads, as tensor parallelism with ZeRO cuts a
  // row-parallel weight: `sum` over the ranks holding the same columns, `cols_sum` over those
  // holding the same rows. 4 steps of each mode against Adafactor on the whole matrix:
  // within 1e-12. All-reduces per step: factored rows first, four ([rows + 1] over the
  // columns' holders, [cols + 2] over the rows', the update's squares over both); optax on
  // the taller-than-wide 12 x 10 (factored columns first), five (its column statistics'
  // sum over the columns' holders too); kept whole (optax below its factoring size), four
  // (the parameter's squares over the columns' holders, then with them over the rows', the
  // update's squares over both).
  int runs = 0;
  for (const Shape& shape : {Shape{10, 12}, Shape{12, 10}}) {
    const int64_t rows = shape[0] / 2, cols = shape[1] / 2;
    manual_seed(11);
    const Tensor init = randn(shape, DType::f64);
    std::vector<Tensor> grads;
    for (int step = 0; step < 4; ++step) grads.push_back(randn(shape, DType::f64));
    for (optim::AdafactorMode mode :
         {optim::AdafactorMode::hf, optim::AdafactorMode::torch, optim::AdafactorMode::optax}) {
      for (int64_t min_dim : {int64_t{1}, int64_t{128}}) {
        if (min_dim == 128 && mode != optim::AdafactorMode::optax) continue;
        CAPTURE(shape_str(shape));
        CAPTURE(std::string(optim::adafactor_mode_name(mode)));
        CAPTURE(min_dim);
        optim::AdafactorOptions ao = adafactor_options(mode);
        ao.min_dim_size_to_factor = min_dim;
        const bool columns_first =
            mode == optim::AdafactorMode::optax && min_dim == 1 && shape[0] > shape[1];
        Tensor whole = init.clone();
        optim::Adafactor one(std::vector<Tensor>{whole}, ao);
        for (const Tensor& g : grads) {
          whole.set_grad(g.clone());
          one.step();
        }
        std::vector<double> worst(4, 0.0);
        std::vector<int> reduces(4, 0);
        run_threads(4, [&](CommPtr world) {
          const int r = world->rank(), rb = r / 2, cb = r % 2;
          CommPtr same_cols = world->split(cb, r, "same columns");
          CommPtr same_rows = world->split(10 + rb, r, "same rows");
          const auto block = [&](const Tensor& t) {
            return t.narrow(0, rb * rows, rows).narrow(1, cb * cols, cols).contiguous().clone();
          };
          Tensor w = block(init);
          optim::Adafactor opt(std::vector<Tensor>{w}, ao);
          optim::RowShard rs{shape, rb * rows, rows,
                             [&](const Tensor& t) {
                               ++reduces[r];
                               same_cols->all_reduce(t, ReduceOp::sum);
                             },
                             0, "w",
                             [&](const Tensor& t) {
                               ++reduces[r];
                               same_rows->all_reduce(t, ReduceOp::sum);
                             }};
          opt.set_row_shards({{w.impl(), rs}});
          for (const Tensor& g : grads) {
            w.set_grad(block(g));
            opt.step();
          }
          const std::vector<double> got = w.to_vector<double>(),
                                    want = block(whole).to_vector<double>();
          for (size_t i = 0; i < got.size(); ++i) {
            worst[r] = std::max(worst[r], std::abs(got[i] - want[i]));
          }
        });
        for (int r = 0; r < 4; ++r) {
          CHECK(worst[r] <= 1e-12);
          CHECK(reduces[r] == (columns_first ? 5 : 4) * static_cast<int>(grads.size()));
        }
        ++runs;
      }
    }
  }
  CHECK(runs == 8);
}

}  // namespace
}  // namespace tessera::parallel
