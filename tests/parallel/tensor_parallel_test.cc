// Tensor parallelism as a plan (parallel/tensor_parallel.h): path patterns, the styles, a
// module's parameters sharded by a plan (grouped views, errors), the vocab-parallel loss, and
// a second model (an MLP) that needs only a plan and a forward written once over the layout
// to match one device (f64, 1e-12: the same products, summed over 2 ranks in another order).
#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/moe.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/tensor_parallel.h"
#include "tensor/allocator.h"
#include "tensor/random.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

// The MLP's forward, once: Linear, ReLU, Linear (nn::Sequential names them "0" and "2").
template <class L, class P>
typename L::Tensor mlp_forward(const L& layout, const P& param, const typename L::Tensor& x) {
  const typename L::Tensor up =
      relu(matmul(layout.column_input(x), transpose(param("0.weight"), 0, 1)) + param("0.bias"));
  return layout.stream(matmul(up, transpose(param("2.weight"), 0, 1))) + param("2.bias");
}

std::shared_ptr<nn::Sequential> make_mlp() {
  manual_seed(3);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(8, 12, true, DType::f64));
  m->push_back(std::make_shared<nn::ReLU>());
  m->push_back(std::make_shared<nn::Linear>(12, 6, true, DType::f64));
  return m;
}

TEST_CASE("plans: '*' matches one path component; the styles") {
  CHECK(path_matches("h.*.mlp.c_fc.weight", "h.3.mlp.c_fc.weight"));
  CHECK_FALSE(path_matches("h.*.mlp.c_fc.weight", "h.3.4.mlp.c_fc.weight"));
  CHECK_FALSE(path_matches("h.*.mlp.c_fc.weight", "h.mlp.c_fc.weight"));
  CHECK_FALSE(path_matches("h.*.mlp.c_fc.weight", "h.3.mlp.c_fc.bias"));
  const TpPlan plan = column_wise("a", 3) + row_wise("b") + vocab_parallel("e");
  REQUIRE(plan.size() == 5);
  CHECK(plan[0].pattern == "a.weight");
  CHECK(plan[0].placement == Shard(1));  // of the grouped view [3, out / 3, in]
  CHECK(plan[0].groups == 3);
  CHECK(plan[2].placement == Shard(1));  // row-wise: input features
  CHECK(plan[3].placement == Replicate());
  CHECK(plan[4].pattern == "e.weight");
  CHECK(plan[4].placement == Shard(0));
  CHECK(column_wise("a")[1].placement == Shard(0));
  CHECK(testing::contains(testing::error_of([] { column_wise("a", 0); }),
                          "column_wise: groups must be >= 1 for 'a', got 0"));
}

TEST_CASE("a second model needs only a plan: the MLP on {dp: 2, tp: 2} equals one device") {
  const auto ref = make_mlp();
  manual_seed(4);
  const Tensor x = randn({4, 8}, DType::f64);
  const Tensor want = mlp_forward(SingleDevice{}, ModuleParameters(*ref), x);
  sum(want * want).backward();
  run_threads(4, [&](CommPtr world) {
    const auto model = make_mlp();
    auto mesh = make_mesh(world, {{"dp", 2}, {"tp", 2}});
    const ShardedParameters params(*model, mesh, column_wise("0") + row_wise("2"));
    CHECK(params("0.weight").placements() == Placements{Replicate(), Shard(0)});
    CHECK(params("0.bias").placements() == Placements{Replicate(), Shard(0)});
    CHECK(params("2.weight").placements() == Placements{Replicate(), Shard(1)});
    CHECK(params("2.bias").placements() == Placements{Replicate(), Replicate()});
    const TpLayout layout(mesh);
    CommLog log;
    ShardedTensor y;
    {
      CommLogScope scope(log);
      y = mlp_forward(layout, params, layout.input(x));
    }
    CHECK(y.placements() == Placements{Shard(0), Replicate()});
    CHECK(max(abs(y.full_tensor() - want)).item<double>() <= 1e-12);
    // The row-wise product's Partial sum is the one collective on tp.
    int tp_collectives = 0;
    for (const CommRecord& r : log.records) {
      if (r.group != "tp") continue;
      ++tp_collectives;
      CHECK(r.op == "all_reduce");
      CHECK(r.cause == "with_sharding_constraint");
    }
    CHECK(tp_collectives == 1);
    sum(y * y).backward();
    for (const auto& entry : ref->named_parameters()) {
      const std::string& name = entry.first;  // (CAPTURE captures it: no structured binding)
      const Tensor& t = entry.second;
      CAPTURE(name);
      CHECK(max(abs(params.full_grad(name) - t.grad())).item<double>() <= 1e-12);
    }
  });
}

TEST_CASE("TpLayout::recompute: the plain forward's gradients, and nothing kept after backward") {
  // The MLP's activation and down projection recomputed in backward (as GPT's selective
  // recomputation does under tp): same gradients as without; once backward is done every
  // byte the step allocated is freed (no reference cycle through the kept function).
  const auto mlp_recomputed = [](const TpLayout& layout, const ShardedParameters& param,
                                 const ShardedTensor& x) {
    const ShardedTensor pre =
        matmul(layout.column_input(x), transpose(param("0.weight"), 0, 1)) + param("0.bias");
    const ShardedTensor product = layout.recompute(
        true,
        [](const std::vector<ShardedTensor>& in) {
          return std::vector<ShardedTensor>{matmul(relu(in[0]), transpose(in[1], 0, 1))};
        },
        {pre, param("2.weight")})[0];
    return layout.stream(product) + param("2.bias");
  };
  run_threads(2, [&](CommPtr world) {
    MemoryTracker rank;
    const MemoryScope scope(&rank);
    const auto model = make_mlp();
    auto mesh = make_mesh(world, {{"tp", 2}});
    const ShardedParameters params(*model, mesh, column_wise("0") + row_wise("2"));
    const TpLayout layout(mesh);
    manual_seed(4);
    const Tensor x = randn({4, 8}, DType::f64);
    std::map<std::string, Tensor> plain;
    {
      const ShardedTensor y = mlp_forward(layout, params, layout.input(x));
      sum(y * y).backward();
      for (const auto& [name, t] : model->named_parameters()) plain[name] = params.full_grad(name);
    }
    for (const auto& [name, p] : params.all()) p.local().set_grad(Tensor());
    const int64_t before = rank.current();
    for (int round = 0; round < 2; ++round) {
      {
        const ShardedTensor y = mlp_recomputed(layout, params, layout.input(x));
        CHECK(max(abs(y.full_tensor() - mlp_forward(layout, params, layout.input(x)).full_tensor()))
                  .item<double>() == 0.0);
        sum(y * y).backward();
      }
      for (const auto& entry : model->named_parameters()) {
        const std::string& name = entry.first;  // (CAPTURE captures it: no structured binding)
        CAPTURE(name);
        CHECK(max(abs(params.full_grad(name) - plain.at(name))).item<double>() <= 1e-12);
      }
      for (const auto& [name, p] : params.all()) p.local().set_grad(Tensor());
      CHECK(rank.current() == before);  // the step's tensors, the kept function's included
    }
  });
}

TEST_CASE("grouped column-wise rules view the parameter; bad plans and paths are errors") {
  run_threads(2, [&](CommPtr world) {
    auto mesh = make_mesh(world, {{"tp", 2}});
    manual_seed(5);
    nn::Sequential fused;  // "0.weight": three stacked [2, 4] blocks
    fused.push_back(std::make_shared<nn::Linear>(4, 6, true, DType::f64));
    const ShardedParameters params(fused, mesh, column_wise("*", 3));
    CHECK(params("0.weight").shape() == Shape{3, 2, 4});
    CHECK(params("0.weight").local().shape() == Shape{3, 1, 4});  // row r of every block
    CHECK(params("0.bias").shape() == Shape{3, 2});
    const Tensor w = fused.named_parameters()[0].second;
    CHECK(max(abs(params("0.weight").full_tensor().reshape({6, 4}) - w)).item<double>() == 0.0);
    CHECK(testing::contains(testing::error_of([&] { params("nope"); }),
                            "ShardedParameters: no parameter or buffer 'nope'"));
    // A buffer (the experts' selection bias) is whole on every rank and shares the module's
    // storage: an update in place shows through.
    nn::MoeOptions o;
    o.experts = 4;
    o.bias_rate = 0.1;
    nn::MixtureOfExperts moe(8, o);
    const ShardedParameters with_buffer(moe, mesh, TpPlan{});
    const ShardedTensor& bias = with_buffer("selection_bias");
    CHECK(bias.shape() == Shape{4});
    CHECK(bias.local().shape() == Shape{4});
    moe.selection_bias.copy_(Tensor::from_vector<float>({1, 2, 3, 4}, {4}));
    CHECK(bias.local().to_vector<float>() == std::vector<float>{1, 2, 3, 4});
    nn::Sequential odd;
    odd.push_back(std::make_shared<nn::Linear>(4, 5, true, DType::f64));
    CHECK(testing::contains(testing::error_of([&] { ShardedParameters p(odd, mesh, column_wise("*", 3)); }),
                            "rule '*.weight' stacks 3 groups in dim 0 of '0.weight', whose shape [5, 4]"));
    CHECK(testing::contains(testing::error_of([&] { ShardedParameters p(odd, mesh, {}, "model"); }),
                            "model"));
  });
}

TEST_CASE("the vocab-parallel cross-entropy equals the fused one and moves only row statistics") {
  manual_seed(6);
  const Tensor logits = randn({6, 7}, DType::f64);  // 7 classes: uneven blocks on 2 and 3 ranks
  const Tensor targets = Tensor::from_vector<int64_t>({0, 6, 3, 2, 5, 1}, {6});
  const Tensor want = SingleDevice{}.cross_entropy(logits, targets);
  for (int tp : {2, 3}) {
    CAPTURE(tp);
    run_threads(tp, [&](CommPtr world) {
      auto mesh = make_mesh(world, {{"tp", tp}});
      const TpLayout layout(mesh);
      const ShardedTensor z = distribute(logits, mesh, {Shard(1)});
      CommLog log;
      ShardedTensor loss;
      {
        CommLogScope scope(log);
        loss = layout.cross_entropy(z, layout.input(targets));
      }
      CHECK(loss.placements() == Placements{Replicate()});
      CHECK(std::abs(loss.local().item<double>() - want.item<double>()) <= 1e-12);
      for (const CommRecord& r : log.records) CHECK(r.elements <= 6);
    });
  }
}

}  // namespace
}  // namespace tessera::parallel
