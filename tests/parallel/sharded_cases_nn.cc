// Sharded op cases written here rather than read from the op's record (sharded_cases.cc's
// record_cases): ops whose sharded form is not parallel::call of the record's attributes
// (clone and to_device, the composites stack and split, in-place updates, views,
// factories).
#include "tensor/ops.h"
#include "tests/parallel/sharded_cases.h"

namespace tessera::parallel::testing {
namespace {

Attrs dim_attrs(int64_t dim) {
  Attrs a;
  a.dim = dim;
  return a;
}

// to_device and clone: their records' cases run them through `run` (to check the copy's
// storage), so their sharded cases are here.
void copies(std::vector<OpCase>& out) {
  for (OpId op : {OpId::to_device, OpId::clone}) {
    out.push_back(op_case(op, "[5, 7]", {in({5, 7})}));
    out.push_back(op_case(op, "[2, 3, 5]", {in({2, 3, 5})}));
  }
}

// stack and split: composites, through their named sharded functions.
void joining(std::vector<OpCase>& out) {
  for (auto [label, inputs, dim] :
       {std::tuple{"3 x [2, 3] dim 0", std::vector<InputSpec>{in({2, 3}), in({2, 3}), in({2, 3})}, int64_t{0}},
        std::tuple{"2 x [5, 3] dim 1", std::vector<InputSpec>{in({5, 3}), in({5, 3})}, int64_t{1}},
        std::tuple{"2 x [5, 3] dim -1", std::vector<InputSpec>{in({5, 3}), in({5, 3})}, int64_t{-1}}}) {
    OpCase c = op_case(OpId::stack, label, inputs, dim_attrs(dim));
    c.single = [](const Tensors& t, const Attrs& a) { return Tensors{tessera::stack(t, a.dim)}; };
    c.sharded = [](const ShardedTensors& t, const Attrs& a) { return ShardedTensors{parallel::stack(t, a.dim)}; };
    out.push_back(c);
  }
  for (auto [label, shape, size, dim] : {std::tuple{"[5, 3] split_size 2 dim 0", Shape{5, 3}, int64_t{2}, int64_t{0}},
                                         std::tuple{"[4, 7] split_size 3 dim 1", Shape{4, 7}, int64_t{3}, int64_t{1}},
                                         std::tuple{"[6, 5] split_size 4 dim -1", Shape{6, 5}, int64_t{4}, int64_t{-1}}}) {
    OpCase c = op_case(OpId::split, label, {in(shape)}, dim_attrs(dim));
    c.attrs.step = size;  // the split size travels in an unused field
    c.single = [](const Tensors& t, const Attrs& a) { return tessera::split(t[0], a.step, a.dim); };
    c.sharded = [](const ShardedTensors& t, const Attrs& a) { return parallel::split(t[0], a.step, a.dim); };
    out.push_back(c);
  }
}

// copy_, adamw_ and sgd_: in place (the written inputs keep one shared placement).
void in_place(std::vector<OpCase>& out) {
  for (auto [label, src] : {std::pair{"[5, 7] <- [5, 7]", in({5, 7})},
                            std::pair{"[5, 7] <- [1, 7] (broadcast)", in({1, 7})},
                            std::pair{"[5, 7] <- 0-d", in({})},
                            std::pair{"[5, 7] <- i64 [7]", index({7}, -3, 3)}}) {
    OpCase c = op_case(OpId::copy_, label, {in({5, 7}), src});
    c.written = {0};
    c.single = [](const Tensors& t, const Attrs&) {
      tessera::call_copy_(t[0], t[1]);
      return Tensors{t[0]};
    };
    c.sharded = [](const ShardedTensors& t, const Attrs& a) {
      parallel::call_inplace(OpId::copy_, t, a, {0});
      return ShardedTensors{t[0]};
    };
    out.push_back(c);
  }

  Attrs adam;
  adam.lr = 0.1;
  adam.eps = 1e-8;
  adam.weight_decay = 0.1;
  adam.step_count = 3;
  for (const Shape& s : {Shape{5, 7}, Shape{2, 3, 5}}) {
    OpCase c = op_case(OpId::adamw_, shape_str(s) + " t 3",
                       {in(s), in(s), in(s, 0.3), positive(s, 0.01, 0.5)}, adam);
    c.written = {0, 2, 3};
    c.single = [](const Tensors& t, const Attrs& a) {
      tessera::call_inplace(OpId::adamw_, t, a, {0, 2, 3});
      return Tensors{t[0], t[2], t[3]};
    };
    c.sharded = [](const ShardedTensors& t, const Attrs& a) {
      parallel::call_inplace(OpId::adamw_, t, a, {0, 2, 3});
      return ShardedTensors{t[0], t[2], t[3]};
    };
    out.push_back(c);
  }
  Attrs plain;
  plain.lr = 0.1;
  plain.weight_decay = 0.01;
  OpCase sgd = op_case(OpId::sgd_, "[5, 7] plain", {in({5, 7}), in({5, 7}), absent()}, plain);
  sgd.written = {0};
  sgd.single = [](const Tensors& t, const Attrs& a) {
    tessera::call_inplace(OpId::sgd_, t, a, {0});
    return Tensors{t[0]};
  };
  sgd.sharded = [](const ShardedTensors& t, const Attrs& a) {
    parallel::call_inplace(OpId::sgd_, t, a, {0});
    return ShardedTensors{t[0]};
  };
  out.push_back(sgd);
  Attrs momentum = plain;
  momentum.momentum = 0.9;
  momentum.dampening = 0.1;
  momentum.step_count = 4;
  sgd = op_case(OpId::sgd_, "[5, 7] momentum t 4", {in({5, 7}), in({5, 7}), in({5, 7}, 0.5)}, momentum);
  sgd.written = {0, 2};
  sgd.single = [](const Tensors& t, const Attrs& a) {
    tessera::call_inplace(OpId::sgd_, t, a, {0, 2});
    return Tensors{t[0], t[2]};
  };
  sgd.sharded = [](const ShardedTensors& t, const Attrs& a) {
    parallel::call_inplace(OpId::sgd_, t, a, {0, 2});
    return ShardedTensors{t[0], t[2]};
  };
  out.push_back(sgd);
}

void views(std::vector<OpCase>& out) {
  auto shape_attrs = [](Shape s) {
    Attrs a;
    a.shape = std::move(s);
    return a;
  };
  auto dims_attrs = [](std::vector<int64_t> d) {
    Attrs a;
    a.dims = std::move(d);
    return a;
  };
  out.push_back(op_case(OpId::view, "[6, 10] as [3, 2, 5, 2] (splits dims)", {in({6, 10})}, shape_attrs({3, 2, 5, 2})));
  out.push_back(op_case(OpId::view, "[6, 10] as [60] (merges dims)", {in({6, 10})}, shape_attrs({60})));
  out.push_back(op_case(OpId::view, "[5, 6] as [5, -1, 3]", {in({5, 6})}, shape_attrs({5, -1, 3})));
  out.push_back(op_case(OpId::view, "[2, 3, 5] as [6, 5]", {in({2, 3, 5})}, shape_attrs({6, 5})));
  out.push_back(op_case(OpId::permute, "[2, 3, 5] order [2, 0, 1]", {in({2, 3, 5})}, dims_attrs({2, 0, 1})));
  out.push_back(op_case(OpId::permute, "[5, 7] order [1, 0]", {in({5, 7})}, dims_attrs({1, 0})));
  struct S {
    int64_t dim, start, end, step;
  };
  for (const S& s : {S{0, 1, 6, 1}, S{1, 0, 6, 2}, S{-1, -4, -1, 1}, S{0, 0, 7, 3}}) {
    Attrs a;
    a.dim = s.dim;
    a.start = s.start;
    a.end = s.end;
    a.step = s.step;
    out.push_back(op_case(OpId::slice,
                          "[7, 6] dim " + std::to_string(s.dim) + " [" + std::to_string(s.start) + ":" +
                              std::to_string(s.end) + ":" + std::to_string(s.step) + "]",
                          {in({7, 6})}, a));
  }
  out.push_back(op_case(OpId::expand, "[1, 5] to [4, 5]", {in({1, 5})}, shape_attrs({4, 5})));
  out.push_back(op_case(OpId::expand, "[3, 1] to [2, 3, 5]", {in({3, 1})}, shape_attrs({2, 3, 5})));
  out.push_back(op_case(OpId::squeeze, "[3, 1, 5, 1] all", {in({3, 1, 5, 1})}));
  out.push_back(op_case(OpId::squeeze, "[3, 1, 5, 1] dims {1}", {in({3, 1, 5, 1})}, dims_attrs({1})));
  out.push_back(op_case(OpId::unsqueeze, "[5, 6] dim 1", {in({5, 6})}, dim_attrs(1)));
  out.push_back(op_case(OpId::unsqueeze, "[5, 6] dim -1", {in({5, 6})}, dim_attrs(-1)));
  out.push_back(op_case(OpId::unsqueeze, "0-d dim 0", {in({})}, dim_attrs(0)));
}

OpCase factory(OpId op, std::string label, Attrs a) {
  OpCase c = op_case(op, std::move(label), {}, std::move(a));
  c.is_factory = true;
  c.attrs_for = [](Attrs& x, DType dt) { x.dtype = dt; };
  c.factory_single = [op](const Attrs& x) { return tessera::call1(op, {}, x); };
  c.factory_sharded = [op](const Attrs& x, const MeshPtr& mesh, const Placements& p) {
    return parallel::factory(op, x, mesh, p);
  };
  return c;
}

// zeros and ones: composites, through their named sharded functions.
void factories(std::vector<OpCase>& out) {
  for (OpId op : {OpId::zeros, OpId::ones}) {
    for (const Shape& shape : {Shape{5, 7}, Shape{2, 3, 5}}) {
      Attrs a;
      a.shape = shape;
      OpCase c = factory(op, shape_str(shape), a);
      const bool one = op == OpId::ones;
      c.factory_single = [one](const Attrs& x) { return one ? tessera::ones(x.shape, x.dtype) : tessera::zeros(x.shape, x.dtype); };
      c.factory_sharded = [one](const Attrs& x, const MeshPtr& mesh, const Placements& p) {
        return one ? parallel::ones(x.shape, mesh, p, x.dtype) : parallel::zeros(x.shape, mesh, p, x.dtype);
      };
      out.push_back(c);
    }
  }
}

}  // namespace

std::vector<OpCase> nn_cases() {
  std::vector<OpCase> out;
  copies(out);
  return out;
}

std::vector<OpCase> data_cases() {
  std::vector<OpCase> out;
  joining(out);
  in_place(out);
  views(out);
  factories(out);
  return out;
}

}  // namespace tessera::parallel::testing
