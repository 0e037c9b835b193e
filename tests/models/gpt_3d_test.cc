// GPT on a {pp, dp, tp} mesh (models/gpt/parallel3d.h) on the threads backend: every
// factorisation of 8 ranks, with each pipeline schedule where pp > 1 and ZeRO 0 and 1 over
// dp, trains 10 AdamW steps whose losses and final parameters equal the single-device run
// (f64, 1e-10; tests/models/gpt_3d_cases.h). A configuration the model cannot take (more
// stages than pipeline layers) is skipped with the reason; layouts that cannot work are
// errors before any step.
#include <doctest/doctest.h>

#include <vector>

#include "models/gpt/parallel3d.h"
#include "parallel/comm/threads.h"
#include "tensor/random.h"
#include "tests/models/gpt_3d_cases.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

using namespace testing3d;

TEST_CASE("3-D: every pp x dp x tp factorisation of 8 ranks, each schedule, ZeRO 0/1, equals one device") {
  const Run ref = reference();
  CHECK(ref.losses.back() < ref.losses.front() - 0.5);  // it learns
  std::vector<int> runs(8);
  parallel::run_threads(8, [&](parallel::CommPtr world) {
    runs[world->rank()] = check_factorisations(world, ref);
  });
  // pp 1: dp 1, 2, 4, 8 with 1F1B only = 4 layouts; pp 2: dp 1, 2, 4 x 3 schedules = 9;
  // pp 4: dp 1, 2 x 3 = 6; pp 8: dp 1 x GPipe, 1F1B (interleaved needs 16 stages of 8
  // layers: skipped) = 2. 21 layouts x ZeRO 0/1 = 42 runs, on every rank.
  CHECK(runs == std::vector<int>(8, 42));
}

TEST_CASE("3-D in f32: every factorisation of 8 ranks with 1F1B and ZeRO 1 equals one device to 1e-5") {
  const Run ref = reference(DType::f32);
  std::vector<int> runs(8);
  parallel::run_threads(8, [&](parallel::CommPtr world) {
    runs[world->rank()] = check_factorisations_f32(world, ref);
  });
  // One 1F1B / ZeRO 1 run per (pp, dp): 4 + 3 + 2 + 1 = 10, on every rank.
  CHECK(runs == std::vector<int>(8, 10));
}

TEST_CASE("3-D: layouts that cannot work are errors before any step") {
  parallel::run_threads(8, [&](parallel::CommPtr world) {
    manual_seed(0);
    const auto model = std::make_shared<Gpt>(
        GptConfig{.layers = 6, .heads = 8, .width = 32, .context = 8, .vocab = 256});
    using testing::contains;
    using testing::error_of;
    CHECK(contains(error_of([&] { Gpt3d g(*model, world, {.pp = 2, .dp = 2, .tp = 4}); }),
                   "pp 2 x dp 2 x tp 4 = 16 ranks, but the world has 8"));
    CHECK(contains(error_of([&] {
                     Gpt3d g(*model, world, {.pp = 4, .dp = 1, .tp = 2, .schedule = "interleaved",
                                             .chunks = 2, .microbatches = 6});
                   }),
                   "micro-batches (6) must be a multiple of the pipeline ranks (4)"));
    CHECK(contains(error_of([&] {
                     Gpt3d g(*model, world, {.pp = 8, .dp = 1, .tp = 1, .schedule = "interleaved",
                                             .chunks = 2, .microbatches = 8});
                   }),
                   "16 stages for 8 layers"));
    CHECK(contains(error_of([&] { Gpt3d g(*model, world, {.pp = 2, .dp = 4, .tp = 1, .zero = 4}); }),
                   "ZeRO stage must be 0, 1, 2 or 3, got 4"));
    CHECK(contains(error_of([&] { Gpt3d g(*model, world, {.pp = 2, .dp = 4, .tp = 1, .accum = 0}); }),
                   "accum must be >= 1, got 0"));
  });
}

}  // namespace
}  // namespace tessera::gpt
