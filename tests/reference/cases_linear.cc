// Records (cases.h): linear (x W^T + b and an activation in one op) and its fused backward
// helper linear_act_backward, and the CPU kernel's claim that the fused op gives the bits of
// matmul, add and the activation run one after another.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "tensor/op_attrs.h"
#include "tests/reference/cases.h"

namespace tessera::sweep {
namespace {

using ref::map;
using ref::zip;

double act_ref(Activation a, double x) {
  switch (a) {
    case Activation::none: return x;
    case Activation::relu: return ref::relu(x);
    case Activation::gelu: return ref::gelu(x, false);
    case Activation::gelu_tanh: return ref::gelu(x, true);
  }
  return x;
}

double act_backward_ref(Activation a, double g, double x) {
  switch (a) {
    case Activation::none: return g;
    case Activation::relu: return x > 0 ? g : 0.0;
    case Activation::gelu: return ref::gelu_backward(g, x, false);
    case Activation::gelu_tanh: return ref::gelu_backward(g, x, true);
  }
  return g;
}

bool is_gelu(Activation a) { return a == Activation::gelu || a == Activation::gelu_tanh; }

// h = x W^T + b over the last dim of x.
NdArray pre_activation(const NdArray& x, const NdArray& w, const NdArray& b, bool magnitudes) {
  NdArray h = ref::matmul(magnitudes ? abs_of(x) : x, ref::permute(magnitudes ? abs_of(w) : w, {1, 0}));
  if (b.defined) {
    const int64_t n = w.shape[0];
    for (int64_t i = 0; i < h.numel(); ++i) h.data[i] += magnitudes ? std::fabs(b.data[i % n]) : b.data[i % n];
  }
  return h;
}

// ---- linear ------------------------------------------------------------------------------

struct Lin {
  const char* label;
  Shape x;
  int64_t n;
  bool bias;
  Activation act;
};
const Lin kLinear[] = {
    {"[4, 6] -> 5, bias", {4, 6}, 5, true, Activation::none},
    {"[4, 6] -> 5, no bias (a Partial product when K is split)", {4, 6}, 5, false, Activation::none},
    {"[2, 3, 6] -> 4, bias, gelu_tanh", {2, 3, 6}, 4, true, Activation::gelu_tanh},
    {"[2, 3, 6] -> 4, no bias, gelu", {2, 3, 6}, 4, false, Activation::gelu},
    {"[7, 5] -> 6, bias, relu", {7, 5}, 6, true, Activation::relu},
    {"[5] -> 3 (one row), bias, gelu_tanh", {5}, 3, true, Activation::gelu_tanh},
    // Three strips of rows (12 + 12 + 1 on AVX-512): three epilogue calls, the last partial.
    {"[25, 40] -> 37, bias, gelu_tanh (several epilogue strips)", {25, 40}, 37, true, Activation::gelu_tanh},
    {"[3, 0] -> 4 (k = 0), bias, gelu", {3, 0}, 4, true, Activation::gelu},
    {"[0, 4] -> 3 (no rows), bias, gelu_tanh", {0, 4}, 3, true, Activation::gelu_tanh},
};

OpSweep linear_sweep() {
  OpSweep s{OpId::linear, kFloats, kNonFloat, {}, {}};
  for (const Lin& l : kLinear) {
    Case c;
    c.label = l.label;
    const int64_t k = l.x.back();
    c.args = {arg(l.x, normal(1)), arg({l.n, k}, normal(1)), l.bias ? arg({l.n}, normal(1)) : absent_arg()};
    c.attrs.activation = l.act;
    const Activation act = l.act;
    // 16-bit: y rounds twice (x W^T + b, then the activation of that rounded value). The
    // count is per case, so the pre-activation output (rounded once) gets the same bound.
    if (act != Activation::none) c.rounds = 2;
    c.ref = [act](const Arrays& in, DType) {
      const NdArray h = pre_activation(in[0], in[1], in[2], false);
      if (act == Activation::none) return Arrays{h, NdArray::absent()};
      return Arrays{map(h, [act](double v) { return act_ref(act, v); }), h};
    };
    // The product's terms |x| |W|^T + |b|, carried through the activation (|gelu'| < 1.13,
    // |relu'| <= 1), plus the activation's own evaluation error.
    c.mag = [act](const Arrays& in, DType) {
      const NdArray terms = pre_activation(in[0], in[1], in[2], true);
      if (act == Activation::none) return Arrays{terms, NdArray::absent()};
      const NdArray h = pre_activation(in[0], in[1], in[2], false);
      NdArray y = terms;
      for (int64_t i = 0; i < y.numel(); ++i) {
        y.data[i] = 1.13 * terms.data[i] + std::fabs(act_ref(act, h.data[i]));
        if (is_gelu(act)) y.data[i] += gelu_mag(h.data[i], act == Activation::gelu_tanh);
      }
      return Arrays{y, terms};
    };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("linear [3, 4] with weight [5, 3]", [] { linear(zeros({3, 4}), zeros({5, 3})); });
    expect_error("linear bias [4] for weight [5, 4]",
                 [] { linear(zeros({3, 4}), zeros({5, 4}), zeros({4})); });
    expect_error("linear weight [5, 4, 1]", [] { linear(zeros({3, 4}), zeros({5, 4, 1})); });
    expect_error("linear f32 x with f64 weight", [] { linear(zeros({3, 4}), zeros({5, 4}, DType::f64)); });
    expect_error("linear 0-d x", [] { linear(zeros({}), zeros({5, 1})); });
    if (!sweep_device().is_cpu()) return;
    // The CPU kernel's bias and activation epilogue rounds every element as matmul, add and
    // the activation's op do: the same bits, at a GPT MLP's shape (many strips; split over
    // the threads when there are several) and at an odd one, for every activation; in 16 bits
    // the activation of the rounded pre-activation, rounded again, as its own op gives.
    struct Shape3 {
      int64_t rows, k, n;
    };
    // The 16-bit activation runs in parallel chunks of 16,384 elements: 128 x 256 spans two.
    for (const auto& [sh, dt] : {std::pair{Shape3{128, 64, 256}, DType::f32}, std::pair{Shape3{37, 29, 45}, DType::f32},
                                 std::pair{Shape3{37, 29, 45}, DType::bf16}, std::pair{Shape3{128, 64, 256}, DType::bf16},
                                 std::pair{Shape3{37, 29, 45}, DType::f16}}) {
      const Tensor x = randn({sh.rows, sh.k}).cast(dt), w = randn({sh.n, sh.k}).cast(dt);
      const Tensor b = randn({sh.n}).cast(dt);
      // f32: the unfused matmul + add; 16-bit: the bias-only linear (x W^T + b rounded once,
      // which matmul + add would round twice), then the activation's own op.
      const Tensor h = dt == DType::f32 ? matmul(x, w.t()) + b : linear(x, w, b);
      for (Activation act : {Activation::none, Activation::relu, Activation::gelu, Activation::gelu_tanh}) {
        Tensor want = h;
        if (act == Activation::relu) want = relu(h);
        if (is_gelu(act)) want = gelu(h, act == Activation::gelu_tanh);
        const std::vector<Tensor> got = call(OpId::linear, {x, w, b}, op_attrs::linear(act));
        const auto same = [](const Tensor& a, const Tensor& e) {
          return a.shape() == e.shape() &&
                 std::memcmp(a.contiguous().raw_data(), e.contiguous().raw_data(),
                             static_cast<size_t>(a.nbytes())) == 0;
        };
        if (!same(got[0], want) || (act != Activation::none && !same(got[1], h))) {
          report_failure(fmt::format("linear [{}, {}] -> {} {} {}: the fused op's bits differ from "
                                     "matmul + add + the activation",
                                     sh.rows, sh.k, sh.n, activation_name(act), dt));
        }
      }
    }
  };
  return s;
}

// ---- linear_act_backward ----------------------------------------------------------------

struct ActBwd {
  const char* label;
  Shape shape;
  Activation act;
};
const ActBwd kActBackward[] = {
    {"[4, 6] gelu_tanh", {4, 6}, Activation::gelu_tanh},
    {"[2, 3, 5] gelu", {2, 3, 5}, Activation::gelu},
    {"[7, 4] relu", {7, 4}, Activation::relu},
    {"[5] one row, gelu_tanh", {5}, Activation::gelu_tanh},
    // 70 rows: three chunks of the CPU kernel's bias-gradient partial sums (32 rows each).
    {"[70, 9] gelu_tanh (3 row chunks)", {70, 9}, Activation::gelu_tanh},
    {"[0, 5] no rows (a zero bias gradient)", {0, 5}, Activation::gelu},
};

OpSweep linear_act_backward_sweep() {
  OpSweep s{OpId::linear_act_backward, kFloats, kNonFloat, {}, {}};
  for (const ActBwd& a : kActBackward) {
    Case c;
    c.label = a.label;
    c.args = {arg(a.shape, normal(1)), arg(a.shape, normal(2))};
    c.attrs.activation = a.act;
    const Activation act = a.act;
    std::vector<int64_t> lead;
    for (int64_t d = 0; d + 1 < static_cast<int64_t>(a.shape.size()); ++d) lead.push_back(d);
    c.ref = [act, lead](const Arrays& in, DType) {
      const NdArray d = zip(in[0], in[1], [act](double g, double x) { return act_backward_ref(act, g, x); });
      return Arrays{d, lead.empty() ? d : ref::sum(d, lead, false)};
    };
    c.mag = [act, lead](const Arrays& in, DType) {
      const NdArray m = zip(in[0], in[1], [act](double g, double x) {
        const double base = std::fabs(act_backward_ref(act, g, x));
        return is_gelu(act) ? base + gelu_backward_mag(g, x, act == Activation::gelu_tanh) : base;
      });
      return Arrays{m, lead.empty() ? m : ref::sum(m, lead, false)};
    };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("linear_act_backward without an activation",
                 [] { linear_act_backward(zeros({3, 4}), zeros({3, 4}), Activation::none); });
    expect_error("linear_act_backward grad [3, 4] vs pre [4, 3]",
                 [] { linear_act_backward(zeros({3, 4}), zeros({4, 3}), Activation::gelu); });
  };
  return s;
}

}  // namespace

std::vector<OpSweep> linear_sweeps() { return {linear_sweep(), linear_act_backward_sweep()}; }

}  // namespace tessera::sweep
