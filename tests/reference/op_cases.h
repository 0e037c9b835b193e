// One test case per op, after PyTorch's OpInfo and ggml's test_case: its f64 reference and
// the values it is checked on. A functor family op (tensor/op_list.h's TS_UNARY_OPS,
// TS_BINARY_OPS, TS_COMPARE_OPS) has one FunctorOpCase (its shapes and layouts come from
// the family); any other op written since (topk, ...) has its OpTestCases (shapes and
// attributes given, layouts from the runner). Every runner reads this one record: the op sweep (all dtypes and
// layouts against the reference, tests/tensor), gradcheck (tests/autograd), the sharded
// equivalence suite (every placement on 1-D and 2-D meshes, tests/parallel) and the CUDA
// suites (tests/cuda). Shapes and layouts come from the family (each runner's own set).
//
//   unary(OpId::exp, normal(2), [](double x) { return std::exp(x); }),  // in op_cases.cc:
//                                                 // the whole test of a new unary op
//
// Domains are one vocabulary for every runner (Domain below): the op sweep draws them as
// given; gradcheck and the sharded suite map them onto their own generators (positive
// values, values away from zero, small integers).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/op.h"
#include "tests/reference/reference.h"

namespace tessera::ref {

// How an input's values are drawn.
struct Domain {
  enum class Kind { normal, uniform, away_from_zero, integers, nonzero_integers, boolean, fixed };
  Kind kind = Kind::normal;
  double a = 0.0, b = 1.0;     // normal: shift, scale; uniform/away: [a, b); integers: [a, b]
  std::vector<double> values;  // fixed
  bool positive() const { return (kind == Kind::uniform && a >= 0.0); }
};
Domain normal(double scale = 1.0, double shift = 0.0);
Domain uniform(double lo, double hi);
Domain away(double lo, double hi);  // a random sign times uniform [lo, hi)
Domain ints(int64_t lo, int64_t hi);
Domain nonzero_ints(int64_t lo, int64_t hi);
Domain bools();
Domain fixed(std::vector<double> values);

struct FunctorOpCase {
  OpId op;
  // Values of input 0 (and 1 for binary ops) for the float dtypes, and for the integer
  // dtypes when the op takes them (unset: ints(-9, 9)).
  Domain a, b;
  std::optional<Domain> int_a, int_b;
  // The f64 reference: unary or binary (comparisons return 0 or 1); binary ops get the
  // dtype for integer-specific rules (pow).
  std::function<double(double)> unary;
  std::function<double(double, double, DType)> binary;
  bool exact = false;         // bitwise on every dtype (neg, abs, relu, maximum, compare)
  bool cancels = false;       // a sum or difference: error relative to |a| + |b|
  bool kink_at_zero = false;  // not differentiable at 0: gradients checked away from it
  bool ties = false;          // gradients need distinct operands (maximum, minimum)
};

// Every functor family op, in op-list order.
const std::vector<FunctorOpCase>& functor_op_cases();
// The case of `op`; Error-free: null when op is not a functor family op.
const FunctorOpCase* functor_op_case(OpId op);

// ---- Any other op: given shapes and attributes, and an f64 reference of every output ----
struct OpInput {
  Shape shape;
  Domain domain = normal();
  std::optional<DType> dtype;  // a fixed dtype (indices); unset: the case's dtype
};

struct OpTestCase {
  OpId op;
  std::string label;
  std::vector<OpInput> inputs;
  Attrs attrs;
  // Every output from the inputs' values (as doubles) and the attributes.
  std::function<std::vector<NdArray>(const std::vector<NdArray>&, const Attrs&)> ref;
  std::vector<std::optional<DType>> out_dtypes;  // per output; unset: the case's dtype
  std::vector<DType> dtypes = {DType::f32, DType::f64, DType::f16, DType::bf16};
  std::vector<DType> rejected = {DType::i32, DType::i64, DType::b8};  // must throw
  bool exact = false;    // float outputs bitwise (selections, copies); integers always are
  int grad_output = 0;   // the output gradcheck differentiates; -1: none (NoDiff ops)
};

// The cases of every op outside the functor families that has them, in op-list order.
const std::vector<OpTestCase>& op_test_cases();

}  // namespace tessera::ref
