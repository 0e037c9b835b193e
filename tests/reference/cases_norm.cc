// Records (cases.h): layer_norm, its fused backward helper (with add_layer_norm's
// residual_grad) and add_layer_norm, with the claims that add_layer_norm gives the bits of
// add then layer_norm, also under autocast, and residual_grad those of grad_x + residual.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <string>

#include "tensor/autocast.h"
#include "tests/reference/cases.h"

namespace tessera::sweep {
namespace {

// ---- layer_norm ----------------------------------------------------------------------------

// y = (x - mean) * rstd * w + b with x - mean evaluated in f32 from a rounded mean: error
// terms (|x| + |mean|) * rstd * |w| + |b|.
Arrays layer_norm_mag(const Arrays& in, int64_t nd, double eps) {
  const Arrays fw = ref::layer_norm(in[0], in[1], in[2], nd, eps);
  const int64_t cols = ref::count(Shape(in[0].shape.end() - nd, in[0].shape.end()));
  NdArray y = in[0];
  for (int64_t i = 0; i < y.numel(); ++i) {
    const int64_t r = i / cols, c = i % cols;
    double m = (std::fabs(in[0].data[i]) + std::fabs(fw[1].data[r])) * fw[2].data[r];
    if (in[1].defined) m *= std::fabs(in[1].data[c]);
    if (in[2].defined) m += std::fabs(in[2].data[c]);
    y.data[i] = m;
  }
  return {y};
}

OpSweep layer_norm_sweep() {
  OpSweep s{OpId::layer_norm, kFloats, kNonFloat, {}, {}};
  struct L {
    const char* label;
    Shape x;
    int64_t nd;
    bool w, b;
    double eps;
    Domain domain;
  };
  for (const L& l :
       {L{"[4, 6] nd 1, weight, bias", {4, 6}, 1, true, true, 1e-5, normal(1)},
        L{"[2, 3, 4] nd 2, weight, bias", {2, 3, 4}, 2, true, true, 1e-5, normal(1)},
        L{"[5, 8] no weight, no bias", {5, 8}, 1, false, false, 1e-5, normal(1)},
        L{"[5, 8] weight only, eps 0.01", {5, 8}, 1, true, false, 1e-2, normal(1)},
        L{"[3, 16] mean 5, sd 0.5", {3, 16}, 1, true, true, 1e-5, normal(0.5, 5)},
        L{"[3, 130] wide rows", {3, 130}, 1, true, true, 1e-5, normal(1)},
        L{"[4, 6] nd 2 (one row, 0-d statistics)", {4, 6}, 2, true, true, 1e-5, normal(1)}}) {
    Case c;
    c.label = l.label;
    const Shape norm(l.x.end() - l.nd, l.x.end());
    c.args = {arg(l.x, l.domain), l.w ? arg(norm, normal(1, 1)) : absent_arg(),
              l.b ? arg(norm, normal(1)) : absent_arg()};
    c.attrs.normalized_ndim = l.nd;
    c.attrs.eps = l.eps;
    const int64_t nd = l.nd;
    const double eps = l.eps;
    c.ref = [=](const Arrays& in, DType) { return ref::layer_norm(in[0], in[1], in[2], nd, eps); };
    c.mag = [=](const Arrays& in, DType) { return layer_norm_mag(in, nd, eps); };
    c.out_dtype = [](DType dt, size_t k) { return k == 0 || dt == DType::f64 ? dt : DType::f32; };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("layer_norm weight [5] for normalized [4]", [] {
      layer_norm(zeros({3, 4}), {4}, zeros({5}));
    });
    expect_error("layer_norm normalized [3] of [3, 4]", [] { layer_norm(zeros({3, 4}), {3}); });
  };
  return s;
}

// add_layer_norm(x, r, w, b) = {s, layer_norm(s)} with s = x + r. The reference adds in f64;
// the op rounds s to the dtype before normalising it, an error of |s| rstd |w| per rounding
// that layer_norm_mag of s already counts. The records are f32 and f64: a 16-bit run's
// statistics are those of s rounded to 16 bits, which neither the f64 reference nor the f32
// twin reproduces. 16-bit is checked below, bitwise against add then layer_norm (both of
// which the sweep checks in 16 bits).
OpSweep add_layer_norm_sweep() {
  OpSweep s{OpId::add_layer_norm, kFloats, kNonFloat, {}, {}};
  struct L {
    const char* label;
    Shape x;
    int64_t nd;
    bool w, b;
    Domain domain;
  };
  for (const L& l : {L{"[4, 6] nd 1, weight, bias", {4, 6}, 1, true, true, normal(1)},
                     L{"[2, 3, 4] nd 2, weight, bias", {2, 3, 4}, 2, true, true, normal(1)},
                     L{"[5, 8] no weight, no bias", {5, 8}, 1, false, false, normal(1)},
                     L{"[3, 16] mean 5, sd 0.5", {3, 16}, 1, true, true, normal(0.5, 5)},
                     L{"[2, 40] wider rows, weight only", {2, 40}, 1, true, false, normal(1)}}) {
    Case c;
    c.label = l.label;
    const Shape norm(l.x.end() - l.nd, l.x.end());
    c.args = {arg(l.x, l.domain), arg(l.x, normal(1)), l.w ? arg(norm, normal(1, 1)) : absent_arg(),
              l.b ? arg(norm, normal(1)) : absent_arg()};
    c.attrs.normalized_ndim = l.nd;
    c.attrs.eps = 1e-5;
    const int64_t nd = l.nd;
    const auto sum = [](const Arrays& in) {
      NdArray s = in[0];
      for (int64_t i = 0; i < s.numel(); ++i) s.data[i] += in[1].data[i];
      return s;
    };
    c.ref = [=](const Arrays& in, DType) {
      const NdArray s = sum(in);
      const Arrays ln = ref::layer_norm(s, in[2], in[3], nd, 1e-5);
      return Arrays{s, ln[0], ln[1], ln[2]};
    };
    // s: |x| + |r|; y: layer_norm's terms on s; mean: the row's mean of |x| + |r| (the sum
    // rounded per element, then summed); rstd: |want|.
    c.mag = [=](const Arrays& in, DType) {
      NdArray ms = in[0];
      for (int64_t i = 0; i < ms.numel(); ++i) ms.data[i] = std::fabs(in[0].data[i]) + std::fabs(in[1].data[i]);
      const Arrays my = layer_norm_mag({sum(in), in[2], in[3]}, nd, 1e-5);
      const int64_t cols = ref::count(Shape(in[0].shape.end() - nd, in[0].shape.end()));
      NdArray mm = NdArray::zeros(Shape(in[0].shape.begin(), in[0].shape.end() - nd));
      for (int64_t i = 0; i < ms.numel(); ++i) mm.data[i / cols] += ms.data[i] / static_cast<double>(cols);
      return Arrays{ms, my[0], mm};
    };
    c.out_dtype = [](DType dt, size_t k) { return k <= 1 || dt == DType::f64 ? dt : DType::f32; };
    c.dtypes = {DType::f32, DType::f64};
    // Gradcheck differentiates one output: s here, and y in a copy of the first two cases
    // (the layer_norm part of the derivative, and weight's and bias's gradients).
    if (l.w && l.b) {
      Case through_y = c;
      through_y.label = std::string(l.label) + " (gradient through y)";
      through_y.grad_output = 1;
      s.cases.push_back(std::move(through_y));
    }
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("add_layer_norm residual [3, 5] for input [3, 4]", [] {
      add_layer_norm(zeros({3, 4}), zeros({3, 5}), {4});
    });
    expect_error("add_layer_norm f64 residual for an f32 input", [] {
      add_layer_norm(zeros({3, 4}), zeros({3, 4}, DType::f64), {4});
    });
    expect_error("add_layer_norm weight [5] for normalized [4]", [] {
      add_layer_norm(zeros({3, 4}), zeros({3, 4}), {4}, zeros({5}));
    });
    // What it replaces, bit for bit: x + r, then layer_norm of it (the sum rounded to the
    // dtype first), on the sweep's device; rows of 64 take CUDA's warp path, rows of 101
    // (no whole vectors) its block path.
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      for (int64_t cols : {64, 101}) {
        manual_seed(5);
        const Device dev = sweep_device();
        const Tensor x = randn({6, cols}).cast(dt).to(dev), r = randn({6, cols}).cast(dt).to(dev);
        const Tensor w = randn({cols}).cast(dt).to(dev), b = randn({cols}).cast(dt).to(dev);
        const AddLayerNorm fused = add_layer_norm(x, r, {cols}, w, b);
        const Tensor s = x + r, y = layer_norm(s, {cols}, w, b);
        const std::string at = fmt::format("add_layer_norm {} [6, {}] against x + r, then layer_norm",
                                           dtype_name(dt), cols);
        expect_same_bits(at + ": the sum", fused.sum, s);
        expect_same_bits(at + ": the normalised sum", fused.normed, y);
      }
    }
    // Under autocast: the composite's dtypes, whether the op runs (an f32 stream and a
    // 16-bit branch: f32) or falls back to the two ops (both 16-bit: a 16-bit sum).
    const Device dev = sweep_device();
    int autocast_cases = 0;
    for (DType xd : {DType::f32, DType::bf16}) {
      manual_seed(6);
      const Tensor x = randn({4, 64}).cast(xd).to(dev), r = randn({4, 64}).cast(DType::bf16).to(dev);
      const Tensor w = randn({64}).to(dev), b = randn({64}).to(dev);
      AutocastGuard amp(DType::bf16);
      const AddLayerNorm fused = add_layer_norm(x, r, {64}, w, b);
      const Tensor s = x + r, y = layer_norm(s, {64}, w, b);
      CHECK(add_layer_norm_fuses(xd, DType::bf16) == (xd == DType::f32));
      CHECK(fused.sum.dtype() == s.dtype());
      CHECK(fused.normed.dtype() == y.dtype());
      expect_same_bits(fmt::format("add_layer_norm under bf16 autocast, {} input, against the two ops",
                                   dtype_name(xd)),
                       fused.normed, y);
      ++autocast_cases;
    }
    CHECK(autocast_cases == 2);
  };
  return s;
}

OpSweep layer_norm_backward_sweep() {
  OpSweep s{OpId::layer_norm_backward, kFloats, kNonFloat, {}, {}};
  struct L {
    const char* label;
    Shape x;
    int64_t nd;
    bool w, b;
    bool residual = false;  // a residual_grad added to grad_x (add_layer_norm's backward)
  };
  for (const L& l : {L{"[4, 6] nd 1, weight, bias", {4, 6}, 1, true, true},
                     L{"[2, 3, 4] nd 2, weight, bias", {2, 3, 4}, 2, true, true},
                     L{"[5, 8] no weight, no bias", {5, 8}, 1, false, false},
                     L{"[40, 8] weight only (several row blocks)", {40, 8}, 1, true, false},
                     L{"[4, 6] weight, bias, residual_grad", {4, 6}, 1, true, true, true},
                     L{"[2, 3, 4] nd 2, residual_grad", {2, 3, 4}, 2, false, false, true}}) {
    Case c;
    c.label = l.label;
    const Shape norm(l.x.end() - l.nd, l.x.end()), rows(l.x.begin(), l.x.end() - l.nd);
    Arg mean = arg(rows), rstd = arg(rows);
    mean.stats = rstd.stats = true;
    c.args = {arg(l.x),
              arg(l.x),
              mean,
              rstd,
              l.w ? arg(norm, normal(1, 1)) : absent_arg(),
              l.b ? arg(norm) : absent_arg()};
    const bool residual = l.residual;
    if (residual) {
      c.args.push_back(arg(l.x));
      c.rounds = 2;  // 16-bit: grad_x rounded, then the sum
    }
    const int64_t nd = l.nd;
    c.attrs.normalized_ndim = nd;
    // mean and rstd are the forward's statistics of x.
    c.prepare = [nd](Arrays& in, DType) {
      const Arrays fw = ref::layer_norm(in[1], NdArray::absent(), NdArray::absent(), nd, 1e-5);
      in[2] = fw[1];
      in[3] = fw[2];
    };
    c.ref = [nd, residual](const Arrays& in, DType) {
      Arrays out = ref::layer_norm_backward(in[0], in[1], in[2], in[3], in[4], in[5], nd);
      if (residual) {
        for (int64_t i = 0; i < out[0].numel(); ++i) out[0].data[i] += in[6].data[i];
      }
      return out;
    };
    // dx = rstd (g w - mean(g w) - xhat mean(g w xhat)) with xhat = (x - mean) rstd carrying
    // (|x| + |mean|) rstd; dw = sum g xhat; db = sum g: the sums of the terms' magnitudes.
    c.mag = [nd, residual](const Arrays& in, DType) {
      const int64_t cols = ref::count(Shape(in[1].shape.end() - nd, in[1].shape.end()));
      const int64_t rows = cols == 0 ? 0 : in[1].numel() / cols;
      NdArray dx = in[1];
      NdArray dw = in[4].defined ? NdArray::zeros(in[4].shape) : NdArray::absent();
      NdArray db = in[5].defined ? NdArray::zeros(in[5].shape) : NdArray::absent();
      for (int64_t r = 0; r < rows; ++r) {
        const double rs = std::fabs(in[3].data[r]), m = std::fabs(in[2].data[r]);
        double mean_gw = 0, mean_gwx = 0;
        for (int64_t k = 0; k < cols; ++k) {
          const double g = std::fabs(in[0].data[r * cols + k]);
          const double gw = in[4].defined ? g * std::fabs(in[4].data[k]) : g;
          const double xh = (std::fabs(in[1].data[r * cols + k]) + m) * rs;
          mean_gw += gw / cols;
          mean_gwx += gw * xh / cols;
          if (dw.defined) dw.data[k] += g * xh;
          if (db.defined) db.data[k] += g;
        }
        for (int64_t k = 0; k < cols; ++k) {
          const double g = std::fabs(in[0].data[r * cols + k]);
          const double gw = in[4].defined ? g * std::fabs(in[4].data[k]) : g;
          const double xh = (std::fabs(in[1].data[r * cols + k]) + m) * rs;
          dx.data[r * cols + k] = rs * (gw + mean_gw + xh * mean_gwx);
          if (residual) dx.data[r * cols + k] += std::fabs(in[6].data[r * cols + k]);
        }
      }
      return Arrays{dx, dw, db};
    };
    s.cases.push_back(std::move(c));
  }
  // residual_grad is grad_x + residual_grad bit for bit (grad_x rounded first), on the sweep's
  // device: rows of 64 take CUDA's warp kernel, rows of 101 its block kernel.
  s.extra = [] {
    expect_error("layer_norm_backward residual_grad [4, 5] for grad [4, 6]", [] {
      layer_norm_backward(zeros({4, 6}), zeros({4, 6}), zeros({4}), ones({4}), Tensor(), Tensor(), 1,
                          zeros({4, 5}));
    });
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      for (int64_t cols : {64, 101}) {
        manual_seed(9);
        const Device dev = sweep_device();
        const Tensor x = randn({6, cols}).cast(dt).to(dev), w = randn({cols}).cast(dt).to(dev);
        const Tensor b = randn({cols}).cast(dt).to(dev);
        const Tensor g = randn({6, cols}).cast(dt).to(dev), res = randn({6, cols}).cast(dt).to(dev);
        // Any statistics do for the comparison.
        const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
        const Tensor mean = (randn({6}) * 0.1).cast(st).to(dev), rstd = (rand({6}) + 0.5).cast(st).to(dev);
        const std::vector<Tensor> fused = layer_norm_backward(g, x, mean, rstd, w, b, 1, res);
        const std::vector<Tensor> plain = layer_norm_backward(g, x, mean, rstd, w, b, 1);
        const std::string at = fmt::format("layer_norm_backward {} [6, {}] residual_grad", dtype_name(dt), cols);
        expect_same_bits(at + ": grad_x against grad_x + residual_grad", fused[0], plain[0] + res);
        expect_same_bits(at + ": grad_weight", fused[1], plain[1]);
        expect_same_bits(at + ": grad_bias", fused[2], plain[2]);
      }
    }
  };
  return s;
}

}  // namespace

std::vector<OpSweep> norm_sweeps() {
  std::vector<OpSweep> out;
  out.push_back(layer_norm_sweep());
  out.push_back(layer_norm_backward_sweep());
  out.push_back(add_layer_norm_sweep());
  return out;
}

}  // namespace tessera::sweep
