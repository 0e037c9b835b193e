// Sharded op cases written here rather than read from the op's record (sharded_cases.cc's
// record_cases): ops whose sharded form is not parallel::call of the record's attributes
// (the composites stack, split, zeros and ones: through their named sharded functions).
#include "tensor/ops.h"
#include "tests/parallel/sharded_cases.h"

namespace tessera::parallel::testing {
namespace {

Attrs dim_attrs(int64_t dim) {
  Attrs a;
  a.dim = dim;
  return a;
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

// zeros and ones: composites, through their named sharded functions.
void factories(std::vector<OpCase>& out) {
  for (OpId op : {OpId::zeros, OpId::ones}) {
    for (const Shape& shape : {Shape{5, 7}, Shape{2, 3, 5}}) {
      Attrs a;
      a.shape = shape;
      OpCase c = op_case(op, shape_str(shape), {}, a);
      c.is_factory = true;
      c.attrs_for = [](Attrs& x, DType dt) { x.dtype = dt; };
      const bool one = op == OpId::ones;
      c.factory_single = [one](const Attrs& x) { return one ? tessera::ones(x.shape, x.dtype) : tessera::zeros(x.shape, x.dtype); };
      c.factory_sharded = [one](const Attrs& x, const MeshPtr& mesh, const Placements& p) {
        return one ? parallel::ones(x.shape, mesh, p, x.dtype) : parallel::zeros(x.shape, mesh, p, x.dtype);
      };
      out.push_back(c);
    }
  }
}

// counting_sort takes integer keys only, so its record (no f64 case) does not run here.
void counting_sorts(std::vector<OpCase>& out) {
  for (auto [label, n, buckets] : {std::tuple{"[13] keys in [0, 4)", int64_t{13}, int64_t{4}},
                                   std::tuple{"[6] keys in [0, 8)", int64_t{6}, int64_t{8}}}) {
    Attrs a;
    a.k = buckets;
    out.push_back(op_case(OpId::counting_sort, label, {index({n}, 0, buckets - 1)}, a));
  }
}

}  // namespace

std::vector<OpCase> data_cases() {
  std::vector<OpCase> out;
  joining(out);
  factories(out);
  counting_sorts(out);
  return out;
}

}  // namespace tessera::parallel::testing
