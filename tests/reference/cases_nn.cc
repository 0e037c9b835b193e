// Records (cases.h): matmul, softmax, cross_entropy, dropout, conv2d, max_pool2d, grouped
// matmul and their fused backward helpers (attention: cases_attention.cc; linear:
// cases_linear.cc; layer_norm and add_layer_norm: cases_norm.cc).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "tests/reference/cases.h"

namespace tessera::sweep {
namespace {

using ref::map;
using ref::zip;

NdArray absent_or_abs(const NdArray& a) { return a.defined ? abs_of(a) : a; }

// ---- matmul -----------------------------------------------------------------------------

OpSweep matmul_sweep() {
  OpSweep s{OpId::matmul, kFloats, kNonFloat, {}, {}};
  struct M {
    const char* label;
    Shape a, b;
    bool api;  // through tessera::matmul (1-D promotion) rather than the op itself
  };
  // Inner dims <= 65: Eigen's f32 GEMM accumulates each output over k terms, so its error
  // is <= k * 2^-24 * (|a| @ |b|) = 3.9e-6 relative to mag, inside rel32 = 1e-5.
  for (const M& m :
       {M{"[3, 4] @ [4, 5]", {3, 4}, {4, 5}, false},
        M{"[2, 3, 4] @ [2, 4, 5]", {2, 3, 4}, {2, 4, 5}, false},
        M{"[2, 1, 3, 4] @ [3, 4, 5] (batch broadcast)", {2, 1, 3, 4}, {3, 4, 5}, false},
        M{"[3, 0] @ [0, 4] (k = 0)", {3, 0}, {0, 4}, false},
        M{"[0, 4] @ [4, 3] (m = 0)", {0, 4}, {4, 3}, false},
        M{"[33, 65] @ [65, 17]", {33, 65}, {65, 17}, false},
        M{"[4] @ [4, 5] (api, 1-d left)", {4}, {4, 5}, true},
        M{"[3, 4] @ [4] (api, 1-d right)", {3, 4}, {4}, true},
        M{"[4] @ [4] (api, dot)", {4}, {4}, true},
        M{"[2, 3, 4] @ [4] (api)", {2, 3, 4}, {4}, true}}) {
    Case c;
    c.label = m.label;
    c.args = {arg(m.a), arg(m.b)};
    c.ref = [](const Arrays& in, DType) { return Arrays{ref::matmul(in[0], in[1])}; };
    c.mag = [](const Arrays& in, DType) { return Arrays{ref::matmul(abs_of(in[0]), abs_of(in[1]))}; };
    if (m.api) c.run = [](const Tensors& in, DType) { return Tensors{matmul(in[0], in[1])}; };
    s.cases.push_back(std::move(c));
  }
  // A transposed batch of matrices (the column-major GEMM path for every batch entry).
  Case t;
  t.label = "[2, 4, 3]^T @ [2, 4, 5] (api, transposed batch)";
  t.args = {arg({2, 4, 3}), arg({2, 4, 5})};
  t.ref = [](const Arrays& in, DType) {
    return Arrays{ref::matmul(ref::permute(in[0], {0, 2, 1}), in[1])};
  };
  t.mag = [](const Arrays& in, DType) {
    return Arrays{ref::matmul(abs_of(ref::permute(in[0], {0, 2, 1})), abs_of(in[1]))};
  };
  t.run = [](const Tensors& in, DType) { return Tensors{matmul(in[0].transpose(1, 2), in[1])}; };
  s.cases.push_back(std::move(t));
  s.extra = [] {
    expect_error("matmul [3, 4] @ [5, 2]", [] { matmul(zeros({3, 4}), zeros({5, 2})); });
    expect_error("matmul f32 @ f64", [] { matmul(zeros({3, 4}), zeros({4, 2}, DType::f64)); });
    expect_error("matmul batch [2] vs [3]", [] { matmul(zeros({2, 3, 4}), zeros({3, 4, 2})); });
  };
  return s;
}

// ---- softmax ------------------------------------------------------------------------------

// Per element: |x - max| + |log sum exp(x - max)| + |x| + |max|, the terms log_softmax
// subtracts; softmax's exp(x - max) carries that argument error as a relative error.
NdArray softmax_terms(const NdArray& x, int64_t dim) {
  const NdArray ls = ref::log_softmax(x, dim);
  const int64_t d = x.ndim() == 0 ? 0 : dim;
  const NdArray mx = x.ndim() == 0 ? x : ref::broadcast_to(ref::max(x, {d}, true), x.shape);
  NdArray out = x;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double shifted = x.data[i] - mx.data[i];
    out.data[i] = std::fabs(shifted) + std::fabs(shifted - ls.data[i]) + std::fabs(x.data[i]) +
                  std::fabs(mx.data[i]);
  }
  return out;
}

OpSweep softmax_sweep(OpId op) {
  const bool log = op == OpId::log_softmax;
  OpSweep s{op, kFloats, kNonFloat, {}, {}};
  struct S {
    const char* label;
    Shape shape;
    int64_t dim;
    Domain domain;
  };
  for (const S& x : {S{"[4, 7] dim -1", {4, 7}, -1, normal(2)},
                     S{"[4, 7] dim 0 (strided rows)", {4, 7}, 0, normal(2)},
                     S{"[2, 3, 5] dim 1", {2, 3, 5}, 1, normal(2)},
                     S{"[3, 9] dim 1, scale 30 (needs the max shift)", {3, 9}, 1, normal(30)},
                     S{"0-d", {}, 0, normal(1)},
                     S{"[3, 4] dim 1, -inf masks (all-masked row: NaN)",
                       {3, 4},
                       1,
                       fixed({0, -INFINITY, 1, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                              -INFINITY, 2, 3, -INFINITY, 0.5})},
                     S{"[0, 5] dim 1 (empty)", {0, 5}, 1, normal(1)}}) {
    Case c;
    c.label = x.label;
    c.args = {arg(x.shape, x.domain)};
    c.attrs.dim = x.dim;
    const int64_t dim = x.dim;
    c.ref = [=](const Arrays& in, DType) {
      return Arrays{log ? ref::log_softmax(in[0], dim) : ref::softmax(in[0], dim)};
    };
    c.mag = [=](const Arrays& in, DType) {
      const NdArray terms = softmax_terms(in[0], dim);
      if (log) return Arrays{terms};
      const NdArray y = ref::softmax(in[0], dim);
      return Arrays{zip(y, terms, [](double p, double t) { return p * (1 + t); })};
    };
    s.cases.push_back(std::move(c));
  }
  return s;
}

// ---- cross_entropy ----------------------------------------------------------------------

ref::Reduction to_ref(Reduction r) {
  return r == Reduction::mean  ? ref::Reduction::mean
         : r == Reduction::sum ? ref::Reduction::sum
                               : ref::Reduction::none;
}

struct CE {
  const char* label;
  int64_t n, c;
  Reduction reduction;
  int64_t ignore_index;
  std::vector<double> targets;  // empty: random classes
  DType target_dt = DType::i64;
};
const CE kCrossEntropy[] = {
    {"[6, 5] mean", 6, 5, Reduction::mean, -100, {}},
    {"[6, 5] sum", 6, 5, Reduction::sum, -100, {}},
    {"[6, 5] none", 6, 5, Reduction::none, -100, {}},
    {"[6, 5] mean, two rows ignored (-100)", 6, 5, Reduction::mean, -100, {0, -100, 3, 2, -100, 4}},
    {"[6, 5] none, class 1 ignored", 6, 5, Reduction::none, 1, {1, 0, 3, 1, 2, 4}},
    {"[6, 5] sum, i32 targets", 6, 5, Reduction::sum, -100, {}, DType::i32},
    {"[3, 4] mean, every row ignored (NaN)", 3, 4, Reduction::mean, -100, {-100, -100, -100}},
    {"[4, 300] mean, wide rows", 4, 300, Reduction::mean, -100, {}},
};

Arg target_arg(const CE& ce) {
  return ce.targets.empty() ? index_arg({ce.n}, 0, ce.c - 1, ce.target_dt)
                            : fixed_arg({ce.n}, ce.targets, ce.target_dt);
}

OpSweep cross_entropy_sweep() {
  OpSweep s{OpId::cross_entropy, kFloats, kNonFloat, {}, {}};
  for (const CE& ce : kCrossEntropy) {
    Case c;
    c.label = ce.label;
    c.args = {arg({ce.n, ce.c}, normal(3)), target_arg(ce)};
    c.attrs.reduction = ce.reduction;
    c.attrs.ignore_index = ce.ignore_index;
    // Every row ignored under mean: 0 / 0, no derivative to check.
    c.grad = !(ce.reduction == Reduction::mean && !ce.targets.empty() &&
               std::all_of(ce.targets.begin(), ce.targets.end(),
                           [&](double t) { return t == static_cast<double>(ce.ignore_index); }));
    c.ref = [ce](const Arrays& in, DType) {
      return ref::cross_entropy(in[0], in[1], to_ref(ce.reduction), ce.ignore_index);
    };
    // The loss and the logsumexp in the stats dtype (f32 for 16-bit logits).
    c.out_dtype = [](DType dt, size_t) { return dt == DType::f64 ? dt : DType::f32; };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    const Tensor logits = zeros({2, 3});
    expect_error("cross_entropy target 3 of 3 classes", [&] {
      cross_entropy(logits, make_tensor(NdArray::of({2}, {0, 3}), DType::i64));
    });
    expect_error("cross_entropy f32 targets", [&] { cross_entropy(logits, zeros({2})); });
    expect_error("cross_entropy target [3] for [2, 3]", [&] {
      cross_entropy(logits, make_tensor(NdArray::of({3}, {0, 1, 2}), DType::i64));
    });
  };
  return s;
}

OpSweep cross_entropy_backward_sweep() {
  OpSweep s{OpId::cross_entropy_backward, kFloats, kNonFloat, {}, {}};
  for (const CE& ce : kCrossEntropy) {
    if (ce.reduction == Reduction::mean && ce.targets.size() == static_cast<size_t>(ce.n) &&
        std::all_of(ce.targets.begin(), ce.targets.end(), [](double t) { return t == -100; })) {
      continue;  // all ignored: the forward's loss is NaN and there is nothing to propagate
    }
    Case c;
    c.label = ce.label;
    const Shape grad = ce.reduction == Reduction::none ? Shape{ce.n} : Shape{};
    Arg lse = arg({ce.n});
    lse.stats = true;
    Arg grad_arg = arg(grad, normal(1));
    grad_arg.stats = true;  // the loss's gradient, in the loss's (stats) dtype
    c.args = {grad_arg, arg({ce.n, ce.c}, normal(3)), target_arg(ce), lse};
    c.attrs.reduction = ce.reduction;
    c.attrs.ignore_index = ce.ignore_index;
    c.prepare = [](Arrays& in, DType) {
      in[3] =
          ref::cross_entropy(in[1], NdArray::zeros({in[1].shape[0]}), ref::Reduction::none, -1)[1];
    };
    c.ref = [ce](const Arrays& in, DType) {
      return Arrays{ref::cross_entropy_backward(in[0], in[1], in[2], in[3], to_ref(ce.reduction),
                                                ce.ignore_index)};
    };
    // scale * (exp(x - lse) - onehot): exp's argument carries u (|x| + |lse|) (relative),
    // and the target entry subtracts |scale|.
    c.mag = [ce](const Arrays& in, DType) {
      const int64_t n = in[1].shape[0], k = in[1].shape[1];
      int64_t counted = 0;
      for (int64_t r = 0; r < n; ++r) counted += in[2].data[r] != ce.ignore_index;
      NdArray m = NdArray::zeros(in[1].shape);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = static_cast<int64_t>(in[2].data[r]);
        if (t == ce.ignore_index) continue;
        double scale = std::fabs(ce.reduction == Reduction::none ? in[0].data[r] : in[0].data[0]);
        if (ce.reduction == Reduction::mean) scale /= static_cast<double>(counted);
        for (int64_t i = 0; i < k; ++i) {
          const double x = in[1].data[r * k + i], p = std::exp(x - in[3].data[r]);
          m.data[r * k + i] =
              scale * (p * (1 + std::fabs(x) + std::fabs(in[3].data[r])) + (i == t ? 1 : 0));
        }
      }
      return Arrays{m};
    };
    s.cases.push_back(std::move(c));
  }
  return s;
}

// ---- dropout --------------------------------------------------------------------------------

OpSweep dropout_sweep() {
  OpSweep s{OpId::dropout, kFloats, kNonFloat, {}, {}};
  // p exactly representable, so the f32 keep test u >= p has no rounding ambiguity.
  for (double p : {0.25, 0.5}) {
    for (const Shape& shape : {Shape{7, 9}, Shape{2, 3, 40}}) {
      Case c;
      c.label = fmt::format("{} p {}", shape_str(shape), p);
      c.args = {arg(shape)};
      c.attrs.p = p;
      c.attrs.seed = 1234;
      c.attrs.offset = 77;
      c.ref = [p](const Arrays& in, DType) { return Arrays{ref::dropout(in[0], p, 1234, 77)}; };
      s.cases.push_back(std::move(c));
    }
  }
  Case block;  // a shard: the mask of its slice of the logical tensor
  block.label = "[3, 4] block at [2, 3] of [6, 8], p 0.5";
  block.args = {arg({3, 4})};
  block.attrs.p = 0.5;
  block.attrs.seed = 99;
  block.attrs.offset = 11;
  block.attrs.rng_view = {{6, 8}, {2, 3}};
  block.ref = [](const Arrays& in, DType) {
    return Arrays{ref::dropout(in[0], 0.5, 99, 11, {6, 8}, {2, 3})};
  };
  block.sharded = false;  // the sharded form sets rng_view per block itself
  s.cases.push_back(std::move(block));
  s.extra = [] {
    const Tensor x = ones({1000});
    CHECK(dropout(x, 0.3, /*training=*/false).is_same(x));
    CHECK(dropout(x, 0.0).is_same(x));
    expect_error("dropout p = 1", [&] { dropout(x, 1.0); });
    // The kept fraction of 10^4 Bernoulli(0.7) draws: sd = sqrt(0.21 / 1e4) = 0.0046.
    Generator g(5);
    const NdArray y = read_tensor(dropout(ones({10000}), 0.3, true, &g));
    double kept = 0;
    for (double v : y.data) kept += v != 0;
    CHECK(std::fabs(kept / 1e4 - 0.7) < 5 * 0.0046);
  };
  return s;
}

// ---- conv2d and max_pool2d ---------------------------------------------------------------

struct Conv {
  const char* label;
  Shape x, w;
  std::array<int64_t, 2> stride, padding;
  bool bias;
};
const Conv kConvs[] = {
    {"x [2, 3, 7, 6] w [4, 3, 3, 2]", {2, 3, 7, 6}, {4, 3, 3, 2}, {1, 1}, {0, 0}, true},
    {"stride 2, padding 1", {2, 3, 7, 6}, {4, 3, 3, 3}, {2, 2}, {1, 1}, true},
    {"no bias, stride [2, 1], padding [0, 2]", {1, 2, 6, 5}, {3, 2, 2, 3}, {2, 1}, {0, 2}, false},
    {"1x1 kernel", {2, 5, 4, 4}, {3, 5, 1, 1}, {1, 1}, {0, 0}, true},
    // 16 outputs take the kernel's pixel-major GEMM; 17 images make uneven chunks of images
    // and weight-gradient groups of 1 and 2 images.
    {"17 images, 16 outputs, padding 1", {17, 4, 3, 2}, {16, 4, 3, 3}, {1, 1}, {1, 1}, true},
    // 20 output pixels: one vectorised 16 x 16 transpose block back to NCHW and a remainder.
    {"16 outputs, 5x4 pixels, padding 1", {2, 4, 5, 4}, {16, 4, 3, 3}, {1, 1}, {1, 1}, true},
};

int64_t conv_out(int64_t in, int64_t k, int64_t s, int64_t p) { return (in + 2 * p - k) / s + 1; }
Shape conv_out_shape(const Conv& c) {
  return {c.x[0], c.w[0], conv_out(c.x[2], c.w[2], c.stride[0], c.padding[0]),
          conv_out(c.x[3], c.w[3], c.stride[1], c.padding[1])};
}

std::vector<OpSweep> conv_sweeps() {
  OpSweep fwd{OpId::conv2d, kFloats, kNonFloat, {}, {}};
  OpSweep bwd_in{OpId::conv2d_backward_input, kFloats, kNonFloat, {}, {}};
  OpSweep bwd_w{OpId::conv2d_backward_weight, kFloats, kNonFloat, {}, {}};
  for (const Conv& cv : kConvs) {
    // Each output sums C * kh * kw <= 27 products (GEMM in f32): well inside rel32.
    Case c;
    c.label = cv.label;
    c.args = {arg(cv.x), arg(cv.w), cv.bias ? arg({cv.w[0]}) : absent_arg()};
    c.attrs.stride = cv.stride;
    c.attrs.padding = cv.padding;
    c.ref = [cv](const Arrays& in, DType) {
      return Arrays{ref::conv2d(in[0], in[1], in[2], cv.stride, cv.padding)};
    };
    c.mag = [cv](const Arrays& in, DType) {
      return Arrays{
          ref::conv2d(abs_of(in[0]), abs_of(in[1]), absent_or_abs(in[2]), cv.stride, cv.padding)};
    };
    fwd.cases.push_back(std::move(c));

    Case bi;
    bi.label = cv.label;
    bi.args = {arg(conv_out_shape(cv)), arg(cv.w)};
    bi.attrs = fwd.cases.back().attrs;
    bi.attrs.shape = cv.x;
    bi.ref = [cv](const Arrays& in, DType) {
      return Arrays{ref::conv2d_backward_input(in[0], in[1], cv.x, cv.stride, cv.padding)};
    };
    bi.mag = [cv](const Arrays& in, DType) {
      return Arrays{
          ref::conv2d_backward_input(abs_of(in[0]), abs_of(in[1]), cv.x, cv.stride, cv.padding)};
    };
    bwd_in.cases.push_back(std::move(bi));

    Case bw;
    bw.label = cv.label;
    bw.args = {arg(conv_out_shape(cv)), arg(cv.x)};
    bw.attrs = fwd.cases.back().attrs;
    bw.attrs.shape = cv.w;
    // Each weight-gradient element sums N * OH * OW products in f32.
    const Shape out = conv_out_shape(cv);
    bw.rel32 = std::max(1e-5, static_cast<double>(out[0] * out[2] * out[3]) * std::ldexp(1.0, -24));
    bw.ref = [cv](const Arrays& in, DType) {
      return Arrays{ref::conv2d_backward_weight(in[0], in[1], cv.w, cv.stride, cv.padding)};
    };
    bw.mag = [cv](const Arrays& in, DType) {
      return Arrays{
          ref::conv2d_backward_weight(abs_of(in[0]), abs_of(in[1]), cv.w, cv.stride, cv.padding)};
    };
    bwd_w.cases.push_back(std::move(bw));
  }
  fwd.extra = [] {
    expect_error("conv2d 3 channels vs weight 2", [] {
      conv2d(zeros({1, 3, 5, 5}), zeros({2, 2, 3, 3}));
    });
    expect_error("conv2d kernel 6 > input 5", [] {
      conv2d(zeros({1, 1, 5, 5}), zeros({1, 1, 6, 6}));
    });
    expect_error("conv2d bias [3] for 2 outputs", [] {
      conv2d(zeros({1, 1, 5, 5}), zeros({2, 1, 3, 3}), zeros({3}));
    });
  };
  return {fwd, bwd_in, bwd_w};
}

OpSweep max_pool_sweep() {
  OpSweep s{OpId::max_pool2d, kNumeric, {DType::b8}, {}, {}};
  struct P {
    const char* label;
    Shape x;
    std::array<int64_t, 2> k, stride, pad;
    Domain domain;
  };
  for (const P& p :
       {P{"[2, 3, 7, 6] k 2 s 2", {2, 3, 7, 6}, {2, 2}, {2, 2}, {0, 0}, normal(1)},
        P{"[1, 2, 4, 41] k 2 s 2 (20 outputs a row)", {1, 2, 4, 41}, {2, 2}, {2, 2}, {0, 0},
          normal(1)},
        P{"k 3 s 2 pad 1", {2, 3, 7, 6}, {3, 3}, {2, 2}, {1, 1}, normal(1)},
        P{"k [3, 2] s [1, 2] pad [1, 0]", {1, 2, 5, 6}, {3, 2}, {1, 2}, {1, 0}, normal(1)},
        P{"k 2 s 1 ties", {2, 2, 5, 5}, {2, 2}, {1, 1}, {0, 0}, ints(-1, 1)},
        P{"k 2 s 1 IEEE specials",
          {1, 1, 3, 4},
          {2, 2},
          {1, 1},
          {0, 0},
          fixed({1, NAN, 3, -INFINITY, -INFINITY, -INFINITY, 2, INFINITY, -INFINITY, -INFINITY, NAN,
                 0})},
        // The vectorised 2x2 stride-2 path. Windows: a NaN before a larger value, all -inf,
        // a NaN after a larger value, two NaNs, tied infinities, a NaN in the last position.
        P{"k 2 s 2 IEEE specials",
          {1, 1, 4, 6},
          {2, 2},
          {2, 2},
          {0, 0},
          fixed({1,   NAN,       -INFINITY, -INFINITY, 5,   1,     //
                 3,   -INFINITY, -INFINITY, -INFINITY, NAN, 2,     //
                 NAN, 2,         INFINITY,  INFINITY,  -1,  -1,    //
                 NAN, INFINITY,  0,         0,         -1,  NAN})}}) {
    Case c;
    c.label = p.label;
    c.args = {arg(p.x, p.domain, ints(-5, 5))};
    c.attrs.kernel_size = p.k;
    c.attrs.stride = p.stride;
    c.attrs.padding = p.pad;
    c.ref = [p](const Arrays& in, DType) { return ref::max_pool2d(in[0], p.k, p.stride, p.pad); };
    c.out_dtype = [](DType dt, size_t k) { return k == 0 ? dt : DType::i64; };
    c.exact = true;
    if (p.domain.kind == Domain::Kind::fixed) c.dtypes = kFloats;
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("max_pool2d padding 2 > kernel 3 / 2", [] {
      max_pool2d(zeros({1, 1, 6, 6}), {3, 3}, {1, 1}, {2, 2});
    });
    // The API defaults the stride to the kernel size.
    const Tensor x = make_tensor(NdArray::of({1, 1, 2, 4}, {1, 5, 2, 0, 3, 4, 8, 9}), DType::f32);
    expect_close("max_pool2d default stride", max_pool2d(x, {2, 2}),
                 NdArray::of({1, 1, 1, 2}, {5, 9}), 0);
  };
  return s;
}

// max_pool2d_backward adds each grad at its index within the input plane: any index is
// valid, so random ones test repeats (overlapping windows) too.
OpSweep max_pool_backward_sweep() {
  OpSweep s{OpId::max_pool2d_backward, kFloats, kNonFloat, {}, {}};
  struct P {
    const char* label;
    Shape in, out;
    Arg indices;
  };
  for (const P& p : {P{"[2, 3, 7, 6] from [2, 3, 3, 3]", {2, 3, 7, 6}, {2, 3, 3, 3},
                       index_arg({2, 3, 3, 3}, 0, 41)},
                     P{"repeated indices, i32", {1, 2, 2, 2}, {1, 2, 4, 3},
                       index_arg({1, 2, 4, 3}, 0, 3, DType::i32)},
                     P{"[3, 2, 8, 8] from [3, 2, 4, 4]", {3, 2, 8, 8}, {3, 2, 4, 4},
                       index_arg({3, 2, 4, 4}, 0, 63)}}) {
    Case c;
    c.label = p.label;
    c.args = {arg(p.out), p.indices};
    c.attrs.shape = p.in;
    const Shape in = p.in;
    c.ref = [in](const Arrays& v, DType) { return Arrays{ref::max_pool2d_backward(v[0], v[1], in)}; };
    c.mag = [in](const Arrays& v, DType) {
      return Arrays{ref::max_pool2d_backward(abs_of(v[0]), v[1], in)};
    };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    Attrs a;
    a.shape = {1, 1, 2, 2};
    expect_error("max_pool2d_backward index 4 outside a 2x2 plane", [&] {
      call(OpId::max_pool2d_backward,
           {zeros({1, 1, 1, 1}), Tensor::from_vector<int64_t>({4}, {1, 1, 1, 1})}, a);
    });
    expect_error("max_pool2d_backward indices shape differs from grad", [&] {
      call(OpId::max_pool2d_backward,
           {zeros({1, 1, 1, 2}), Tensor::from_vector<int64_t>({0}, {1, 1, 1, 1})}, a);
    });
    expect_error("max_pool2d_backward input N, C differ from grad", [&] {
      call(OpId::max_pool2d_backward,
           {zeros({1, 2, 1, 1}), Tensor::from_vector<int64_t>({0, 1}, {1, 2, 1, 1})}, a);
    });
  };
  return s;
}

// ---- grouped matmul ------------------------------------------------------------------------

// grouped_matmul's f64 reference: row r of x belongs to the group whose [start, start + size)
// holds it, and out[r] = x[r] @ w[group]. Written per row, not per group.
NdArray grouped_matmul_ref(const NdArray& x, const NdArray& w, const NdArray& sizes) {
  const int64_t N = x.shape[0], K = x.shape[1], M = w.shape[2];
  NdArray out = NdArray::zeros({N, M});
  int64_t group = 0, end = static_cast<int64_t>(sizes.data[0]);
  for (int64_t r = 0; r < N; ++r) {
    while (r >= end) end += static_cast<int64_t>(sizes.data[++group]);
    for (int64_t j = 0; j < M; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += x.data[r * K + k] * w.data[(group * K + k) * M + j];
      out.data[r * M + j] = acc;
    }
  }
  return out;
}

// dw[e][k][j] = sum over group e's rows r of x[r][k] g[r][j].
NdArray grouped_matmul_backward_weight_ref(const NdArray& x, const NdArray& g, const NdArray& sizes) {
  const int64_t E = sizes.shape[0], K = x.shape[1], M = g.shape[1];
  NdArray out = NdArray::zeros({E, K, M});
  int64_t r0 = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(sizes.data[e]);
    for (int64_t r = r0; r < r0 + n; ++r) {
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < M; ++j) out.data[(e * K + k) * M + j] += x.data[r * K + k] * g.data[r * M + j];
      }
    }
    r0 += n;
  }
  return out;
}

struct GroupedShapes {
  const char* label;
  int64_t K, M;
  std::vector<double> sizes;
};
// Groups: uneven, an empty one first, in the middle and last, one group, no rows. The
// largest group sums 33 terms per output: 33 * 2^-24 relative to mag, inside rel32.
const std::vector<GroupedShapes>& grouped_shapes() {
  static const std::vector<GroupedShapes> shapes = {
      {"K 4 M 6 sizes [2, 0, 3]", 4, 6, {2, 0, 3}},
      {"K 33 M 17 sizes [0, 7, 13, 0, 20]", 33, 17, {0, 7, 13, 0, 20}},
      {"K 5 M 3 one group [4]", 5, 3, {4}},
      {"K 3 M 2 no rows [0, 0]", 3, 2, {0, 0}}};
  return shapes;
}

int64_t rows_of(const std::vector<double>& sizes) {
  double n = 0;
  for (double v : sizes) n += v;
  return static_cast<int64_t>(n);
}

Arg sizes_arg(const std::vector<double>& sizes) {
  Arg a = fixed_arg({static_cast<int64_t>(sizes.size())}, sizes, DType::i64);
  a.expandable = false;  // a broadcast layout would repeat one size: they would not sum to N
  return a;
}

OpSweep grouped_matmul_sweep() {
  OpSweep s{OpId::grouped_matmul, kFloats, kNonFloat, {}, {}};
  for (const GroupedShapes& g : grouped_shapes()) {
    const int64_t E = static_cast<int64_t>(g.sizes.size());
    Case c;
    c.label = g.label;
    c.args = {arg({rows_of(g.sizes), g.K}), arg({E, g.K, g.M}), sizes_arg(g.sizes)};
    c.ref = [](const Arrays& in, DType) { return Arrays{grouped_matmul_ref(in[0], in[1], in[2])}; };
    c.mag = [](const Arrays& in, DType) {
      return Arrays{grouped_matmul_ref(abs_of(in[0]), abs_of(in[1]), in[2])};
    };
    s.cases.push_back(std::move(c));
  }
  // The experts stored as Linear weights [E, M, K] and passed transposed (strided B panels).
  Case t;
  t.label = "weight [3, 6, 4] transposed, sizes [1, 3, 1] (api)";
  t.args = {arg({5, 4}), arg({3, 6, 4}), sizes_arg({1, 3, 1})};
  const auto transposed = [](const NdArray& w) { return ref::permute(w, {0, 2, 1}); };
  t.ref = [transposed](const Arrays& in, DType) {
    return Arrays{grouped_matmul_ref(in[0], transposed(in[1]), in[2])};
  };
  t.mag = [transposed](const Arrays& in, DType) {
    return Arrays{grouped_matmul_ref(abs_of(in[0]), transposed(abs_of(in[1])), in[2])};
  };
  t.run = [](const Tensors& in, DType) { return Tensors{grouped_matmul(in[0], in[1].transpose(1, 2), in[2])}; };
  s.cases.push_back(std::move(t));
  s.extra = [] {
    const Tensor x = zeros({5, 4}), w = zeros({3, 4, 6});
    const auto sizes = [](std::vector<int64_t> v) {
      return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
    };
    expect_error("grouped_matmul sizes sum to 4, x has 5 rows",
                 [&] { grouped_matmul(x, w, sizes({1, 1, 2})); });
    expect_error("grouped_matmul negative size", [&] { grouped_matmul(x, w, sizes({6, -1, 0})); });
    expect_error("grouped_matmul K mismatch", [&] { grouped_matmul(x, zeros({3, 5, 6}), sizes({2, 0, 3})); });
    expect_error("grouped_matmul E mismatch", [&] { grouped_matmul(x, w, sizes({2, 3})); });
    expect_error("grouped_matmul float sizes", [&] { grouped_matmul(x, w, zeros({3})); });
  };
  return s;
}

OpSweep grouped_matmul_backward_weight_sweep() {
  OpSweep s{OpId::grouped_matmul_backward_weight, kFloats, kNonFloat, {}, {}};
  for (const GroupedShapes& g : grouped_shapes()) {
    const int64_t N = rows_of(g.sizes);
    Case c;
    c.label = g.label;
    c.args = {arg({N, g.K}), arg({N, g.M}), sizes_arg(g.sizes)};
    c.ref = [](const Arrays& in, DType) {
      return Arrays{grouped_matmul_backward_weight_ref(in[0], in[1], in[2])};
    };
    c.mag = [](const Arrays& in, DType) {
      return Arrays{grouped_matmul_backward_weight_ref(abs_of(in[0]), abs_of(in[1]), in[2])};
    };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("grouped_matmul_backward_weight sizes sum to 3, rows 5", [] {
      grouped_matmul_backward_weight(zeros({5, 4}), zeros({5, 2}), Tensor::from_vector<int64_t>({1, 2}, {2}));
    });
    expect_error("grouped_matmul_backward_weight rows differ", [] {
      grouped_matmul_backward_weight(zeros({5, 4}), zeros({4, 2}), Tensor::from_vector<int64_t>({5}, {1}));
    });
  };
  return s;
}

}  // namespace

std::vector<OpSweep> nn_sweeps() {
  std::vector<OpSweep> out;
  out.push_back(matmul_sweep());
  for (OpSweep& s : linear_sweeps()) out.push_back(std::move(s));
  out.push_back(grouped_matmul_sweep());
  out.push_back(grouped_matmul_backward_weight_sweep());
  out.push_back(softmax_sweep(OpId::softmax));
  out.push_back(softmax_sweep(OpId::log_softmax));
  for (OpSweep& s : norm_sweeps()) out.push_back(std::move(s));
  out.push_back(cross_entropy_sweep());
  out.push_back(cross_entropy_backward_sweep());
  out.push_back(dropout_sweep());
  for (OpSweep& s : attention_sweeps()) out.push_back(std::move(s));
  for (OpSweep& s : conv_sweeps()) out.push_back(std::move(s));
  out.push_back(max_pool_sweep());
  out.push_back(max_pool_backward_sweep());
  return out;
}

}  // namespace tessera::sweep
