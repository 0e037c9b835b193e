// The one training loop (models/common/train_loop.h) over a scripted replica: the calls it
// makes per step (micro-batches, clipping, update, saves, validations), --nonfinite=skip
// and error, a poisoned gradient norm, a stop signal saving and stopping after the same
// step; and the StepMeter's windows, rate (with warm-up steps left out) and ETA.
#include <doctest/doctest.h>
#include <signal.h>

#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "models/common/run_control.h"
#include "models/common/train_loop.h"
#include "tests/testing.h"

namespace tessera::models {
namespace {

using testing::contains;
using testing::error_of;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Micro-batch m of step s has loss 10 s + m unless scripted; records what the loop asks.
class ScriptedReplica final : public Replica {
 public:
  std::map<int64_t, double> loss_at, norm_at;  // by step (0-based)
  int64_t signal_at = -1;                      // raise SIGTERM in this step
  std::vector<double> lrs;
  std::vector<int> micros;
  std::vector<bool> skips;
  std::vector<int64_t> saves, evals;
  std::vector<double> clips;

  void zero_grad(int64_t, double lr) override { lrs.push_back(lr); }
  Tensor forward_backward(int64_t step, int micro) override {
    micros.push_back(micro);
    if (step == signal_at && micro == 0) raise(SIGTERM);
    const auto it = loss_at.find(step);
    const double loss = it != loss_at.end() ? it->second : 10.0 * step + micro;
    return Tensor::from_vector<double>({loss}, {1});
  }
  std::optional<double> grad_norm(double max_norm) override {
    clips.push_back(max_norm);
    const auto it = norm_at.find(static_cast<int64_t>(lrs.size()) - 1);
    return it != norm_at.end() ? it->second : 1.0;
  }
  void step(bool skip) override { skips.push_back(skip); }
  void save(int64_t step) override { saves.push_back(step); }
  double evaluate(int64_t step) override {
    evals.push_back(step);
    return 0.5;
  }
};

LoopOptions options(int64_t steps) {
  LoopOptions o;
  o.program = "test";
  o.stop_at = steps;
  o.lr = [](int64_t step) { return 0.1 * static_cast<double>(step + 1); };
  o.verbose = false;
  return o;
}

LoopResult run(ScriptedReplica& r, const LoopOptions& o) {
  StepMeter meter(8, "samples");
  Progress progress;
  MetricsWriter metrics;
  return run_loop(r, o, meter, progress, metrics);
}

TEST_CASE("train loop: micro-batches, learning rates, saves and validations per step") {
  ScriptedReplica r;
  LoopOptions o = options(5);
  o.accum = 2;
  o.save = "unused.safetensors";
  o.save_every = 2;
  o.val_every = 2;
  const LoopResult res = run(r, o);
  CHECK(res.step == 5);
  CHECK(r.lrs == std::vector<double>{0.1, 0.2, 0.30000000000000004, 0.4, 0.5});
  CHECK(r.micros == std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1, 0, 1});
  // The mean of each step's micro-batch losses.
  CHECK(res.losses == std::vector<double>{0.5, 10.5, 20.5, 30.5, 40.5});
  CHECK(r.clips.empty());  // no clipping, no skipping: the norm is never asked for
  CHECK(r.skips == std::vector<bool>(5, false));
  CHECK(r.saves == std::vector<int64_t>{2, 4, 5});  // every 2 steps, and at the end
  CHECK(r.evals == std::vector<int64_t>{2, 4});     // the final one is the program's
  CHECK(res.val_losses.size() == 2);
  // The last window (log_every 10: all 5 steps) is the mean of every step's loss.
  CHECK(res.train_loss == doctest::Approx(20.5).epsilon(1e-12));
}

TEST_CASE("train loop: --nonfinite=skip drops the step; error stops before saving more") {
  ScriptedReplica skipping;
  skipping.loss_at[2] = kNaN;
  skipping.norm_at[3] = std::numeric_limits<double>::infinity();
  LoopOptions o = options(5);
  o.skip_nonfinite = true;
  const LoopResult res = run(skipping, o);
  CHECK(res.nonfinite_skipped == 2);
  CHECK(skipping.skips == std::vector<bool>{false, false, true, true, false});
  CHECK(skipping.clips == std::vector<double>(5, 0.0));  // measured, not clipped

  ScriptedReplica diverging;
  diverging.loss_at[2] = kNaN;
  o = options(5);
  o.save = "run/c.safetensors";
  o.save_every = 1;
  const std::string msg = error_of([&] { run(diverging, o); });
  CHECK(contains(msg, "test: the loss is nan at step 3 (the run diverged); stopped before "
                      "saving anything more: run/c.safetensors holds the last good checkpoint"));
  CHECK(diverging.saves == std::vector<int64_t>{1, 2});

  ScriptedReplica poisoned;  // with clipping the norm is known: inf poisoned the update
  poisoned.norm_at[1] = std::numeric_limits<double>::infinity();
  o = options(5);
  o.clip = 1.0;
  CHECK(contains(error_of([&] { run(poisoned, o); }), "the gradient norm is inf at step 2"));
  CHECK(poisoned.clips == std::vector<double>{1.0, 1.0});
}

TEST_CASE("train loop: a SIGTERM saves after the step and stops with StopRequested") {
  StopSignals signals;
  ScriptedReplica r;
  r.signal_at = 2;
  LoopOptions o = options(10);
  o.save = "run/c.safetensors";
  int sig = 0;
  std::string msg;
  try {
    run(r, o);
  } catch (const StopRequested& e) {
    sig = e.signal();
    msg = e.what();
  }
  CHECK(sig == SIGTERM);
  CHECK(contains(msg, "test: stopped by SIGTERM after step 3 of 10; saved run/c.safetensors"));
  CHECK(r.saves == std::vector<int64_t>{3});
}

TEST_CASE("step meter: windows, the rate without warm-up steps, ETA") {
  StepMeter meter(10, "tokens", /*timing_skip=*/1);
  CHECK(meter.rate() == 0.0);
  meter.add(1.0, 2.0);
  CHECK(meter.rate() == 0.0);  // only the warm-up step so far
  meter.add(3.0, 4.0);
  const StepMeter::Window w = meter.take_window();
  CHECK(w.steps == 2);
  CHECK(w.loss == 3.0);
  CHECK(w.rate == 5.0);              // 2 steps x 10 tokens in 4 s
  CHECK(meter.rate() == 10.0 / 3.0);  // the step after the warm-up: 10 tokens in 3 s
  CHECK(meter.eta(3) == 6.0);         // 2 s per step so far
  CHECK(meter.take_window().steps == 0);
}

}  // namespace
}  // namespace tessera::models
