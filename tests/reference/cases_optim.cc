// The records of the fused optimizer updates adamw_, adamw8bit_[segments_] and sgd_
// (Adafactor's passes and scale_: cases_optim_passes.cc). They write
// into their inputs (Arg::expandable false), which are their outputs (param, the state, and
// the master copy when there is one); written inputs are never laid out as expanded
// (stride-0) views, the gradient is.
//
// Tolerances: the f32 kernel against the f64 reference, relative to the sum of the
// magnitudes of the terms each update adds (mag below): a handful of roundings per element,
// far inside rel32 = 1e-5. With a master, param's reference is the updated master itself:
// the 16-bit result is then checked as the f32 twin rounded once.
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

DType state_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

Arg state_arg(Shape shape, Domain domain) {
  Arg a = written(arg(std::move(shape), std::move(domain)));
  a.stats = true;
  return a;
}

Arg master_arg(Shape shape) {
  Arg a = written(arg(std::move(shape)));
  a.dtype = DType::f32;
  return a;
}

// ---- adamw_ -------------------------------------------------------------------------------

struct AdamSetup {
  int64_t t = 1;
  double lr = 0.1, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.1;
  double grad_scale = 1.0;  // the update reads grad * grad_scale (clipping)
};

// The gradient the update reads, as tensor/ops.h specifies it: grad * grad_scale as scale_
// computes it, in f64 for f64 and otherwise in f32 (the scale rounded to f32; the product of
// two f32 values is exact in f64, then rounded to f32), rounded to the gradient's dtype.
NdArray scaled(const NdArray& g, double grad_scale, DType dt) {
  NdArray out = g;
  if (grad_scale == 1.0) return out;
  const double s32 = ref::round_to(grad_scale, DType::f32);
  for (double& v : out.data) {
    v = dt == DType::f64 ? v * grad_scale : ref::round_to(ref::round_to(v * s32, DType::f32), dt);
  }
  return out;
}

// Inputs: param, grad, exp_avg, exp_avg_sq[, master]. Outputs: param, exp_avg, exp_avg_sq
// [, master].
Case adamw_case(std::string label, Shape shape, AdamSetup h, bool master) {
  Case c;
  c.label = std::move(label);
  c.args = {written(arg(shape)), arg(shape), state_arg(shape, normal(0.3)),
            state_arg(shape, uniform(0, 0.5))};
  if (master) {
    c.args.push_back(master_arg(shape));
    c.dtypes = {DType::f32, DType::f16, DType::bf16};
    // A param holds its master rounded (the kernel ignores param's own values then).
    c.prepare = [](Arrays& in, DType) { in[0] = in[4]; };
  }
  c.ref = [h, master](const Arrays& in, DType dt) {
    const NdArray& x = master ? in[4] : in[0];
    Arrays out = ref::adamw(x, scaled(in[1], h.grad_scale, dt), in[2], in[3], h.t, h.lr, h.beta1,
                            h.beta2, h.eps, h.weight_decay);
    if (master) out.push_back(out[0]);
    return out;
  };
  // exp_avg = beta1 m + (1 - beta1) g; param = x (1 - lr wd) - step_size m_hat / denom, whose
  // second term carries exp_avg's error; exp_avg_sq adds positive terms only (|want|).
  c.mag = [h, master](const Arrays& in, DType dt) {
    const NdArray& x = master ? in[4] : in[0];
    const NdArray g = scaled(in[1], h.grad_scale, dt);
    const Arrays want = ref::adamw(x, g, in[2], in[3], h.t, h.lr, h.beta1, h.beta2, h.eps,
                                   h.weight_decay);
    const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(h.t));
    const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(h.t));
    NdArray mp = x, mm = x;
    for (int64_t i = 0; i < x.numel(); ++i) {
      mm.data[i] = h.beta1 * std::fabs(in[2].data[i]) + (1 - h.beta1) * std::fabs(g.data[i]);
      const double denom = std::sqrt(want[2].data[i]) / std::sqrt(bc2) + h.eps;
      mp.data[i] = std::fabs(x.data[i]) * (1 - h.lr * h.weight_decay) +
                   h.lr / bc1 * mm.data[i] / denom;
    }
    Arrays out = {mp, mm, NdArray::absent()};
    if (master) out.push_back(mp);
    return out;
  };
  c.attrs = op_attrs::adamw(h.t, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay);
  c.attrs.grad_scale = h.grad_scale;
  c.out_dtype = [](DType dt, size_t k) {
    return k == 0 ? dt : k == 3 ? DType::f32 : state_dtype(dt);
  };
  return c;
}

void adamw_errors() {
  const Tensor p = zeros({2, 3}), g = zeros({2, 3}), m = zeros({2, 3}), v = zeros({2, 3});
  auto step = [](const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                 const Tensor& master = Tensor()) {
    adamw_(p, g, m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, master);
  };
  expect_error("adamw_ grad [3, 2] for param [2, 3]", [&] { step(p, zeros({3, 2}), m, v); });
  expect_error("adamw_ f16 exp_avg for an f32 param",
               [&] { step(p, g, zeros({2, 3}, DType::f16), v); });
  expect_error("adamw_ f32 moments for an f64 param", [&] {
    step(zeros({2, 3}, DType::f64), zeros({2, 3}, DType::f64), m, v);
  });
  expect_error("adamw_ undefined exp_avg_sq", [&] { step(p, g, m, Tensor()); });
  expect_error("adamw_ master for an f64 param", [&] {
    const Tensor p64 = zeros({2, 3}, DType::f64);
    step(p64, zeros({2, 3}, DType::f64), zeros({2, 3}, DType::f64), zeros({2, 3}, DType::f64),
         zeros({2, 3}));
  });
  expect_error("adamw_ bf16 master", [&] {
    const Tensor pb = zeros({2, 3}, DType::bf16);
    step(pb, zeros({2, 3}, DType::bf16), m, v, zeros({2, 3}, DType::bf16));
  });
  expect_error("adamw_ i32 param", [&] {
    step(zeros({2, 3}, DType::i32), zeros({2, 3}, DType::i32), m, v);
  });
  expect_error("adamw_ expanded param", [&] { step(zeros({1, 3}).expand({2, 3}), g, m, v); });
  expect_error("adamw_ exp_avg aliasing param", [&] { step(p, g, p, v); });
  expect_error("adamw_ step 0", [&] { adamw_(p, g, m, v, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0); });
  expect_error("adamw_ beta1 1", [&] { adamw_(p, g, m, v, 1, 1e-3, 1.0, 0.999, 1e-8, 0.0); });
  expect_error("adamw_ infinite grad_scale", [&] {
    adamw_(p, g, m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, Tensor(), std::numeric_limits<double>::infinity());
  });
  expect_error("adamw_ under grad mode with a param that requires grad", [&] {
    const Tensor w = zeros({2, 3}).requires_grad_();
    step(w, g, m, v);
  });
  // Error messages name the op and both shapes.
  try {
    step(p, zeros({3, 2}), m, v);
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("adamw_") != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("[3, 2]") != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("[2, 3]") != std::string::npos, msg);
  }
}

// grad_scale's definition, bitwise on the sweep's device: the update with grad_scale s
// equals scale_(grad, s) followed by the update with 1, in every float dtype (16-bit: the
// scaled gradient rounded to 16 bits), with and without a master. `update(p, g, state,
// scale)` runs the op; state tensors are made by `make_state`.
void grad_scale_matches_scale_(
    const char* op, const std::function<Tensors(DType)>& make_state,
    const std::function<void(const Tensor&, const Tensor&, const Tensors&, double)>& update) {
  const Device dev = sweep_device();
  int checked = 0;
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    manual_seed(11);
    const Tensor p = (randn({300}) * 0.5).cast(dt).to(dev), g = (randn({300}) * 3.0).cast(dt).to(dev);
    const Tensors state = make_state(dt);
    std::vector<Tensor> a = {p.clone(), g.clone()}, b = {p.clone(), g.clone()};
    Tensors sa, sb;
    for (const Tensor& t : state) {
      sa.push_back(t.defined() ? t.to(dev).clone() : Tensor());
      sb.push_back(t.defined() ? t.to(dev).clone() : Tensor());
    }
    {
      NoGradGuard no_grad;
      update(a[0], a[1], sa, 0.37);
      scale_({b[1]}, 0.37);
      update(b[0], b[1], sb, 1.0);
    }
    const auto same = [&](const std::string& what, const Tensor& x, const Tensor& y) {
      expect_same_bits(fmt::format("{} grad_scale 0.37 in {}: {}, against scale_ then the update", op,
                                   dtype_name(dt), what),
                       x, y);
    };
    same("param", a[0], b[0]);
    for (size_t k = 0; k < sa.size(); ++k) {
      if (sa[k].defined()) same(fmt::format("state {}", k), sa[k], sb[k]);
    }
    ++checked;
  }
  if (checked != 4) report_failure(fmt::format("{}: {} of 4 dtypes checked", op, checked));
}

OpSweep adamw_sweep() {
  OpSweep s{OpId::adamw_, kFloats, kNonFloat, {}, {}};
  s.cases.push_back(adamw_case("[5, 7] t 1 (bias correction 1 - beta)", {5, 7}, {}, false));
  s.cases.push_back(adamw_case("[4, 6] t 10 betas (0.8, 0.99) eps 1e-6", {4, 6},
                               {10, 0.05, 0.8, 0.99, 1e-6, 0.01}, false));
  s.cases.push_back(adamw_case("[2, 3, 4] t 3 no weight decay", {2, 3, 4},
                               {3, 0.01, 0.9, 0.999, 1e-8, 0.0}, false));
  s.cases.push_back(adamw_case("0-d t 2", {}, {2}, false));
  s.cases.push_back(adamw_case("[0, 3] (empty)", {0, 3}, {}, false));
  s.cases.push_back(adamw_case("[4, 6] t 5 f32 master", {4, 6}, {5, 0.02}, true));
  // Clipping's coefficient applied in the update. A 16-bit run is checked against its f32
  // twin, which does not round the scaled gradient to 16 bits, so 16-bit dtypes take a
  // power of two here (exact); grad_scale_matches_scale_ checks the rounding bitwise.
  Case gs = adamw_case("[4, 6] t 3 grad_scale 0.37", {4, 6}, {3, 0.05, 0.9, 0.999, 1e-8, 0.1, 0.37},
                       false);
  gs.dtypes = {DType::f32, DType::f64};
  s.cases.push_back(std::move(gs));
  s.cases.push_back(adamw_case("[4, 6] t 2 grad_scale 0.25, master", {4, 6},
                               {2, 0.05, 0.9, 0.999, 1e-8, 0.1, 0.25}, true));
  // Over kUpdateGrain elements: the update runs in chunks on several threads.
  Case big = adamw_case("[130, 257] t 2 (parallel chunks)", {130, 257}, {2}, false);
  big.layouts = {Layout::contiguous, Layout::strided};
  s.cases.push_back(std::move(big));
  Case big_master = adamw_case("[130, 257] t 7 master (parallel chunks)", {130, 257}, {7}, true);
  big_master.layouts = {Layout::contiguous};
  s.cases.push_back(std::move(big_master));
  // Edge values: zero gradient and second moment (the denominator is eps), large values.
  Case edge = adamw_case("edges: zero grad and exp_avg_sq, large values", {6}, {1}, false);
  edge.args[0] = written(arg({6}, fixed({0, 1, -1, 300, -2, 0.5})));
  edge.args[1] = arg({6}, fixed({0, 0, 1e-3, -200, 4, 0}));
  edge.args[2] = state_arg({6}, fixed({0, 0.5, 0, 10, -1, 0}));
  edge.args[3] = state_arg({6}, fixed({0, 0, 0, 100, 0.25, 0}));
  s.cases.push_back(std::move(edge));
  s.extra = [] {
    adamw_errors();
    // exp_avg, exp_avg_sq, and for 16-bit params an f32 master.
    grad_scale_matches_scale_(
        "adamw_",
        [](DType dt) {
          const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
          const bool half = dt == DType::f16 || dt == DType::bf16;
          return Tensors{randn({300}).cast(st) * 0.1, rand({300}).cast(st) * 0.2,
                         half ? randn({300}) * 0.5 : Tensor()};
        },
        [](const Tensor& p, const Tensor& g, const Tensors& st, double scale) {
          adamw_(p, g, st[0], st[1], 4, 0.05, 0.9, 0.999, 1e-8, 0.1, st[2], scale);
        });
    inplace_effects(
        [](const Tensors& in) {
          adamw_(in[0], in[1], in[2], in[3], 1, 0.1, 0.9, 0.999, 1e-8, 0.1, in[4]);
        },
        5, {0, 2, 3, 4}, "adamw_");
  };
  return s;
}

// ---- adamw8bit_ ---------------------------------------------------------------------------
// Exact: the reference emulates the kernel's arithmetic in the state type operation by
// operation (ref::adamw8bit) on maps decoded independently from their bit patterns, and
// finds codes by a linear scan of midpoints; every output must match bitwise.

// Inputs: param, grad, exp_avg, exp_avg_sq (u8 codes), exp_avg_absmax, exp_avg_sq_absmax
// [, master]. Outputs: the same without grad.
Case adamw8bit_case(std::string label, Shape shape, AdamSetup h, bool master) {
  Case c;
  c.label = std::move(label);
  const int64_t blocks = (numel_of(shape) + 255) / 256;
  auto codes = [&] { return written(index_arg(shape, 0, 255, DType::u8)); };
  c.args = {written(arg(shape)), arg(shape), codes(), codes(),
            state_arg({blocks}, uniform(0.01, 2)), state_arg({blocks}, uniform(0.01, 2))};
  if (master) {
    c.args.push_back(master_arg(shape));
    c.dtypes = {DType::f32, DType::f16, DType::bf16};
    c.prepare = [](Arrays& in, DType) { in[0] = in[6]; };
  }
  c.ref = [h](const Arrays& in, DType dt) {
    return ref::adamw8bit(in, h.t, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, dt);
  };
  c.exact = true;
  c.layouts = {Layout::contiguous};  // the op takes contiguous operands only
  c.attrs = op_attrs::adamw(h.t, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay);
  c.out_dtype = [](DType dt, size_t k) {
    return k == 0 ? dt : k <= 2 ? DType::u8 : k <= 4 ? state_dtype(dt) : DType::f32;
  };
  return c;
}

void adamw8bit_errors() {
  const Tensor p = zeros({2, 300}), g = zeros({2, 300});
  const Tensor c1 = zeros({2, 300}, DType::u8), c2 = zeros({2, 300}, DType::u8);
  const Tensor a1 = zeros({3}), a2 = zeros({3});
  auto step = [](const Tensor& p, const Tensor& g, const Tensor& c1, const Tensor& c2,
                 const Tensor& a1, const Tensor& a2, const Tensor& master = Tensor()) {
    adamw8bit_(p, g, c1, c2, a1, a2, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, master);
  };
  expect_error("adamw8bit_ f32 codes", [&] { step(p, g, zeros({2, 300}), c2, a1, a2); });
  expect_error("adamw8bit_ codes of another shape",
               [&] { step(p, g, c1, zeros({300, 2}, DType::u8), a1, a2); });
  expect_error("adamw8bit_ absmax [2] for 600 elements (3 blocks)",
               [&] { step(p, g, c1, c2, zeros({2}), a2); });
  expect_error("adamw8bit_ f64 absmax for an f32 param",
               [&] { step(p, g, c1, c2, a1, zeros({3}, DType::f64)); });
  expect_error("adamw8bit_ transposed param", [&] {
    step(zeros({300, 2}).t(), zeros({300, 2}).t(), c1, c2, a1, a2);
  });
  expect_error("adamw8bit_ strided codes", [&] {
    step(p, g, zeros({2, 600}, DType::u8).narrow(1, 0, 300), c2, a1, a2);
  });
  expect_error("adamw8bit_ codes aliasing each other", [&] { step(p, g, c1, c1, a1, a2); });
  expect_error("adamw8bit_ bf16 master", [&] {
    step(zeros({2, 300}, DType::bf16), zeros({2, 300}, DType::bf16), c1, c2, a1, a2,
         zeros({2, 300}, DType::bf16));
  });
  expect_error("adamw8bit_ i32 param", [&] {
    step(zeros({2, 300}, DType::i32), zeros({2, 300}, DType::i32), c1, c2, a1, a2);
  });
  expect_error("adamw8bit_ step 0",
               [&] { adamw8bit_(p, g, c1, c2, a1, a2, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0); });
  // Error messages name the op, the operand and the expected shape.
  try {
    step(p, g, c1, c2, zeros({2}), a2);
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("adamw8bit_: exp_avg_absmax must be f32 [3]") != std::string::npos,
                  msg);
  }
}

void adamw8bit_grad_scale() {
  // Codes and block scales (300 elements: 2 blocks), and for 16-bit params an f32 master.
  grad_scale_matches_scale_(
      "adamw8bit_",
      [](DType dt) {
        const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
        const bool half = dt == DType::f16 || dt == DType::bf16;
        const Tensor c1 = (rand({300}) * 255.0).cast(DType::u8), c2 = (rand({300}) * 255.0).cast(DType::u8);
        return Tensors{c1, c2, (rand({2}) + 0.1).cast(st), (rand({2}) * 0.1 + 0.01).cast(st),
                       half ? randn({300}) * 0.5 : Tensor()};
      },
      [](const Tensor& p, const Tensor& g, const Tensors& st, double scale) {
        adamw8bit_(p, g, st[0], st[1], st[2], st[3], 4, 0.05, 0.9, 0.999, 1e-8, 0.1, st[4], scale);
      });
}

OpSweep adamw8bit_sweep() {
  OpSweep s{OpId::adamw8bit_, kFloats, kNonFloat, {}, {}};
  s.cases.push_back(adamw8bit_case("[5, 7] t 1 (one short block)", {5, 7}, {}, false));
  s.cases.push_back(adamw8bit_case("[3, 300] t 10 betas (0.8, 0.99) eps 1e-6 (4 blocks)",
                                   {3, 300}, {10, 0.05, 0.8, 0.99, 1e-6, 0.01}, false));
  s.cases.push_back(adamw8bit_case("[512] t 3 no weight decay (2 whole blocks)", {512},
                                   {3, 0.01, 0.9, 0.999, 1e-8, 0.0}, false));
  s.cases.push_back(adamw8bit_case("0-d t 2", {}, {2}, false));
  s.cases.push_back(adamw8bit_case("[0, 3] (empty: no blocks)", {0, 3}, {}, false));
  s.cases.push_back(adamw8bit_case("[2, 300] t 5 f32 master", {2, 300}, {5, 0.02}, true));
  // Over kUpdateGrain elements: threads take runs of blocks.
  s.cases.push_back(adamw8bit_case("[130, 257] t 2 (parallel blocks)", {130, 257}, {2}, false));
  s.cases.push_back(
      adamw8bit_case("[130, 257] t 7 master (parallel blocks)", {130, 257}, {7}, true));
  // Edges: a zero gradient on zero moments (the block's absmax becomes 0, its codes those of
  // 0), large values, and the extreme codes.
  Case edge = adamw8bit_case("edges: an all-zero block, large values", {300}, {1}, false);
  std::vector<double> p(300, 0.0), g(300, 0.0), c1(300, 127), c2(300, 0);
  for (int i = 256; i < 300; ++i) {
    p[i] = (i % 2 ? 300 : -2);
    g[i] = (i % 3 == 0 ? 0 : (i % 2 ? -200 : 1e-3));
    c1[i] = i % 2 ? 255 : 0;
    c2[i] = i % 2 ? 255 : 1;
  }
  edge.args[0] = written(arg({300}, fixed(p)));
  edge.args[1] = arg({300}, fixed(g));
  edge.args[2] = written(fixed_arg({300}, c1, DType::u8));
  edge.args[3] = written(fixed_arg({300}, c2, DType::u8));
  s.cases.push_back(std::move(edge));
  s.extra = [] {
    adamw8bit_errors();
    adamw8bit_grad_scale();
  };
  return s;
}

// ---- adamw8bit_segments_ ------------------------------------------------------------------
// Exact, as adamw8bit_: ref::adamw8bit_segments emulates each pass. The param's elements lie
// in segments of blocks of a larger tensor (scales of `blocks` blocks, some not touched).

// Inputs: param, grad, exp_avg, exp_avg_sq (u8), exp_avg_absmax, exp_avg_sq_absmax, master
// (or absent), segments (i64 [S, 2]: end, block), new_absmax, new_sq_absmax. Outputs (the
// written inputs): pass 1 param[, master], new_absmax, new_sq_absmax; pass 2 the codes and
// the scales.
Case adamw8bit_segments_case(std::string label, Shape shape, int64_t blocks,
                             std::vector<double> segments, int pass, AdamSetup h, bool master) {
  Case c;
  c.label = std::move(label);
  auto codes = [&] {
    Arg a = index_arg(shape, 0, 255, DType::u8);
    return pass == 2 ? written(a) : a;
  };
  auto scales = [&](bool out) {
    Arg a = state_arg({blocks}, uniform(0.01, 2));
    a.expandable = !out;
    return a;
  };
  Arg w = master ? master_arg(shape) : absent_arg();
  w.expandable = pass == 2;  // pass 2 does not write it
  const int64_t count = static_cast<int64_t>(segments.size()) / 2;
  c.args = {pass == 1 ? written(arg(shape)) : arg(shape),
            arg(shape),
            codes(),
            codes(),
            scales(pass == 2),
            scales(pass == 2),
            w,
            fixed_arg({count, 2}, std::move(segments), DType::i64),
            scales(pass == 1),
            scales(pass == 1)};
  if (master) {
    c.dtypes = {DType::f32, DType::f16, DType::bf16};
    c.prepare = [](Arrays& in, DType) { in[0] = in[6]; };
  }
  c.ref = [h, pass](const Arrays& in, DType dt) {
    return ref::adamw8bit_segments(in, pass, h.t, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                                   dt);
  };
  c.exact = true;
  c.layouts = {Layout::contiguous};  // the op takes contiguous operands only
  c.attrs = op_attrs::adamw(h.t, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay);
  c.attrs.k = pass;
  c.out_dtype = [pass, master](DType dt, size_t k) {
    if (pass == 2) return k < 2 ? DType::u8 : state_dtype(dt);
    return k == 0 ? dt : master && k == 1 ? DType::f32 : state_dtype(dt);
  };
  return c;
}

void adamw8bit_segments_errors() {
  const Tensor p = zeros({300}), g = zeros({300});
  const Tensor c1 = zeros({300}, DType::u8), c2 = zeros({300}, DType::u8);
  const Tensor a1 = zeros({4}), a2 = zeros({4}), n1 = zeros({4}), n2 = zeros({4});
  auto step = [&](const std::vector<double>& seg, int pass = 1, const Tensor& new1 = Tensor()) {
    const Tensor s = Tensor::from_vector<double>(seg, {static_cast<int64_t>(seg.size()) / 2, 2})
                         .cast(DType::i64);
    adamw8bit_segments_(p, g, c1, c2, a1, a2, Tensor(), s, new1.defined() ? new1 : n1, n2, pass,
                        1, 1e-3, 0.9, 0.999, 1e-8, 0.0);
  };
  expect_error("adamw8bit_segments_ a segment of 257 elements", [&] { step({257, 0, 300, 1}); });
  expect_error("adamw8bit_segments_ segments ending short of the param",
               [&] { step({100, 0, 200, 1}); });
  expect_error("adamw8bit_segments_ blocks not increasing", [&] { step({100, 1, 300, 1}); });
  expect_error("adamw8bit_segments_ a block past the scales", [&] { step({100, 0, 300, 4}); });
  expect_error("adamw8bit_segments_ pass 3", [&] { step({100, 0, 300, 1}, 3); });
  expect_error("adamw8bit_segments_ new scales of another length",
               [&] { step({100, 0, 300, 1}, 1, zeros({3})); });
  bool threw = false;
  try {
    step({100, 0, 50, 1});
  } catch (const Error& e) {
    threw = true;
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("adamw8bit_segments_: segment 1 ends at element 50 after the "
                           "previous one's end 100") != std::string::npos,
                  msg);
  }
  CHECK(threw);
}

OpSweep adamw8bit_segments_sweep() {
  OpSweep s{OpId::adamw8bit_segments_, kFloats, kNonFloat, {}, {}};
  // 300 elements in blocks 0, 1 and 3 of 5 (64, 64 and 172 of their elements).
  const std::vector<double> three = {64, 0, 128, 1, 300, 3};
  for (int pass : {1, 2}) {
    const std::string p = fmt::format("pass {}", pass);
    s.cases.push_back(adamw8bit_segments_case(p + " [5, 60] in 3 segments of 5 blocks", {5, 60}, 5,
                                              three, pass, {}, false));
    s.cases.push_back(adamw8bit_segments_case(
        p + " [300] t 10 betas (0.8, 0.99) eps 1e-6, master", {300}, 5, three, pass,
        {10, 0.05, 0.8, 0.99, 1e-6, 0.01}, true));
    s.cases.push_back(adamw8bit_segments_case(p + " one element in one of 2 blocks", {1}, 2,
                                              {1, 1}, pass, {3}, false));
    s.cases.push_back(adamw8bit_segments_case(p + " [0] (no segments)", {0}, 2, {}, pass, {},
                                              false));
  }
  // Many segments: threads take runs of them (runs of 48 of every block of 256, 200 blocks:
  // more than one chunk of kUpdateGrain / 256 = 32 segments).
  std::vector<double> many;
  for (int64_t b = 0; b < 200; ++b) many.insert(many.end(), {double(48 * (b + 1)), double(b)});
  for (int pass : {1, 2}) {
    s.cases.push_back(adamw8bit_segments_case(fmt::format("pass {} [200, 48] in 200 segments", pass),
                                              {200, 48}, 200, many, pass, {2}, false));
  }
  s.extra = [] { adamw8bit_segments_errors(); };
  return s;
}

// ---- sgd_ ---------------------------------------------------------------------------------

struct SgdSetup {
  int64_t t = 1;
  double lr = 0.1, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false;
  double grad_scale = 1.0;  // the update reads grad * grad_scale (clipping)
};

// Inputs: param, grad, momentum_buffer (absent without momentum)[, master]. Outputs: param
// [, momentum_buffer][, master].
Case sgd_case(std::string label, Shape shape, SgdSetup h, bool master) {
  Case c;
  c.label = std::move(label);
  const bool buffer = h.momentum != 0;
  c.args = {written(arg(shape)), arg(shape),
            buffer ? state_arg(shape, normal(0.5)) : absent_arg()};
  if (master) {
    c.args.push_back(master_arg(shape));
    c.dtypes = {DType::f32, DType::f16, DType::bf16};
    c.prepare = [](Arrays& in, DType) { in[0] = in[3]; };
  }
  auto outputs = [buffer, master](const NdArray& p, const NdArray& buf) {
    Arrays out = {p};
    if (buffer) out.push_back(buf);
    if (master) out.push_back(p);
    return out;
  };
  c.ref = [h, master, outputs](const Arrays& in, DType dt) {
    const Arrays r = ref::sgd(master ? in[3] : in[0], scaled(in[1], h.grad_scale, dt), in[2], h.t,
                              h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov);
    return outputs(r[0], r[1]);
  };
  // d = g + wd x; buf = momentum buf + (1 - dampening) d; d' = d + momentum buf (nesterov)
  // or buf; param = x - lr d': each magnitude is the sum of its terms' magnitudes.
  c.mag = [h, master, buffer, outputs](const Arrays& in, DType) {
    const NdArray& x = master ? in[3] : in[0];
    NdArray mp = x, mb = x;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double d =
          std::fabs(in[1].data[i] * h.grad_scale) + h.weight_decay * std::fabs(x.data[i]);
      double step = d;
      if (buffer) {
        mb.data[i] = h.t == 1 ? d
                              : h.momentum * std::fabs(in[2].data[i]) + (1 - h.dampening) * d;
        step = h.nesterov ? d + h.momentum * mb.data[i] : mb.data[i];
      }
      mp.data[i] = std::fabs(x.data[i]) + h.lr * step;
    }
    return outputs(mp, mb);
  };
  c.attrs = op_attrs::sgd(h.t, h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov);
  c.attrs.grad_scale = h.grad_scale;
  c.out_dtype = [buffer](DType dt, size_t k) {
    if (k == 0) return dt;
    return k == 1 && buffer ? state_dtype(dt) : DType::f32;
  };
  return c;
}

void sgd_errors() {
  const Tensor p = zeros({2, 3}), g = zeros({2, 3}), b = zeros({2, 3});
  expect_error("sgd_ momentum 0.9 without a buffer",
               [&] { sgd_(p, g, Tensor(), 1, 0.1, 0.9, 0, 0, false); });
  expect_error("sgd_ a buffer with momentum 0", [&] { sgd_(p, g, b, 1, 0.1, 0, 0, 0, false); });
  expect_error("sgd_ nesterov with dampening",
               [&] { sgd_(p, g, b, 2, 0.1, 0.9, 0.1, 0, true); });
  expect_error("sgd_ buffer [3, 2] for param [2, 3]",
               [&] { sgd_(p, g, zeros({3, 2}), 2, 0.1, 0.9, 0, 0, false); });
  expect_error("sgd_ f16 grad for an f32 param",
               [&] { sgd_(p, zeros({2, 3}, DType::f16), Tensor(), 1, 0.1, 0, 0, 0, false); });
  expect_error("sgd_ f64 master", [&] {
    sgd_(zeros({2, 3}, DType::bf16), zeros({2, 3}, DType::bf16), Tensor(), 1, 0.1, 0, 0, 0,
         false, zeros({2, 3}, DType::f64));
  });
  expect_error("sgd_ infinite lr", [&] {
    sgd_(p, g, Tensor(), 1, std::numeric_limits<double>::infinity(), 0, 0, 0, false);
  });
  expect_error("sgd_ buffer aliasing grad", [&] { sgd_(p, g, g, 2, 0.1, 0.9, 0, 0, false); });
  expect_error("sgd_ NaN grad_scale", [&] {
    sgd_(p, g, Tensor(), 1, 0.1, 0, 0, 0, false, Tensor(), std::nan(""));
  });
}

OpSweep sgd_sweep() {
  OpSweep s{OpId::sgd_, kFloats, kNonFloat, {}, {}};
  s.cases.push_back(sgd_case("[5, 7] plain", {5, 7}, {}, false));
  s.cases.push_back(sgd_case("[5, 7] weight decay 0.1", {5, 7}, {1, 0.1, 0, 0, 0.1}, false));
  s.cases.push_back(sgd_case("[4, 6] momentum t 1 (buffer seeded with d)", {4, 6},
                             {1, 0.1, 0.9, 0.1, 0.01}, false));
  s.cases.push_back(sgd_case("[4, 6] momentum 0.9 dampening 0.3 t 4", {4, 6},
                             {4, 0.05, 0.9, 0.3, 0.01}, false));
  s.cases.push_back(sgd_case("[2, 3, 4] nesterov t 3", {2, 3, 4}, {3, 0.1, 0.8, 0, 0.05, true},
                             false));
  s.cases.push_back(sgd_case("[4, 6] nesterov t 1, master", {4, 6}, {1, 0.1, 0.9, 0, 0.01, true},
                             true));
  s.cases.push_back(sgd_case("[4, 6] plain, master", {4, 6}, {2, 0.3}, true));
  // As adamw_'s grad_scale cases.
  Case gs = sgd_case("[4, 6] nesterov t 2 grad_scale 0.21", {4, 6}, {2, 0.1, 0.9, 0, 0.01, true, 0.21},
                     false);
  gs.dtypes = {DType::f32, DType::f64};
  s.cases.push_back(std::move(gs));
  s.cases.push_back(sgd_case("[4, 6] grad_scale 0.5, master", {4, 6}, {2, 0.3, 0, 0, 0, false, 0.5},
                             true));
  s.cases.push_back(sgd_case("0-d momentum t 2", {}, {2, 0.1, 0.9}, false));
  s.cases.push_back(sgd_case("[0, 3] (empty)", {0, 3}, {2, 0.1, 0.9}, false));
  Case big = sgd_case("[130, 257] momentum t 2 (parallel chunks)", {130, 257},
                      {2, 0.1, 0.9, 0.1, 0.01}, false);
  big.layouts = {Layout::contiguous, Layout::strided};
  s.cases.push_back(std::move(big));
  // Without weight decay an infinite param stays infinite (0 * inf would make it NaN).
  Case edge = sgd_case("edges: inf param without weight decay", {4}, {1, 0.5}, false);
  const double inf = std::numeric_limits<double>::infinity();
  edge.args[0] = written(arg({4}, fixed({inf, -inf, 0, 2})));
  edge.args[1] = arg({4}, fixed({1, 1, 0, -4}));
  s.cases.push_back(std::move(edge));
  s.extra = [] {
    sgd_errors();
    grad_scale_matches_scale_(
        "sgd_",
        [](DType dt) {
          const bool half = dt == DType::f16 || dt == DType::bf16;
          return Tensors{randn({300}).cast(dt == DType::f64 ? DType::f64 : DType::f32),
                         half ? randn({300}) * 0.5 : Tensor()};
        },
        [](const Tensor& p, const Tensor& g, const Tensors& st, double scale) {
          sgd_(p, g, st[0], 3, 0.1, 0.9, 0, 0.01, true, st[1], scale);
        });
    inplace_effects(
        [](const Tensors& in) { sgd_(in[0], in[1], in[2], 2, 0.1, 0.9, 0.1, 0.01, false, in[3]); },
        4, {0, 2, 3}, "sgd_");
  };
  return s;
}

}  // namespace

std::vector<OpSweep> optim_sweeps() {
  std::vector<OpSweep> out = {adamw_sweep(), adamw8bit_sweep(), adamw8bit_segments_sweep(), sgd_sweep()};
  for (OpSweep& s : optim_pass_sweeps()) out.push_back(std::move(s));
  return out;
}

}  // namespace tessera::sweep
