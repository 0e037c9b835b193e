// The gradcheck case table shared by gradcheck_test.cc and tests/cuda/cuda_gradcheck_test.cc:
// per differentiable op, the cases to check (Table, keyed by OpId), most read from the op's
// record (gradcheck_records.cc), the rest written here with inputs from Maker; and the checks
// run on each case (check_op_cases).
//
//   const Table t = make_table();
//   for (const Case& c : t.at(OpId::exp).make(mk)) autograd::gradcheck(c.fn, c.inputs);
//
// Device: cases are made on case_device() (the records' device: the CPU unless a suite sets
// another): leaves are laid out in device memory, and fixed tensors (indices, conditions)
// are copied there (on_device).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tests/reference/cases.h"

namespace tessera::gradcheck_cases {

using autograd::GradcheckFn;
using autograd::GradcheckOptions;
using Tensors = std::vector<Tensor>;

// What a case covers: contiguous inputs, inputs broadcast against each other, or
// non-contiguous inputs (laid out in one of the records' layouts, Memory below).
enum class Covers { contiguous, broadcast, noncontiguous };

inline const char* covers_name(Covers c) {
  switch (c) {
    case Covers::contiguous: return "contiguous";
    case Covers::broadcast: return "broadcast";
    case Covers::noncontiguous: return "non-contiguous";
  }
  return "?";
}

// The device the cases' tensors are made on: the records' device (cases.h), set with
// sweep::set_sweep_device before calling OpCases::make.
inline Device case_device() { return sweep::sweep_device(); }
// A fixed (not differentiated) tensor made on the CPU, on case_device().
inline Tensor on_device(const Tensor& t) { return t.to(case_device()); }

struct Case {
  Covers covers;
  std::string label;
  Tensors inputs;
  GradcheckFn fn;
  GradcheckOptions options{};
};
using CaseList = std::vector<Case>;

// How a leaf's elements sit in memory: the records' layouts (cases.h; permuted is a
// transpose for 2-D inputs, all dims reversed above; strided holds every other element of a
// longer last dim, with NaN in the gaps).
using Memory = sweep::Layout;

// Deterministic inputs. Values are given in logical (row-major) order and then written
// through the requested memory layout into a fresh f64 leaf.
class Maker {
 public:
  explicit Maker(uint64_t seed) : gen_(seed) {}

  Tensor normal(const Shape& s, Memory m = Memory::contiguous) {
    return leaf(s, draw_normal(numel_of(s)), m);
  }
  // In [0.5, 1.5): the domain of log, sqrt, rsqrt and pow's base.
  Tensor positive(const Shape& s, Memory m = Memory::contiguous) {
    std::vector<double> v = rand({numel_of(s)}, DType::f64, kCPU, &gen_).to_vector<double>();
    for (double& x : v) x += 0.5;
    return leaf(s, v, m);
  }
  // |x| >= 0.25: away from the kinks of abs and relu, and safe as a divisor.
  Tensor nonzero(const Shape& s, Memory m = Memory::contiguous) {
    std::vector<double> v = draw_normal(numel_of(s));
    for (double& x : v) x = std::copysign(0.25 + std::abs(x), x);
    return leaf(s, v, m);
  }
  // Distinct values on a shuffled grid of step 1/32 (parity 0: even points, 1: odd points),
  // so no two values of one tensor, nor of a parity-0 and a parity-1 tensor, are within
  // 1/32 of each other: no ties for max, maximum, minimum, max_pool2d; never 0 either.
  Tensor distinct(const Shape& s, int parity, Memory m = Memory::contiguous) {
    const int64_t n = numel_of(s);
    std::vector<int64_t> perm(n);
    for (int64_t i = 0; i < n; ++i) perm[i] = i;
    const std::vector<double> u = rand({n}, DType::f64, kCPU, &gen_).to_vector<double>();
    for (int64_t i = n - 1; i > 0; --i) {
      std::swap(perm[i], perm[static_cast<int64_t>(u[i] * static_cast<double>(i + 1))]);
    }
    std::vector<double> v(n);
    for (int64_t i = 0; i < n; ++i) {
      v[i] = (static_cast<double>(2 * perm[i] + parity - n) + 0.25) / 32.0;
    }
    return leaf(s, v, m);
  }
  // Multiples of 1/64 in [-2, 2]: exact in f32, and so is x +- 2^-12 (see the cast case).
  Tensor dyadic(const Shape& s, Memory m = Memory::contiguous) {
    std::vector<double> v = rand({numel_of(s)}, DType::f64, kCPU, &gen_).to_vector<double>();
    for (double& x : v) x = std::round(x * 256.0 - 128.0) / 64.0;
    return leaf(s, v, m);
  }

  static Tensor leaf(const Shape& shape, const std::vector<double>& values, Memory m,
                     bool requires_grad = true) {
    NoGradGuard no_grad;
    ref::NdArray a = ref::NdArray::zeros(shape);
    a.data = values;
    const sweep::Built b = sweep::build(a, DType::f64, m, 0);
    REQUIRE((m == Memory::contiguous || b.laid_out));
    Tensor t = b.tensor;
    if (requires_grad) t.requires_grad_();
    return t;
  }

 private:
  std::vector<double> draw_normal(int64_t n) {
    return randn({n}, DType::f64, kCPU, &gen_).to_vector<double>();
  }
  Generator gen_;
};

inline Tensor index(const std::vector<int64_t>& values, const Shape& shape) {
  return on_device(Tensor::from_vector<int64_t>(values, shape));
}

struct OpCases {
  std::function<CaseList(Maker&)> make;
  std::string node;  // the graph node the cases must contain (empty: the op's own name)
};
using Table = std::map<OpId, OpCases>;

using Unary = std::function<Tensor(const Tensor&)>;
using Binary = std::function<Tensor(const Tensor&, const Tensor&)>;

inline GradcheckFn on1(Unary f) {
  return [f](const Tensors& in) { return f(in[0]); };
}
inline GradcheckFn on2(Binary f) {
  return [f](const Tensors& in) { return f(in[0], in[1]); };
}

// Fill the table: elementwise ops, reductions, copies and views / matmul, fused layers,
// indexing, joining and splitting.
void add_elementwise_cases(Table& t);
void add_nn_cases(Table& t);
// Every op's record (tests/reference/cases.h) read as gradcheck cases: gradcheck_records.cc.
void add_record_cases(Table& t);
// The whole table: the three above.
inline Table make_table() {
  Table t;
  add_elementwise_cases(t);
  add_nn_cases(t);
  add_record_cases(t);
  return t;
}

// Runs every case of one op (made on case_device() from Maker(seed)) through its checks:
// differentiable leaves are f64 leaves, a non-contiguous case has a non-contiguous input,
// the graph contains the op's node, a non-contiguous forward equals the forward on
// contiguous copies (within 1e-12), and autograd::gradcheck passes. Failures are doctest
// FAIL_CHECKs naming op, layout and case; an exception fails its case only.
struct OpResult {
  int checked = 0, failed = 0;
  std::string first_failure;
};
OpResult check_op_cases(const OpInfo& info, const OpCases& cases, uint64_t seed);

}  // namespace tessera::gradcheck_cases
