// GPU-tagged: the NCCL backend with one rank on cuda:0 (the threads backend, one rank, is
// the bootstrap). Every collective x dtype, blocking and async, against the CPU result; with
// one member each collective's result is its input (avg: divided by 1), which checks the
// plumbing: types, widening of f16/bf16, offsets, streams and events. Needs a GPU:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/parallel:comm_nccl_test
// Without --config=cuda this file compiles to an empty suite (nccl.cc is not built).
#include <doctest/doctest.h>

#ifdef TESSERA_NCCL

#include <vector>

#include "parallel/comm/nccl.h"
#include "parallel/comm/threads.h"
#include "tensor/ops.h"
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

TEST_CASE("nccl: one-rank collectives return their input, every dtype, blocking and async") {
  with_nccl([](const CommPtr& world) {
    for (DType dt : kAllDTypes) {
      CAPTURE(dt);
      const Tensor x = values(10, dt);
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
        if (op == ReduceOp::avg && !is_floating(dt)) continue;
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
      world->reduce_scatter(scattered, x.to(cuda(0)), ReduceOp::max, {10});
      CHECK(host(scattered) == host(x));

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

TEST_CASE("nccl: f16/bf16 averages go through an f32 copy and back") {
  with_nccl([](const CommPtr& world) {
    // The widened copy (f32 on the device) is reduced and copied back: values survive exactly.
    for (DType dt : {DType::f16, DType::bf16}) {
      Tensor t = Tensor::from_vector<float>({0.5f, 1.0f, 3.0f}, {3}).cast(dt).to(cuda(0));
      world->all_reduce(t, ReduceOp::avg);
      CHECK(t.to(kCPU).to_vector<float>() == std::vector<float>{0.5f, 1.0f, 3.0f});
    }
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
  });
}

TEST_CASE("nccl: CPU tensors are rejected naming the op, group and device") {
  with_nccl([](const CommPtr& world) {
    const std::string msg = error_of([&] { world->all_reduce(Tensor::empty({4}), ReduceOp::sum); });
    CHECK(contains(msg, "nccl: all_reduce on group 'world' (rank 0): tensor [4] is on cpu"));
  });
}

}  // namespace
}  // namespace tessera::parallel

#endif  // TESSERA_NCCL
