// Records (cases.h): elementwise unary/binary ops, comparisons, where, reductions.
#include <cmath>

#include "tests/reference/cases.h"

namespace tessera::sweep {

namespace {
constexpr double kGeluC = 0.044715;
double gelu_z(double x) { return std::sqrt(2.0 / M_PI) * (x + kGeluC * x * x * x); }
}  // namespace

// Error magnitudes of f32 GELU evaluations (see cases.h; linear's records use them too): 0.5 x (1 + erf(x / sqrt 2))
// cancels in 1 + erf, whose argument carries u |x| (times erf' = 2/sqrt(pi) e^{-x^2/2});
// the tanh form cancels in 1 + tanh(z) with z carrying u |z| (times 1 - tanh^2 z).
double gelu_mag(double x, bool tanh_form) {
  if (!tanh_form) return std::fabs(x) * (1 + std::fabs(x) * std::exp(-0.5 * x * x));
  const double t = std::tanh(gelu_z(x));
  return std::fabs(x) * (1 + (1 - t * t) * std::fabs(gelu_z(x)));
}

// d/dx gelu: cdf + x pdf (pdf's argument error u x^2 / 2 is relative), and the tanh form's
// 1 - t^2, which cancels with an absolute error of about 3u + 2 (1 - t^2) |z| u.
double gelu_backward_mag(double g, double x, bool tanh_form) {
  if (!tanh_form) {
    const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
    return std::fabs(g) *
           (1 + std::fabs(x) * std::exp(-0.5 * x * x) + std::fabs(x) * pdf * (1 + x * x));
  }
  const double z = gelu_z(x), t = std::tanh(z);
  return std::fabs(g) *
         (1 + (1 - t * t) * std::fabs(z) +
          std::fabs(x) * (1 + 3 * kGeluC * x * x) * (3 + 2 * (1 - t * t) * std::fabs(z)));
}

namespace {

using ref::map;
using ref::zip;

// Shapes every elementwise op runs on: plain, rank 3, 0-d, empty, and one large enough
// (> kElementwiseGrain = 2^15 elements) to be split across threads.
struct Shaped {
  const char* label;
  Shape shape;
};
const Shaped kUnaryShapes[] = {{"[5, 7]", {5, 7}},
                               {"[2, 3, 4]", {2, 3, 4}},
                               {"0-d", {}},
                               {"empty [0, 3]", {0, 3}},
                               {"[300, 130] (threaded)", {300, 130}}};

struct Shaped2 {
  const char* label;
  Shape a, b;
};
const Shaped2 kBinaryShapes[] = {
    {"[4, 6] . [4, 6]", {4, 6}, {4, 6}},
    {"[3, 1, 5] . [4, 1] (broadcast)", {3, 1, 5}, {4, 1}},
    {"[4, 6] . 0-d", {4, 6}, {}},
    {"0-d . [6]", {}, {6}},
    {"0-d . 0-d", {}, {}},
    {"[300, 130] . [130] (threaded)", {300, 130}, {130}},
    {"[0, 4] . [4] (empty)", {0, 4}, {4}},
};

// IEEE special values (and signed zero) that every float kernel must treat as the
// reference does: NaN propagates, infinities follow the C library's rules.
const double kNaN = std::nan(""), kInf = INFINITY;
// Pairs of binary ops take the first 8; unary ops all 36 (two rounds, so that 16-wide
// vector paths see them too), with subnormals of f32 (1e-40) and f64 (1e-310) and values
// that overflow f16 or exp.
const std::vector<double> kSpecials = {kNaN, kInf, -kInf, 0.0, -0.0, 1.0, -1.0, 3.0};
const std::vector<double> kUnarySpecials = [] {
  std::vector<double> v = kSpecials;
  v.insert(v.end(), {1e-40, -1e-40, 1e-310, 1e30, 0.5, -2.0, 100.0, -100.0, 1000.0, -1000.0});
  v.insert(v.end(), v.begin(), v.end());
  return v;
}();

struct UnarySpec {
  OpId op;
  std::vector<DType> dtypes, rejected;
  Domain domain;
  std::function<double(double)> f;
  bool exact = false;
  std::function<double(double)> mag;  // per element from x; null: |y|
  Domain int_domain = ints(-9, 9);
};

UnarySpec spec(OpId op, std::vector<DType> dtypes, std::vector<DType> rejected, Domain domain,
               std::function<double(double)> f, bool exact = false,
               std::function<double(double)> mag = nullptr) {
  return UnarySpec{op,    std::move(dtypes), std::move(rejected), std::move(domain), std::move(f),
                   exact, std::move(mag)};
}

OpSweep unary_sweep(const UnarySpec& u, Attrs attrs = {}) {
  OpSweep s{u.op, u.dtypes, u.rejected, {}, {}};
  for (const Shaped& sh : kUnaryShapes) {
    Case c = unary(sh.label, sh.shape, u.domain, u.f, u.int_domain);
    c.exact = u.exact;
    c.attrs = attrs;
    if (u.mag) {
      auto f = u.f, m = u.mag;
      c.mag = [f, m](const Arrays& in, DType) {
        return Arrays{map(in[0], [&](double x) { return m(x) + std::fabs(f(x)); })};
      };
    }
    s.cases.push_back(std::move(c));
  }
  Case specials = s.cases.front();
  specials.label = "IEEE specials";
  specials.args = {arg({static_cast<int64_t>(kUnarySpecials.size())}, fixed(kUnarySpecials))};
  specials.dtypes = kFloats;
  s.cases.push_back(std::move(specials));
  return s;
}

// The dtypes a functor family op runs on, and those it must reject.
std::pair<std::vector<DType>, std::vector<DType>> family_dtypes(OpId op) {
  switch (op_info(op).family) {
    case OpFamily::UnaryFloat:
    case OpFamily::BinaryFloat: return {kFloats, kNonFloat};
    case OpFamily::Compare: return {kAll, {}};
    default: return {kNumeric, {DType::b8}};
  }
}

std::vector<OpSweep> unary_sweeps() {
  std::vector<OpSweep> out;
  // The functor family's unary ops, from their one test case each.
  for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
    if (!fc.unary) continue;
    auto [dtypes, rejected] = family_dtypes(fc.op);
    UnarySpec u = spec(fc.op, dtypes, rejected, fc.a, fc.unary, fc.exact);
    u.int_domain = fc.int_a.value_or(ints(-9, 9));
    out.push_back(unary_sweep(u));
  }
  // gelu: both forms; the tanh form as extra cases of the same sweep.
  OpSweep gelu = unary_sweep(spec(
      OpId::gelu, kFloats, kNonFloat, normal(2), [](double x) { return ref::gelu(x, false); },
      false, [](double x) { return gelu_mag(x, false); }));
  Attrs tanh_attrs;
  tanh_attrs.approximate_tanh = true;
  OpSweep gelu_tanh = unary_sweep(
      spec(
          OpId::gelu, kFloats, kNonFloat, normal(2), [](double x) { return ref::gelu(x, true); },
          false, [](double x) { return gelu_mag(x, true); }),
      tanh_attrs);
  for (Case& c : gelu_tanh.cases) {
    c.label += " tanh";
    gelu.cases.push_back(std::move(c));
  }
  out.push_back(std::move(gelu));

  OpSweep gb{OpId::gelu_backward, kFloats, kNonFloat, {}, {}};
  for (bool tanh_form : {false, true}) {
    for (const Shaped& sh : kUnaryShapes) {
      Case c;
      c.label = std::string(sh.label) + (tanh_form ? " tanh" : " erf");
      c.args = {arg(sh.shape, normal(1)), arg(sh.shape, normal(2))};
      c.attrs.approximate_tanh = tanh_form;
      c.ref = [tanh_form](const Arrays& in, DType) {
        return Arrays{zip(in[0], in[1],
                          [&](double g, double x) { return ref::gelu_backward(g, x, tanh_form); })};
      };
      c.mag = [tanh_form](const Arrays& in, DType) {
        return Arrays{zip(in[0], in[1], [&](double g, double x) {
          return gelu_backward_mag(g, x, tanh_form) +
                 std::fabs(ref::gelu_backward(g, x, tanh_form));
        })};
      };
      gb.cases.push_back(std::move(c));
    }
  }
  gb.extra = [] {
    expect_error("gelu_backward: grad [3, 4] vs input [4, 3]", [] {
      gelu_backward(zeros({3, 4}), zeros({4, 3}));
    });
  };
  out.push_back(std::move(gb));
  return out;
}

struct BinarySpec {
  OpId op;
  std::vector<DType> dtypes, rejected;
  Domain a, b;
  Domain int_a, int_b;
  std::function<double(double, double, DType)> f;
  bool exact = false;
  bool cancels = false;  // a sum or difference: error relative to |a| + |b|
};

OpSweep binary_sweep(const BinarySpec& b) {
  OpSweep s{b.op, b.dtypes, b.rejected, {}, {}};
  for (const Shaped2& sh : kBinaryShapes) {
    Case c;
    c.label = sh.label;
    c.args = {arg(sh.a, b.a, b.int_a), arg(sh.b, b.b, b.int_b)};
    auto f = b.f;
    c.ref = [f](const Arrays& in, DType dt) {
      return Arrays{zip(in[0], in[1], [&](double x, double y) { return f(x, y, dt); })};
    };
    if (b.cancels) {
      c.mag = [](const Arrays& in, DType) {
        return Arrays{zip(abs_of(in[0]), abs_of(in[1]), std::plus<>())};
      };
    }
    c.exact = b.exact;
    s.cases.push_back(std::move(c));
  }
  // Every pair of special values: a [8, 1] against b [1, 8].
  Case specials = s.cases.front();
  specials.label = "IEEE specials, all pairs";
  specials.args = {arg({8, 1}, fixed(kSpecials)), arg({1, 8}, fixed(kSpecials))};
  specials.dtypes = kFloats;
  s.cases.push_back(std::move(specials));
  return s;
}

std::vector<OpSweep> binary_sweeps() {
  std::vector<OpSweep> out;
  // The functor family's binary ops and comparisons, from their one test case each.
  for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
    if (!fc.binary) continue;
    auto [dtypes, rejected] = family_dtypes(fc.op);
    OpSweep s = binary_sweep({fc.op, dtypes, rejected, fc.a, fc.b, fc.int_a.value_or(ints(-9, 9)),
                              fc.int_b.value_or(ints(-9, 9)), fc.binary, fc.exact, fc.cancels});
    if (op_info(fc.op).family == OpFamily::Compare) {
      // Ties are common on the small integers of the case; also normal values.
      Case smooth = s.cases[1];
      smooth.label += " normal values";
      smooth.args = {arg({3, 1, 5}, normal(1)), arg({4, 1}, normal(1))};
      smooth.dtypes = kFloats;
      s.cases.push_back(smooth);
      for (Case& c : s.cases) c.out_dtype = [](DType, size_t) { return DType::b8; };
    }
    out.push_back(std::move(s));
  }
  for (OpSweep& s : out) {
    if (s.op == OpId::add) {
      s.extra = [] {
        expect_error("add f32 + f64", [] { add(zeros({3}), zeros({3}, DType::f64)); });
        expect_error("add [3] + [4]", [] { add(zeros({3}), zeros({4})); });
        expect_error("i32 tensor * 0.5", [] { (void)(zeros({3}, DType::i32) * 0.5); });
      };
    } else if (s.op == OpId::ge) {
      s.extra = [] {
        expect_error("ge f32 vs i64", [] { ge(zeros({2}), zeros({2}, DType::i64)); });
      };
    } else if (s.op == OpId::pow) {
      // Integers to negative powers: the same values on every device (no error).
      s.extra = [] {
        const Tensor got = pow(Tensor::from_vector<int32_t>({2, -3, 1, -1, -1, 0}, {6}),
                               Tensor::from_vector<int32_t>({-1, -1, -3, -3, -2, -1}, {6}));
        expect_close("pow integers to negative powers", got,
                     ref::NdArray::of({6}, {0, 0, 1, -1, 1, 0}), 0.0);
      };
    }
  }

  OpSweep w{OpId::where, kAll, {}, {}, {}};
  struct W {
    const char* label;
    Shape c, a, b;
  };
  for (const W& sh : {W{"[4, 6] x3", {4, 6}, {4, 6}, {4, 6}},
                      W{"cond [4, 5], a [3, 1, 5], b [5] (broadcast)", {4, 5}, {3, 1, 5}, {5}},
                      W{"a 0-d", {2, 3}, {}, {2, 3}}}) {
    Case c;
    c.label = sh.label;
    Arg cond = arg(sh.c, bools());
    cond.dtype = DType::b8;
    c.args = {cond, arg(sh.a, normal(2), ints(-9, 9)), arg(sh.b, normal(2), ints(-9, 9))};
    c.ref = [](const Arrays& in, DType) { return Arrays{ref::where(in[0], in[1], in[2])}; };
    c.exact = true;
    w.cases.push_back(std::move(c));
  }
  w.extra = [] {
    expect_error("where with an f32 condition", [] { where(zeros({3}), zeros({3}), zeros({3})); });
    expect_error("where with a f32 / f64 pair",
                 [] { where(full({3}, 1, DType::b8), zeros({3}), zeros({3}, DType::f64)); });
  };
  out.push_back(std::move(w));
  return out;
}

// ---- reductions --------------------------------------------------------------------------

struct R {
  const char* label;
  Shape shape;
  std::vector<int64_t> dims;
  bool keepdim = false;
  double rel32 = 1e-5;
};

// The sum kernel adds contiguous runs in 16 f32 lanes (blocks of 2^14 elements for long
// reductions): a lane sums up to 2^14 / 16 = 1024 terms, so its recursive-summation bound
// is 1024 * 2^-24 * sum|x| (Higham, Accuracy and Stability, 4.2); 1e-5 covers <= 168 terms.
constexpr double kLongSumRel = 1024.0 / (1 << 24);

const std::vector<double> kSpecialRows = {1,     kNaN,  3,     2,     kNaN,  0,     -1,    5,
                                          -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf,
                                          0,     -0.0,  kInf,  1,     kInf,  2,     3,     4};

const R kReductions[] = {
    {"[4, 5, 6] all", {4, 5, 6}, {}},
    {"[4, 5, 6] dims {1}", {4, 5, 6}, {1}},
    {"[4, 5, 6] dims {0, 2} keepdim", {4, 5, 6}, {0, 2}, true},
    {"[4, 5, 6] dims {-1} keepdim", {4, 5, 6}, {-1}, true},
    {"[4, 5, 6] dims {2, 0}", {4, 5, 6}, {2, 0}},
    {"0-d", {}, {}},
    {"0-d dims {0} keepdim", {}, {0}, true},
    {"0-d dims {-1}", {}, {-1}},
    {"[0, 3] all (empty)", {0, 3}, {}},
    {"[3, 0] dims {1} (empty)", {3, 0}, {1}},
    {"[8, 40] dims {0} (outer loop)", {8, 40}, {0}},
    {"[2, 66000] dims {1} (blocked)", {2, 66000}, {1}, false, kLongSumRel},
};

OpSweep reduce_sweep(OpId op, std::vector<DType> dtypes, std::vector<DType> rejected,
                     bool allow_empty) {
  OpSweep s{op, dtypes, rejected, {}, {}};
  for (const R& r : kReductions) {
    if (!allow_empty && ref::count(r.shape) == 0) continue;
    Case c;
    c.label = r.label;
    c.args = {arg(r.shape, normal(1), ints(-9, 9))};
    c.attrs.dims = r.dims;
    c.attrs.keepdim = r.keepdim;
    c.rel32 = r.rel32;
    const auto dims = r.dims;
    const bool keep = r.keepdim;
    if (op == OpId::sum) {
      c.ref = [=](const Arrays& in, DType) { return Arrays{ref::sum(in[0], dims, keep)}; };
      c.mag = [=](const Arrays& in, DType) { return Arrays{ref::sum(abs_of(in[0]), dims, keep)}; };
      c.out_dtype = [](DType dt, size_t) { return dt == DType::b8 ? DType::i64 : dt; };
    } else if (op == OpId::mean) {
      c.ref = [=](const Arrays& in, DType) { return Arrays{ref::mean(in[0], dims, keep)}; };
      c.mag = [=](const Arrays& in, DType) { return Arrays{ref::mean(abs_of(in[0]), dims, keep)}; };
    } else {
      c.ref = [=](const Arrays& in, DType) { return Arrays{ref::max(in[0], dims, keep)}; };
      c.exact = true;
    }
    s.cases.push_back(std::move(c));
  }
  // Rows: a NaN among finite values; all -inf; two +inf and a signed zero.
  Case specials = s.cases[1];
  specials.label = "[3, 8] dims {1} IEEE specials";
  specials.args = {arg({3, 8}, fixed(kSpecialRows))};
  specials.attrs.dims = {1};
  specials.attrs.keepdim = false;
  specials.dtypes = kFloats;
  specials.ref = [op](const Arrays& in, DType) {
    return Arrays{op == OpId::sum    ? ref::sum(in[0], {1}, false)
                  : op == OpId::mean ? ref::mean(in[0], {1}, false)
                                     : ref::max(in[0], {1}, false)};
  };
  specials.mag = nullptr;
  s.cases.push_back(specials);
  if (op == OpId::max) {
    Case ties = s.cases[1];
    ties.label += " ties";
    ties.args[0].domain = ints(-2, 2);
    s.cases.push_back(ties);
  }
  return s;
}

std::vector<OpSweep> reduction_sweeps() {
  std::vector<OpSweep> out;
  out.push_back(reduce_sweep(OpId::sum, kAll, {}, true));
  out.back().extra = [] {
    expect_error("sum dims {3} of a 3-d tensor", [] { sum(zeros({2, 3, 4}), {3}); });
    expect_error("sum dims {1, 1}", [] { sum(zeros({2, 3, 4}), {1, -2}); });
  };
  out.push_back(reduce_sweep(OpId::mean, kFloats, kNonFloat, true));
  out.push_back(reduce_sweep(OpId::max, kNumeric, {DType::b8}, false));
  out.back().extra = [] { expect_error("max over an empty dim", [] { max(zeros({3, 0}), {1}); }); };

  OpSweep am{OpId::argmax, kNumeric, {DType::b8}, {}, {}};
  struct A {
    const char* label;
    Shape shape;
    int64_t dim;
    bool keepdim, all;
    Domain domain;
  };
  for (const A& a : {A{"[4, 5, 6] dim 1", {4, 5, 6}, 1, false, false, normal(1)},
                     A{"[4, 5, 6] dim -1 keepdim", {4, 5, 6}, -1, true, false, normal(1)},
                     A{"[4, 5, 6] dim 0", {4, 5, 6}, 0, false, false, normal(1)},
                     A{"[4, 5, 6] dim 1 ties", {4, 5, 6}, 1, false, false, ints(-2, 2)},
                     A{"[4, 5, 6] all", {4, 5, 6}, 0, false, true, normal(1)},
                     A{"[4, 5, 6] all keepdim ties", {4, 5, 6}, 0, true, true, ints(-2, 2)},
                     A{"0-d", {}, 0, false, false, normal(1)},
                     A{"[3, 8] dim 1 IEEE specials", {3, 8}, 1, false, false, fixed(kSpecialRows)},
                     A{"[3, 8] all IEEE specials", {3, 8}, 0, false, true, fixed(kSpecialRows)}}) {
    Case c;
    c.label = a.label;
    c.args = {arg(a.shape, a.domain, ints(-3, 3))};
    c.attrs.dim = a.dim;
    c.attrs.keepdim = a.keepdim;
    c.attrs.all_dims = a.all;
    c.ref = [a](const Arrays& in, DType) {
      return Arrays{a.all ? ref::argmax_all(in[0], a.keepdim)
                          : ref::argmax(in[0], a.dim, a.keepdim)};
    };
    c.out_dtype = [](DType, size_t) { return DType::i64; };
    if (a.domain.kind == Domain::Kind::fixed) c.dtypes = kFloats;
    am.cases.push_back(std::move(c));
  }
  am.extra = [] { expect_error("argmax of an empty tensor", [] { argmax(zeros({0, 3})); }); };
  out.push_back(std::move(am));

  OpSweep v{OpId::var, kFloats, kNonFloat, {}, {}};
  struct V {
    const char* label;
    Shape shape;
    std::vector<int64_t> dims;
    int64_t correction;
    bool keepdim;
    Domain domain;
    bool nan = false;  // count <= correction: NaN outputs, no derivative to check
  };
  for (const V& a :
       {V{"[4, 5, 6] all", {4, 5, 6}, {}, 1, false, normal(1)},
        V{"[4, 5, 6] dims {1} correction 0", {4, 5, 6}, {1}, 0, false, normal(1)},
        V{"[4, 5, 6] dims {0, 2} keepdim correction 2", {4, 5, 6}, {0, 2}, 2, true, normal(1)},
        V{"[4, 1, 3] dims {1} (count <= correction: NaN)", {4, 1, 3}, {1}, 1, false, normal(1), true},
        V{"[6, 50] dims {1} mean 10, sd 0.1", {6, 50}, {1}, 1, false, normal(0.1, 10)}}) {
    Case c;
    c.label = a.label;
    c.args = {arg(a.shape, a.domain)};
    c.attrs.dims = a.dims;
    c.attrs.correction = a.correction;
    c.attrs.keepdim = a.keepdim;
    c.grad = !a.nan;
    c.ref = [a](const Arrays& in, DType) {
      return Arrays{ref::var(in[0], a.dims, a.correction, a.keepdim)};
    };
    v.cases.push_back(std::move(c));
  }
  out.push_back(std::move(v));

  // sum_squares(x1, ..., xk): every element's square, in f64, one 0-d f64 output.
  OpSweep sq{OpId::sum_squares, kFloats, kNonFloat, {}, {}};
  const auto squares_ref = [](const Arrays& in, DType) {
    // In long double (64-bit significand), so that the reference's own additions stay far
    // below the bound even over 70,001 equal terms (an expanded layout).
    long double total = 0;
    for (const NdArray& x : in) {
      for (double v : x.data) total += static_cast<long double>(v) * v;
    }
    NdArray out = NdArray::zeros({});
    out.data[0] = static_cast<double>(total);
    return Arrays{out};
  };
  struct Q {
    const char* label;
    std::vector<Shape> shapes;
  };
  for (const Q& q : {Q{"[4, 6]", {{4, 6}}},
                     Q{"[3, 5], 0-d, [0], [40, 33]", {{3, 5}, {}, {0}, {40, 33}}},
                     Q{"[70001] (blocks) and [2, 3]", {{70001}, {2, 3}}}}) {
    Case c;
    c.label = q.label;
    for (const Shape& shape : q.shapes) c.args.push_back(arg(shape, normal(2)));
    c.ref = squares_ref;
    c.out_dtype = [](DType, size_t) { return DType::f64; };
    // The squares are exact in f64 (from at most f32 values); only the order of additions
    // differs from the reference's, well within a few ulps per addition.
    c.rel32 = c.rel64 = 1e-12;
    sq.cases.push_back(std::move(c));
  }
  sq.extra = [] {
    expect_error("sum_squares of no tensors", [] { sum_squares({}); });
    expect_error("sum_squares of an i64 tensor", [] { sum_squares({zeros({2}), zeros({2}, DType::i64)}); });
    // The additions of summing each tensor's sum(cast(x, f64)^2) in order: bitwise on the
    // CPU (the single block and the blocks path, strided, 16-bit), the same in one call as
    // tensor by tensor.
    if (!sweep_device().is_cpu()) return;
    const auto same = [](const std::string& what, double got, double want) {
      if (got != want) report_failure(fmt::format("sum_squares {}: {} is not bitwise {}", what, got, want));
    };
    for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
      const std::vector<Tensor> xs = {randn({70001}).cast(dt), transpose(randn({33, 40}).cast(dt), 0, 1),
                                      randn({5}).cast(dt), randn({300, 257}).cast(dt)};
      double by_sum = 0.0;
      for (size_t i = 0; i < xs.size(); ++i) {
        const Tensor x64 = cast(xs[i], DType::f64);
        const double s = sum(x64 * x64).item<double>();
        by_sum = i == 0 ? s : by_sum + s;
        same(fmt::format("of tensor {} in {}", i, dtype_name(dt)), sum_squares({xs[i]}).item<double>(), s);
      }
      same(fmt::format("of 4 tensors in {}", dtype_name(dt)), sum_squares(xs).item<double>(), by_sum);
    }
  };
  out.push_back(std::move(sq));
  return out;
}

}  // namespace

std::vector<OpSweep> elementwise_sweeps() {
  std::vector<OpSweep> out = unary_sweeps();
  for (auto* family : {&binary_sweeps, &reduction_sweeps}) {
    for (OpSweep& s : (*family)()) out.push_back(std::move(s));
  }
  return out;
}

}  // namespace tessera::sweep
