// The records of the optimizers' other in-place passes: Adafactor's adafactor_stats_,
// adafactor_norm_ and adafactor_apply_, and scale_ (clipping's coefficient, when the
// optimizer does not take it into its update), with the claim that scale_ gives the bits of
// copy_(x, x * k).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "tensor/op_attrs.h"
#include "tests/reference/cases.h"

namespace tessera::sweep {
namespace {

// ---- Adafactor's passes -------------------------------------------------------------------
// adafactor_stats_, adafactor_norm_ and adafactor_apply_ (tensor/ops.h) on [B, M, N]
// matrices, f32 and f64, contiguous operands (the kernels' requirement). The references are
// the formulas in f64 on the inputs as the tensors hold them.

// The passes take f32 and f64 (the optimizer keeps the ops for 16-bit parameters).
const std::vector<DType> kAdafactorDtypes = {DType::f32, DType::f64};
const std::vector<DType> kAdafactorRejected = {DType::f16, DType::bf16, DType::i32, DType::i64,
                                               DType::b8};

struct AdafactorForm {
  bool product = true;
  double divisor = 1.0, floor = 0.0;
};

// The update of element (k, i, j) of [B, M, N] from a [B, M] and b [B, N], each operation
// rounded to dt as the kernel's (so a sum of their squares differs only in its order).
double adafactor_update(const AdafactorForm& f, double g, double a, double b, DType dt) {
  const auto r = [dt](double x) { return ref::round_to(x, dt); };
  if (f.product) return r(r(g * a) * b);
  const double v = r(r(a * b) / r(f.divisor));
  return r(g * r(1.0 / r(std::sqrt(std::max(v, r(f.floor))))));
}

Arg f64_out(Shape shape) {
  Arg a = written(arg(std::move(shape)));
  a.dtype = DType::f64;
  return a;
}

Case adafactor_stats_case(std::string label, Shape s, double eps) {
  Case c;
  c.label = std::move(label);
  const int64_t B = s[0], M = s[1], N = s[2];
  c.args = {arg(s), written(arg({B, M + N}))};
  c.attrs.eps = eps;
  c.dtypes = kAdafactorDtypes;
  c.layouts = {Layout::contiguous};
  c.ref = [B, M, N, eps](const Arrays& in, DType) {
    NdArray out = NdArray::zeros({B, M + N});
    for (int64_t k = 0; k < B; ++k) {
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          const double g = in[0].data[static_cast<size_t>((k * M + i) * N + j)];
          out.data[static_cast<size_t>(k * (M + N) + i)] += g * g + eps;
          out.data[static_cast<size_t>(k * (M + N) + M + j)] += g * g + eps;
        }
      }
    }
    return Arrays{out};
  };
  return c;
}

Case adafactor_norm_case(std::string label, Shape s, AdafactorForm f) {
  Case c;
  c.label = std::move(label);
  const int64_t B = s[0], M = s[1], N = s[2];
  c.args = {arg(s), arg({B, M}, uniform(0.1, 2)), arg({B, N}, uniform(0.1, 2)), f64_out({1})};
  c.attrs = op_attrs::adafactor(f.product, f.divisor, f.floor);
  c.dtypes = kAdafactorDtypes;
  c.layouts = {Layout::contiguous};
  c.out_dtype = [](DType, size_t) { return DType::f64; };
  c.ref = [B, M, N, f](const Arrays& in, DType dt) {
    double sum = 0;
    for (int64_t k = 0; k < B; ++k) {
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          const double u = adafactor_update(f, in[0].data[static_cast<size_t>((k * M + i) * N + j)],
                                            in[1].data[static_cast<size_t>(k * M + i)],
                                            in[2].data[static_cast<size_t>(k * N + j)], dt);
          sum += ref::round_to(u * u, dt);
        }
      }
    }
    return Arrays{NdArray::of({1}, {sum})};
  };
  return c;
}

struct AdafactorApply {
  AdafactorForm f;
  double scale = 0.05, beta1 = 0.0, c = 0.0;
  int64_t form = 0;  // 0 hf, 1 torch, 2 optax
};

Case adafactor_apply_case(std::string label, Shape s, AdafactorApply h) {
  Case c;
  c.label = std::move(label);
  const int64_t B = s[0], M = s[1], N = s[2];
  const bool moment = h.beta1 > 0;
  c.args = {written(arg(s)), arg(s), arg({B, M}, uniform(0.1, 2)), arg({B, N}, uniform(0.1, 2)),
            moment ? written(arg(s, normal(0.1))) : absent_arg()};
  c.attrs = op_attrs::adafactor(h.f.product, h.f.divisor, h.f.floor, h.scale, h.beta1, h.c, h.form);
  c.dtypes = kAdafactorDtypes;
  c.layouts = {Layout::contiguous};
  // param and exp_avg per element; `mag` (for the tolerance) the sum of the terms' magnitudes.
  const auto run = [B, M, N, h, moment](const Arrays& in, bool magnitudes) {
    // (The update in f64: the tolerance covers the dtype's roundings, see mag.)
    NdArray p = in[0], m = moment ? in[4] : NdArray::absent();
    for (int64_t k = 0; k < B; ++k) {
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          const size_t e = static_cast<size_t>((k * M + i) * N + j);
          double x = adafactor_update(h.f, in[1].data[e], in[2].data[static_cast<size_t>(k * M + i)],
                                      in[3].data[static_cast<size_t>(k * N + j)], DType::f64) *
                     h.scale;
          if (magnitudes) x = std::fabs(x);
          if (moment) {
            const double old = magnitudes ? std::fabs(in[4].data[e]) : in[4].data[e];
            m.data[e] = old * h.beta1 + x * (1 - h.beta1);
            x = m.data[e];
          }
          const double w = in[0].data[e];
          if (magnitudes) {
            p.data[e] = std::fabs(w) * (1 + h.c) + x;
          } else if (h.form == 0) {
            p.data[e] = (h.c > 0 ? w - w * h.c : w) - x;
          } else if (h.form == 1) {
            p.data[e] = (h.c > 0 ? w * (1 - h.c) : w) - x;
          } else {
            p.data[e] = h.c > 0 ? w - (x + w * h.c) : w - x;
          }
        }
      }
    }
    Arrays out = {p};
    if (moment) out.push_back(m);
    return out;
  };
  c.ref = [run](const Arrays& in, DType) { return run(in, false); };
  c.mag = [run](const Arrays& in, DType) { return run(in, true); };
  return c;
}

void adafactor_errors() {
  const Tensor g = zeros({1, 2, 3}), out = zeros({1, 5});
  expect_error("adafactor_stats_ 2-D grad", [&] { adafactor_stats_(zeros({2, 3}), out, 0.0); });
  expect_error("adafactor_stats_ out [1, 6] for [1, 2, 3]",
               [&] { adafactor_stats_(g, zeros({1, 6}), 0.0); });
  expect_error("adafactor_stats_ bf16 grad", [&] {
    adafactor_stats_(zeros({1, 2, 3}, DType::bf16), zeros({1, 5}, DType::bf16), 0.0);
  });
  expect_error("adafactor_stats_ strided out",
               [&] { adafactor_stats_(g, zeros({1, 10}).slice(1, 0, 10, 2), 0.0); });
  const Tensor a = ones({1, 2}), b = ones({1, 3}), sq = zeros({1}, DType::f64);
  expect_error("adafactor_norm_ f32 out", [&] {
    adafactor_norm_(g, a, b, zeros({1}), true, 1.0, 0.0);
  });
  expect_error("adafactor_norm_ b [1, 2] for [1, 2, 3]",
               [&] { adafactor_norm_(g, a, ones({1, 2}), sq, true, 1.0, 0.0); });
  expect_error("adafactor_norm_ divisor 0", [&] { adafactor_norm_(g, a, b, sq, false, 0.0, 0.0); });
  expect_error("adafactor_apply_ beta1 without exp_avg", [&] {
    adafactor_apply_(zeros({1, 2, 3}), g, a, b, Tensor(), true, 1.0, 0.0, 1.0, 0.9, 0.0, 0);
  });
  expect_error("adafactor_apply_ exp_avg without beta1", [&] {
    adafactor_apply_(zeros({1, 2, 3}), g, a, b, zeros({1, 2, 3}), true, 1.0, 0.0, 1.0, 0.0, 0.0, 0);
  });
  expect_error("adafactor_apply_ form 3", [&] {
    adafactor_apply_(zeros({1, 2, 3}), g, a, b, Tensor(), true, 1.0, 0.0, 1.0, 0.0, 0.0, 3);
  });
  expect_error("adafactor_apply_ f64 param for an f32 grad", [&] {
    adafactor_apply_(zeros({1, 2, 3}, DType::f64), g, a, b, Tensor(), true, 1.0, 0.0, 1.0, 0.0, 0.0, 0);
  });
  // Error messages name the op and the shapes.
  try {
    adafactor_stats_(g, zeros({1, 6}), 0.0);
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("adafactor_stats_: out must be f32 [1, 5] for grad [1, 2, 3], got f32 "
                           "[1, 6]") != std::string::npos, msg);
  }
}

OpSweep adafactor_stats_sweep() {
  OpSweep s{OpId::adafactor_stats_, kAdafactorDtypes, kAdafactorRejected, {}, {}};
  s.cases.push_back(adafactor_stats_case("[1, 5, 7] eps 1e-30 (hf)", {1, 5, 7}, 1e-30));
  s.cases.push_back(adafactor_stats_case("[3, 4, 6] eps 0 (torch; 3 matrices)", {3, 4, 6}, 0.0));
  s.cases.push_back(adafactor_stats_case("[1, 0, 4] (no rows)", {1, 0, 4}, 1e-3));
  // Over one chunk's elements: rows split over threads, the column sums added in order.
  Case big = adafactor_stats_case("[1, 300, 257] eps 1e-3 (parallel chunks)", {1, 300, 257}, 1e-3);
  big.sharded = false;
  s.cases.push_back(std::move(big));
  Case batched = adafactor_stats_case("[2, 130, 257] (parallel chunks per matrix)", {2, 130, 257}, 0.0);
  batched.sharded = false;
  s.cases.push_back(std::move(batched));
  s.extra = [] { adafactor_errors(); };
  return s;
}

OpSweep adafactor_norm_sweep() {
  OpSweep s{OpId::adafactor_norm_, kAdafactorDtypes, kAdafactorRejected, {}, {}};
  s.cases.push_back(adafactor_norm_case("[1, 5, 7] product", {1, 5, 7}, {}));
  s.cases.push_back(adafactor_norm_case("[2, 4, 6] floored, divisor 1.5, floor 0.3", {2, 4, 6},
                                        {false, 1.5, 0.3}));
  Case big = adafactor_norm_case("[1, 300, 257] product (parallel chunks)", {1, 300, 257}, {});
  big.sharded = false;
  s.cases.push_back(std::move(big));
  return s;
}

OpSweep adafactor_apply_sweep() {
  OpSweep s{OpId::adafactor_apply_, kAdafactorDtypes, kAdafactorRejected, {}, {}};
  s.cases.push_back(adafactor_apply_case("[1, 5, 7] hf, no decay", {1, 5, 7}, {}));
  s.cases.push_back(adafactor_apply_case("[1, 4, 6] hf, decay 0.01, beta1 0.9", {1, 4, 6},
                                         {{}, 0.05, 0.9, 0.01, 0}));
  s.cases.push_back(adafactor_apply_case("[1, 4, 6] torch (floored), decay 1e-3", {1, 4, 6},
                                         {{false, 1.5, 0.3}, 0.02, 0.0, 1e-3, 1}));
  s.cases.push_back(adafactor_apply_case("[2, 3, 5] optax, decay 0.1, beta1 0.5", {2, 3, 5},
                                         {{}, 0.1, 0.5, 0.1, 2}));
  Case big = adafactor_apply_case("[1, 130, 257] hf beta1 0.9 (parallel chunks)", {1, 130, 257},
                                  {{}, 0.05, 0.9, 0.01, 0});
  big.sharded = false;
  s.cases.push_back(std::move(big));
  return s;
}

// scale_(x1, ..., xk; scale): each x times the scale in its compute type, in place.
OpSweep scale_sweep() {
  OpSweep s{OpId::scale_, kFloats, kNonFloat, {}, {}};
  struct S {
    const char* label;
    std::vector<Shape> shapes;
    double scale;
  };
  // (A case's tensors have one rank: the sharded suite places them alike.)
  for (const S& q : {S{"[5, 7] by 0.37", {{5, 7}}, 0.37},
                     S{"0-d by 3", {{}}, 3.0},
                     S{"[3, 4], [0, 4], [130, 257] by 1.0e-3 (parallel chunks)",
                       {{3, 4}, {0, 4}, {130, 257}}, 1e-3},
                     S{"[2, 3] and [4, 6] by -2.5", {{2, 3}, {4, 6}}, -2.5}}) {
    Case c;
    c.label = q.label;
    for (const Shape& shape : q.shapes) c.args.push_back(written(arg(shape, normal(2))));
    c.attrs = op_attrs::scale(q.scale);
    const double k = q.scale;
    c.ref = [k](const Arrays& in, DType) {
      Arrays out = in;
      for (NdArray& x : out) {
        for (double& v : x.data) v *= k;
      }
      return out;
    };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("scale_ of no tensors", [] { scale_({}, 2.0); });
    expect_error("scale_ of an i32 tensor", [] { scale_({zeros({2}, DType::i32)}, 2.0); });
    expect_error("scale_ by infinity", [] { scale_({zeros({2})}, INFINITY); });
    expect_error("scale_ of an expanded tensor", [] { scale_({zeros({1}).expand({4})}, 2.0); });
    expect_error("scale_ of one tensor twice", [] {
      const Tensor x = zeros({4});
      scale_({x, x}, 2.0);
    });
    expect_error("scale_ of overlapping slices", [] {
      const Tensor x = zeros({8});
      scale_({x.slice(0, 0, 5, 1), x.slice(0, 4, 8, 1)}, 2.0);
    });
    inplace_effects([](const Tensors& in) { scale_({in[0], in[1]}, 0.5); }, 2, {0, 1}, "scale_");
    // What clipping did before, per tensor, bitwise: copy_(x, x * k) (16-bit through f32).
    const double k = 0.123456789;
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      const Tensor a = randn({70001}).cast(dt).to(sweep_device());
      const Tensor b = transpose(randn({33, 40}).cast(dt).to(sweep_device()), 0, 1);
      const bool narrow = dt == DType::f16 || dt == DType::bf16;
      std::vector<Tensor> want;
      for (const Tensor& x : {a, b}) {
        const Tensor w = x.clone();
        copy_(w, (narrow ? cast(w, DType::f32) : w) * k);
        want.push_back(w);
      }
      {
        NoGradGuard no_grad;
        scale_({a, b}, k);
      }
      CHECK_MESSAGE(a.to(kCPU).cast(DType::f64).to_vector<double>() ==
                        want[0].to(kCPU).cast(DType::f64).to_vector<double>(),
                    "scale_ of a contiguous ", dtype_name(dt), " tensor is copy_(x, x * k)'s");
      CHECK_MESSAGE(b.to(kCPU).cast(DType::f64).to_vector<double>() ==
                        want[1].to(kCPU).cast(DType::f64).to_vector<double>(),
                    "scale_ of a transposed ", dtype_name(dt), " tensor is copy_(x, x * k)'s");
    }
  };
  return s;
}

}  // namespace

std::vector<OpSweep> optim_pass_sweeps() {
  return {adafactor_stats_sweep(), adafactor_norm_sweep(), adafactor_apply_sweep(), scale_sweep()};
}

}  // namespace tessera::sweep
