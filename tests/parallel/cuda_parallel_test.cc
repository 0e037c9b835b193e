// GPU-tagged: data parallelism with several ranks sharing cuda:0 through the threads
// communicator, which stages CUDA tensors through host copies (parallel/comm/staging.h;
// NCCL refuses two ranks on one GPU). The shared collective checks on CUDA buffers; the
// comm log against CPU buffers; DDP and ZeRO stages 1-3 on the MNIST MLP and GPT-mini
// (dp 2 and 4) with parameters and batches on cuda:0 against the single-device CUDA run
// (dp_harness.h's tolerances: f64 1e-10 element-wise, f32 1e-5; ZeRO's f32 cases, against
// train_reference, twice the one-device f32 run's own rounding where that is larger), after
// a triage case that tells kernel thread-safety problems from communicator ones. Needs a GPU:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/parallel:cuda_parallel_test
// Without --config=cuda this file compiles to an empty suite.
#include <doctest/doctest.h>

#ifdef TESSERA_CUDA

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <string>
#include <vector>

#include "optim/adamw.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/data_parallel.h"
#include "tensor/ops.h"
#include "tests/parallel/collective_checks.h"
#include "tests/parallel/dp_harness.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using namespace testing_dp;

const Device kGpu = cuda(0);

TEST_CASE("threads on cuda:0: every collective on 1, 2, 3 and 4 ranks sharing the GPU") {
  for (int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    run_threads(n, [](CommPtr world) { testing::check_collectives(world, kGpu); });
  }
}

TEST_CASE("threads on cuda:0: the comm log records what CPU buffers record") {
  auto record = [](Device device) {
    std::vector<std::vector<CommRecord>> logs(4);
    run_threads(4, [&](CommPtr world) {
      const int me = world->rank();
      CommLog log;
      {
        CommLogScope scope(log);
        world->all_reduce(zeros({10}, DType::f32, device), ReduceOp::sum);
        world->all_gather(Tensor::empty({12}, DType::bf16, device),
                          zeros({3}, DType::bf16, device));
        world->reduce_scatter(Tensor::empty({2}, DType::f64, device),
                              zeros({8}, DType::f64, device), ReduceOp::avg);
        world->broadcast(zeros({5}, DType::i64, device), 2);
        world->all_to_all(Tensor::empty({8}, DType::i32, device), zeros({8}, DType::i32, device));
        if (me % 2 == 0) world->send(zeros({7}, DType::f32, device), me + 1, 3);
        else world->recv(Tensor::empty({7}, DType::f32, device), me - 1, 3);
        world->barrier();
      }
      logs[me] = log.records;
    });
    return logs;
  };
  const auto cpu = record(kCPU), gpu = record(kGpu);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    REQUIRE(gpu[r].size() == cpu[r].size());
    for (size_t i = 0; i < cpu[r].size(); ++i) {
      CAPTURE(cpu[r][i].op);
      CHECK(gpu[r][i].op == cpu[r][i].op);
      CHECK(gpu[r][i].bytes == cpu[r][i].bytes);
      CHECK(gpu[r][i].elements == cpu[r][i].elements);
      CHECK(gpu[r][i].dtype == cpu[r][i].dtype);
    }
  }
}

TEST_CASE("threads on cuda:0: async collectives see the device work queued before them") {
  run_threads(2, [](CommPtr world) {
    // 32 MiB copied host -> device on the compute stream, an async all_reduce issued at
    // once, then device work queued before wait(): the staged copy must read the finished
    // buffer, and wait() must land the result before later kernels read it.
    constexpr int64_t n = int64_t{8} << 20;
    const double mine = world->rank() + 1.0;
    Tensor d = zeros({n}, DType::f32, kGpu);
    d.copy_(full({n}, mine, DType::f32));
    WorkHandle h = world->all_reduce_async(d, ReduceOp::sum);
    Tensor other = full({n}, 7.0, DType::f32, kGpu);  // unrelated work meanwhile
    h->wait();
    Tensor copy = Tensor::empty({n}, DType::f32, kGpu);
    copy.copy_(d);  // a device kernel after wait()
    const std::vector<float> v = copy.to(kCPU).to_vector<float>();
    CHECK(v.front() == 3.0f);
    CHECK(v[n / 2] == 3.0f);
    CHECK(v.back() == 3.0f);
    CHECK(other.to(kCPU).to_vector<float>()[5] == 7.0f);
  });
}

// DDP over `dp` threads sharing the task's device (data_parallel_test's loop: AdamW without
// weight decay or clipping); dp = 0 is the single-device reference without a wrapper.
Run train_ddp(const Task& task, DType dtype, int dp, int accum, DdpOptions options = {}) {
  const int ranks = std::max(dp, 1);
  std::vector<Run> runs(ranks);
  run_threads(ranks, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = make_model(task, dtype);
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
    for (const Tensor& p : model->parameters()) CHECK(p.device() == task.device);
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

// Triage for the equivalence cases below, which need more than the communicator: (1) the
// single-device run repeated on two threads at once (no collectives) must equal it - else
// some CUDA kernel is not safe to call from several host threads; (2) DDP over one rank
// (gradients become views of a bucket, staged through the host and back) must equal it -
// else a kernel mishandles gradients that are offset views, or the staging is wrong.
TEST_CASE("cuda triage: two threads training alone, and DDP over one rank, equal one thread") {
  for (const Task& task : {mlp_task(kGpu), gpt_task(kGpu)}) {
    const Run reference = train_reference(task, DType::f64);
    std::vector<Run> alone(2);
    run_threads(2, [&](CommPtr world) {
      alone[world->rank()] = train_reference(task, DType::f64);
    });
    for (int r = 0; r < 2; ++r) {
      check_close(task, DType::f64, alone[r], reference,
                  fmt::format("thread {} of 2 training alone", r));
    }
    const Run ddp_ref = train_ddp(task, DType::f64, 0, 1);
    check_close(task, DType::f64, train_ddp(task, DType::f64, 1, 1), ddp_ref,
                "ddp over one rank");
  }
}

// Per parameter tensor (by name): max |device - cpu| / max |cpu| of the f64 gradients of
// step 0's micro-batch `part` of `parts`, one backward each from the same initial values.
std::vector<std::pair<std::string, double>> gradient_gaps(const Task& on_device, const Task& on_cpu,
                                                          int part, int parts) {
  const auto grads = [&](const Task& task) {
    std::shared_ptr<nn::Module> model = make_model(task, DType::f64);
    task.loss(*model, DType::f64, 0, part, parts).backward();
    std::vector<std::pair<std::string, std::vector<double>>> out;
    for (const auto& [name, p] : model->named_parameters()) {
      REQUIRE_MESSAGE(p.grad().defined(), fmt::format("{}: {} has no gradient", task.name, name));
      out.emplace_back(name, p.grad().to(kCPU).to_vector<double>());
    }
    return out;
  };
  const auto got = grads(on_device), want = grads(on_cpu);
  REQUIRE(got.size() == want.size());
  std::vector<std::pair<std::string, double>> gaps;
  for (size_t t = 0; t < want.size(); ++t) {
    REQUIRE(got[t].first == want[t].first);
    REQUIRE(got[t].second.size() == want[t].second.size());
    double diff = 0, scale = 0;
    for (size_t i = 0; i < want[t].second.size(); ++i) {
      diff = std::max(diff, std::abs(got[t].second[i] - want[t].second[i]));
      scale = std::max(scale, std::abs(want[t].second[i]));
    }
    gaps.emplace_back(want[t].first, scale > 0 ? diff / scale : diff);
  }
  return gaps;
}

// Triage for the DDP cases' mismatch (2026-11-22 on an H100: f64 dp=2 off the one-device
// run by 1.6%, the replicas bitwise equal - which the all-reduce gives whatever the
// gradients were) that needs no second rank: ranks train on slices of the batch (dp=2: 16
// of the MLP's 32 rows; dp=4 x accum 2: 4 rows, one GPT-mini sequence), shapes no other
// CUDA test trains on. (1) Each micro-batch shape's f64 gradients on cuda:0 against the
// CPU's, per tensor: the largest difference over the tensor's largest element, at most
// 1e-10 (summation order alone gives ~1e-15; a wrong kernel, percents), naming the first tensor off; (2) the same shapes as
// accumulated micro-batches on one thread, without DDP, against the whole batch. If both
// pass and the DDP cases fail, the fault is in the ranks' sharing after all.
TEST_CASE("cuda triage: micro-batch shapes on one thread - their gradients against the CPU's, "
          "accumulated against the whole batch") {
  int compared = 0;
  for (const auto& [gpu_task, cpu_task] :
       {std::pair{mlp_task(kGpu), mlp_task(kCPU)}, std::pair{gpt_task(kGpu), gpt_task(kCPU)}}) {
    CAPTURE(gpu_task.name);
    // (part, parts): the whole batch, the first and last slices of dp=2's and of dp=4 x 2's.
    for (const auto& [part, parts] : {std::pair{0, 1}, {0, 2}, {1, 2}, {0, 8}, {7, 8}}) {
      for (const auto& [name, gap] : gradient_gaps(gpu_task, cpu_task, part, parts)) {
        CHECK_MESSAGE(gap <= 1e-10, fmt::format("{} micro-batch {} of {}: {}'s f64 gradient is "
                                                "{:.3g} (of its largest element) off the CPU's",
                                                gpu_task.name, part, parts, name, gap));
        ++compared;
      }
    }
    const Run whole = train_ddp(gpu_task, DType::f64, 0, 1);
    for (int accum : {2, 8}) {
      check_close(gpu_task, DType::f64, train_ddp(gpu_task, DType::f64, 0, accum), whole,
                  fmt::format("one thread, {} accumulated micro-batches", accum));
    }
  }
  // Parameter tensors: the MLP's 2 Linears (4), GPT-mini's 2 blocks (12 each) and its
  // embeddings and final norm (4); 5 micro-batches each.
  CHECK(compared == 5 * (4 + 28));
}

void check_ddp(const Task& task, DType dtype) {
  const Run reference = train_ddp(task, dtype, 0, 1);
  CHECK(reference.losses.back() < reference.losses.front() - 0.1);  // it learns something
  // (dp, accum): small buckets with accumulation, so several collectives are in flight
  // during backward.
  for (auto [dp, accum] : {std::pair{2, 1}, std::pair{4, 2}}) {
    CAPTURE(dp);
    CAPTURE(accum);
    DdpOptions options;
    if (accum == 2) options.bucket_bytes = 16 << 10;
    const Run run = train_ddp(task, dtype, dp, accum, options);
    check_close(task, dtype, run, reference,
                fmt::format("cuda ddp dp={} accum={} bucket_bytes={}", dp, accum,
                            options.bucket_bytes));
  }
}

TEST_CASE("cuda ddp: MNIST MLP on threads sharing cuda:0 equals one device (f64 and f32)") {
  check_ddp(mlp_task(kGpu), DType::f64);
  check_ddp(mlp_task(kGpu), DType::f32);
}

TEST_CASE("cuda ddp: GPT-mini on threads sharing cuda:0 equals one device (f64 and f32)") {
  check_ddp(gpt_task(kGpu), DType::f64);
  check_ddp(gpt_task(kGpu), DType::f32);
}

Run run_zero(const Task& task, DType dtype, int dp, const ZeroRun& spec) {
  std::vector<Run> runs(dp);
  run_threads(dp, [&](CommPtr world) {
    runs[world->rank()] = train_zero(*world, task, dtype, spec);
  });
  for (int r = 1; r < dp; ++r) {
    CAPTURE(r);
    CHECK(runs[r].losses == runs[0].losses);
    CHECK(runs[r].params == runs[0].params);
  }
  return runs[0];
}

void check_zero(const Task& task, DType dtype) {
  const Run reference = train_reference(task, dtype);
  CHECK(reference.losses.back() < reference.losses.front() - 0.1);
  // (Stages 1-3 are not compared bitwise with each other as on the CPU: a CUDA kernel that
  // accumulates with atomics makes two runs differ in the last bits.)
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    const Run run = run_zero(task, dtype, 2, {.stage = stage, .accum = 1});
    check_close(task, dtype, run, reference, fmt::format("cuda dp=2 zero={}", stage));
  }
  // Accumulation once, on the largest group and the sharded-parameter stage.
  const Run accum = run_zero(task, dtype, 4, {.stage = 3, .accum = 2});
  check_close(task, dtype, accum, reference, "cuda dp=4 zero=3 accum=2");
}

TEST_CASE("cuda zero: MNIST MLP, stages 1-3 on threads sharing cuda:0 (f64 and f32)") {
  check_zero(mlp_task(kGpu), DType::f64);
  check_zero(mlp_task(kGpu), DType::f32);
}

TEST_CASE("cuda zero: GPT-mini, stages 1-3 on threads sharing cuda:0 (f64 and f32)") {
  check_zero(gpt_task(kGpu), DType::f64);
  check_zero(gpt_task(kGpu), DType::f32);
}

}  // namespace
}  // namespace tessera::parallel

#endif  // TESSERA_CUDA
