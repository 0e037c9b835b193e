// Records (cases.h): indexing, joining and splitting, copies and casts, views, factories.
#include <doctest/doctest.h>

#include <cmath>

#include "tensor/op_attrs.h"
#include "tests/reference/cases.h"

namespace tessera::sweep {
namespace {

using ref::map;


Case exact_case(std::string label, std::vector<Arg> args,
                std::function<Arrays(const Arrays&, DType)> reference) {
  Case c;
  c.label = std::move(label);
  c.args = std::move(args);
  c.ref = std::move(reference);
  c.exact = true;
  return c;
}

// ---- indexing ------------------------------------------------------------------------------

// topk's f64 reference: the k largest along dim, largest first (NaN largest, equal values
// in index order), and their indices.
Arrays topk_ref(const NdArray& x, int64_t k, int64_t dim_in) {
  const int64_t dim = ref::wrap_dim(dim_in, x.ndim());
  Shape s = x.shape;
  s[dim] = k;
  NdArray values = NdArray::zeros(s), indices = NdArray::zeros(s);
  for (int64_t flat = 0; flat < values.numel(); ++flat) {
    std::vector<int64_t> at = ref::unravel(flat, s);
    if (at[dim] != 0) continue;  // one row per position of the other dims
    std::vector<std::pair<double, int64_t>> row;
    for (int64_t j = 0; j < x.shape[dim]; ++j) {
      at[dim] = j;
      row.push_back({x.at(at), j});
    }
    std::stable_sort(row.begin(), row.end(), [](const auto& p, const auto& q) {
      if (std::isnan(p.first) || std::isnan(q.first)) return std::isnan(p.first) && !std::isnan(q.first);
      return p.first > q.first;
    });
    for (int64_t j = 0; j < k; ++j) {
      at[dim] = j;
      values.at(at) = row[j].first;
      indices.at(at) = static_cast<double>(row[j].second);
    }
  }
  return {values, indices};
}

// topk along attrs.dim; integer dtypes draw small integers (ties).
OpSweep topk_sweep() {
  OpSweep s{OpId::topk, kNumeric, {DType::b8}, {}, {}};
  struct T {
    const char* label;
    Shape shape;
    int64_t k, dim;
    Domain domain;
  };
  for (const T& t : {T{"[6, 9] k 3 dim -1", {6, 9}, 3, -1, normal()},
                     T{"[4, 5, 6] k 2 dim 1", {4, 5, 6}, 2, 1, normal()},
                     T{"[5, 7] k 7 dim 1 (all, sorted)", {5, 7}, 7, 1, normal()},
                     T{"[5, 7] k 0", {5, 7}, 0, 1, normal()},
                     T{"[8, 4] k 3 dim 0 ties", {8, 4}, 3, 0, ints(-2, 2)},
                     T{"[2, 8] k 4 IEEE specials", {2, 8}, 4, 1,
                       fixed({NAN, 1.0, -INFINITY, 0.0, -0.0, INFINITY, 3.0, NAN, 2.0, 2.0, -1.0,
                              5.0, -5.0, 2.0, 0.5, 1.0})}}) {
    Case c;
    c.label = t.label;
    c.args = {arg(t.shape, t.domain, ints(-9, 9))};
    c.attrs.k = t.k;
    c.attrs.dim = t.dim;
    c.ref = [k = t.k, dim = t.dim](const Arrays& in, DType) { return topk_ref(in[0], k, dim); };
    c.out_dtype = [](DType dt, size_t i) { return i == 1 ? DType::i64 : dt; };
    c.exact = true;
    s.cases.push_back(std::move(c));
  }
  return s;
}

// counting_sort: keys in [0, k) of the case's integer dtype; the reference sorts (key,
// position) pairs with std::stable_sort and counts by scanning.
OpSweep counting_sort_sweep() {
  OpSweep s{OpId::counting_sort, {DType::i32, DType::i64}, {DType::f32, DType::f64, DType::b8}, {}, {}};
  struct K {
    const char* label;
    int64_t n, buckets, hi;
  };
  for (const K& k : {K{"[12] in [0, 4)", 12, 4, 3}, K{"[30] in [0, 8), buckets 8 (some empty)", 30, 8, 5},
                     K{"[0] buckets 3", 0, 3, 2}, K{"[9] one bucket", 9, 1, 0}}) {
    Case c;
    c.label = k.label;
    c.args = {arg({k.n}, uniform(0, 1), ints(0, k.hi))};
    c.attrs.k = k.buckets;
    c.ref = [b = k.buckets](const Arrays& in, DType) {
      const int64_t n = in[0].numel();
      std::vector<std::pair<double, int64_t>> pairs;
      for (int64_t i = 0; i < n; ++i) pairs.push_back({in[0].data[i], i});
      std::stable_sort(pairs.begin(), pairs.end(),
                       [](const auto& p, const auto& q) { return p.first < q.first; });
      NdArray order = NdArray::zeros({n}), counts = NdArray::zeros({b});
      for (int64_t i = 0; i < n; ++i) {
        order.data[i] = static_cast<double>(pairs[i].second);
        counts.data[static_cast<int64_t>(pairs[i].first)] += 1;
      }
      return Arrays{order, counts};
    };
    c.out_dtype = [](DType, size_t) { return DType::i64; };
    c.exact = true;
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("counting_sort key 4 with 4 buckets",
                 [] { counting_sort(Tensor::from_vector<int64_t>({0, 4}, {2}), 4); });
    expect_error("counting_sort negative key",
                 [] { counting_sort(Tensor::from_vector<int64_t>({-1}, {1}), 4); });
    expect_error("counting_sort 0 buckets", [] { counting_sort(Tensor::from_vector<int64_t>({0}, {1}), 0); });
    expect_error("counting_sort 2-d keys", [] { counting_sort(zeros({2, 2}, DType::i64), 2); });
  };
  return s;
}

std::vector<OpSweep> index_sweeps() {
  std::vector<OpSweep> out;
  OpSweep emb{OpId::embedding, kAll, {}, {}, {}};
  for (auto [label, idx] : {std::pair{"indices [5]", index_arg({5}, 0, 6)},
                            std::pair{"indices [2, 3]", index_arg({2, 3}, 0, 6)},
                            std::pair{"indices i32 [4]", index_arg({4}, 0, 6, DType::i32)},
                            std::pair{"indices 0-d", index_arg({}, 0, 6)}}) {
    emb.cases.push_back(
        exact_case(label, {arg({7, 4}, normal(2), ints(-9, 9)), idx},
                   [](const Arrays& in, DType) { return Arrays{ref::embedding(in[0], in[1])}; }));
  }
  emb.extra = [] {
    expect_error("embedding index 7 of 7 rows", [] {
      embedding(zeros({7, 2}), make_tensor(NdArray::of({2}, {0, 7}), DType::i64));
    });
    expect_error("embedding f32 indices", [] { embedding(zeros({7, 2}), zeros({2})); });
    expect_error("embedding index -1", [] {
      embedding(zeros({7, 2}), make_tensor(NdArray::of({1}, {-1}), DType::i64));
    });
  };
  out.push_back(std::move(emb));

  OpSweep sel{OpId::index_select, kAll, {}, {}, {}};
  struct S {
    const char* label;
    int64_t dim;
    Arg index;
  };
  for (const S& s : {S{"[5, 4, 3] dim 0, index [6]", 0, index_arg({6}, 0, 4)},
                     S{"[5, 4, 3] dim 1, index [3]", 1, index_arg({3}, 0, 3)},
                     S{"[5, 4, 3] dim -1, index i32 [4]", -1, index_arg({4}, 0, 2, DType::i32)},
                     S{"[5, 4, 3] dim 0, empty index", 0, index_arg({0}, 0, 4)}}) {
    Case c = exact_case(s.label, {arg({5, 4, 3}, normal(2), ints(-9, 9)), s.index},
                        [dim = s.dim](const Arrays& in, DType) {
                          return Arrays{ref::index_select(in[0], dim, in[1])};
                        });
    c.attrs.dim = s.dim;
    sel.cases.push_back(std::move(c));
  }
  sel.extra = [] {
    expect_error("index_select index 5 of 5", [] {
      index_select(zeros({5, 2}), 0, make_tensor(NdArray::of({1}, {5}), DType::i64));
    });
    expect_error("index_select 2-d index", [] {
      index_select(zeros({5, 2}), 0, make_tensor(NdArray::of({1, 1}, {0}), DType::i64));
    });
  };
  out.push_back(std::move(sel));

  // index_add / scatter_add accumulate in the tensor's dtype: each 16-bit output element
  // is rounded once per index that hits it, so `rounds` = the index length + 1.
  OpSweep ia{OpId::index_add, kNumeric, {DType::b8}, {}, {}};
  struct IA {
    const char* label;
    Shape x;
    int64_t dim;
    Arg index;
    Shape src;
  };
  for (const IA& a :
       {IA{"[5, 4] dim 0, index [6]", {5, 4}, 0, index_arg({6}, 0, 4), {6, 4}},
        IA{"[3, 5] dim 1, index [7]", {3, 5}, 1, index_arg({7}, 0, 4), {3, 7}},
        IA{"[2, 3, 4] dim -1, index i32 [5]",
           {2, 3, 4},
           -1,
           index_arg({5}, 0, 3, DType::i32),
           {2, 3, 5}},
        IA{"[2, 300] dim 0, index [3] (wide rows)", {2, 300}, 0, index_arg({3}, 0, 1), {3, 300}}}) {
    Case c;
    c.label = a.label;
    c.args = {arg(a.x, normal(2), ints(-9, 9)), a.index, arg(a.src, normal(2), ints(-9, 9))};
    c.attrs.dim = a.dim;
    c.rounds = static_cast<double>(a.index.shape[0] + 1);
    c.ref = [dim = a.dim](const Arrays& in, DType) {
      return Arrays{ref::index_add(in[0], dim, in[1], in[2])};
    };
    c.mag = [dim = a.dim](const Arrays& in, DType) {
      return Arrays{ref::index_add(abs_of(in[0]), dim, in[1], abs_of(in[2]))};
    };
    ia.cases.push_back(std::move(c));
  }
  ia.extra = [] {
    expect_error("index_add source [2, 3] for [3, 3] dim 0 index [3]", [] {
      index_add(zeros({3, 3}), 0, make_tensor(NdArray::of({3}, {0, 1, 2}), DType::i64),
                zeros({2, 3}));
    });
  };
  out.push_back(std::move(ia));

  OpSweep ga{OpId::gather, kAll, {}, {}, {}};
  struct G {
    const char* label;
    Shape x;
    int64_t dim;
    Arg index;
  };
  for (const G& g : {G{"[4, 5] dim 0, index [3, 5]", {4, 5}, 0, index_arg({3, 5}, 0, 3)},
                     G{"[4, 5] dim 1, index [4, 2]", {4, 5}, 1, index_arg({4, 2}, 0, 4)},
                     G{"[4, 5] dim 1, index [2, 3] (smaller)", {4, 5}, 1, index_arg({2, 3}, 0, 4)},
                     G{"[2, 3, 4] dim -1, index i32 [2, 3, 6]",
                       {2, 3, 4},
                       -1,
                       index_arg({2, 3, 6}, 0, 3, DType::i32)}}) {
    Case c = exact_case(
        g.label, {arg(g.x, normal(2), ints(-9, 9)), g.index},
        [dim = g.dim](const Arrays& in, DType) { return Arrays{ref::gather(in[0], dim, in[1])}; });
    c.attrs.dim = g.dim;
    ga.cases.push_back(std::move(c));
  }
  ga.extra = [] {
    expect_error("gather index 4 of 4", [] {
      gather(zeros({4, 2}), 0, make_tensor(NdArray::of({1, 2}, {0, 4}), DType::i64));
    });
    expect_error("gather index rank 1 for rank 2", [] {
      gather(zeros({4, 2}), 0, make_tensor(NdArray::of({2}, {0, 1}), DType::i64));
    });
  };
  out.push_back(std::move(ga));

  OpSweep sa{OpId::scatter_add, kNumeric, {DType::b8}, {}, {}};
  struct SA {
    const char* label;
    Shape x;
    int64_t dim;
    Arg index;
    Shape src;
  };
  for (const SA& a : {SA{"[4, 5] dim 0, index [3, 5]", {4, 5}, 0, index_arg({3, 5}, 0, 3), {3, 5}},
                      SA{"[4, 5] dim 1, index [4, 3], src [4, 6] (larger)",
                         {4, 5},
                         1,
                         index_arg({4, 3}, 0, 4),
                         {4, 6}},
                      SA{"[2, 3, 4] dim -1, index i32 [2, 2, 5]",
                         {2, 3, 4},
                         -1,
                         index_arg({2, 2, 5}, 0, 3, DType::i32),
                         {2, 3, 5}}}) {
    Case c;
    c.label = a.label;
    c.args = {arg(a.x, normal(2), ints(-9, 9)), a.index, arg(a.src, normal(2), ints(-9, 9))};
    c.attrs.dim = a.dim;
    const int64_t d = ref::wrap_dim(a.dim, static_cast<int64_t>(a.x.size()));
    c.rounds = static_cast<double>(a.index.shape[d] + 1);
    c.ref = [dim = a.dim](const Arrays& in, DType) {
      return Arrays{ref::scatter_add(in[0], dim, in[1], in[2])};
    };
    c.mag = [dim = a.dim](const Arrays& in, DType) {
      return Arrays{ref::scatter_add(abs_of(in[0]), dim, in[1], abs_of(in[2]))};
    };
    sa.cases.push_back(std::move(c));
  }
  out.push_back(std::move(sa));
  out.push_back(topk_sweep());
  out.push_back(counting_sort_sweep());
  return out;
}

// ---- joining and splitting ------------------------------------------------------------------

std::vector<OpSweep> join_sweeps() {
  std::vector<OpSweep> out;
  auto args_of = [](const std::vector<Shape>& shapes) {
    std::vector<Arg> a;
    for (const Shape& s : shapes) a.push_back(arg(s, normal(2), ints(-9, 9)));
    return a;
  };
  auto arrays = [](const Arrays& in) { return std::vector<NdArray>(in.begin(), in.end()); };

  OpSweep cat_s{OpId::cat, kAll, {}, {}, {}};
  struct J {
    const char* label;
    std::vector<Shape> shapes;
    int64_t dim;
  };
  for (const J& j :
       {J{"[2, 3] + [4, 3] + [1, 3] dim 0", {{2, 3}, {4, 3}, {1, 3}}, 0},
        J{"[2, 3] + [2, 5] dim 1", {{2, 3}, {2, 5}}, 1},
        J{"[2, 3, 4] + [2, 3, 1] dim -1", {{2, 3, 4}, {2, 3, 1}}, -1},
        J{"[2, 3] + [0, 3] + [1, 3] dim 0 (an empty part)", {{2, 3}, {0, 3}, {1, 3}}, 0},
        J{"[3, 4] alone dim 1", {{3, 4}}, 1}}) {
    Case c = exact_case(j.label, args_of(j.shapes), [=](const Arrays& in, DType) {
      return Arrays{ref::cat(arrays(in), j.dim)};
    });
    c.attrs.dim = j.dim;
    cat_s.cases.push_back(std::move(c));
  }
  cat_s.extra = [] {
    expect_error("cat f32 + f64", [] { cat({zeros({2}), zeros({2}, DType::f64)}); });
    expect_error("cat [2, 3] + [2, 4] dim 0", [] { cat({zeros({2, 3}), zeros({2, 4})}, 0); });
  };
  out.push_back(std::move(cat_s));

  OpSweep st{OpId::stack, kAll, {}, {}, {}};
  for (const J& j :
       {J{"3 x [2, 3] dim 0", {{2, 3}, {2, 3}, {2, 3}}, 0},
        J{"2 x [2, 3] dim 1", {{2, 3}, {2, 3}}, 1}, J{"2 x [2, 3] dim -1", {{2, 3}, {2, 3}}, -1},
        J{"2 x 0-d dim 0", {{}, {}}, 0}}) {
    Case c = exact_case(j.label, args_of(j.shapes), [=](const Arrays& in, DType) {
      return Arrays{ref::stack(arrays(in), j.dim)};
    });
    c.run = [dim = j.dim](const Tensors& in, DType) { return Tensors{stack(in, dim)}; };
    st.cases.push_back(std::move(c));
  }
  st.extra = [] { expect_error("stack [2] + [3]", [] { stack({zeros({2}), zeros({3})}); }); };
  out.push_back(std::move(st));

  OpSweep sp{OpId::split, kAll, {}, {}, {}};
  struct P {
    const char* label;
    Shape shape;
    std::vector<int64_t> sizes;
    int64_t split_size;  // > 0: split(x, split_size, dim)
    int64_t dim;
  };
  for (const P& p : {P{"[5, 3] split_size 2 dim 0", {5, 3}, {2, 2, 1}, 2, 0},
                     P{"[4, 6] sizes {1, 3, 2} dim 1", {4, 6}, {1, 3, 2}, 0, 1},
                     P{"[2, 3, 4] sizes {0, 4} dim -1", {2, 3, 4}, {0, 4}, 0, -1}}) {
    Case c = exact_case(p.label, {arg(p.shape, normal(2), ints(-9, 9))},
                        [=](const Arrays& in, DType) { return ref::split(in[0], p.sizes, p.dim); });
    c.run = [p](const Tensors& in, DType) {
      return p.split_size > 0 ? split(in[0], p.split_size, p.dim) : split(in[0], p.sizes, p.dim);
    };
    c.views_input0 = true;
    sp.cases.push_back(std::move(c));
  }
  sp.extra = [] {
    expect_error("split sizes {1, 1} of 3", [] { split(zeros({3}), std::vector<int64_t>{1, 1}); });
  };
  out.push_back(std::move(sp));
  return out;
}

// ---- copies and casts -------------------------------------------------------------------------

std::vector<OpSweep> copy_sweeps() {
  std::vector<OpSweep> out;
  OpSweep cast_s{OpId::cast, kAll, {}, {}, {}};
  for (DType to : kAll) {
    // normal(3) values: fractional and negative, so float -> int truncation is exercised.
    Case c = exact_case(fmt::format("[4, 6] to {}", dtype_name(to)),
                        {arg({4, 6}, normal(3), ints(-9, 9))},
                        [to](const Arrays& in, DType) { return Arrays{ref::round_to(in[0], to)}; });
    c.attrs.dtype = to;
    c.out_dtype = [to](DType, size_t) { return to; };
    // Finite differences through a rounding to a narrower float measure the rounding, not
    // the derivative: gradcheck_cases_elementwise.cc checks those casts on exact values.
    c.grad = to == DType::f64;
    cast_s.cases.push_back(std::move(c));
  }
  struct Edge {
    const char* label;
    std::vector<DType> from;
    DType to;
    std::vector<double> values;
  };
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  const Edge edges[] = {
      // Ties go to even; 65520 is the first value that rounds past the f16 maximum 65504.
      {"f16 ties, overflow, subnormals",
       {DType::f32, DType::f64},
       DType::f16,
       {1 + 0x1p-11, 1 + 0x3p-11, 65504, 65519, 65520, -65520, 0x1p-24, 0x1p-25, 0x3p-26, 1e-8, inf,
        -inf, nan, -0.0, 0.1, -2.5}},
      {"bf16 ties, overflow",
       {DType::f32, DType::f64},
       DType::bf16,
       {1 + 0x1p-8, 1 + 0x3p-8, 3.4e38, -3.4e38, 0x1p-130, 1e-40, inf, nan, -0.0, 0.1, 255.5, 257}},
      // A value just above an f16 / bf16 tie must round up: rounding through f32 first
      // would land on the tie and round to even (double rounding).
      {"f64 just above a tie (no double rounding)",
       {DType::f64},
       DType::f16,
       {1 + 0x1p-11 + 0x1p-40, 1 + 0x1p-11 - 0x1p-40, 2049 + 0x1p-30, -(1 + 0x1p-11 + 0x1p-40)}},
      {"f64 just above a bf16 tie",
       {DType::f64},
       DType::bf16,
       {1 + 0x1p-8 + 0x1p-40, 257 + 0x1p-30, -(1 + 0x1p-8 + 0x1p-40), 1 + 0x1p-8 - 0x1p-40}},
      {"f64 to f32 ties, overflow, subnormals",
       {DType::f64},
       DType::f32,
       {1 + 0x1p-24, 1 + 0x3p-24, 3.5e38, 1e-40, 1e-46, 0x1p-149, -1e300}},
      {"tiny f64 to bool (nonzero is true)",
       {DType::f64},
       DType::b8,
       {1e-300, -4.9e-324, 0.0, -0.0, 1e-46, 2.5, nan}},
      {"integers to f16 / bf16 ties",
       {DType::i32, DType::i64},
       DType::f16,
       {2049, 2051, -2049, 70000, 65519, 65520}},
      {"integers to bf16 ties",
       {DType::i32, DType::i64},
       DType::bf16,
       {257, 259, -257, 16777216 + 65537, -(16777216 + 65537), 65535}},
  };
  for (const Edge& e : edges) {
    Case c = exact_case(
        e.label, {arg({static_cast<int64_t>(e.values.size())}, fixed(e.values))},
        [to = e.to](const Arrays& in, DType) { return Arrays{ref::round_to(in[0], to)}; });
    c.dtypes = e.from;
    c.attrs.dtype = e.to;
    c.out_dtype = [to = e.to](DType, size_t) { return to; };
    cast_s.cases.push_back(std::move(c));
  }
  cast_s.extra = [] {
    const Tensor x = zeros({2});
    CHECK(cast(x, DType::f32).is_same(x));  // a no-op cast returns the tensor itself
  };
  out.push_back(std::move(cast_s));

  // sign_pack / sign_unpack: 8 signs a byte, least significant bit first; a sign bit is 1
  // for a value that is not negative (>= 0, -0, NaN).
  auto pack_ref = [](const Arrays& in, DType) {
    const NdArray& x = in[0];
    NdArray out = NdArray::zeros({(x.numel() + 7) / 8});
    for (int64_t i = 0; i < x.numel(); ++i) {
      if (!(x.data[static_cast<size_t>(i)] < 0)) out.data[static_cast<size_t>(i / 8)] += double(1 << (i % 8));
    }
    return Arrays{out};
  };
  OpSweep pack_s{OpId::sign_pack, kFloats, {DType::i32, DType::i64, DType::b8}, {}, {}};
  for (const Shape& shape : {Shape{4, 6}, Shape{3, 5}, Shape{}, Shape{0}, Shape{40, 33}}) {
    Case c = exact_case(shape_str(shape), {arg(shape, normal(2))}, pack_ref);
    c.out_dtype = [](DType, size_t) { return DType::u8; };
    pack_s.cases.push_back(std::move(c));
  }
  {
    const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
    Case c = exact_case("zeros, -0, NaN, infinities, tiny",
                        {arg({11}, fixed({0.0, -0.0, nan, inf, -inf, 1e-30, -1e-30, -1e-45, 3, -3, -nan}))},
                        pack_ref);
    c.out_dtype = [](DType, size_t) { return DType::u8; };
    pack_s.cases.push_back(std::move(c));
  }
  out.push_back(std::move(pack_s));
  OpSweep unpack_s{OpId::sign_unpack, kFloats, {}, {}, {}};
  for (DType dt : kFloats) {  // the output's dtype is an attribute: a case per dtype
    for (int64_t n : {int64_t{13}, int64_t{16}, int64_t{1}, int64_t{0}, int64_t{1000}, int64_t{300001}}) {
      Case c = exact_case(
          fmt::format("{} signs to {}", n, dtype_name(dt)), {index_arg({(n + 7) / 8}, 0, 255, DType::u8)},
          [n](const Arrays& in, DType) {
            NdArray out = NdArray::zeros({n});
            for (int64_t i = 0; i < n; ++i) {
              const int64_t byte = static_cast<int64_t>(in[0].data[static_cast<size_t>(i / 8)]);
              out.data[static_cast<size_t>(i)] = (byte >> (i % 8)) & 1 ? 1.0 : -1.0;
            }
            return Arrays{out};
          });
      c.attrs.shape = {n};
      c.attrs.dtype = dt;
      c.dtypes = {dt};
      // The strided layouts' gap sentinel is no u8 value; a strided case is in `extra`.
      c.layouts = {Layout::contiguous};
      unpack_s.cases.push_back(std::move(c));
    }
  }
  unpack_s.extra = [] {
    expect_error("sign_unpack of 20 signs from 2 bytes",
                 [] { sign_unpack(zeros({2}, DType::u8), 20); });
    expect_error("sign_unpack of f32 bits", [] { sign_unpack(zeros({2}), 16); });
    expect_error("sign_unpack to i32", [] { sign_unpack(zeros({2}, DType::u8), 16, DType::i32); });
    // Strided bits (every other byte) unpack as their contiguous copy.
    const Tensor all = Tensor::from_vector<uint8_t>({0x0f, 0xff, 0xa5, 0x00, 0x81, 0x11}, {6});
    const Tensor every_other = all.slice(0, 0, 6, 2);
    CHECK(!every_other.is_contiguous());
    CHECK(sign_unpack(every_other, 24).to_vector<float>() ==
          sign_unpack(every_other.contiguous(), 24).to_vector<float>());
    // Round trip: unpack(pack(x)) is x's signs.
    const Tensor x = Tensor::from_vector<float>({1.5f, -2.0f, 0.0f, -0.0f, -1e-30f, 7.0f, -3.0f, 2.0f, -1.0f}, {9});
    CHECK(sign_unpack(sign_pack(x), 9).to_vector<float>() ==
          std::vector<float>{1, -1, 1, 1, -1, 1, -1, 1, -1});
  };
  out.push_back(std::move(unpack_s));

  auto identity = [](const Arrays& in, DType) { return Arrays{in[0]}; };
  OpSweep to_dev{OpId::to_device, kAll, {}, {}, {}};
  OpSweep cl{OpId::clone, kAll, {}, {}, {}};
  for (const Shape& shape : {Shape{4, 6}, Shape{2, 3, 4}, Shape{}, Shape{0, 3}}) {
    Case c = exact_case(shape_str(shape), {arg(shape, normal(2), ints(-9, 9))}, identity);
    // The op itself (to() would return the input): a copy within the sweep's device.
    c.copies_input0 = true;
    to_dev.cases.push_back(c);
    cl.cases.push_back(c);
  }
  to_dev.extra = [] {
    const Tensor x = zeros({2});
    CHECK(to(x, kCPU).is_same(x));
  };
  out.push_back(std::move(to_dev));
  out.push_back(std::move(cl));

  OpSweep cp{OpId::copy_, kAll, {}, {}, {}};
  struct C {
    const char* label;
    Shape dst, src;
    std::optional<DType> src_dt;  // empty: the dst dtype
  };
  for (const C& k :
       {C{"[4, 5] <- [4, 5]", {4, 5}, {4, 5}, {}},
        C{"[4, 5] <- [1, 5] (broadcast)", {4, 5}, {1, 5}, {}}, C{"[4, 5] <- 0-d", {4, 5}, {}, {}},
        C{"[3, 4] <- f64 [3, 4]", {3, 4}, {3, 4}, DType::f64},
        C{"[3, 4] <- i64 [4]", {3, 4}, {4}, DType::i64},
        C{"[3, 4] <- bool [3, 1]", {3, 4}, {3, 1}, DType::b8},
        C{"[3, 4] <- f16 [3, 4]", {3, 4}, {3, 4}, DType::f16}}) {
    Arg dst = arg(k.dst, normal(2), ints(-9, 9));
    dst.expandable = false;  // writing through a stride-0 view is not a copy
    Arg src = arg(k.src, normal(3), ints(-9, 9));
    src.dtype = k.src_dt;
    Case c = exact_case(k.label, {dst, src}, [](const Arrays& in, DType dt) {
      return Arrays{ref::round_to(ref::broadcast_to(in[1], in[0].shape), dt)};
    });
    cp.cases.push_back(std::move(c));
  }
  cp.extra = [] {
    // Writing into a strided destination leaves the gaps between its elements alone.
    const Built dst = build(NdArray::zeros({3, 4}), DType::f32, Layout::strided, 0);
    copy_(dst.tensor, ones({3, 4}));
    int64_t touched = 0, ones_seen = 0;
    for (int64_t i = 0; i < dst.tensor.storage()->nbytes() / 4; ++i) {
      const double v = read_storage(dst.tensor, i);
      touched += !std::isnan(v);
      ones_seen += v == 1.0;
    }
    CHECK_MESSAGE(touched == 12, "copy_ into a strided view wrote outside it");
    CHECK(ones_seen == 12);
    expect_error("copy_ [3] <- [4]", [] { copy_(zeros({3}), zeros({4})); });
  };
  out.push_back(std::move(cp));
  return out;
}

// ---- views -------------------------------------------------------------------------------------

// A view op on its attributes (as the named wrapper packs them: tensor/op_attrs.h).
Case view_case(std::string label, Shape shape, Attrs attrs,
               std::function<NdArray(const NdArray&)> reference) {
  Case c = exact_case(std::move(label), {arg(std::move(shape), normal(2), ints(-9, 9))},
                      [reference](const Arrays& in, DType) { return Arrays{reference(in[0])}; });
  c.attrs = std::move(attrs);
  c.views_input0 = true;
  return c;
}

std::vector<OpSweep> view_sweeps() {
  std::vector<OpSweep> out;
  OpSweep v{OpId::view, kAll, {}, {}, {}};
  for (const Shape& to : {Shape{2, 2, 3, 2}, Shape{4, -1, 2}}) {
    v.cases.push_back(view_case(
        fmt::format("[4, 6] as {} (splits dims: any layout)", shape_str(to)), {4, 6},
        op_attrs::shape(to),
        [to](const NdArray& x) { return ref::reshape(x, to); }));
  }
  Case merge = view_case(
      "[4, 6] as [24] (merges dims: contiguous only)", {4, 6},
      op_attrs::shape({24}),
      [](const NdArray& x) { return ref::reshape(x, {24}); });
  merge.layouts = {Layout::contiguous};
  v.cases.push_back(merge);
  v.cases.push_back(view_case(
      "0-d as [1, 1]", {},
      op_attrs::shape({1, 1}),
      [](const NdArray& x) {
        return ref::reshape(x, {1, 1});
      }));
  v.cases.push_back(view_case(
      "[0, 3] as [3, 0]", {0, 3},
      op_attrs::shape({3, 0}),
      [](const NdArray& x) {
        return ref::reshape(x, {3, 0});
      }));
  v.extra = [] {
    const Built t = build(NdArray::of({2, 3}, {0, 1, 2, 3, 4, 5}), DType::f32, Layout::permuted, 0);
    expect_error("view of a transposed [2, 3] as [6]", [&] { view(t.tensor, {6}); });
    expect_close("reshape of a transposed [2, 3] as [6]", reshape(t.tensor, {6}),
                 NdArray::of({6}, {0, 1, 2, 3, 4, 5}), 0);
    expect_close("flatten of [2, 3, 2] dims 1..2",
                 flatten(make_tensor(NdArray::zeros({2, 3, 2}, 1), DType::f32), 1),
                 NdArray::zeros({2, 6}, 1), 0);
    expect_error("view [2, 3] as [4]", [] { view(zeros({2, 3}), {4}); });
  };
  out.push_back(std::move(v));

  OpSweep p{OpId::permute, kAll, {}, {}, {}};
  // Plain variables, not a structured binding: lambdas capture them (clang < 16 rejects that).
  for (const auto& entry : {std::pair{Shape{2, 3, 4}, std::vector<int64_t>{2, 0, 1}},
                            std::pair{Shape{2, 3, 4}, std::vector<int64_t>{-1, 0, 1}},
                            std::pair{Shape{4, 6}, std::vector<int64_t>{1, 0}},
                            std::pair{Shape{}, std::vector<int64_t>{}}}) {
    const Shape& shape = entry.first;
    const std::vector<int64_t>& order = entry.second;
    p.cases.push_back(view_case(
        fmt::format("{} order [{}]", shape_str(shape), fmt::join(order, ", ")), shape,
        op_attrs::dims(order),
        [order](const NdArray& x) { return ref::permute(x, order); }));
  }
  p.extra = [] {
    expect_error("permute [0, 0, 1]", [] { permute(zeros({2, 3, 4}), {0, 0, 1}); });
    expect_error("permute [1, 0] of 3-d", [] { permute(zeros({2, 3, 4}), {1, 0}); });
  };
  out.push_back(std::move(p));

  OpSweep sl{OpId::slice, kAll, {}, {}, {}};
  struct S {
    int64_t dim, start, end, step;
  };
  for (const S& s : {S{0, 1, 4, 1}, S{1, 0, 6, 2}, S{-1, -4, -1, 1}, S{1, 2, 100, 1}, S{0, 4, 2, 1},
                     S{0, 0, 5, 3}, S{1, -100, 3, 2}}) {
    sl.cases.push_back(view_case(
        fmt::format("[5, 6] dim {} [{}:{}:{}]", s.dim, s.start, s.end, s.step), {5, 6},
        op_attrs::slice(s.dim, s.start, s.end, s.step),
        [s](const NdArray& x) { return ref::slice(x, s.dim, s.start, s.end, s.step); }));
  }
  sl.extra = [] {
    expect_error("slice step 0", [] { slice(zeros({4}), 0, 0, 4, 0); });
    expect_error("slice of 0-d", [] { slice(zeros({}), 0, 0, 1); });
  };
  out.push_back(std::move(sl));

  OpSweep ex{OpId::expand, kAll, {}, {}, {}};
  for (const auto& entry :
       {std::pair{Shape{1, 5}, Shape{4, 5}}, std::pair{Shape{3, 1}, Shape{2, 3, 4}},
        std::pair{Shape{3, 1}, Shape{-1, 4}}, std::pair{Shape{}, Shape{2, 3}},
        std::pair{Shape{3, 1}, Shape{3, 0}}}) {
    const Shape& from = entry.first;
    const Shape& to = entry.second;
    ex.cases.push_back(view_case(
        fmt::format("{} to {}", shape_str(from), shape_str(to)), from,
        op_attrs::shape(to),
        [to](const NdArray& x) { return ref::expand(x, to); }));
  }
  ex.extra = [] {
    expect_error("expand [3, 2] to [3, 4]", [] { expand(zeros({3, 2}), {3, 4}); });
    expect_error("expand [2, 3] to [3]", [] { expand(zeros({2, 3}), {3}); });
  };
  out.push_back(std::move(ex));

  OpSweep sq{OpId::squeeze, kAll, {}, {}, {}};
  for (const std::vector<int64_t>& dims : {std::vector<int64_t>{}, {1}, {-1}, {0}, {1, 3}}) {
    sq.cases.push_back(view_case(
        fmt::format("[3, 1, 4, 1] dims [{}]", fmt::join(dims, ", ")), {3, 1, 4, 1},
        op_attrs::dims(dims),
        [dims](const NdArray& x) { return ref::squeeze(x, dims); }));
  }
  out.push_back(std::move(sq));

  OpSweep un{OpId::unsqueeze, kAll, {}, {}, {}};
  for (const auto& entry :
       {std::pair{Shape{3, 4}, int64_t{0}}, std::pair{Shape{3, 4}, int64_t{2}},
        std::pair{Shape{3, 4}, int64_t{-1}}, std::pair{Shape{3, 4}, int64_t{1}},
        std::pair{Shape{}, int64_t{0}}, std::pair{Shape{}, int64_t{-1}}}) {
    const Shape& shape = entry.first;
    const int64_t dim = entry.second;
    un.cases.push_back(view_case(
        fmt::format("{} dim {}", shape_str(shape), dim), shape,
        op_attrs::dim(dim),
        [dim](const NdArray& x) { return ref::unsqueeze(x, dim); }));
  }
  un.extra = [] { expect_error("unsqueeze dim 3 of 2-d", [] { unsqueeze(zeros({3, 4}), 3); }); };
  out.push_back(std::move(un));
  return out;
}

}  // namespace

std::vector<OpSweep> factory_sweeps();  // cases_factories.cc

std::vector<OpSweep> data_sweeps() {
  std::vector<OpSweep> out;
  for (auto* family : {&index_sweeps, &join_sweeps, &copy_sweeps, &view_sweeps, &factory_sweeps}) {
    for (OpSweep& s : (*family)()) out.push_back(std::move(s));
  }
  return out;
}

}  // namespace tessera::sweep
