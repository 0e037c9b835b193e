// The records of the fused optimizer updates adamw_, adamw8bit_[segments_] and sgd_. They write
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

Arg written(Arg a) {
  a.expandable = false;  // several elements sharing one location cannot each be updated
  return a;
}

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

// An update bumps the version of what it wrote and leaves the gaps of strided operands alone.
void inplace_effects(const std::function<void(const Tensors&)>& update, size_t n_inputs,
                     std::vector<size_t> written_inputs, const char* op) {
  Tensors in;
  for (size_t i = 0; i < n_inputs; ++i) {
    in.push_back(build(NdArray::zeros({3, 4}, 0.5), DType::f32, Layout::strided, i).tensor);
  }
  std::vector<uint64_t> before;
  for (const Tensor& t : in) before.push_back(t.storage()->version());
  {
    NoGradGuard no_grad;
    update(in);
  }
  for (size_t i = 0; i < in.size(); ++i) {
    const bool is_written =
        std::find(written_inputs.begin(), written_inputs.end(), i) != written_inputs.end();
    CHECK_MESSAGE(in[i].storage()->version() == before[i] + (is_written ? 1 : 0), op,
                  ": input ", i, " version ", in[i].storage()->version(), " (was ", before[i],
                  ")");
    int64_t finite = 0;
    for (int64_t k = 0; k < in[i].storage()->nbytes() / 4; ++k) {
      finite += !std::isnan(read_storage(in[i], k));
    }
    CHECK_MESSAGE(finite == 12, op, ": input ", i, " has ", finite,
                  " non-NaN storage elements: the update wrote into its gaps");
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

std::vector<OpSweep> optim_sweeps() {
  return {adamw_sweep(),           adamw8bit_sweep(),      adamw8bit_segments_sweep(),
          sgd_sweep(),             adafactor_stats_sweep(), adafactor_norm_sweep(),
          adafactor_apply_sweep(), scale_sweep()};
}

}  // namespace tessera::sweep
