// Data parallelism (parallel/data_parallel.h) on the threads backend: the MNIST MLP and a
// GPT-mini trained 20 AdamW steps with dp in {1, 2, 4} x accumulation in {1, 2} at a fixed
// global batch match the single-rank run (loss curve and final parameters); bucket order and
// sizes in the comm log; no_sync; launches during backward; replica checks; unused params.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/data/text.h"
#include "models/gpt/model.h"
#include "models/mnist/model.h"
#include "nn/layers.h"
#include "optim/adamw.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/data_parallel.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tests/parallel/dp_harness.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using testing::contains;
using testing::error_of;


using namespace testing_dp;

// dp = 0: the reference, one rank, one micro-batch, no DDP.
Run train(const Task& task, DType dtype, int dp, int accum, DdpOptions options = {}) {
  const int ranks = std::max(dp, 1);
  std::vector<Run> runs(ranks);
  run_threads(ranks, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = task.make();
    model->to(dtype);
    std::unique_ptr<DistributedDataParallel> ddp;
    if (dp > 0) ddp = std::make_unique<DistributedDataParallel>(*model, *world, options);
    optim::AdamW opt(model->parameters(), {.lr = task.lr});
    Run& run = runs[world->rank()];
    for (int64_t step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      double local = 0;
      for (int micro = 0; micro < accum; ++micro) {
        Tensor loss = task.loss(*model, dtype, step, world->rank() * accum + micro,
                                ranks * accum);
        local += loss.item<double>();
        if (accum > 1) loss = loss / static_cast<double>(accum);
        if (ddp && micro + 1 < accum) {
          auto guard = ddp->no_sync();
          loss.backward();
        } else {
          loss.backward();
          if (ddp) ddp->finish();
        }
      }
      opt.step();
      Tensor total = Tensor::from_vector<double>({local}, {1});
      world->all_reduce(total, ReduceOp::sum);
      run.losses.push_back(total.item<double>() / (ranks * accum));
    }
    run.params = values_of(*model);
    for (auto& [name, _] : model->named_parameters()) run.names.push_back(name);
  });
  // Replicas stay bitwise identical: the same averaged gradients, the same updates.
  for (int r = 1; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(runs[r].params == runs[0].params);
    CHECK(runs[r].losses == runs[0].losses);
  }
  return runs[0];
}


// Tolerances. f64: every element within 1e-10 of the single-rank run (only summation order
// differs, ~1e-16 per gradient; measured ~1e-13 after 20 steps). f32: the loss curve within
// 1e-5 relative and every parameter tensor within 1e-5 in norm (||a - b|| / ||b||; measured
// ~2e-6). Element-wise f32 is not a fair test of AdamW: its normalised step m / sqrt(v) turns
// a gradient that is pure f32 rounding noise (the attention key bias, whose exact gradient is
// zero, or a ReLU unit on the edge of dying) into a full lr-sized step whose sign depends on
// the summation order. Those elements are reported (MESSAGE) and bounded by 2 * steps * lr.
void check_equivalence(const Task& task, DType dtype) {
  const bool f64 = dtype == DType::f64;
  const Run reference = train(task, dtype, 0, 1);
  CHECK(reference.losses.back() < reference.losses.front() - 0.1);  // it learns something
  for (int dp : {1, 2, 4}) {
    for (int accum : {1, 2}) {
      CAPTURE(dp);
      CAPTURE(accum);
      const Run run = train(task, dtype, dp, accum);
      const Diff d = compare(task, run, reference);
      const bool bitwise = run.losses == reference.losses && run.params == reference.params;
      MESSAGE(fmt::format("{} {} dp={} accum={}: {} (loss rel {:.2g}; params: max abs {:.2g}, "
                          "max rel {:.2g}, norm rel {:.2g}, zero-gradient elements abs {:.2g})",
                          task.name, dtype, dp, accum, bitwise ? "bitwise equal" : "close",
                          d.loss, d.param_abs, d.param_rel, d.param_norm, d.zero_grad_abs));
      if (f64) {
        CHECK(d.loss <= 1e-10);
        CHECK(d.param_abs <= 1e-10);
        CHECK(d.param_rel <= 1e-10);
      } else {
        CHECK(d.loss <= 1e-5);
        CHECK(d.param_norm <= 1e-5);
        CHECK(d.zero_grad_abs <= 2 * kSteps * task.lr);
      }
      // One rank, one micro-batch: DDP's all_reduce over a group of one copies the gradient
      // through the bucket and back unchanged.
      if (dp == 1 && accum == 1) CHECK(bitwise);
    }
  }
}

TEST_CASE("ddp: MNIST MLP, dp x accumulation equals one rank (f64 and f32)") {
  check_equivalence(mlp_task(), DType::f64);
  check_equivalence(mlp_task(), DType::f32);
}

TEST_CASE("ddp: GPT-mini, dp x accumulation equals one rank (f64 and f32)") {
  check_equivalence(gpt_task(), DType::f64);
  check_equivalence(gpt_task(), DType::f32);
}

// The bucket layout the greedy rule gives over reverse registration order (one dtype).
std::vector<std::vector<std::string>> expected_buckets(const nn::Module& model, int64_t cap) {
  std::vector<std::vector<std::string>> out;
  int64_t bytes = 0;
  const nn::NamedTensors params = model.named_parameters();
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (out.empty() || (bytes > 0 && bytes + it->second.nbytes() > cap)) {
      out.emplace_back();
      bytes = 0;
    }
    out.back().push_back(it->first);
    bytes += it->second.nbytes();
  }
  return out;
}

TEST_CASE("ddp: small buckets launch in reverse layer order during backward") {
  const Task task = gpt_task();
  constexpr int64_t kCap = 16 << 10;  // 16 KiB: several buckets for GPT-mini in f32
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = task.make();
    DistributedDataParallel ddp(*model, *world, {.bucket_bytes = kCap});
    const auto buckets = ddp.buckets();
    const auto expected = expected_buckets(*model, kCap);
    REQUIRE(buckets.size() == expected.size());
    CHECK(buckets.size() >= 4);
    for (size_t k = 0; k < buckets.size(); ++k) CHECK(buckets[k].names == expected[k]);
    CHECK(buckets.front().names.front() == "ln_f.bias");     // the last registered
    CHECK(buckets.back().names.back() == "wte.weight");      // the first registered

    // The token embedding's gradient arrives last (the embedding and the tied head both
    // feed it); by then the buckets of the later layers are already on the wire.
    CommLog log;
    int64_t launched_before_last_grad = -1;
    Tensor wte;
    for (auto& [name, p] : model->named_parameters()) {
      if (name == "wte.weight") wte = p;
    }
    wte.register_hook([&](const Tensor&) {
      launched_before_last_grad = log.count("all_reduce");
      return Tensor();
    });
    {
      CommLogScope scope(log);
      task.loss(*model, DType::f32, 0, world->rank(), 2).backward();
      // Every bucket filled during backward, so every one was launched from a hook.
      CHECK(log.count("all_reduce") == static_cast<int64_t>(buckets.size()));
      CHECK(ddp.pending() == static_cast<int>(buckets.size()));
      CHECK(ddp.stats().launched_in_backward == static_cast<int64_t>(buckets.size()));
      ddp.finish();
    }
    CHECK(launched_before_last_grad >= 1);
    CHECK(launched_before_last_grad < static_cast<int64_t>(buckets.size()));
    CHECK(ddp.pending() == 0);
    REQUIRE(log.records.size() == buckets.size());
    for (size_t k = 0; k < buckets.size(); ++k) {
      CAPTURE(k);
      CHECK(log.records[k].op == "all_reduce");
      CHECK(log.records[k].cause == fmt::format("ddp bucket {}", k));
      CHECK(log.records[k].elements == buckets[k].elements);
      CHECK(log.records[k].group == "world");
    }
  });
}

TEST_CASE("ddp: one bucket with the default size; no_sync reduces once per step") {
  const Task task = mlp_task();
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = task.make();
    DistributedDataParallel ddp(*model, *world);  // 25 MiB: the MLP (0.8 MB) fits one
    REQUIRE(ddp.buckets().size() == 1);
    CHECK(ddp.buckets()[0].elements == model->num_parameters());
    CommLog log;
    CommLogScope scope(log);
    for (int64_t step = 0; step < 2; ++step) {
      for (int micro = 0; micro < 3; ++micro) {
        Tensor loss = task.loss(*model, DType::f32, step, world->rank() * 3 + micro, 6) / 3.0;
        if (micro < 2) {
          auto guard = ddp.no_sync();
          loss.backward();
          ddp.finish();  // inside no_sync: nothing to do
          CHECK(log.records.empty());
          CHECK(ddp.pending() == 0);
        } else {
          loss.backward();
          CHECK(log.count("all_reduce") == 1);  // launched by the last gradient's hook
          ddp.finish();
        }
      }
      CHECK(log.count("all_reduce") == 1);
      CHECK(log.records[0].elements == model->num_parameters());
      model->zero_grad();
      log.clear();
    }
    CHECK(ddp.stats().rounds == 2);
    CHECK(ddp.stats().launched_in_backward == 2);
    CHECK(ddp.stats().launched_in_finish == 0);
  });
}

// Two heads; rank 0 uses both, rank 1 only `a`: rank 1's bucket holding b never fills during
// backward and is launched by finish(), with zeros for b.
class TwoHeads : public nn::Module {
 public:
  TwoHeads() {
    a = register_module("a", std::make_shared<nn::Linear>(4, 3));
    b = register_module("b", std::make_shared<nn::Linear>(4, 3));
  }
  std::shared_ptr<nn::Linear> a, b;
};

TEST_CASE("ddp: parameters without a gradient still take part (zeros)") {
  std::vector<std::vector<double>> b_grads(2), a_grads(2);
  std::vector<DistributedDataParallel::Stats> stats(2);
  run_threads(2, [&](CommPtr world) {
    manual_seed(0);
    TwoHeads model;
    model.to(DType::f64);
    // A bucket per parameter: b.bias, b.weight, a.bias, a.weight.
    DistributedDataParallel ddp(model, *world, {.bucket_bytes = 8});
    REQUIRE(ddp.buckets().size() == 4);
    manual_seed(5);
    const Tensor x = randn({2, 4}, DType::f64);
    Tensor loss = model.a->forward(x).sum() * (1.0 + world->rank());
    if (world->rank() == 0) loss = loss + (model.b->forward(x) * 3.0).sum();
    loss.backward();
    ddp.finish();
    b_grads[world->rank()] = model.b->weight.grad().to_vector<double>();
    a_grads[world->rank()] = model.a->weight.grad().to_vector<double>();
    stats[world->rank()] = ddp.stats();
  });
  CHECK(b_grads[0] == b_grads[1]);
  CHECK(a_grads[0] == a_grads[1]);
  // d/dW sum(3 (x W^T + b)) = 3 * column sums of x, averaged with rank 1's zeros.
  manual_seed(5);
  const std::vector<double> x = randn({2, 4}, DType::f64).to_vector<double>();
  for (int o = 0; o < 3; ++o) {
    for (int i = 0; i < 4; ++i) {
      CHECK(b_grads[0][o * 4 + i] == doctest::Approx(1.5 * (x[i] + x[4 + i])).epsilon(1e-14));
      CHECK(a_grads[0][o * 4 + i] == doctest::Approx(1.5 * (x[i] + x[4 + i])).epsilon(1e-14));
    }
  }
  CHECK(stats[0].launched_in_backward == 4);
  CHECK(stats[1].launched_in_backward == 0);  // bucket 0 (b.bias) never filled: all wait
  CHECK(stats[1].launched_in_finish == 4);
}

TEST_CASE("ddp: a perturbed replica is named; broadcast_parameters fixes it") {
  std::vector<std::string> errors(3);
  std::vector<std::vector<std::vector<double>>> values(3);
  run_threads(3, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = mlp_task().make();
    if (world->rank() == 2) {
      for (auto& [name, p] : model->named_parameters()) {
        if (name == "3.bias") {
          NoGradGuard no_grad;
          p.narrow(0, 4, 1).copy_(p.narrow(0, 4, 1) + 0.25);
        }
      }
    }
    errors[world->rank()] = error_of([&] { DistributedDataParallel ddp(*model, *world); });
    DistributedDataParallel ddp(*model, *world, {.check_replicas = false});
    ddp.broadcast_parameters();
    ddp.check_replicas();  // passes now
    DistributedDataParallel checked(*model, *world);
    values[world->rank()] = values_of(*model);
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(errors[r]);
    CHECK(errors[r] == errors[0]);  // every member throws the same message
    CHECK(contains(errors[r], "parameter '3.bias' [10] on rank 2"));
    CHECK(contains(errors[r], "largest |difference| over the group 0.25"));
    CHECK(contains(errors[r], "broadcast_parameters()"));
    CHECK(values[r] == values[0]);
  }
}

TEST_CASE("ddp: errors") {
  run_threads(1, [](CommPtr world) {
    std::shared_ptr<nn::Module> model = mlp_task().make();
    CHECK(contains(error_of([&] {
                     DistributedDataParallel bad(*model, *world, {.bucket_bytes = 0});
                   }),
                   "bucket_bytes must be positive"));
    DistributedDataParallel ddp(*model, *world);
    const Task task = mlp_task();
    task.loss(*model, DType::f32, 0, 0, 1).backward();
    // A second synchronising backward before finish() would reduce a half-accumulated sum.
    CHECK(contains(error_of([&] { task.loss(*model, DType::f32, 0, 0, 1).backward(); }),
                   "received a second gradient before finish()"));
    CHECK(contains(error_of([&] { auto guard = ddp.no_sync(); }), "call finish()"));
    ddp.finish();
    // Converting the model after construction leaves the buckets with the old dtype.
    // (The bucket fills during backward, so the error comes from the backward.)
    model->to(DType::f64);
    CHECK(contains(error_of([&] { ddp.backward(task.loss(*model, DType::f64, 0, 0, 1)); }),
                   "construct the DDP after Module::to()"));
  });
  // Members with different models refuse to pair their collectives.
  std::vector<std::string> errors(2);
  run_threads(2, [&](CommPtr world) {
    manual_seed(0);
    nn::Linear model(4, world->rank() == 0 ? 3 : 5);
    errors[world->rank()] = error_of([&] { DistributedDataParallel ddp(model, *world); });
  });
  CHECK(contains(errors[0], "disagree on the parameter list"));
  CHECK(contains(errors[1], "rank 0 has 2 parameters of 15 elements, rank 1 has 2 of 25"));
}

}  // namespace
}  // namespace tessera::parallel
