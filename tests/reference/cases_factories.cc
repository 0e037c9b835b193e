// Records (cases.h): full, arange, rand, randn, zeros, ones. Deterministic factories are compared
// with the reference bitwise; rand/randn with the reference Philox streams (which are checked
// against Random123's known answers), plus range, moments and reproducibility.
#include <doctest/doctest.h>

#include <cmath>

#include "tests/reference/cases.h"

namespace tessera::sweep {
namespace {

Case factory_case(std::string label, std::function<Arrays(DType)> reference) {
  Case c;
  c.label = std::move(label);
  c.ref = [reference](const Arrays&, DType dt) { return reference(dt); };
  c.exact = true;
  return c;
}

OpSweep full_sweep() {
  OpSweep s{OpId::full, kAll, {}, {}, {}};
  struct F {
    Shape shape;
    double value;
  };
  // 0.1 rounds differently in every float type. Fractional values run on floating dtypes
  // only: integer and bool tensors reject them (checked below), as scalar operands do.
  for (const F& f :
       {F{{3, 4}, 2.5}, F{{2, 3}, -3}, F{{5}, 0.1}, F{{}, 7}, F{{0, 2}, 1}, F{{4}, 0}}) {
    Case c = factory_case(fmt::format("{} value {}", shape_str(f.shape), f.value),
                          [f](DType dt) { return Arrays{ref::full(f.shape, f.value, dt)}; });
    c.attrs.shape = f.shape;
    c.attrs.value = f.value;
    if (std::trunc(f.value) != f.value) c.dtypes = {DType::f32, DType::f64, DType::f16, DType::bf16};
    if (f.value == -3) c.dtypes = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64};
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("full negative size", [] { full({2, -1}, 0.0); });
    expect_error("full fractional int", [] { full({2}, 2.5, DType::i32); });
  };
  return s;
}

OpSweep arange_sweep() {
  OpSweep s{OpId::arange, kNumeric, {DType::b8}, {}, {}};
  struct A {
    double start, end, step;
  };
  for (const A& a : {A{0, 10, 1}, A{2.5, -1, -0.5}, A{0, 1, 0.1}, A{5, 5, 1}, A{-3, 4, 2}}) {
    Case c = factory_case(fmt::format("({}, {}, {})", a.start, a.end, a.step), [a](DType dt) {
      return Arrays{ref::arange(a.start, a.end, a.step, dt)};
    });
    c.attrs.range_start = a.start;
    c.attrs.range_end = a.end;
    c.attrs.range_step = a.step;
    // A fractional start or step runs on floating dtypes only (integers reject it below).
    if (std::trunc(a.start) != a.start || std::trunc(a.step) != a.step) {
      c.dtypes = {DType::f32, DType::f64, DType::f16, DType::bf16};
    }
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("arange step 0", [] { arange(0, 1, 0); });
    expect_error("arange fractional int", [] { arange(0, 5, 0.5, DType::i64); });
  };
  return s;
}

struct Draw {
  const char* label;
  Shape shape;
  uint64_t seed, offset;
  RngView view;
};
const Draw kDraws[] = {
    {"[1000] seed 42", {1000}, 42, 0, {}},
    {"[7, 9] seed 7, offset 2^40 + 5 (high counter word)", {7, 9}, 7, (1ull << 40) + 5, {}},
    {"block [3, 4] at [2, 3] of [6, 8]", {3, 4}, 9, 5, {{6, 8}, {2, 3}}},
};

OpSweep random_sweep(OpId op) {
  const bool normal = op == OpId::randn;
  OpSweep s{op, kFloats, kNonFloat, {}, {}};
  for (const Draw& d : kDraws) {
    Case c = factory_case(d.label, [d, normal](DType dt) {
      // randn: the exact f64 normal; the tolerance below is its single rounding to dt.
      return Arrays{
          normal ? ref::randn(d.shape, d.seed, d.offset, DType::f64, d.view.global_shape,
                              d.view.starts)
                 : ref::rand(d.shape, d.seed, d.offset, dt, d.view.global_shape, d.view.starts)};
    });
    c.attrs.shape = d.shape;
    c.attrs.seed = d.seed;
    c.attrs.offset = d.offset;
    c.attrs.rng_view = d.view;
    c.sharded = d.view.global_shape.empty();  // a block: the sharded form sets rng_view itself
    if (normal) {
      // The kernel evaluates the same f64 Box-Muller and rounds once: f32 within u = 2^-24
      // (the factor covers the double arithmetic of the difference); f64 within libm's
      // log/cos differences; f16/bf16 via the f32 twin.
      c.exact = false;
      c.rel32 = 0x1p-24 * (1 + 1e-9);
    }
    s.cases.push_back(std::move(c));
  }
  return s;
}

// Sample moments of n draws must lie within 5 standard errors.
void check_moments(const char* what, const NdArray& x, double mean, double var, double fourth) {
  const double n = static_cast<double>(x.numel());
  double m = 0;
  for (double v : x.data) m += v;
  m /= n;
  double s2 = 0;
  for (double v : x.data) s2 += (v - m) * (v - m);
  s2 /= n - 1;
  CHECK_MESSAGE(std::fabs(m - mean) < 5 * std::sqrt(var / n), what, ": mean ", m);
  CHECK_MESSAGE(std::fabs(s2 - var) < 5 * std::sqrt((fourth - var * var) / n), what, ": variance ",
                s2);
}

void random_extra() {
  // Random123's known-answer vectors for Philox-4x32-10, then Tessera's Philox against the
  // reference on counters with both words set.
  using W4 = std::array<uint32_t, 4>;
  CHECK(ref::philox4x32_10({0, 0, 0, 0}, {0, 0}) ==
        W4{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  CHECK(ref::philox4x32_10({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}) ==
        W4{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  CHECK(ref::philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
                           {0xa4093822, 0x299f31d0}) ==
        W4{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
  for (uint64_t counter : {uint64_t{0}, uint64_t{1}, uint64_t{0x123456789abcdefull}}) {
    const uint64_t seed = 0xfeedface12345678ull;
    const auto t = philox::philox4x32(counter, seed);
    const auto r = ref::philox4x32_10(
        {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0, 0},
        {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
    CHECK(W4{t[0], t[1], t[2], t[3]} == r);
  }

  constexpr int64_t n = 100000;
  for (DType dt : kFloats) {
    Generator g(3);
    const NdArray u = read_tensor(rand({n}, dt, kCPU, &g));
    const NdArray z = read_tensor(randn({n}, dt, kCPU, &g));
    double lo = 1, hi = 0;
    for (double v : u.data) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    CHECK_MESSAGE(lo >= 0.0, "rand ", dtype_name(dt), " min ", lo);
    CHECK_MESSAGE(hi < 1.0, "rand ", dtype_name(dt), " max ", hi);
    const std::string ru = fmt::format("rand {}", dtype_name(dt)),
                      rn = fmt::format("randn {}", dtype_name(dt));
    // Uniform [0, 1): mean 1/2, variance 1/12, fourth central moment 1/80; normal: 0, 1, 3.
    check_moments(ru.c_str(), u, 0.5, 1.0 / 12, 1.0 / 80);
    check_moments(rn.c_str(), z, 0.0, 1.0, 3.0);
    CHECK(g.offset() == 2 * n);  // each draw reserves one counter per element
  }
  // Same generator state, same bits; the next draw differs.
  Generator a(11), b(11);
  const NdArray a1 = read_tensor(randn({64}, DType::f32, kCPU, &a));
  const NdArray b1 = read_tensor(randn({64}, DType::f32, kCPU, &b));
  const NdArray a2 = read_tensor(randn({64}, DType::f32, kCPU, &a));
  CHECK(a1.data == b1.data);
  CHECK(a1.data != a2.data);
  manual_seed(99);
  const NdArray m1 = read_tensor(rand({16}));
  manual_seed(99);
  CHECK(read_tensor(rand({16})).data == m1.data);
  // A block of a logical tensor equals that slice of the whole draw.
  const NdArray whole = read_tensor(rand_block({6, 8}, {}, 21, 3));
  const NdArray block = read_tensor(rand_block({3, 4}, {{6, 8}, {2, 3}}, 21, 3));
  CHECK(block.data == ref::slice(ref::slice(whole, 0, 2, 5, 1), 1, 3, 7, 1).data);
}

OpSweep fill_composite(OpId op, double value) {
  OpSweep s{op, kAll, {}, {}, {}};
  for (const Shape& shape : {Shape{2, 3}, Shape{}, Shape{0}}) {
    Case c = factory_case(shape_str(shape),
                          [shape, value](DType dt) { return Arrays{ref::full(shape, value, dt)}; });
    c.run = [shape, op](const Tensors&, DType dt) {
      const Device d = sweep_device();
      return Tensors{op == OpId::zeros ? zeros(shape, dt, d) : ones(shape, dt, d)};
    };
    s.cases.push_back(std::move(c));
  }
  return s;
}

}  // namespace

std::vector<OpSweep> factory_sweeps() {
  std::vector<OpSweep> out = {full_sweep(),
                              arange_sweep(),
                              random_sweep(OpId::rand),
                              random_sweep(OpId::randn),
                              fill_composite(OpId::zeros, 0),
                              fill_composite(OpId::ones, 1)};
  out[2].extra = random_extra;
  return out;
}

}  // namespace tessera::sweep
