// The functor family ops' test cases (tensor/op_list.h's TS_UNARY_OPS, TS_BINARY_OPS,
// TS_COMPARE_OPS): one FunctorOpCase per op gives its domains, its f64 reference and its
// exact/cancels/kink/ties flags; shapes and layouts come from the family. Every runner
// reads it: the op sweep (cases_elementwise.cc builds the op's record from it), gradcheck
// (tests/autograd), the sharded suite (tests/parallel) and the CUDA elementwise suite.
//
//   unary(OpId::exp, normal(2), [](double x) { return std::exp(x); }),  // in op_cases.cc:
//                                                 // the whole test of a new unary op
//
// Domain is the one vocabulary of input values for every runner (every op's record too,
// cases.h). The op sweep, the sharded suite and gradcheck's record cases draw it with
// cases.h's draw(); gradcheck's functor cases map it onto Maker's generators (values away
// from kinks and ties).
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

}  // namespace tessera::ref
