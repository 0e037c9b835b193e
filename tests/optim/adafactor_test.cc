// Adafactor (optim/adafactor.h) in each mode against an f64 reference written here from the
// published code of that reference, element by element on plain arrays (Hugging Face's /
// fairseq's Adafactor for hf, torch.optim.Adafactor of PyTorch 2.5 for torch,
// optax.adafactor for optax): 6 steps of random gradients, parameters and every state tensor
// within 1e-12. Then a resume from state_dict() continues bitwise, the state's size is the
// factored one, and bad options are errors.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "optim/adafactor.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tests/testing.h"

namespace tessera::optim {
namespace {

using testing::contains;
using testing::error_of;

// ---- an N-d array of doubles --------------------------------------------------------------
struct Nd {
  Shape shape;
  std::vector<double> v;
};

std::vector<int64_t> index_of(int64_t flat, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (int64_t d = static_cast<int64_t>(s.size()) - 1; d >= 0; --d) {
    idx[d] = flat % s[d];
    flat /= s[d];
  }
  return idx;
}
int64_t flat_of(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t f = 0;
  for (size_t d = 0; d < s.size(); ++d) f = f * s[d] + idx[d];
  return f;
}
std::vector<int64_t> drop(std::vector<int64_t> idx, int64_t dim) {
  idx.erase(idx.begin() + dim);
  return idx;
}
// The mean over `dim`.
Nd mean_over(const Nd& x, int64_t dim) {
  Nd out{x.shape, {}};
  out.shape.erase(out.shape.begin() + dim);
  out.v.assign(static_cast<size_t>(numel_of(out.shape)), 0.0);
  for (int64_t i = 0; i < static_cast<int64_t>(x.v.size()); ++i) {
    out.v[flat_of(drop(index_of(i, x.shape), dim), out.shape)] += x.v[i];
  }
  for (double& e : out.v) e /= static_cast<double>(x.shape[dim]);
  return out;
}
double rms(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e * e;
  return std::sqrt(s / static_cast<double>(x.size()));
}

// ---- the references ------------------------------------------------------------------------
struct RefState {
  int64_t t = 0;
  Nd row, col, full, m;  // second-moment rows / columns (factored) or whole; first moment
};

// (rows, cols) as each reference picks them, or (-1, -1).
std::pair<int64_t, int64_t> reference_dims(AdafactorMode mode, const Shape& s, int64_t min_dim) {
  const int64_t n = static_cast<int64_t>(s.size());
  if (n < 2) return {-1, -1};
  if (mode != AdafactorMode::optax) return {n - 2, n - 1};
  std::vector<int64_t> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] < s[b]; });
  if (s[order[n - 2]] < min_dim) return {-1, -1};
  return {order[n - 2], order[n - 1]};  // optax's d1 (kept by v_row) and d0 (averaged away)
}

void reference_step(const AdafactorOptions& o, double lr, double wd, Nd& p, const Nd& g,
                    RefState& st) {
  const size_t N = p.v.size();
  const double t = static_cast<double>(++st.t);
  const auto [r, c] = reference_dims(o.mode, p.shape, o.min_dim_size_to_factor);
  const bool torch = o.mode == AdafactorMode::torch;
  if (st.t == 1) {
    if (r >= 0) {
      st.row = mean_over(Nd{p.shape, std::vector<double>(N, 0.0)}, c);
      st.col = mean_over(Nd{p.shape, std::vector<double>(N, 0.0)}, r);
    } else {
      st.full = Nd{p.shape, std::vector<double>(N, 0.0)};
    }
    st.m = Nd{p.shape, std::vector<double>(N, 0.0)};
  }
  const double scale = std::max(o.eps2, rms(p.v));
  double alpha = 0;
  if (o.mode == AdafactorMode::hf) {
    const double rel = o.relative_step ? std::min(1e-2, 1.0 / std::sqrt(t)) : lr;
    alpha = o.scale_parameter ? scale * rel : rel;
  } else if (torch) {
    alpha = scale * std::min(lr, 1.0 / std::sqrt(t));
    if (wd != 0) {
      for (double& e : p.v) e *= 1.0 - lr * wd;  // torch decays before the update
    }
  } else {
    alpha = o.scale_parameter ? lr * scale : lr;
  }
  const double beta2t = 1.0 - std::pow(t, -o.decay_rate);
  auto blend = [&](double v, double x) {
    return torch ? v + (1.0 - beta2t) * (x - v) : beta2t * v + (1.0 - beta2t) * x;
  };
  Nd u{p.shape, std::vector<double>(N)};
  for (size_t i = 0; i < N; ++i) u.v[i] = g.v[i] * g.v[i] + (torch ? 0.0 : o.eps1);
  std::vector<double> upd(N);
  if (r >= 0) {
    const Nd rm = mean_over(u, c), cm = mean_over(u, r);
    for (size_t i = 0; i < rm.v.size(); ++i) st.row.v[i] = blend(st.row.v[i], rm.v[i]);
    for (size_t i = 0; i < cm.v.size(); ++i) st.col.v[i] = blend(st.col.v[i], cm.v[i]);
    const int64_t r_in_row = r < c ? r : r - 1;
    const Nd row_mean = mean_over(st.row, r_in_row);  // per the row stats' other dims
    for (int64_t i = 0; i < static_cast<int64_t>(N); ++i) {
      const std::vector<int64_t> idx = index_of(i, p.shape);
      const std::vector<int64_t> ri = drop(idx, c), ci = drop(idx, r);
      const double R = st.row.v[flat_of(ri, st.row.shape)];
      const double C = st.col.v[flat_of(ci, st.col.shape)];
      const double Rm = row_mean.v[flat_of(drop(ri, r_in_row), row_mean.shape)];
      if (torch) {
        const double v = R * C / std::max(Rm, o.eps1);
        upd[i] = g.v[i] / std::sqrt(std::max(v, o.eps1 * o.eps1));
      } else {
        upd[i] = g.v[i] / std::sqrt(R / Rm) / std::sqrt(C);
      }
    }
  } else {
    for (size_t i = 0; i < N; ++i) {
      st.full.v[i] = blend(st.full.v[i], u.v[i]);
      upd[i] = torch ? g.v[i] / std::sqrt(std::max(st.full.v[i], o.eps1 * o.eps1))
                     : g.v[i] / std::sqrt(st.full.v[i]);
    }
  }
  const double denom = std::max(1.0, rms(upd) / o.clip_threshold);
  for (size_t i = 0; i < N; ++i) {
    double step = upd[i] * alpha / denom;
    if (!torch && o.beta1 > 0) {
      st.m.v[i] = o.beta1 * st.m.v[i] + (1.0 - o.beta1) * step;
      step = st.m.v[i];
    }
    if (o.mode == AdafactorMode::hf) {
      p.v[i] = p.v[i] - wd * alpha * p.v[i] - step;
    } else if (torch) {
      p.v[i] -= step;
    } else {
      p.v[i] -= step + wd * p.v[i];
    }
  }
}

Nd random_nd(const Shape& shape, Generator& gen, double scale) {
  const Tensor t = randn(shape, DType::f64, kCPU, &gen) * scale;
  return Nd{shape, t.to_vector<double>()};
}

Tensor tensor_of(const Nd& x) { return Tensor::from_vector<double>(x.v, x.shape); }

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

TEST_CASE("Adafactor equals each reference's published update in f64") {
  struct Variant {
    AdafactorMode mode;
    double lr, wd, beta1;
    bool relative_step, scale_parameter;
  };
  const std::vector<Variant> variants = {
      {AdafactorMode::hf, 0.0, 0.0, 0.0, true, true},     // the paper's defaults
      {AdafactorMode::hf, 3e-2, 0.1, 0.9, false, false},  // explicit lr, momentum, decay
      {AdafactorMode::torch, 1e-2, 0.0, 0.0, false, true},
      {AdafactorMode::torch, 5e-2, 0.1, 0.0, false, true},
      {AdafactorMode::optax, 1e-2, 0.0, 0.0, false, true},
      {AdafactorMode::optax, 3e-2, 0.1, 0.9, false, false},
  };
  // Factored over the last two dims (and for optax the two largest: [6, 3, 5] factors dims
  // 2 and 0), a vector kept whole.
  const std::vector<Shape> shapes = {{5, 7}, {2, 3, 4}, {6, 3, 5}, {9}};
  int runs = 0;
  for (const Variant& var : variants) {
    for (const Shape& shape : shapes) {
      CAPTURE(std::string(adafactor_mode_name(var.mode)));
      CAPTURE(shape_str(shape));
      CAPTURE(var.lr);
      AdafactorOptions o;
      o.mode = var.mode;
      o.lr = var.lr;
      o.weight_decay = var.wd;
      o.beta1 = var.beta1;
      o.relative_step = var.relative_step;
      o.scale_parameter = var.scale_parameter;
      // torch's eps1 defaults to the dtype's epsilon; optax factors dims >= 3 here (its
      // default is 128).
      if (var.mode == AdafactorMode::torch) o.eps1 = std::numeric_limits<double>::epsilon();
      o.min_dim_size_to_factor = 3;
      Generator gen(11);
      Nd ref = random_nd(shape, gen, 0.5);
      Tensor p = tensor_of(ref).requires_grad_();
      Adafactor opt({p}, o);
      RefState st;
      for (int step = 0; step < 6; ++step) {
        const Nd g = random_nd(shape, gen, step == 3 ? 50.0 : 0.1);  // step 3 clips
        reference_step(o, var.lr, var.wd, ref, g, st);
        p.set_grad(tensor_of(g));
        opt.step();
      }
      CHECK(max_diff(p.to_vector<double>(), ref.v) <= 1e-12);
      const auto& s = opt.state(0);
      const auto [r, c] = opt.factored_dims(shape);
      CHECK(r == reference_dims(o.mode, shape, 3).first);
      if (r >= 0) {
        CHECK(max_diff(s.at("exp_avg_sq_row").to_vector<double>(), st.row.v) <= 1e-12);
        CHECK(max_diff(s.at("exp_avg_sq_col").to_vector<double>(), st.col.v) <= 1e-12);
      } else {
        CHECK(max_diff(s.at("exp_avg_sq").to_vector<double>(), st.full.v) <= 1e-12);
      }
      if (var.beta1 > 0) CHECK(max_diff(s.at("exp_avg").to_vector<double>(), st.m.v) <= 1e-12);
      ++runs;
    }
  }
  CHECK(runs == 6 * 4);
}

TEST_CASE("Adafactor's fused passes give the ops' update (f32 and f64)") {
  // A contiguous f32/f64 matrix on the CPU takes the fused passes (adafactor_stats_, _norm_,
  // _apply_); with fused = false, or held as a transposed view (not contiguous), the ops.
  // They differ only in the order of the sums: after 6 steps within 1e-13 (f64) and 2e-6
  // (f32) relative to the parameter's largest value.
  struct Variant {
    AdafactorMode mode;
    double wd, beta1;
  };
  int runs = 0;
  for (const Variant& var : {Variant{AdafactorMode::hf, 0.1, 0.9}, Variant{AdafactorMode::torch, 0.1, 0.0},
                             Variant{AdafactorMode::optax, 0.1, 0.5}}) {
    for (DType dt : {DType::f32, DType::f64}) {
      CAPTURE(std::string(adafactor_mode_name(var.mode)));
      CAPTURE(dt);
      AdafactorOptions o;
      o.mode = var.mode;
      o.lr = 1e-2;
      o.relative_step = false;
      o.weight_decay = var.wd;
      o.beta1 = var.beta1;
      o.min_dim_size_to_factor = 3;
      manual_seed(5);
      const Tensor init = randn({24, 40}, dt);  // (wide: optax factors it rows first too)
      Tensor fused = init.clone();
      Tensor transposed = init.t().contiguous().t();  // [24, 40], column-major
      Tensor unfused = init.clone();
      REQUIRE_FALSE(transposed.is_contiguous());
      AdafactorOptions no_fusion = o;
      no_fusion.fused = false;
      Adafactor a({fused}, o), b({transposed}, o), c({unfused}, no_fusion);
      for (int step = 0; step < 6; ++step) {
        const Tensor g = randn({24, 40}, dt) * (step == 3 ? 50.0 : 0.1);
        for (Tensor* p : {&fused, &transposed, &unfused}) p->set_grad(g);
        a.step();
        b.step();
        c.step();
      }
      const std::vector<double> x = fused.to_vector<double>();
      for (const Tensor* ops : {&transposed, &unfused}) {
        const std::vector<double> y = ops->contiguous().to_vector<double>();
        double worst = 0, scale = 0;
        for (size_t i = 0; i < x.size(); ++i) {
          worst = std::max(worst, std::abs(x[i] - y[i]));
          scale = std::max(scale, std::abs(y[i]));
        }
        MESSAGE(fmt::format("{} {}: max |fused - ops| / max |p| {:.3g}",
                            adafactor_mode_name(var.mode), dt, worst / scale));
        CHECK(worst > 0);  // (the two paths did run: their sums differ in order)
        CHECK(worst <= (dt == DType::f64 ? 1e-13 : 2e-6) * scale);
      }
      // The two op paths are the same ops on the same values.
      CHECK(transposed.contiguous().to_vector<double>() == unfused.to_vector<double>());
      ++runs;
    }
  }
  CHECK(runs == 6);
}

TEST_CASE("Adafactor's fused passes give the same bits on 1 and 2 threads") {
  // A [600, 512] matrix: its sums run in two chunks of rows (set by the shape), merged in
  // order, however many threads run them.
  std::vector<std::vector<double>> out;
  const int saved = cpu::num_threads();
  for (int threads : {1, 2}) {
    cpu::set_num_threads(threads);
    manual_seed(9);
    Tensor p = randn({600, 512});
    Adafactor opt({p}, {.mode = AdafactorMode::hf, .lr = 1e-2, .relative_step = false,
                        .beta1 = 0.9, .weight_decay = 0.1});
    for (int step = 0; step < 3; ++step) {
      p.set_grad(randn({600, 512}) * 0.1);
      opt.step();
    }
    out.push_back(p.to_vector<double>());
  }
  cpu::set_num_threads(saved);
  CHECK(out[0] == out[1]);
}

TEST_CASE("Adafactor: the factored state's size, a bitwise resume, and errors") {
  // A [64, 48] matrix keeps 64 + 48 numbers (4 (m + n) bytes in f32), a vector all of its own.
  Tensor w = zeros({64, 48}).requires_grad_(), b = zeros({48}).requires_grad_();
  Adafactor opt({w, b}, {.mode = AdafactorMode::hf});
  w.set_grad(full({64, 48}, 0.5));
  b.set_grad(full({48}, 0.5));
  opt.step();
  CHECK(opt.state(0).at("exp_avg_sq_row").shape() == Shape{64});
  CHECK(opt.state(0).at("exp_avg_sq_col").shape() == Shape{48});
  CHECK(opt.state(1).at("exp_avg_sq").shape() == Shape{48});

  // 3 steps, state_dict, 2 more, against 5 straight: bitwise.
  for (AdafactorMode mode : {AdafactorMode::hf, AdafactorMode::torch, AdafactorMode::optax}) {
    CAPTURE(std::string(adafactor_mode_name(mode)));
    AdafactorOptions o{.mode = mode, .lr = mode == AdafactorMode::hf ? 0.0 : 1e-2,
                       .beta1 = mode == AdafactorMode::torch ? 0.0 : 0.9,
                       .min_dim_size_to_factor = 4};
    auto run = [&](int steps, Tensor p, Adafactor& a, Generator& gen) {
      for (int i = 0; i < steps; ++i) {
        p.set_grad(randn({6, 5}, DType::f32, kCPU, &gen));
        a.step();
      }
    };
    Generator g1(3), g2(3);
    Tensor p1 = ones({6, 5}).requires_grad_(), p2 = ones({6, 5}).requires_grad_();
    Adafactor a1({p1}, o), a2({p2}, o);
    run(5, p1, a1, g1);
    run(3, p2, a2, g2);
    const Optimizer::StateDict saved = a2.state_dict();
    Tensor p3 = p2.detach().clone().requires_grad_();
    Adafactor a3({p3}, o);
    a3.load_state_dict(saved);
    run(2, p3, a3, g2);
    CHECK(p3.to_vector<float>() == p1.to_vector<float>());
    AdafactorOptions other = o;
    other.mode = mode == AdafactorMode::hf ? AdafactorMode::optax : AdafactorMode::hf;
    other.beta1 = 0.0;
    Tensor p4 = ones({6, 5}).requires_grad_();
    Adafactor a4({p4}, other);
    CHECK(contains(error_of([&] { a4.load_state_dict(saved); }), "Adafactor"));
  }

  CHECK(contains(error_of([] { Adafactor a({zeros({2}).requires_grad_()}, {.clip_threshold = 0}); }),
                 "Adafactor: invalid clip_threshold 0 (must be > 0)"));
  CHECK(contains(error_of([] {
                   Adafactor a({zeros({2}).requires_grad_()}, {.mode = AdafactorMode::torch, .beta1 = 0.9});
                 }),
                 "mode torch has no first moment"));
  CHECK(contains(error_of([] { parse_adafactor_mode("adam"); }),
                 "Adafactor: mode must be hf, torch or optax, got 'adam'"));
  Tensor q = zeros({2}).requires_grad_();
  Adafactor hf({q}, {.mode = AdafactorMode::hf});
  hf.set_lr(1e-3);
  q.set_grad(ones({2}));
  CHECK(contains(error_of([&] { hf.step(); }), "relative_step sets the step size itself, but lr is 0.001"));
  Adafactor torch({q}, {.mode = AdafactorMode::torch});
  CHECK(contains(error_of([&] { torch.step(); }), "Adafactor (torch): lr must be > 0"));
  CHECK_FALSE(torch.elementwise());
}

}  // namespace
}  // namespace tessera::optim
