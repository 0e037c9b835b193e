// ZeRO under MPI: one copy of this binary per rank, started by comm_mpi_test.sh (mpirun -np 2).
// Each process trains the single-rank reference itself, then every stage 0-3 with
// accumulation 1 and 2 over the MPI world, on the MNIST MLP and GPT-mini in f64 and f32, and
// compares with dp_harness.h's tolerances; a resume under another stage continues the same
// losses. 8-bit AdamW runs on block shards under every stage. Offloaded ZeRO (host and swap
// file tiers) is bitwise the in-memory run.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "parallel/comm/mpi.h"
#include "tests/parallel/dp_harness.h"

namespace tessera::parallel {
namespace {

using namespace testing_dp;

void check_mpi(const Task& task, DType dtype, int ep = 1) {
  CommPtr world = mpi_world();
  REQUIRE(world->size() == 2);
  const Run reference = train_reference(task, dtype);
  for (int stage : {0, 1, 2, 3}) {
    for (int accum : {1, 2}) {
      CAPTURE(stage);
      CAPTURE(accum);
      const Run run = train_zero(*world, task, dtype, {.stage = stage, .accum = accum, .ep = ep});
      check_close(task, dtype, run, reference,
                  fmt::format("mpi rank {} of 2, zero={} accum={} ep={}", world->rank(), stage, accum, ep));
      check_aux(run, reference, dtype);
    }
  }
}

TEST_CASE("zero over mpi: MNIST MLP, stages x accumulation equal one rank") {
  check_mpi(mlp_task(), DType::f64);
  check_mpi(mlp_task(), DType::f32);
}

TEST_CASE("zero over mpi: GPT-mini, stages x accumulation equal one rank") {
  check_mpi(gpt_task(), DType::f64);
  check_mpi(gpt_task(), DType::f32);
}

TEST_CASE("zero over mpi: GPT-mini with experts, stages equal one rank (aux losses too)") {
  check_mpi(gpt_moe_task(), DType::f64);
  check_mpi(gpt_moe_task(), DType::f32);
}

TEST_CASE("zero over mpi: GPT-mini with its experts split over the 2 processes (ep 2)") {
  check_mpi(gpt_moe_task(), DType::f64, /*ep=*/2);
  check_mpi(gpt_moe_task(), DType::f32, /*ep=*/2);
}

TEST_CASE("zero over mpi: Adafactor on row shards, stages 1-3 x every mode, equals one rank") {
  CommPtr world = mpi_world();
  const Task task = mlp_task();
  int runs = 0;
  for (optim::AdafactorMode mode :
       {optim::AdafactorMode::hf, optim::AdafactorMode::torch, optim::AdafactorMode::optax}) {
    const std::vector<std::vector<double>> want = adafactor_reference(task, mode);
    for (int stage : {1, 2, 3}) {
      CAPTURE(stage);
      const RowShardResult r = adafactor_row_shards(*world, task, mode, stage, want);
      CHECK(r.worst <= 1e-10);
      CHECK(r.reduces == 2 * r.params * kAdafactorSteps);
      ++runs;
    }
  }
  CHECK(runs == 9);
}

TEST_CASE("zero over mpi: 8-bit AdamW on block shards, stages 1-3, equals one rank (f64) and "
          "unsharded dp bitwise (f32)") {
  CommPtr world = mpi_world();
  const Task task = mlp_task();
  const Run reference = train_reference(task, DType::f64, Opt::adamw8bit);
  // Two ranks: the reduced gradient is (g0 + g1) / 2 in any backend, so the f32 runs of
  // every stage are bitwise the same arithmetic as stage 0's.
  const Run base = train_zero(*world, task, DType::f32, {.stage = 0, .opt = Opt::adamw8bit});
  int runs = 0;
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    const Run run64 = train_zero(*world, task, DType::f64, {.stage = stage, .opt = Opt::adamw8bit});
    check_close(task, DType::f64, run64, reference,
                fmt::format("mpi rank {} of 2, 8-bit AdamW, zero={}", world->rank(), stage));
    CommLog log;
    const Run run32 = train_zero(*world, task, DType::f32,
                                 {.stage = stage, .opt = Opt::adamw8bit, .step_log = &log});
    CHECK(run32.losses == base.losses);
    CHECK(run32.params == base.params);
    CHECK(log.count("all_reduce") == 0);
    ++runs;
  }
  CHECK(runs == 3);
}

TEST_CASE("zero over mpi: a stage 3 checkpoint resumes under stage 1") {
  CommPtr world = mpi_world();
  const Task task = gpt_task();
  const Run whole = train_zero(*world, task, DType::f64, {.stage = 3});
  Checkpoint ckpt;
  train_zero(*world, task, DType::f64, {.stage = 3, .stop = kSteps / 2, .save = &ckpt});
  const Run rest =
      train_zero(*world, task, DType::f64, {.stage = 1, .start = kSteps / 2, .load = &ckpt});
  REQUIRE(rest.losses.size() == static_cast<size_t>(kSteps / 2));
  for (int i = 0; i < kSteps / 2; ++i) {
    CHECK(std::abs(rest.losses[i] - whole.losses[kSteps / 2 + i]) <= 1e-10);
  }
}

TEST_CASE("zero over mpi: offloaded (host and swap-file tiers) is bitwise the in-memory run") {
  CommPtr world = mpi_world();
  const char* tmp = std::getenv("TEST_TMPDIR");
  int runs = 0;
  for (const Task& task : {mlp_task(), gpt_task()}) {
    for (int stage : {1, 2, 3}) {
      const Run memory = train_zero(*world, task, DType::f32, {.stage = stage, .stop = 10});
      for (OffloadTier tier : {OffloadTier::host, OffloadTier::file}) {
        ZeroRun spec{.stage = stage, .stop = 10};
        spec.offload.optimizer = tier;
        spec.offload.params = stage == 3 ? tier : OffloadTier::none;
        spec.offload.dir = tmp != nullptr ? tmp : "/tmp";
        const Run off = train_zero(*world, task, DType::f32, spec);
        INFO(task.name, " stage ", stage, " tier ", offload_tier_name(tier));
        CHECK(off.losses == memory.losses);
        CHECK(off.params == memory.params);
        ++runs;
      }
    }
  }
  CHECK(runs == 12);
}

}  // namespace
}  // namespace tessera::parallel
