// GPU-tagged: the NCCL backend with one rank on cuda:0 (the threads backend, one rank, is
// the bootstrap; NCCL refuses two ranks on one GPU, so one GPU means one rank). The shared
// collective checks (collective_checks.h) with every buffer on cuda:0 - every collective x
// dtype x even/uneven x blocking/async, empty blocks, splits, argument errors - plus what
// only this backend does: ordering against the compute stream, f16/bf16 widening, handles
// dropped or polled, the comm log. Needs a GPU:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/parallel:comm_nccl_test
// Without --config=cuda this file compiles to an empty suite (nccl.cc is not built).
#include <doctest/doctest.h>

#ifdef TESSERA_NCCL

#include <vector>

#include "parallel/comm/comm_log.h"
#include "parallel/comm/nccl.h"
#include "parallel/comm/threads.h"
#include "tensor/ops.h"
#include "tests/parallel/collective_checks.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using tessera::testing::contains;
using tessera::testing::error_of;

// Runs fn(nccl world) with one rank on cuda:0.
void with_nccl(const std::function<void(const CommPtr&)>& fn) {
  run_threads(1, [&](CommPtr boot) {
    CommPtr world = nccl_world(boot, 0);
    CHECK(world->backend() == "nccl");
    CHECK(world->name() == "world");
    CHECK(world->size() == 1);
    CHECK(world->rank() == 0);
    fn(world);
  });
}

// -3, -2, ..., small integers exact in every dtype (bool: alternating).
Tensor values(int64_t n, DType dt) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = dt == DType::b8 ? (i % 2) : static_cast<double>(i - 3);
  return Tensor::from_vector<double>(v, {n}).cast(dt);
}

std::vector<double> host(const Tensor& t) { return t.to(kCPU).to_vector<double>(); }

TEST_CASE("nccl: the shared collective checks on one rank, buffers on cuda:0") {
  with_nccl([](const CommPtr& world) { testing::check_collectives(world, cuda(0)); });
}

TEST_CASE("nccl: one-rank collectives return their input, every dtype, blocking and async") {
  with_nccl([](const CommPtr& world) {
    for (DType dt : kAllDTypes) {
      CAPTURE(dt);
      const Tensor x = values(10, dt);
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
        if (op == ReduceOp::avg && !is_floating(dt)) continue;
        if (dt == DType::u8) {  // 8-bit codes are gathered or broadcast, never reduced
          Tensor d = x.to(cuda(0));
          CHECK_THROWS_WITH(world->all_reduce(d, op),
                            doctest::Contains("u8 tensors hold codes and are not reduced"));
          continue;
        }
        Tensor d = x.to(cuda(0));
        world->all_reduce(d, op);
        CHECK(host(d) == host(x));
        Tensor e = x.to(cuda(0));
        WorkHandle h = world->all_reduce_async(e, op);
        h->wait();
        CHECK(h->is_completed());
        CHECK(host(e) == host(x));
      }
      Tensor gathered = Tensor::empty({10}, dt, cuda(0));
      world->all_gather(gathered, x.to(cuda(0)));
      CHECK(host(gathered) == host(x));
      Tensor uneven = Tensor::empty({10}, dt, cuda(0));
      world->all_gather(uneven, x.to(cuda(0)), {10});
      CHECK(host(uneven) == host(x));

      Tensor scattered = Tensor::empty({10}, dt, cuda(0));
      if (dt == DType::u8) {
        CHECK_THROWS_WITH(world->reduce_scatter(scattered, x.to(cuda(0)), ReduceOp::max, {10}),
                          doctest::Contains("u8 tensors hold codes and are not reduced"));
      } else {
        world->reduce_scatter(scattered, x.to(cuda(0)), ReduceOp::max, {10});
        CHECK(host(scattered) == host(x));
      }

      Tensor b = x.to(cuda(0));
      world->broadcast(b, 0);
      CHECK(host(b) == host(x));

      Tensor a2a = Tensor::empty({10}, dt, cuda(0));
      world->all_to_all(a2a, x.to(cuda(0)), {10}, {10});
      CHECK(host(a2a) == host(x));
    }
    world->barrier();
  });
}

TEST_CASE("nccl: collectives run after the compute stream's queued work") {
  with_nccl([](const CommPtr& world) {
    // 64 MiB copied host -> device on the compute stream, then an async all_reduce issued at
    // once: without the event between the streams NCCL would read the buffer mid-copy.
    constexpr int64_t n = int64_t{16} << 20;
    const Tensor src = full({n}, 3.0, DType::f32);
    for (int round = 0; round < 3; ++round) {
      Tensor d = zeros({n}, DType::f32, cuda(0));
      d.copy_(src);
      WorkHandle h = world->all_reduce_async(d, ReduceOp::sum);
      Tensor out = Tensor::empty({4}, DType::f32, cuda(0));
      WorkHandle g = world->all_gather_async(out, d.narrow(0, n - 4, 4));
      h->wait();
      g->wait();
      // Read back on the compute stream: it waited for the collectives' events.
      const std::vector<float> v = d.to(kCPU).to_vector<float>();
      CHECK(v.front() == 3.0f);
      CHECK(v[n / 2] == 3.0f);
      CHECK(v.back() == 3.0f);
      CHECK(out.to(kCPU).to_vector<float>() == std::vector<float>(4, 3.0f));
    }
  });
}

TEST_CASE("nccl: f16/bf16 averages go through an f32 copy and back") {
  with_nccl([](const CommPtr& world) {
    // The widened copy (f32 on the device) is reduced and copied back: values survive exactly.
    for (DType dt : {DType::f16, DType::bf16}) {
      Tensor t = Tensor::from_vector<float>({0.5f, 1.0f, 3.0f}, {3}).cast(dt).to(cuda(0));
      world->all_reduce(t, ReduceOp::avg);
      CHECK(t.dtype() == dt);
      CHECK(t.to(kCPU).to_vector<float>() == std::vector<float>{0.5f, 1.0f, 3.0f});
      Tensor in = Tensor::from_vector<float>({-2.0f, 0.25f}, {2}).cast(dt).to(cuda(0));
      Tensor out = Tensor::empty({2}, dt, cuda(0));
      world->reduce_scatter_async(out, in, ReduceOp::sum)->wait();
      CHECK(out.to(kCPU).to_vector<float>() == std::vector<float>{-2.0f, 0.25f});
    }
  });
}

TEST_CASE("nccl: handles polled, dropped unwaited, and empty collectives") {
  with_nccl([](const CommPtr& world) {
    Tensor t = full({1 << 20}, 2.0, DType::f32, cuda(0));
    WorkHandle h = world->all_reduce_async(t, ReduceOp::max);
    while (!h->is_completed()) {
    }
    h->wait();  // again: returns at once
    CHECK(t.to(kCPU).to_vector<float>()[12345] == 2.0f);
    // Dropped before wait(): its destructor waits, so the buffer may be freed after it.
    for (int i = 0; i < 4; ++i) {
      Tensor tmp = full({1 << 16}, 1.0, DType::f64, cuda(0));
      world->all_reduce_async(tmp, ReduceOp::sum);
    }
    // Zero elements: completed at once, NCCL never called.
    Tensor none = Tensor::empty({0}, DType::bf16, cuda(0));
    WorkHandle e = world->all_reduce_async(none, ReduceOp::avg);
    CHECK(e->is_completed());
    world->broadcast(none, 0);
    world->all_gather(Tensor::empty({0}, DType::bf16, cuda(0)), none);
    world->barrier();
  });
}

TEST_CASE("nccl: the comm log counts the same bytes as the CPU backends") {
  with_nccl([](const CommPtr& world) {
    CommLog log;
    {
      CommLogScope scope(log);
      world->all_reduce(zeros({8}, DType::f32, cuda(0)), ReduceOp::sum);
      world->all_gather(Tensor::empty({8}, DType::f64, cuda(0)), zeros({8}, DType::f64, cuda(0)));
    }
    REQUIRE(log.records.size() == 2);
    CHECK(log.records[0].op == "all_reduce");
    CHECK(log.records[0].elements == 8);
    CHECK(log.records[0].bytes == 0);  // a group of one sends nothing
    CHECK(log.records[1].op == "all_gather");
    CHECK(log.records[1].dtype == DType::f64);
  });
}

TEST_CASE("nccl: split gives a working sub-communicator") {
  with_nccl([](const CommPtr& world) {
    CommPtr solo = world->split(0, 0, "solo");
    CHECK(solo->name() == "solo");
    CHECK(solo->backend() == "nccl");
    CHECK(solo->size() == 1);
    Tensor t = Tensor::from_vector<float>({2.0f, -1.0f}, {2}).to(cuda(0));
    solo->all_reduce(t, ReduceOp::sum);
    CHECK(t.to(kCPU).to_vector<float>() == std::vector<float>{2.0f, -1.0f});
    // Interleaved with the parent (one communication stream per device).
    Tensor u = Tensor::from_vector<float>({4.0f}, {1}).to(cuda(0));
    WorkHandle a = world->all_reduce_async(u, ReduceOp::max);
    solo->all_reduce(t, ReduceOp::min);
    a->wait();
    CHECK(u.to(kCPU).item<float>() == 4.0f);
  });
}

TEST_CASE("nccl: CPU tensors are rejected naming the op, group and device") {
  with_nccl([](const CommPtr& world) {
    const std::string msg = error_of([&] { world->all_reduce(Tensor::empty({4}), ReduceOp::sum); });
    CHECK(contains(msg, "nccl: all_reduce on group 'world' (rank 0): tensor [4] is on cpu"));
    // Nothing was started: the communicator still works.
    Tensor t = full({2}, 1.0, DType::f32, cuda(0));
    world->all_reduce(t, ReduceOp::sum);
    CHECK(t.to(kCPU).to_vector<float>() == std::vector<float>{1.0f, 1.0f});
  });
}

}  // namespace
}  // namespace tessera::parallel

#endif  // TESSERA_NCCL
