// Redistribution between every pair of placements on 1-D and 2-D meshes (even, uneven and
// empty blocks), its gradient, the comm log against the cost model, and the mesh, spec,
// describe and error paths. Ranks are threads (parallel/comm/threads.h); the reference is
// the full tensor every rank builds from one seed.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/ops.h"
#include "parallel/redistribute.h"
#include "tensor/ops.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using testing::contains;
using testing::error_of;

// Every placement of a 2-D tensor on one axis that the pairs test covers.
std::vector<Placement> axis_placements() {
  return {Replicate(), Shard(0), Shard(1), Partial(ReduceOp::sum), Partial(ReduceOp::avg),
          Partial(ReduceOp::max), Partial(ReduceOp::min)};
}

std::vector<Placements> all_specs(int ndim) {
  std::vector<Placements> out{{}};
  for (int a = 0; a < ndim; ++a) {
    std::vector<Placements> next;
    for (const Placements& p : out) {
      for (const Placement& q : axis_placements()) {
        Placements r = p;
        r.push_back(q);
        next.push_back(r);
      }
    }
    out = next;
  }
  return out;
}

// The local block of `x` under `p` with non-trivial Partial terms: along a Partial axis the
// coordinates hold different values that reduce (sum/avg/max/min) to the block. f64, so the
// sums are exact to rounding (checked at 1e-12).
Tensor make_local(const Tensor& x, const DeviceMesh& mesh, const Placements& p, uint64_t seed) {
  const LocalBlock b = local_block(x.shape(), mesh, p);
  Tensor t = x;
  for (size_t d = 0; d < b.shape.size(); ++d) {
    t = t.narrow(static_cast<int64_t>(d), b.starts[d], b.shape[d]);
  }
  t = clone(t);
  for (int a = 0; a < mesh.ndim(); ++a) {
    if (!p[a].is_partial()) continue;
    const int64_t n = mesh.size(a), c = mesh.coordinate(a);
    // Offsets that depend on the element's global position and the coordinate only, so
    // ranks sharing a block agree on them.
    Generator g(seed * 131 + a);
    Tensor r = abs(randn(x.shape(), DType::f64, kCPU, &g)) + 0.5;
    for (size_t d = 0; d < b.shape.size(); ++d) {
      r = r.narrow(static_cast<int64_t>(d), b.starts[d], b.shape[d]);
    }
    switch (p[a].op) {
      case ReduceOp::sum:  // coordinate c holds t*w_c with weights summing to 1
      case ReduceOp::avg: {
        const double w = p[a].op == ReduceOp::sum ? 1.0 : static_cast<double>(n);
        if (c == n - 1) {
          t = t * w - r * static_cast<double>(n - 1);
        } else {
          t = r;
        }
        break;
      }
      case ReduceOp::max:
        if (c != n - 1) t = t - r;
        break;
      case ReduceOp::min:
        if (c != n - 1) t = t + r;
        break;
    }
  }
  return t;
}

void check_close(const Tensor& got, const Tensor& want, const std::string& what) {
  REQUIRE_MESSAGE(got.shape() == want.shape(), what);
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  double worst = 0.0;
  for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(g[i] - w[i]) / (1.0 + std::abs(w[i])));
  CHECK_MESSAGE(worst <= 1e-12, what << ": max relative error " << worst);
}

struct MeshCase {
  std::vector<MeshAxis> axes;
  std::vector<Shape> shapes;
};

void pairs_on(const MeshCase& mc) {
  int world_size = 1;
  for (const MeshAxis& a : mc.axes) world_size *= static_cast<int>(a.size);
  run_threads(world_size, [&](CommPtr world) {
    MeshPtr mesh = make_mesh(world, mc.axes);
    const std::vector<Placements> specs = all_specs(mesh->ndim());
    int64_t checked = 0;
    for (const Shape& shape : mc.shapes) {
      Generator g(7);
      const Tensor x = randn(shape, DType::f64, kCPU, &g);
      for (size_t si = 0; si < specs.size(); ++si) {
        const Placements& from = specs[si];
        const ShardedTensor src = from_local(make_local(x, *mesh, from, si), mesh, from, shape);
        for (const Placements& to : specs) {
          const std::string what = fmt::format("mesh {} shape {} {} -> {} (rank {})", mesh->str(),
                                               shape_str(shape), placements_str(from),
                                               placements_str(to), mesh->rank());
          CommLog log;
          ShardedTensor dst;
          {
            CommLogScope scope(log);
            dst = src.redistribute(to);
          }
          // The comm log against the cost model, axis by axis.
          const RedistributePlan plan = plan_redistribute(*mesh, shape, DType::f64, from, to);
          for (int a = 0; a < mesh->ndim(); ++a) {
            CHECK_MESSAGE(log.bytes(mesh->axis_name(a)) == plan.bytes_per_axis[a],
                          what << " axis " << mesh->axis_name(a) << ": log " << log.str()
                               << " plan " << plan.str());
          }
          int64_t collectives = 0;
          for (const RedistributeStep& s : plan.steps) collectives += s.collective != "local";
          CHECK_MESSAGE(static_cast<int64_t>(log.records.size()) == collectives, what << " " << log.str());
          for (const CommRecord& r : log.records) CHECK(r.cause == "redistribute");
          // The block itself, for targets without Partial terms; every target's full value.
          bool has_partial = false;
          for (const Placement& p : to) has_partial = has_partial || p.is_partial();
          if (!has_partial) check_close(dst.local(), make_local(x, *mesh, to, 0), what + " local");
          check_close(dst.full_tensor(), x, what + " full");
          ++checked;
        }
      }
    }
    CHECK(checked == static_cast<int64_t>(mc.shapes.size() * specs.size() * specs.size()));
  });
}

TEST_CASE("redistribute: every pair of placements on 1-D meshes, even, uneven and empty blocks") {
  pairs_on({{{"x", 2}}, {{4, 6}, {5, 3}, {1, 7}}});
  pairs_on({{{"x", 3}}, {{6, 3}, {4, 5}}});
  pairs_on({{{"x", 4}}, {{8, 4}, {5, 7}, {2, 3}}});
}

TEST_CASE("redistribute: every pair of placements on 2-D meshes") {
  pairs_on({{{"a", 2}, {"b", 2}}, {{4, 8}, {5, 7}, {3, 1}}});
  pairs_on({{{"a", 2}, {"b", 3}}, {{6, 6}, {7, 5}}});
}

TEST_CASE("redistribute: the gradient is the conjugate redistribution") {
  for (std::vector<MeshAxis> axes : {std::vector<MeshAxis>{{"x", 3}}, std::vector<MeshAxis>{{"a", 2}, {"b", 2}}}) {
    int world_size = 1;
    for (const MeshAxis& a : axes) world_size *= static_cast<int>(a.size);
    run_threads(world_size, [&](CommPtr world) {
      MeshPtr mesh = make_mesh(world, axes);
      const Shape shape{5, 7};
      Generator g(3);
      const Tensor x = randn(shape, DType::f64, kCPU, &g);
      const Tensor w = randn(shape, DType::f64, kCPU, &g);
      const std::vector<Placements> specs = all_specs(mesh->ndim());
      for (size_t si = 0; si < specs.size(); ++si) {
        const Placements& from = specs[si];
        for (const Placements& to : specs) {
          Tensor leaf = make_local(x, *mesh, from, si).requires_grad_();
          ShardedTensor src = from_local(leaf, mesh, from, shape);
          Tensor y = src.redistribute(to).full_tensor();
          autograd::backward({sum(y * w)});
          // d loss / d term: w for Replicate/Shard/Partial(sum) sources, w / n for avg, and
          // w where the term is the extreme for max/min (no ties here).
          Tensor want = w;
          for (int a = 0; a < mesh->ndim(); ++a) {
            if (from[a].is_partial(ReduceOp::avg)) want = want * (1.0 / static_cast<double>(mesh->size(a)));
          }
          want = make_local(want, *mesh, [&] {
            Placements p = from;
            for (Placement& q : p) if (q.is_partial()) q = Replicate();
            return p;
          }(), 0);
          for (int a = 0; a < mesh->ndim(); ++a) {
            const bool extreme = from[a].is_partial(ReduceOp::max) || from[a].is_partial(ReduceOp::min);
            if (extreme && mesh->coordinate(a) != mesh->size(a) - 1) want = want * 0.0;
          }
          check_close(leaf.grad(), want,
                      fmt::format("grad {} -> {} on {} (rank {})", placements_str(from),
                                  placements_str(to), mesh->str(), mesh->rank()));
        }
      }
    });
  }
}

TEST_CASE("redistribute: plans pick the direct collective and un-nest inner axes first") {
  run_threads(4, [](CommPtr world) {
    MeshPtr mesh = make_mesh(world, {{"dp", 2}, {"tp", 2}});
    auto kinds = [&](const Placements& from, const Placements& to) {
      std::string s;
      for (const RedistributeStep& st : plan_redistribute(*mesh, {8, 8}, DType::f32, from, to).steps) {
        s += fmt::format("{}{}:{}", s.empty() ? "" : " ", mesh->axis_name(st.axis), st.collective);
      }
      return s;
    };
    CHECK(kinds({Shard(0), Replicate()}, {Replicate(), Replicate()}) == "dp:all_gather");
    CHECK(kinds({Partial(), Replicate()}, {Replicate(), Replicate()}) == "dp:all_reduce");
    CHECK(kinds({Partial(), Replicate()}, {Shard(1), Replicate()}) == "dp:reduce_scatter");
    CHECK(kinds({Shard(0), Replicate()}, {Shard(1), Replicate()}) == "dp:all_to_all");
    CHECK(kinds({Replicate(), Replicate()}, {Shard(0), Shard(1)}) == "tp:local dp:local");
    // Slices before reductions: the all_reduce moves half the data.
    CHECK(kinds({Replicate(), Partial()}, {Shard(0), Replicate()}) == "dp:local tp:all_reduce");
    // Dim 0 split over dp then tp; to split it over tp alone, tp must first let go of it.
    CHECK(kinds({Shard(0), Shard(0)}, {Replicate(), Shard(0)}) == "tp:all_gather dp:all_gather tp:local");
    // An all_gather of 8x8 f32 split 2 ways: each rank sends its 4x8 half once.
    const RedistributePlan p = plan_redistribute(*mesh, {8, 8}, DType::f32, {Shard(0), Replicate()},
                                                 {Replicate(), Replicate()});
    CHECK(p.bytes_per_axis[0] == 4 * 8 * 4);
    CHECK(p.bytes_per_axis[1] == 0);
    const RedistributePlan ar = plan_redistribute(*mesh, {8, 8}, DType::f32, {Partial(), Replicate()},
                                                  {Replicate(), Replicate()});
    CHECK(ar.total_bytes() == 2 * 1 * 256 / 2);
  });
}

TEST_CASE("mesh: coordinates, groups and PartitionSpec-style specs") {
  run_threads(8, [](CommPtr world) {
    MeshPtr mesh = make_mesh(world, {{"pp", 2}, {"dp", 2}, {"tp", 2}});
    const int r = world->rank();
    CHECK(mesh->coordinates() == std::vector<int64_t>{r / 4, (r / 2) % 2, r % 2});
    CHECK(mesh->rank_of(mesh->coordinates()) == r);
    CHECK(mesh->group("tp").size() == 2);
    CHECK(mesh->group("tp").rank() == r % 2);
    CHECK(mesh->group(std::vector<std::string>{"dp", "tp"}).size() == 4);
    CHECK(mesh->group(std::vector<std::string>{"dp", "tp"}).name() == "dp,tp");
    // The tp group of rank r holds r and r ^ 1: an all_reduce of ranks sums the pair.
    Tensor t = Tensor::from_vector<double>({static_cast<double>(r)}, {1});
    mesh->group("tp").all_reduce(t, ReduceOp::sum);
    CHECK(t.item<double>() == static_cast<double>((r & ~1) + (r | 1)));
    CHECK(placements_str(spec(*mesh, {{"dp", "tp"}, {}})) == "[R, S(0), S(0)]");
    CHECK(placements_str(spec(*mesh, {{}, {"pp"}})) == "[S(1), R, R]");
    CHECK(contains(error_of([&] { spec(*mesh, {{"tp", "dp"}}); }), "mesh order"));
    CHECK(contains(error_of([&] { spec(*mesh, {{"ep"}}); }), "no axis named 'ep'"));
    CHECK(contains(error_of([&] { spec(*mesh, {{"dp"}, {"dp"}}); }), "used twice"));
  });
}

TEST_CASE("describe: mesh, placements, blocks per rank and an ASCII map") {
  run_threads(4, [](CommPtr world) {
    MeshPtr mesh = make_mesh(world, {{"dp", 2}, {"tp", 2}});
    ShardedTensor t = distribute(tessera::zeros({5, 6}), mesh, {Shard(0), Shard(1)});
    const std::string d = describe(t);
    CHECK(contains(d, "[5, 6] f32 on mesh {dp: 2, tp: 2}, placements [S(0), S(1)]"));
    CHECK(contains(d, "rank 0 (dp=0, tp=0): block [3, 3] at [0, 0]"));
    CHECK(contains(d, "rank 3 (dp=1, tp=1): block [2, 3] at [3, 3]"));
    CHECK(contains(d, "|  r0  |  r1  |  rows 0..3"));
    CHECK(contains(d, "|  r2  |  r3  |  rows 3..5"));
    ShardedTensor v = distribute(tessera::zeros({7}), mesh, {Shard(0), Replicate()});
    CHECK(contains(describe(v), "| r0,r1 | r2,r3 |"));
    ShardedTensor p = distribute(tessera::zeros({4, 4}), mesh, {Replicate(), Partial()});
    CHECK(contains(describe(p), "axis 'tp': partial"));
  });
}

TEST_CASE("errors: placements, meshes, shapes and strict mode") {
  CHECK(contains(error_of([] {
          run_threads(2, [](CommPtr world) { make_mesh(world, {{"dp", 2}, {"tp", 2}}); });
        }),
        "needs 4 ranks but the world"));
  run_threads(2, [](CommPtr world) {
    MeshPtr mesh = make_mesh(world, {{"dp", 2}});
    MeshPtr other = make_mesh(world, {{"tp", 2}});
    CHECK(contains(error_of([&] { distribute(tessera::zeros({4, 4}), mesh, {Shard(2)}); }),
                   "Shard(2) on mesh axis 'dp' is out of range for a tensor of shape [4, 4]"));
    CHECK(contains(error_of([&] { distribute(tessera::zeros({4, 4}), mesh, {Shard(0), Shard(1)}); }),
                   "2 placements"));
    ShardedTensor a = distribute(tessera::ones({4, 4}), mesh, {Shard(0)});
    ShardedTensor b = distribute(tessera::ones({4, 4}), other, {Shard(0)});
    CHECK(contains(error_of([&] { add(a, b); }), "different meshes"));
    // Local blocks that do not form one tensor: rank 1 claims a wider block.
    CHECK(contains(error_of([&] { from_local(tessera::ones({2, world->rank() == 0 ? 3 : 4}), mesh, {Shard(0)}); }),
                   "do not form one tensor"));
    CHECK(contains(error_of([&] { from_local(tessera::ones({3, 4}), mesh, {Shard(0)}, {4, 4}); }),
                   "global shape [4, 4]"));
    // Strict mode: an op needing a move throws; asking for it explicitly is fine.
    ShardedTensor c = distribute(tessera::ones({4, 4}), mesh, {Shard(1)});
    {
      StrictRedistribution strict;
      CHECK(contains(error_of([&] { add(a, c); }), "strict mode: input 1"));
      ShardedTensor ok = add(a, with_sharding_constraint(c, {Shard(0)}));
      CHECK(ok.placements() == Placements{Shard(0)});
    }
    CHECK(add(a, c).full_tensor().to_vector<float>() == std::vector<float>(16, 2.0f));
  });
}

TEST_CASE("implicit redistributions are visible in the comm log with their op") {
  run_threads(2, [](CommPtr world) {
    MeshPtr mesh = make_mesh(world, {{"tp", 2}});
    ShardedTensor x = distribute(tessera::ones({4, 6}), mesh, {Shard(1)});
    ShardedTensor w = distribute(tessera::ones({6, 8}), mesh, {Shard(0)});
    CommLog log;
    {
      CommLogScope scope(log);
      ShardedTensor y = matmul(x, w);  // row-parallel: a Partial sum, no traffic
      CHECK(y.placements() == Placements{Partial()});
      CHECK(log.records.empty());
      ShardedTensor z = relu(y);  // not linear: the Partial sum is reduced first
      CHECK(z.placements() == Placements{Shard(0)});
    }
    REQUIRE(log.records.size() == 1);
    CHECK(log.records[0].op == "reduce_scatter");
    CHECK(log.records[0].group == "tp");
    CHECK(contains(log.records[0].cause, "relu (input 0 [P(sum)] -> [S(0)])"));
  });
}

}  // namespace
}  // namespace tessera::parallel
