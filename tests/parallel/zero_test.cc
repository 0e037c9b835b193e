// ZeRO stages 0-3 (parallel/zero.h) on the threads backend: the MNIST MLP and a GPT-mini
// trained 20 AdamW steps (clipped) with dp in {1, 2, 4} x stage in {0, 1, 2, 3} x
// accumulation in {1, 2} at a fixed global batch match the single-rank run; tagged memory
// per rank against the ZeRO formulas; bytes per step from the comm log; stage 3's gather
// order; resume under another (dp, stage); errors.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/data/text.h"
#include "models/gpt/model.h"
#include "nn/moe.h"
#include "optim/adamw.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/zero.h"
#include "tensor/allocator.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tests/parallel/dp_harness.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using namespace testing_dp;
using testing::contains;
using testing::error_of;

Run run_zero(const Task& task, DType dtype, int dp, const ZeroRun& spec) {
  std::vector<Run> runs(dp);
  run_threads(dp, [&](CommPtr world) {
    runs[world->rank()] = train_zero(*world, task, dtype, spec);
  });
  // Every rank reports the same global losses and (gathered) parameters.
  for (int r = 1; r < dp; ++r) {
    CAPTURE(r);
    CHECK(runs[r].losses == runs[0].losses);
    CHECK(runs[r].params == runs[0].params);
  }
  return runs[0];
}

bool bitwise(const Run& a, const Run& b) { return a.losses == b.losses && a.params == b.params; }

// Tolerances: dp_harness.h's check_close (f64 1e-10 element-wise; f32 1e-5 on the loss curve
// and per parameter tensor in norm, or twice the one-device f32 run's own rounding where that
// is larger).
void check_equivalence(const Task& task, DType dtype) {
  const Run reference = train_reference(task, dtype);
  CHECK(reference.losses.back() < reference.losses.front() - 0.1);  // it learns something
  for (int dp : {1, 2, 4}) {
    for (int accum : {1, 2}) {
      std::vector<Run> by_stage;
      for (int stage : {0, 1, 2, 3}) {
        CAPTURE(dp);
        CAPTURE(stage);
        CAPTURE(accum);
        const Run run = run_zero(task, dtype, dp, {.stage = stage, .accum = accum});
        const bool bitwise = check_close(
            task, dtype, run, reference, fmt::format("dp={} zero={} accum={}", dp, stage, accum));
        // One rank, one micro-batch, stage 0: the same arithmetic as the reference.
        if (dp == 1 && accum == 1 && stage == 0) CHECK(bitwise);
        by_stage.push_back(run);
      }
      // Stages 1-3 share the segments, so the same reductions, the same clipping norm and
      // the same element-wise updates: bitwise equal to each other.
      CAPTURE(dp);
      CAPTURE(accum);
      CHECK(bitwise(by_stage[1], by_stage[2]));
      CHECK(bitwise(by_stage[1], by_stage[3]));
    }
  }
}

TEST_CASE("zero: MNIST MLP, dp x stage x accumulation equals one rank (f64 and f32)") {
  check_equivalence(mlp_task(), DType::f64);
  check_equivalence(mlp_task(), DType::f32);
}

TEST_CASE("zero: GPT-mini, dp x stage x accumulation equals one rank (f64 and f32)") {
  check_equivalence(gpt_task(), DType::f64);
  check_equivalence(gpt_task(), DType::f32);
}

// Dropless experts (8, top-2) in both blocks, with the balancing and z-losses: the routing
// counts are summed over the ranks, and with accumulation taken from a routing pass over the
// whole step, so the losses the experts attach (and their gradients) are one device's, and
// every layout trains the single-device model.
TEST_CASE("zero: GPT-mini with experts, dp x stage x accumulation equals one rank (f64 and f32), aux losses too") {
  const Task task = gpt_moe_task();
  int runs = 0;
  for (DType dtype : {DType::f64, DType::f32}) {
    const Run reference = train_reference(task, dtype);
    CHECK(reference.losses.back() < reference.losses.front() - 0.1);
    REQUIRE(reference.aux.size() == static_cast<size_t>(kSteps));
    CHECK(reference.aux[0] > 0.02);  // two blocks' alpha = 0.01 balancing losses, and more
    for (int dp : {1, 2, 4}) {
      for (int stage : {0, 1, 2, 3}) {
        for (int accum : {1, 2}) {
          CAPTURE(dtype);
          CAPTURE(dp);
          CAPTURE(stage);
          CAPTURE(accum);
          const Run run = run_zero(task, dtype, dp, {.stage = stage, .accum = accum});
          check_close(task, dtype, run, reference, fmt::format("dp={} zero={} accum={}", dp, stage, accum));
          check_aux(run, reference, dtype);
          ++runs;
        }
      }
    }
  }
  CHECK(runs == 2 * 3 * 4 * 2);
}

// Expert parallelism: the 8 experts split over groups of ep consecutive ranks (2 or 4 of the
// dp ranks), each expert's rows exchanged by all-to-all: the single-device model, in f64 to
// 1e-10 (f32 as stated above), on every ZeRO stage. Each rank holds its experts' parameters
// only, reduced (and sharded) over the dp / ep ranks holding the same experts; the final
// parameters compared are those gathered whole over ep.
TEST_CASE("zero: GPT-mini with experts over ep ranks (all-to-all) equals one rank, every stage") {
  const Task task = gpt_moe_task();
  int runs = 0;
  for (DType dtype : {DType::f64, DType::f32}) {
    const Run reference = train_reference(task, dtype);
    for (const auto& layout : {std::pair{2, 2}, std::pair{4, 2}, std::pair{4, 4}}) {
      const int dp = layout.first, ep = layout.second;  // (captured: no structured binding)
      for (int stage : {0, 1, 2, 3}) {
        CAPTURE(dtype);
        CAPTURE(dp);
        CAPTURE(ep);
        CAPTURE(stage);
        const Run run = run_zero(task, dtype, dp, {.stage = stage, .ep = ep});
        check_close(task, dtype, run, reference, fmt::format("dp={} ep={} zero={}", dp, ep, stage));
        check_aux(run, reference, dtype);
        ++runs;
      }
    }
  }
  CHECK(runs == 2 * 3 * 4);
}

// Where the experts' parameters live: each rank keeps E / ep experts, so its parameter
// elements are the whole model's less (1 - 1/ep) of the experts'; their gradients are
// reduced over the expert-data-parallel group ("edp", dp / ep ranks), everything else over
// the whole dp group, on every stage (the elements of each group's gradient collectives,
// from the comm log of one step, against the parameters that belong to it).
TEST_CASE("zero: experts' parameters live on their ranks and reduce over the expert-data-parallel group") {
  const Task task = gpt_moe_task();
  constexpr int dp = 4;
  int64_t whole = 0, expert = 0;
  {
    const std::shared_ptr<nn::Module> model = make_model(task, DType::f64);
    for (const auto& [name, t] : model->named_parameters()) {
      whole += t.numel();
      for (const char* part : {"mlp.fc_weight", "mlp.fc_bias", "mlp.proj_weight", "mlp.proj_bias"}) {
        if (name.ends_with(part)) expert += t.numel();
      }
    }
  }
  REQUIRE(expert > 0);
  int runs = 0;
  for (int ep : {2, 4}) {
    for (int stage : {0, 1, 2, 3}) {
      CAPTURE(ep);
      CAPTURE(stage);
      std::vector<CommLog> logs(dp);
      std::vector<int64_t> local(dp, 0);
      run_threads(dp, [&](CommPtr world) {
        ZeroRun spec{.stage = stage, .stop = 1, .ep = ep};
        spec.forward_log = &logs[world->rank()];
        spec.local_params = &local[world->rank()];
        train_zero(*world, task, DType::f64, spec);
      });
      for (int r = 0; r < dp; ++r) {
        CAPTURE(r);
        CHECK(local[r] == whole - expert + expert / ep);
        int64_t on_edp = 0, on_dp = 0, edp_records = 0;
        for (const CommRecord& rec : logs[r].records) {
          if (rec.kind != CommKind::gradients) continue;
          if (rec.group == "edp") {
            CHECK(rec.group_size == dp / ep);
            on_edp += rec.elements;
            ++edp_records;
          } else {
            CHECK(rec.group_size == dp);
            on_dp += rec.elements;
          }
        }
        CHECK(edp_records > 0);
        CHECK(on_edp == expert / ep);
        CHECK(on_dp == whole - expert);
      }
      ++runs;
    }
  }
  CHECK(runs == 2 * 4);
}

// The all-to-all bytes of one step from the comm log against the formula from the routed
// counts. Per layer, rank r sends the rows of its tokens for experts it does not hold
// (dispatch) and the outputs of the rows other ranks sent it (combine); backward sends the
// same amounts the other way. Each rank's counts come from the single-device model run on
// its slice of the batch (the same routing, independently of the exchange).
TEST_CASE("zero: expert parallelism's all-to-all bytes per step equal the formula from the counts") {
  const Task task = gpt_moe_task();
  constexpr int dp = 4;
  for (int ep : {2, 4}) {
    CAPTURE(ep);
    // counts[r][layer][e]: rank r's assignments to expert e in each block.
    std::vector<std::vector<std::vector<int64_t>>> counts(dp);
    {
      const std::shared_ptr<nn::Module> model = make_model(task, DType::f64);
      const NoGradGuard no_grad;
      for (int r = 0; r < dp; ++r) {
        const nn::MoeStatsScope routing;
        task.loss(*model, DType::f64, 0, r, dp);
        for (const nn::MoeLayerStats& l : routing.layers()) counts[r].push_back(l.counts);
      }
    }
    const int64_t E = task.experts, local = E / ep, C = 32, bytes = 8;
    std::vector<int64_t> want(dp, 0);
    for (int r = 0; r < dp; ++r) {
      const int group = r / ep, me = r % ep;
      for (size_t l = 0; l < counts[r].size(); ++l) {
        int64_t dispatch = 0, combine = 0;
        for (int64_t e = 0; e < E; ++e) {
          if (e / local != me) dispatch += counts[r][l][e];
        }
        for (int s = group * ep; s < (group + 1) * ep; ++s) {
          if (s == r) continue;
          for (int64_t e = me * local; e < (me + 1) * local; ++e) combine += counts[s][l][e];
        }
        want[r] += 2 * (dispatch + combine) * C * bytes;  // forward and backward
      }
    }
    std::vector<CommLog> logs(dp);
    run_threads(dp, [&](CommPtr world) {
      ZeroRun spec{.stage = 0, .stop = 1, .ep = ep};
      spec.forward_log = &logs[world->rank()];
      train_zero(*world, task, DType::f64, spec);
    });
    for (int r = 0; r < dp; ++r) {
      CAPTURE(r);
      CHECK(counts[r].size() == 2);  // both blocks route
      CHECK(want[r] > 0);
      CHECK(logs[r].bytes({CommKind::activations}) == want[r]);
      // Per block: the counts' exchange, dispatch and combine forward, both again backward.
      CHECK(logs[r].count("all_to_all", "ep") == 2 * 5);
    }
  }
}

// One training step of `task` under ZeRO on `world`, with the model called through
// operator() (the slice of rank r of the step's global batch).
void one_step(ZeroDataParallel& zero, optim::Optimizer& opt, const Task& task,
              Communicator& world, int64_t step) {
  zero.zero_grad();
  zero.backward(task.loss(zero.module(), DType::f32, step, world.rank(), world.size()));
  zero.clip_grad_norm(kClip);
  zero.step(opt);
}

TEST_CASE("zero: tagged memory per rank matches the ZeRO formulas within 5%") {
  const Task task = gpt_task();
  for (int dp : {2, 4}) {
    for (int stage : {0, 1, 2, 3}) {
      std::vector<ZeroMemory> reports(dp);
      std::vector<int64_t> gathered_now(dp);
      run_threads(dp, [&](CommPtr world) {
        MemoryTracker tracker;  // this rank's allocations only
        MemoryScope scope(&tracker);
        std::shared_ptr<nn::Module> model = task.make();
        ZeroDataParallel zero(*model, *world, {.stage = stage, .units = task.units});
        optim::AdamW opt(zero.param_groups(task.lr, kWeightDecay), {.lr = task.lr});
        one_step(zero, opt, task, *world, 0);
        reports[world->rank()] = zero.memory_report();
        gathered_now[world->rank()] = tracker.current(MemoryTag::gathered);
      });
      for (int r = 0; r < dp; ++r) {
        const ZeroMemory& m = reports[r];
        CAPTURE(dp);
        CAPTURE(stage);
        CAPTURE(r);
        MESSAGE(m.str());
        CHECK(m.numel == 2 * 12 * 32 * 32 + 2 * 13 * 32 + 256 * 32 + 16 * 32 + 2 * 32);
        CHECK(std::abs(m.measured() / m.formula() - 1.0) <= 0.05);
        // Each tag on its own, too (the split between them is the point of each stage).
        const double psi = static_cast<double>(m.numel), n = dp;
        const double params = stage == 3 ? 4 * psi / n : 4 * psi;
        const double grads = stage >= 2 ? 4 * psi / n : 4 * psi;
        const double optim_state = stage >= 1 ? 8 * psi / n : 8 * psi;
        CHECK(std::abs(m.parameters / params - 1.0) <= 0.05);
        CHECK(std::abs(m.gradients / grads - 1.0) <= 0.05);
        CHECK(std::abs(m.optimizer_state / optim_state - 1.0) <= 0.05);
        if (stage == 3) {
          // Between steps nothing stays gathered; at the peak the root (kept for the whole
          // step), the unit in use and the one prefetched (see the 4-block case below).
          CHECK(gathered_now[r] == 0);
          CHECK(m.gathered_peak == m.root_unit + 2 * m.largest_unit);
        } else {
          CHECK(m.gathered_peak == 0);
        }
      }
    }
  }
}

TEST_CASE("zero: bytes per step from the comm log (2 Psi for stages 0-2, 3 Psi for stage 3 units)") {
  const Task task = gpt_task();
  for (int dp : {2, 4}) {
    for (int stage : {0, 1, 2, 3}) {
      std::vector<CommLog> logs(dp);
      int64_t psi = 0, root_psi = 0;
      run_threads(dp, [&](CommPtr world) {
        std::shared_ptr<nn::Module> model = task.make();
        if (world->rank() == 0) {
          psi = model->num_parameters();
          for (auto& [name, p] : model->named_parameters()) {
            if (!name.starts_with("h.")) root_psi += p.numel();
          }
        }
        ZeroDataParallel zero(*model, *world, {.stage = stage, .units = task.units});
        optim::AdamW opt(zero.param_groups(task.lr, kWeightDecay), {.lr = task.lr});
        one_step(zero, opt, task, *world, 0);  // first step: optimizer state created
        CommLogScope scope(logs[world->rank()]);
        one_step(zero, opt, task, *world, 1);
      });
      // In units of Ψ f32 elements moved by a ring: 4 Ψ (n - 1) / n bytes per rank.
      const double unit = 4.0 * static_cast<double>(psi) * (dp - 1) / dp;
      for (int r = 0; r < dp; ++r) {
        CAPTURE(dp);
        CAPTURE(stage);
        CAPTURE(r);
        const CommLog& log = logs[r];
        int64_t clip_bytes = 0;
        for (const CommRecord& rec : log.records) {
          if (rec.cause == "zero clip_grad_norm") clip_bytes += rec.bytes;
        }
        const double volume = static_cast<double>(log.bytes() - clip_bytes) / unit;
        MESSAGE(fmt::format("dp={} stage={} rank {}: {:.4f} Psi per step ({} collectives, {} "
                            "bytes)",
                            dp, stage, r, volume, log.records.size(), log.bytes()));
        if (stage == 0) {
          CHECK(log.count("all_reduce") >= 1);
          CHECK(log.count("all_gather") == 0);
          CHECK(std::abs(volume - 2.0) <= 0.01);
        } else if (stage <= 2) {
          CHECK(log.count("all_reduce") == (stage == 0 ? 0 : 1));  // the clipping norm
          CHECK(log.count("reduce_scatter") == log.count("all_gather"));
          // Uneven blocks make a rank's share differ from 1/n by at most one element each.
          CHECK(std::abs(volume - 2.0) <= 0.01);
        } else {
          // Units: gathered for forward and for backward, then reduce-scattered (3 Psi); the
          // root is gathered once per step (FSDP keeps it between forward and backward).
          const double expected = 3.0 - static_cast<double>(root_psi) / psi;
          CHECK(std::abs(volume - expected) <= 0.01);
        }
      }
    }
  }
}

TEST_CASE("zero: stage 3 gathers each unit before forward and backward, prefetching the next") {
  const Task task = gpt_task();
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = task.make();
    ZeroDataParallel zero(*model, *world, {.stage = 3, .units = task.units});
    optim::AdamW opt(zero.param_groups(task.lr, kWeightDecay), {.lr = task.lr});
    CommLog log;
    {
      CommLogScope scope(log);
      one_step(zero, opt, task, *world, 0);
    }
    std::vector<std::string> gathers;
    for (const CommRecord& rec : log.records) {
      if (rec.op == "all_gather") gathers.push_back(rec.cause);
    }
    // Forward: the root (embeddings), then block 0 and block 1 each launched one unit ahead;
    // backward: block 1 again, then block 0 (launched when block 1's backward starts).
    // Each unit has two segments (the decay and the no-decay parameters): two records.
    std::vector<std::string> want;
    for (const char* unit : {"root", "h.0", "h.1", "h.1", "h.0"}) {
      want.insert(want.end(), 2, fmt::format("zero gather {}", unit));
    }
    CAPTURE(fmt::format("{}", fmt::join(gathers, " | ")));
    CHECK(gathers == want);
    // Outside a step every parameter's bytes are released: calling a unit's forward directly
    // (not through operator()) names the problem.
    auto& gpt = static_cast<gpt::Gpt&>(*model);
    const data::TextBatch b = data::TextWindows(std::vector<uint8_t>(64, 'a'),
                                                data::TextSplit::train, 0)
                                  .get(0, 1, 8);
    CHECK(contains(error_of([&] { gpt.forward(b.idx); }), "released storage"));
    // Through operator() it works, in eval too (no gradients: everything freed after).
    {
      NoGradGuard no_grad;
      CHECK(gpt(b.idx).shape() == Shape{1, 8, 256});
    }
    CHECK(contains(error_of([&] { gpt.forward(b.idx); }), "released storage"));
  });
}

TEST_CASE("zero: stage 3's gathered peak is the root plus two blocks (one without prefetch)") {
  for (bool prefetch : {true, false}) {
    run_threads(2, [&](CommPtr world) {
      MemoryTracker tracker;
      MemoryScope scope(&tracker);
      manual_seed(0);
      auto model = std::make_shared<gpt::Gpt>(
          gpt::GptConfig{.layers = 4, .heads = 2, .width = 32, .context = 16, .vocab = 256});
      ZeroDataParallel zero(*model, *world,
                            {.stage = 3, .units = {"h.0", "h.1", "h.2", "h.3"},
                             .prefetch = prefetch});
      optim::AdamW opt(zero.param_groups(1e-3, kWeightDecay));
      const data::TextBatch b = data::TextWindows(std::vector<uint8_t>(256, 'a'),
                                                  data::TextSplit::train, 0)
                                    .get(0, 4, 16, world->rank(), 2);
      zero.zero_grad();
      zero.backward(gpt::Gpt::loss((*model)(b.idx), b.targets));
      zero.step(opt);
      const ZeroMemory m = zero.memory_report();
      CAPTURE(prefetch);
      MESSAGE(m.str());
      CHECK(m.gathered_peak == m.root_unit + (prefetch ? 2 : 1) * m.largest_unit);
      CHECK(tracker.current(MemoryTag::gathered) == 0);
      // Each segment's full gradient buffer is freed once its reduction is taken (at the
      // latest when the next segment launches): the whole model's never exists at once.
      CHECK(m.gradients_peak < 4 * m.numel);
      CHECK(m.gradients_peak >= m.gradients + 4 * 12 * 32 * 32);  // + one block's matrices
    });
  }
}

TEST_CASE("zero: resume under another (dp, stage) continues the same losses") {
  for (const Task& task : {gpt_task(), mlp_task()}) {
    constexpr int64_t kHalf = kSteps / 2;
    // Uninterrupted, on dp=2 stage 3.
    const Run whole = run_zero(task, DType::f64, 2, {.stage = 3});
    // Saved at step 10 under dp=2 stage 3 ...
    Checkpoint ckpt;
    std::vector<Checkpoint> saved(2);
    run_threads(2, [&](CommPtr world) {
      train_zero(*world, task, DType::f64,
                 {.stage = 3, .stop = kHalf, .save = &saved[world->rank()]});
    });
    ckpt = saved[0];
    // ... the single-device layout: same keys as a plain AdamW on decay_groups.
    {
      std::shared_ptr<nn::Module> model = task.make();
      optim::AdamW plain(optim::decay_groups(model->named_parameters(), 1e-3, 0.1));
      plain.zero_grad();
      for (const Tensor& p : model->parameters()) p.set_grad(zeros_like(p));
      plain.step();
      std::vector<std::string> want, got;
      for (auto& [k, v] : plain.state_dict()) want.push_back(k);
      for (auto& [k, v] : ckpt.optimizer) got.push_back(k);
      CHECK(got == want);
      // Plain variables, not a structured binding: CAPTURE captures them (clang < 16 rejects
      // that).
      for (auto& entry : plain.state_dict()) {
        const std::string& k = entry.first;
        Tensor& v = entry.second;
        CAPTURE(k);
        CHECK(ckpt.optimizer.at(k).shape() == v.shape());
      }
    }
    // ... and loaded under dp=1 stage 0, dp=4 stage 1 and dp=2 stage 2.
    for (const auto& layout : {std::pair{1, 0}, std::pair{4, 1}, std::pair{2, 2}}) {
      const int dp = layout.first, stage = layout.second;
      CAPTURE(task.name);
      CAPTURE(dp);
      CAPTURE(stage);
      const Run rest =
          run_zero(task, DType::f64, dp, {.stage = stage, .start = kHalf, .load = &ckpt});
      REQUIRE(rest.losses.size() == static_cast<size_t>(kSteps - kHalf));
      for (int64_t i = 0; i < kSteps - kHalf; ++i) {
        CHECK(std::abs(rest.losses[i] - whole.losses[kHalf + i]) <= 1e-10);
      }
      Run tail = whole;  // the params after step 20; the losses were compared above
      tail.losses = rest.losses;
      const Diff d = compare(task, rest, tail);
      CHECK(d.param_abs <= 1e-10);
    }
  }
}

// Steps each parameter by its gradient over the gradient's L2 norm: the norm is the whole
// tensor's, so the update of an element depends on the other elements (not elementwise).
class NormalizedSGD final : public optim::Optimizer {
 public:
  NormalizedSGD(std::vector<optim::ParamGroup> groups, double lr)
      : Optimizer("NormalizedSGD", std::move(groups), lr, 0.0) {}
  void step() override {
    NoGradGuard no_grad;
    for (const optim::ParamGroup& g : param_groups()) {
      for (const Tensor& p : g.params) {
        if (!p.grad().defined()) continue;
        const double norm = std::sqrt(sum(mul(p.grad(), p.grad())).item<double>());
        p.copy_(p - p.grad() * (g.lr / (norm + 1e-12)));
      }
    }
  }
  bool elementwise() const override { return false; }

 protected:
  std::vector<StateSpec> state_specs(const Tensor&) const override { return {}; }
  std::map<std::string, double> hyperparameters() const override { return {}; }
  void set_hyperparameters(const std::map<std::string, double>&) override {}
};

TEST_CASE("zero: a non-elementwise optimizer is refused on flat shards, accepted by stage 0") {
  const Task task = gpt_task();
  for (int stage : {0, 1, 3}) {
    CAPTURE(stage);
    run_threads(2, [&](CommPtr world) {
      std::shared_ptr<nn::Module> model = task.make();
      ZeroDataParallel zero(*model, *world, {.stage = stage, .units = task.units});
      NormalizedSGD opt(zero.param_groups(task.lr, 0.0), task.lr);
      zero.zero_grad();
      zero.backward(task.loss(*model, DType::f32, 0, world->rank(), 2));
      if (stage == 0) {
        CHECK_NOTHROW(zero.step(opt));  // DDP: the optimizer sees the whole parameters
        return;
      }
      const std::string msg = error_of([&] { zero.step(opt); });
      CHECK(contains(msg, fmt::format("ZeRO stage {} runs the optimizer on flat 1-D shards", stage)));
      CHECK(contains(msg, "NormalizedSGD is not elementwise"));
      CHECK(contains(error_of([&] { zero.optimizer_state_dict(opt); }), "NormalizedSGD"));
    });
  }
}

TEST_CASE("zero: errors") {
  const Task task = gpt_task();
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = task.make();
    CHECK(contains(error_of([&] { ZeroDataParallel z(*model, *world, {.stage = 4}); }),
                   "stage must be 0, 1, 2 or 3, got 4"));
    CHECK(contains(error_of([&] {
                     ZeroDataParallel z(*model, *world, {.stage = 3, .units = {"h.7"}});
                   }),
                   "has no submodule '7' (looking up 'h.7')"));
    CHECK(contains(error_of([&] {
                     ZeroDataParallel z(*model, *world, {.stage = 3, .units = {"h", "h.0"}});
                   }),
                   "also belongs to unit 'h'"));
  });
  // Members that disagree on the stage are told so before any gradient moves.
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = task.make();
    CHECK(contains(error_of([&] {
                     ZeroDataParallel z(*model, *world, {.stage = 1 + world->rank()});
                   }),
                   "disagree on the parameter list"));
  });
  // Stage 1 keeps the reduced gradients in the full buffer: a second synchronising backward
  // needs zero_grad() first.
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = task.make();
    ZeroDataParallel zero(*model, *world, {.stage = 1});
    zero.zero_grad();
    zero.backward(task.loss(*model, DType::f32, 0, world->rank(), 2));
    CHECK(contains(error_of([&] {
                     zero.backward(task.loss(*model, DType::f32, 0, world->rank(), 2));
                   }),
                   "without zero_grad() in between"));
  });
}

}  // namespace
}  // namespace tessera::parallel
