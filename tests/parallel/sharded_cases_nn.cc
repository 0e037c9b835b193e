// Sharded op cases: linear algebra and fused layers, indexing, joining, copies, optimizer
// updates, views and factories.
#include "tensor/ops.h"
#include "tests/parallel/sharded_cases.h"

namespace tessera::parallel::testing {
namespace {

Attrs dim_attrs(int64_t dim) {
  Attrs a;
  a.dim = dim;
  return a;
}

Attrs conv_attrs(std::array<int64_t, 2> stride, std::array<int64_t, 2> padding, Shape shape = {}) {
  Attrs a;
  a.stride = stride;
  a.padding = padding;
  a.shape = std::move(shape);
  return a;
}

Attrs pool_attrs(std::array<int64_t, 2> k, std::array<int64_t, 2> stride,
                 std::array<int64_t, 2> padding, Shape shape = {}) {
  Attrs a = conv_attrs(stride, padding, std::move(shape));
  a.kernel_size = k;
  return a;
}

// The forward's statistics, so the backward helpers see consistent inputs.
void layer_norm_stats(Tensors& in, DType) {
  NoGradGuard no_grad;
  Attrs a;
  a.normalized_ndim = static_cast<int64_t>(in[1].dim() - in[2].dim());
  const Tensors fw = tessera::call(OpId::layer_norm, {in[1], Tensor(), Tensor()}, a);
  in[2] = fw[1];
  in[3] = fw[2];
}

void cross_entropy_lse(Tensors& in, DType) {
  NoGradGuard no_grad;
  Attrs a;
  a.reduction = Reduction::none;
  a.ignore_index = -1;
  const Tensor classes = tessera::zeros({in[1].size(0)}, DType::i64);
  in[3] = tessera::call(OpId::cross_entropy, {in[1], classes}, a)[1];
}

// out and lse of attention(q, k, v), so the backward sees consistent inputs.
std::function<void(Tensors&, DType)> attention_forward_outputs(bool causal) {
  return [causal](Tensors& in, DType) {
    NoGradGuard no_grad;
    Attrs a;
    a.causal = causal;
    const Tensors fw = tessera::call(OpId::attention, {in[1], in[2], in[3]}, a);
    in[4] = fw[0];
    in[5] = fw[1];
  };
}

void linalg(std::vector<OpCase>& out) {
  OpCase mm = op_case(OpId::matmul, "[5, 7] @ [7, 6]", {in({5, 7}), in({7, 6})});
  mm.mesh_2x4 = true;
  out.push_back(mm);
  OpCase batched = op_case(OpId::matmul, "[2, 5, 3] @ [2, 3, 6]", {in({2, 5, 3}), in({2, 3, 6})});
  batched.mesh_2x4 = true;
  out.push_back(batched);
  out.push_back(op_case(OpId::matmul, "[2, 1, 3, 4] @ [3, 4, 5] (batch broadcast)",
                        {in({2, 1, 3, 4}), in({3, 4, 5})}));

  for (OpId op : {OpId::softmax, OpId::log_softmax}) {
    out.push_back(op_case(op, "[5, 7] dim -1", {in({5, 7}, 2)}, dim_attrs(-1)));
    out.push_back(op_case(op, "[5, 7] dim 0", {in({5, 7}, 2)}, dim_attrs(0)));
    out.push_back(op_case(op, "[2, 3, 5] dim 1", {in({2, 3, 5}, 2)}, dim_attrs(1)));
  }

  Attrs nd1, nd2;
  nd2.normalized_ndim = 2;
  out.push_back(op_case(OpId::layer_norm, "[5, 6] nd 1, weight, bias", {in({5, 6}), in({6}), in({6})}, nd1));
  out.push_back(op_case(OpId::layer_norm, "[2, 3, 4] nd 2, weight, bias",
                        {in({2, 3, 4}), in({3, 4}), in({3, 4})}, nd2));
  out.push_back(op_case(OpId::layer_norm, "[5, 7] no weight, no bias", {in({5, 7}), absent(), absent()}, nd1));

  // grad, x, mean, rstd, weight, bias (mean and rstd from x).
  OpCase lnb = op_case(OpId::layer_norm_backward, "[5, 6] nd 1, weight, bias",
                       {in({5, 6}), in({5, 6}), in({5}), in({5}), in({6}), in({6})}, nd1);
  lnb.prepare = layer_norm_stats;
  out.push_back(lnb);
  lnb = op_case(OpId::layer_norm_backward, "[5, 7] no weight, no bias",
                {in({5, 7}), in({5, 7}), in({5}), in({5}), absent(), absent()}, nd1);
  lnb.prepare = layer_norm_stats;
  out.push_back(lnb);
  lnb = op_case(OpId::layer_norm_backward, "[2, 3, 4] nd 2, weight only",
                {in({2, 3, 4}), in({2, 3, 4}), in({2}), in({2}), in({3, 4}), absent()}, nd2);
  lnb.prepare = layer_norm_stats;
  out.push_back(lnb);

  struct CE {
    const char* label;
    Reduction reduction;
    int64_t ignore_index;
    std::vector<double> targets;  // empty: random classes
    DType target_dtype = DType::i64;
  };
  for (const CE& ce : {CE{"[7, 5] mean", Reduction::mean, -100, {}},
                       CE{"[7, 5] sum", Reduction::sum, -100, {}},
                       CE{"[7, 5] none", Reduction::none, -100, {}},
                       CE{"[7, 5] mean, two rows ignored", Reduction::mean, -100, {0, -100, 3, 2, -100, 4, 1}},
                       CE{"[7, 5] none, class 1 ignored", Reduction::none, 1, {1, 0, 3, 1, 2, 4, 1}},
                       CE{"[7, 5] sum, i32 targets", Reduction::sum, -100, {}, DType::i32}}) {
    const InputSpec target = ce.targets.empty() ? index({7}, 0, 4, ce.target_dtype)
                                                : fixed_index({7}, ce.targets, ce.target_dtype);
    Attrs a;
    a.reduction = ce.reduction;
    a.ignore_index = ce.ignore_index;
    out.push_back(op_case(OpId::cross_entropy, ce.label, {in({7, 5}, 3), target}, a));
    // grad, logits, target, logsumexp (from logits).
    const Shape grad = ce.reduction == Reduction::none ? Shape{7} : Shape{};
    OpCase b = op_case(OpId::cross_entropy_backward, ce.label, {in(grad), in({7, 5}, 3), target, in({7})}, a);
    b.prepare = cross_entropy_lse;
    out.push_back(b);
  }

  for (auto [shape, p] : {std::pair{Shape{7, 9}, 0.5}, std::pair{Shape{2, 3, 5}, 0.25}}) {
    Attrs a;
    a.p = p;
    a.seed = 1234;
    a.offset = 77;
    out.push_back(op_case(OpId::dropout, shape_str(shape) + " p " + std::to_string(p), {in(shape)}, a));
  }

  // attention over [B, H, T, D] with B = 3, H = 2 (uneven and empty blocks on 4 ranks), and
  // as tensor-parallel GPT runs it: causal, 4 heads, whole heads per rank on every mesh.
  struct Attn {
    Shape s;
    bool causal;
  };
  for (const Attn& at : {Attn{{3, 2, 5, 4}, true}, Attn{{3, 2, 5, 4}, false}, Attn{{2, 4, 6, 3}, true}}) {
    Attrs a;
    a.causal = at.causal;
    const Shape& s = at.s;
    const std::string label = shape_str(s) + (at.causal ? " causal" : " not causal");
    out.push_back(op_case(OpId::attention, label, {in(s), in(s), in(s)}, a));
    // grad, q, k, v, out, lse (out and lse from q, k, v).
    OpCase b = op_case(OpId::attention_backward, label,
                       {in(s), in(s), in(s), in(s), in(s), in({s[0], s[1], s[2]})}, a);
    b.prepare = attention_forward_outputs(at.causal);
    out.push_back(b);
  }

  struct Conv {
    const char* label;
    Shape x, w, y;
    std::array<int64_t, 2> stride, padding;
    bool bias;
  };
  for (const Conv& cv : {Conv{"x [3, 2, 6, 5] w [4, 2, 3, 2], bias", {3, 2, 6, 5}, {4, 2, 3, 2}, {3, 4, 4, 4}, {1, 1}, {0, 0}, true},
                         Conv{"x [3, 2, 7, 6] w [5, 2, 3, 3], stride 2, padding 1", {3, 2, 7, 6}, {5, 2, 3, 3}, {3, 5, 4, 3}, {2, 2}, {1, 1}, false}}) {
    out.push_back(op_case(OpId::conv2d, cv.label, {in(cv.x), in(cv.w), cv.bias ? in({cv.w[0]}) : absent()},
                          conv_attrs(cv.stride, cv.padding)));
    out.push_back(op_case(OpId::conv2d_backward_input, cv.label, {in(cv.y), in(cv.w)},
                          conv_attrs(cv.stride, cv.padding, cv.x)));
    out.push_back(op_case(OpId::conv2d_backward_weight, cv.label, {in(cv.y), in(cv.x)},
                          conv_attrs(cv.stride, cv.padding, cv.w)));
  }
  out.push_back(op_case(OpId::max_pool2d, "[3, 2, 7, 6] k 2 s 2", {in({3, 2, 7, 6})},
                        pool_attrs({2, 2}, {2, 2}, {0, 0})));
  out.push_back(op_case(OpId::max_pool2d, "[2, 3, 7, 6] k 3 s 2 pad 1", {in({2, 3, 7, 6})},
                        pool_attrs({3, 3}, {2, 2}, {1, 1})));
  // Indices anywhere in the 7 x 6 input plane (repeats included).
  out.push_back(op_case(OpId::max_pool2d_backward, "[3, 2, 7, 6] from [3, 2, 3, 3]",
                        {in({3, 2, 3, 3}), index({3, 2, 3, 3}, 0, 41)},
                        pool_attrs({2, 2}, {2, 2}, {0, 0}, {3, 2, 7, 6})));
}

void indexing(std::vector<OpCase>& out) {
  out.push_back(op_case(OpId::embedding, "weight [7, 4], indices [5]", {in({7, 4}), index({5}, 0, 6)}));
  out.push_back(op_case(OpId::embedding, "weight [7, 4], indices [2, 3]", {in({7, 4}), index({2, 3}, 0, 6)}));
  out.push_back(op_case(OpId::index_select, "[5, 4, 3] dim 0, index [6]", {in({5, 4, 3}), index({6}, 0, 4)}, dim_attrs(0)));
  out.push_back(op_case(OpId::index_select, "[5, 4, 3] dim 1, index [3]", {in({5, 4, 3}), index({3}, 0, 3)}, dim_attrs(1)));
  out.push_back(op_case(OpId::index_select, "[5, 4, 3] dim -1, index i32 [4]",
                        {in({5, 4, 3}), index({4}, 0, 2, DType::i32)}, dim_attrs(-1)));
  out.push_back(op_case(OpId::index_add, "[5, 4] dim 0, index [6]", {in({5, 4}), index({6}, 0, 4), in({6, 4})}, dim_attrs(0)));
  out.push_back(op_case(OpId::index_add, "[3, 5] dim 1, index [7]", {in({3, 5}), index({7}, 0, 4), in({3, 7})}, dim_attrs(1)));
  out.push_back(op_case(OpId::gather, "[4, 5] dim 0, index [3, 5]", {in({4, 5}), index({3, 5}, 0, 3)}, dim_attrs(0)));
  out.push_back(op_case(OpId::gather, "[4, 5] dim 1, index [4, 2]", {in({4, 5}), index({4, 2}, 0, 4)}, dim_attrs(1)));
  out.push_back(op_case(OpId::gather, "[5, 4] dim 1, index [2, 3] (smaller)", {in({5, 4}), index({2, 3}, 0, 3)}, dim_attrs(1)));
  out.push_back(op_case(OpId::scatter_add, "[4, 5] dim 0, index [3, 5]",
                        {in({4, 5}), index({3, 5}, 0, 3), in({3, 5})}, dim_attrs(0)));
  out.push_back(op_case(OpId::scatter_add, "[4, 5] dim 1, index [4, 3], src [4, 6]",
                        {in({4, 5}), index({4, 3}, 0, 4), in({4, 6})}, dim_attrs(1)));
}

void joining(std::vector<OpCase>& out) {
  out.push_back(op_case(OpId::cat, "[2, 3] + [4, 3] + [1, 3] dim 0", {in({2, 3}), in({4, 3}), in({1, 3})}, dim_attrs(0)));
  out.push_back(op_case(OpId::cat, "[5, 3] + [5, 2] dim 1", {in({5, 3}), in({5, 2})}, dim_attrs(1)));
  out.push_back(op_case(OpId::cat, "[2, 3, 4] + [2, 3, 1] dim -1", {in({2, 3, 4}), in({2, 3, 1})}, dim_attrs(-1)));
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

void copies(std::vector<OpCase>& out) {
  OpCase other = op_case(OpId::cast, "[5, 7] to the other float", {in({5, 7}, 3)});
  other.attrs_for = [](Attrs& a, DType dt) { a.dtype = dt == DType::f64 ? DType::f32 : DType::f64; };
  out.push_back(other);
  for (DType to : {DType::i64, DType::b8}) {
    Attrs a;
    a.dtype = to;
    out.push_back(op_case(OpId::cast, std::string("[5, 7] to ") + std::string(dtype_name(to)), {in({5, 7}, 3)}, a));
  }
  for (OpId op : {OpId::to_device, OpId::clone}) {
    out.push_back(op_case(op, "[5, 7]", {in({5, 7})}));
    out.push_back(op_case(op, "[2, 3, 5]", {in({2, 3, 5})}));
  }
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

void factories(std::vector<OpCase>& out) {
  Attrs f;
  f.shape = {5, 7};
  f.value = 2.5;
  out.push_back(factory(OpId::full, "[5, 7] value 2.5", f));
  f.shape = {2, 3, 5};
  f.value = -3;
  out.push_back(factory(OpId::full, "[2, 3, 5] value -3", f));
  for (auto [label, start, end, step] : {std::tuple{"(0, 11, 1)", 0.0, 11.0, 1.0},
                                         std::tuple{"(2.5, -1, -0.5)", 2.5, -1.0, -0.5},
                                         std::tuple{"(-3, 4, 2)", -3.0, 4.0, 2.0}}) {
    Attrs a;
    a.range_start = start;
    a.range_end = end;
    a.range_step = step;
    out.push_back(factory(OpId::arange, label, a));
  }
  for (OpId op : {OpId::rand, OpId::randn}) {
    for (auto [shape, seed, offset] : {std::tuple{Shape{5, 7}, uint64_t{42}, uint64_t{0}},
                                       std::tuple{Shape{2, 3, 5}, uint64_t{7}, (uint64_t{1} << 40) + 5}}) {
      Attrs a;
      a.shape = shape;
      a.seed = seed;
      a.offset = offset;
      out.push_back(factory(op, shape_str(shape) + " seed " + std::to_string(seed), a));
    }
  }
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
  linalg(out);
  return out;
}

std::vector<OpCase> data_cases() {
  std::vector<OpCase> out;
  indexing(out);
  joining(out);
  copies(out);
  views(out);
  factories(out);
  return out;
}

}  // namespace tessera::parallel::testing
