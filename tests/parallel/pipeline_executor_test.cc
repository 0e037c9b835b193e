// The pipeline executor (parallel/pipeline/executor.h) on the threads backend: a stack of
// tanh layers split into contiguous stages, trained one step with GPipe, 1F1B and interleaved
// 1F1B (with and without recomputation) on 2 and 4 ranks, gives the single-device loss and
// gradients (f64, 1e-12); each rank runs its compute actions in the schedule's order and
// keeps at most the simulator's live micro-batches.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <memory>
#include <vector>

#include "nn/layers.h"
#include "parallel/comm/threads.h"
#include "parallel/pipeline/executor.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tests/testing.h"

namespace tessera::parallel::pipeline {
namespace {

constexpr int64_t kWidth = 6, kBatch = 16;
constexpr int per_stage = 2;  // layers per pipeline stage

struct Stack {
  std::vector<std::shared_ptr<nn::Linear>> layers;
  explicit Stack(int n) {
    manual_seed(11);
    for (int i = 0; i < n; ++i) {
      layers.push_back(std::make_shared<nn::Linear>(kWidth, kWidth));
      layers.back()->to(DType::f64);
    }
  }
  Tensor run(const Tensor& x, int begin, int end) const {
    Tensor h = x;
    for (int i = begin; i < end; ++i) h = tanh((*layers[i])(h));
    return h;
  }
};

Tensor batch_inputs() {
  manual_seed(5);
  return randn({kBatch, kWidth}, DType::f64);
}
Tensor batch_targets() {
  manual_seed(6);
  return randn({kBatch, kWidth}, DType::f64);
}
Tensor mse(const Tensor& y, const Tensor& t) { return mean((y - t) * (y - t)); }

void check_schedule(const Schedule& schedule, bool recompute) {
  const int stages = schedule.num_stages(), m = schedule.microbatches;
  const Tensor x = batch_inputs(), t = batch_targets();
  // The reference: one device, the whole batch.
  Stack ref(stages * per_stage);
  const Tensor ref_loss = mse(ref.run(x, 0, stages * per_stage), t);
  ref_loss.backward();
  const Timeline timeline = simulate(schedule);

  run_threads(schedule.ranks, [&](CommPtr pp) {
    Stack model(stages * per_stage);
    PipelineChunks chunks;
    for (int c = 0; c < schedule.chunks; ++c) {
      const int stage = schedule.stage_of(pp->rank(), c);
      chunks.push_back([&model, stage](const Tensor& h, int) {
        return model.run(h, stage * per_stage, (stage + 1) * per_stage);
      });
    }
    const int64_t rows = kBatch / m;
    const PipelineStep step = run_pipeline(
        *pp, schedule, chunks, [&](int mb) { return x.narrow(0, mb * rows, rows); },
        [&](const Tensor& y, int mb) { return mse(y, t.narrow(0, mb * rows, rows)); },
        {.recompute = recompute});
    CHECK(std::abs(step.loss - ref_loss.item<double>()) <= 1e-12);
    // This rank's layers have the single-device gradients; the others none.
    for (int c = 0; c < schedule.chunks; ++c) {
      const int stage = schedule.stage_of(pp->rank(), c);
      for (int i = stage * per_stage; i < (stage + 1) * per_stage; ++i) {
        for (const char* which : {"weight", "bias"}) {
          const Tensor got = which[0] == 'w' ? model.layers[i]->weight.grad()
                                             : model.layers[i]->bias.grad();
          const Tensor want = which[0] == 'w' ? ref.layers[i]->weight.grad()
                                              : ref.layers[i]->bias.grad();
          REQUIRE(got.defined());
          CHECK(max(abs(got - want)).item<double>() <= 1e-12);
        }
      }
    }
    std::vector<Action> expected;
    for (const Action& a : schedule.actions[pp->rank()]) {
      if (a.kind == ActionKind::forward || a.kind == ActionKind::backward) expected.push_back(a);
    }
    REQUIRE(step.executed.size() == expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      CHECK(step.executed[i].kind == expected[i].kind);
      CHECK(step.executed[i].microbatch == expected[i].microbatch);
      CHECK(step.executed[i].chunk == expected[i].chunk);
    }
    CHECK(step.peak_live == timeline.peak_live[pp->rank()]);
  });
}

TEST_CASE("every schedule trains one step exactly like one device") {
  for (int p : {2, 4}) {
    for (int m : {4, 8}) {
      for (bool recompute : {false, true}) {
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(recompute);
        check_schedule(gpipe(p, m), recompute);
        check_schedule(one_f_one_b(p, m), recompute);
        check_schedule(interleaved_1f1b(p, m, 2), recompute);
      }
    }
  }
}

TEST_CASE("errors: a schedule for another group size or chunk count") {
  run_threads(2, [&](CommPtr pp) {
    using testing::contains;
    using testing::error_of;
    const PipelineChunks one = {[](const Tensor& h, int) { return h; }};
    auto input = [](int) { return zeros({1}); };
    auto loss = [](const Tensor& y, int) { return sum(y); };
    CHECK(contains(error_of([&] { run_pipeline(*pp, one_f_one_b(4, 4), one, input, loss); }),
                   "the 1f1b schedule is for 4 ranks, the pipeline group 'world' has 2"));
    CHECK(contains(error_of([&] { run_pipeline(*pp, interleaved_1f1b(2, 4, 2), one, input, loss); }),
                   "runs 2 chunks per rank, rank " + std::to_string(pp->rank()) + " has 1"));
  });
}

}  // namespace
}  // namespace tessera::parallel::pipeline
