// GPU-tagged: the CUDA elementwise ops, reductions and random/range factories against the
// CPU kernels (the spec). Needs a GPU and --config=cuda:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:elementwise_test
//
// Tolerances: f32 1e-5 relative (device expf/tanhf/erff are within 2 ulp, reductions sum in
// another order), f64 1e-12 relative, f16/bf16 one rounding (2^-10 / 2^-7 relative: the f32
// results may straddle a 16-bit rounding boundary), integers and bool exactly; each with a
// small absolute floor for results near zero. rand and the dropout mask are bitwise.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tensor/ops.h"
#include "tests/cuda/device_compare.h"
#include "tests/reference/op_cases.h"
#include "tensor/random.h"

using namespace tessera;
using tessera::cuda_testing::check_close;
using tessera::cuda_testing::kGpu;
using tessera::cuda_testing::Tol;

namespace {

Tol tol_for(DType dt) {
  switch (dt) {
    case DType::f32: return {1e-5, 1e-6};
    case DType::f64: return {1e-12, 1e-14};
    case DType::f16: return {1.0 / 1024, 1e-6};
    case DType::bf16: return {1.0 / 128, 1e-6};
    default: return {0, 0};
  }
}

using cuda_testing::check_close;
// `got` (on the GPU) equals `want` (on the CPU) within the dtype's tolerances.
void check_close(const Tensor& got, const Tensor& want, const std::string& what) {
  check_close(got, want, what, tol_for(want.dtype()));
}

// Bytes of a (contiguous) tensor's elements, for bitwise comparisons.
std::vector<unsigned char> bytes_of(const Tensor& t) {
  const Tensor h = t.to(kCPU).contiguous();
  std::vector<unsigned char> b(static_cast<size_t>(h.nbytes()));
  std::memcpy(b.data(), h.raw_data(), b.size());
  return b;
}

Tensor normal(const Shape& s, DType dt, uint64_t seed) {
  Generator g(seed);
  return cast(randn(s, DType::f32, kCPU, &g), dt);
}
Tensor uniform(const Shape& s, DType dt, uint64_t seed) {
  Generator g(seed);
  return cast(rand(s, DType::f32, kCPU, &g), dt);
}
// Small integers in [-range, range], in dtype dt.
Tensor small_ints(const Shape& s, DType dt, uint64_t seed, int range) {
  Generator g(seed);
  Tensor u = rand(s, DType::f64, kCPU, &g) * (2.0 * range + 1) - (range + 0.5);
  return cast(cast(u + 1000.5, DType::i64) - full({}, 1000.0, DType::i64), dt);
}

const DType kFloats[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

}  // namespace

// Values in an op's domain (tests/reference/op_cases.h): positive ones for log, sqrt, ...
Tensor in_domain(const Tensor& x, const ref::Domain& d) {
  if (d.positive()) return abs(x) + 0.1;
  if (d.kind == ref::Domain::Kind::away_from_zero) return where(ge(x, zeros_like(x)), x + 0.5, x - 0.5);
  return x;
}

TEST_CASE("unary ops match the CPU for every float dtype, contiguous and strided") {
  // Every unary functor family op (from its test case) and both forms of gelu.
  std::vector<std::pair<std::string, std::function<Tensor(const Tensor&)>>> ops;
  for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
    if (!fc.unary) continue;
    ops.emplace_back(std::string(op_name(fc.op)),
                     [op = fc.op, d = fc.a](const Tensor& x) { return call1(op, {in_domain(x, d)}); });
  }
  ops.emplace_back("gelu", [](const Tensor& x) { return gelu(x); });
  ops.emplace_back("gelu_tanh", [](const Tensor& x) { return gelu(x, true); });
  for (DType dt : kFloats) {
    // 1027 elements: a vector body and a scalar tail; the slice starts off 16-byte alignment.
    const Tensor x = normal({3, 1027}, dt, 1) * 3.0;
    const Tensor xd = x.to(kGpu);
    for (const auto& [name, f] : ops) {
      const std::string what = name + " " + std::string(dtype_name(dt));
      check_close(f(xd), f(x), what + " contiguous");
      check_close(f(xd.t()), f(x.t()), what + " transposed");
      check_close(f(xd.slice(1, 1, 1026)), f(x.slice(1, 1, 1026)), what + " misaligned slice");
    }
  }
  // The UnaryNumeric ops (neg, abs, relu, ...) on integers, exactly.
  for (DType dt : {DType::i32, DType::i64}) {
    const Tensor x = small_ints({5, 33}, dt, 2, 50);
    for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
      if (op_info(fc.op).family != OpFamily::UnaryNumeric) continue;
      check_close(call1(fc.op, {x.to(kGpu)}), call1(fc.op, {x}),
                  std::string(op_name(fc.op)) + " int");
    }
  }
}

TEST_CASE("binary ops broadcast like the CPU, with host scalars and one-element tensors") {
  // Every binary functor family op but the comparisons (below), from its test case.
  struct Op {
    std::string name;
    std::function<Tensor(const Tensor&, const Tensor&)> f;
    OpFamily family;
  };
  std::vector<Op> ops;
  for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
    if (!fc.binary || op_info(fc.op).family == OpFamily::Compare) continue;
    ops.push_back({std::string(op_name(fc.op)),
                   [op = fc.op, da = fc.a, db = fc.b](const Tensor& a, const Tensor& b) {
                     return call1(op, {in_domain(a, da), in_domain(b, db)});
                   },
                   op_info(fc.op).family});
  }
  struct Layout {
    const char* name;
    Shape a, b;
  };
  const Layout layouts[] = {
      {"same shape", {3, 257}, {3, 257}},
      {"row broadcast", {4, 5, 6}, {6}},
      {"both broadcast", {4, 1, 6}, {5, 1}},
      {"one-element device tensor", {7, 9}, {1}},
      {"bias row (16-byte inner vectors)", {6, 128}, {128}},
      {"per-row scale (broadcast inner dim)", {3, 5, 64}, {3, 5, 1}},
  };
  for (DType dt : kFloats) {
    for (const Layout& l : layouts) {
      const Tensor a = normal(l.a, dt, 3), b = normal(l.b, dt, 4);
      const Tensor ad = a.to(kGpu), bd = b.to(kGpu);
      for (const Op& op : ops) {
        const std::string what = op.name + " " + l.name + " " + std::string(dtype_name(dt));
        check_close(op.f(ad, bd), op.f(a, b), what);
        check_close(op.f(bd, ad), op.f(b, a), what + " (swapped)");
      }
    }
    // A transposed operand, and 0-d CPU scalars on either side.
    const Tensor a = normal({6, 5}, dt, 5), b = normal({5, 6}, dt, 6);
    check_close(a.to(kGpu).t() * b.to(kGpu), a.t() * b, "mul transposed");
    check_close(a.to(kGpu) * 2.5, a * 2.5, "tensor * host scalar");
    check_close(2.5 - a.to(kGpu), 2.5 - a, "host scalar - tensor");
    check_close(a.to(kGpu) / 3.0, a / 3.0, "tensor / host scalar");
    check_close(pow(abs(a.to(kGpu)), 1.5), pow(abs(a), 1.5), "pow host scalar exponent");
  }
  // Integers: exact, wrapping as the CPU does; pow by squaring, and to negative powers the
  // same truncated values as the CPU (device and host-scalar exponents).
  for (DType dt : {DType::i32, DType::i64}) {
    const Tensor a = small_ints({4, 5, 6}, dt, 7, 1000), b = small_ints({6}, dt, 8, 1000);
    for (const Op& op : ops) {
      if (op.family == OpFamily::BinaryFloat || op.name == "pow") continue;
      check_close(op.f(a.to(kGpu), b.to(kGpu)), op.f(a, b), op.name + " int");
    }
    const Tensor base = small_ints({40}, dt, 9, 3), e = small_ints({40}, dt, 10, 6);
    check_close(pow(base.to(kGpu), e.to(kGpu)), pow(base, e), "pow int");
    check_close(pow(base.to(kGpu), 3.0), pow(base, 3.0), "pow int host scalar");
    check_close(pow(base.to(kGpu), -1.0), pow(base, -1.0), "pow int host scalar -1");
  }
}

TEST_CASE("comparisons give bool, where selects bits, for every dtype") {
  std::vector<std::function<Tensor(const Tensor&, const Tensor&)>> ops;
  for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
    if (op_info(fc.op).family != OpFamily::Compare) continue;
    ops.push_back([op = fc.op](const Tensor& a, const Tensor& b) { return call1(op, {a, b}); });
  }
  for (DType dt : kAllDTypes) {
    // Small integers make ties common; bool gets 0/1 from them.
    const Tensor a = small_ints({9, 70}, dt, 11, 2), b = small_ints({70}, dt, 12, 2);
    for (const auto& f : ops) {
      const Tensor got = f(a.to(kGpu), b.to(kGpu));
      CHECK(got.dtype() == DType::b8);
      check_close(got, f(a, b), "compare " + std::string(dtype_name(dt)));
      check_close(f(a.to(kGpu), b.to(kGpu).slice(0, 3, 4).squeeze()), f(a, b.slice(0, 3, 4).squeeze()),
                  "compare with a device 0-d tensor " + std::string(dtype_name(dt)));
    }
    const Tensor cond = gt(small_ints({9, 1}, DType::i32, 13, 1), full({}, 0.0, DType::i32));
    const Tensor wd = where(cond.to(kGpu), a.to(kGpu), b.to(kGpu));
    CHECK(bytes_of(wd) == bytes_of(where(cond, a, b)));
  }
  // A host scalar branch.
  const Tensor x = normal({33, 17}, DType::bf16, 14);
  const Tensor zero = full({}, 0.0, DType::bf16);
  const Tensor cd = gt(x.to(kGpu), zero);
  CHECK(bytes_of(where(cd, x.to(kGpu), zero)) == bytes_of(where(gt(x, zero), x, zero)));
}

TEST_CASE("gelu_backward matches the CPU, exact and tanh forms") {
  for (DType dt : kFloats) {
    const Tensor g = normal({5, 301}, dt, 15), x = normal({5, 301}, dt, 16) * 3.0;
    for (bool approx : {false, true}) {
      check_close(gelu_backward(g.to(kGpu), x.to(kGpu), approx), gelu_backward(g, x, approx),
                  "gelu_backward " + std::string(dtype_name(dt)));
    }
  }
}

TEST_CASE("reductions over any dims match the CPU") {
  struct Case {
    Shape shape;
    std::vector<int64_t> dims;
    bool transpose;  // reduce a transposed view of the tensor
  };
  const Case cases[] = {
      {{37, 1000}, {1}, false},          // rows, a warp each
      {{37, 1000}, {0}, false},          // columns
      {{37, 1000}, {}, false},           // everything
      {{8, 33, 130}, {0, 2}, false},     // neither: packed with the reduced dims last
      {{8, 33, 130}, {1}, false},        // columns with outer kept dims
      {{3, 100003}, {1}, false},         // long rows: block per row, split into chunks
      {{100003, 3}, {0}, false},         // few long columns: split into chunks
      {{1 << 21}, {0}, false},           // one long row, split
      {{64, 48}, {1}, true},             // transposed view: reduced dim strided
      {{5, 1, 7}, {1}, false},           // reducing a size-1 dim only
      {{3, 8, 130}, {0}, false},         // thin columns: 3 reduced (GPT's q/k/v sum)
      {{16, 2, 33}, {0}, false},         // thin columns at the limit, 16
      {{17, 40}, {0}, false},            // one past it: the block kernel
      {{2, 5, 3, 40}, {0, 2}, false},    // thin, two reduced dims, an outer kept dim
  };
  for (const Case& c : cases) {
    for (DType dt : kFloats) {
      Tensor x = uniform(c.shape, dt, 17) * 4.0 - 1.0;
      Tensor xd = x.to(kGpu);
      if (c.transpose) {
        x = x.t();
        xd = xd.t();
      }
      const std::string what = shape_str(c.shape) + " dims " + shape_str(c.dims) + " " +
                               std::string(dtype_name(dt));
      for (bool keep : {false, true}) {
        check_close(sum(xd, c.dims, keep), sum(x, c.dims, keep), "sum " + what);
        check_close(mean(xd, c.dims, keep), mean(x, c.dims, keep), "mean " + what);
        check_close(max(xd, c.dims, keep), max(x, c.dims, keep), "max " + what);
        check_close(var(xd, c.dims, 1, keep), var(x, c.dims, 1, keep), "var " + what);
      }
      check_close(var(xd, c.dims, 0), var(x, c.dims, 0), "var correction 0 " + what);
      if (c.dims.size() == 1) {
        check_close(argmax(xd, c.dims[0], true), argmax(x, c.dims[0], true), "argmax " + what);
      }
      check_close(argmax(xd), argmax(x), "argmax all " + what);
    }
    // Integers (ties: the first maximum wins) and bool sums, exactly.
    for (DType dt : {DType::i32, DType::i64}) {
      Tensor x = small_ints(c.shape, dt, 18, 5);
      Tensor xd = x.to(kGpu);
      if (c.transpose) {
        x = x.t();
        xd = xd.t();
      }
      check_close(sum(xd, c.dims), sum(x, c.dims), "sum int");
      check_close(max(xd, c.dims, true), max(x, c.dims, true), "max int");
      if (c.dims.size() == 1) check_close(argmax(xd, c.dims[0]), argmax(x, c.dims[0]), "argmax int");
      check_close(argmax(xd), argmax(x), "argmax all int");
    }
    const Tensor b = gt(small_ints(c.shape, DType::i32, 19, 1), full({}, 0.0, DType::i32));
    check_close(sum(b.to(kGpu), c.dims), sum(b, c.dims), "sum bool");
  }
  // Thin columns step the reduced elements in order: an f64 sum over 3 is (x0 + x1) + x2.
  {
    const Tensor x = uniform({3, 1000}, DType::f64, 20) * 4.0 - 1.0;
    const std::vector<double> v = x.to_vector<double>();
    const std::vector<double> got = sum(x.to(kGpu), {0}).to(kCPU).to_vector<double>();
    REQUIRE(got.size() == 1000);
    int differ = 0;
    for (size_t j = 0; j < 1000; ++j) {
      double want = v[j];
      want += v[1000 + j];
      want += v[2000 + j];
      differ += std::memcmp(&want, &got[j], sizeof(double)) != 0;
    }
    CHECK(differ == 0);
  }
  // NaN: max and argmax take the first NaN.
  const float nan = std::nanf("");
  const Tensor x = Tensor::from_vector<float>({1, nan, 3, nan, 2, 5}, {2, 3});
  CHECK(std::isnan(max(x.to(kGpu)).to(kCPU).item<float>()));
  CHECK(argmax(x.to(kGpu)).to(kCPU).item<int64_t>() == 1);
  CHECK(argmax(x.to(kGpu), 1).to(kCPU).to_vector<int64_t>() == std::vector<int64_t>{1, 0});
}

TEST_CASE("rand is bitwise the CPU's, randn within a few ulps, arange exact") {
  for (DType dt : kFloats) {
    Generator gc(21), gd(21);
    const Tensor rc = rand({1000, 33}, dt, kCPU, &gc), rd = rand({1000, 33}, dt, kGpu, &gd);
    CHECK_MESSAGE(bytes_of(rd) == bytes_of(rc), "rand " << dtype_name(dt));
    const Tensor nc = randn({1000, 33}, dt, kCPU, &gc), nd = randn({1000, 33}, dt, kGpu, &gd);
    // Device log/cos are within 2 ulp of the CPU's (a few ulps in f64 before rounding).
    const Tol t = dt == DType::f64 ? Tol{1e-13, 1e-14} : dt == DType::f32 ? Tol{1e-6, 1e-7} : tol_for(dt);
    check_close(nd, nc, "randn " + std::string(dtype_name(dt)), t);
    // A block of a larger logical tensor (sharded init).
    RngView view{{40, 50}, {10, 20}};
    CHECK(bytes_of(rand_block({12, 7}, view, 5, 9, dt, kGpu)) ==
          bytes_of(rand_block({12, 7}, view, 5, 9, dt, kCPU)));
  }
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    CHECK(bytes_of(arange(-7, 300, 3, dt, kGpu)) == bytes_of(arange(-7, 300, 3, dt, kCPU)));
  }
  for (DType dt : kFloats) {
    CHECK(bytes_of(arange(0.1, 7.3, 0.013, dt, kGpu)) == bytes_of(arange(0.1, 7.3, 0.013, dt, kCPU)));
  }
}

TEST_CASE("dropout keeps the same elements as the CPU, bit for bit") {
  for (DType dt : kFloats) {
    const Tensor x = normal({64, 257}, dt, 22) + 5.0;  // no zeros in x
    Generator gc(31), gd(31);
    const Tensor yc = dropout(x, 0.3, true, &gc);
    const Tensor yd = dropout(x.to(kGpu), 0.3, true, &gd);
    CHECK(bytes_of(eq(yd, full({}, 0.0, dt))) == bytes_of(eq(yc, full({}, 0.0, dt))));
    check_close(yd, yc, "dropout values " + std::string(dtype_name(dt)));
    // A non-contiguous input is read in its logical order.
    Generator gc2(32), gd2(32);
    CHECK(bytes_of(eq(dropout(x.to(kGpu).t(), 0.5, true, &gd2), full({}, 0.0, dt))) ==
          bytes_of(eq(dropout(x.t(), 0.5, true, &gc2), full({}, 0.0, dt))));
  }
}

TEST_CASE("sum_squares over many tensors: each tensor's sum folded in order, whatever is launched with it") {
  // 100 tensors (more than one launch's 48), mixed dtypes, empty ones inside a launch's group,
  // sizes around the 2^14-element block: the sum over the list is bitwise the in-order f64
  // fold of each tensor's own sum_squares, and within 1e-12 of a long-double host sum.
  const DType dts[] = {DType::f32, DType::bf16, DType::f64, DType::f16};
  const int64_t sizes[] = {1, 16384, 0, 16385, 777, 50000, 3, 0, 40000, 16383};
  std::vector<Tensor> xs;
  long double host = 0;
  for (int i = 0; i < 100; ++i) {
    // Tensor 47, last in the first group, empty.
    const Tensor x = i == 47 ? Tensor::empty({0}, DType::f32, kCPU)
                             : uniform({sizes[i % 10] + (i / 10)}, dts[i % 4], 100 + i) * 2.0 - 1.0;
    for (double v : x.to_vector<double>()) host += static_cast<long double>(v) * v;
    xs.push_back(x.to(kGpu));
  }
  const double got = sum_squares(xs).to(kCPU).item<double>();
  double fold = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double one = sum_squares({xs[i]}).to(kCPU).item<double>();
    if (i == 0) fold = one;
    else fold += one;
  }
  CHECK(std::memcmp(&got, &fold, sizeof(double)) == 0);
  const double want = static_cast<double>(host);
  CHECK(std::fabs(got - want) <= 1e-12 * want);
}
