// The functor family ops' test cases (see op_cases.h). A new unary or binary op adds one
// record here; every runner picks it up.
#include "tests/reference/op_cases.h"

#include <algorithm>
#include <cmath>

#include "tests/reference/reference.h"

namespace tessera::ref {

Domain normal(double scale, double shift) { return {Domain::Kind::normal, shift, scale, {}}; }
Domain uniform(double lo, double hi) { return {Domain::Kind::uniform, lo, hi, {}}; }
Domain away(double lo, double hi) { return {Domain::Kind::away_from_zero, lo, hi, {}}; }
Domain ints(int64_t lo, int64_t hi) {
  return {Domain::Kind::integers, static_cast<double>(lo), static_cast<double>(hi), {}};
}
Domain nonzero_ints(int64_t lo, int64_t hi) {
  return {Domain::Kind::nonzero_integers, static_cast<double>(lo), static_cast<double>(hi), {}};
}
Domain bools() { return {Domain::Kind::boolean, 0, 1, {}}; }
Domain fixed(std::vector<double> values) { return {Domain::Kind::fixed, 0, 0, std::move(values)}; }

namespace {

FunctorOpCase unary(OpId op, Domain a, std::function<double(double)> f) {
  FunctorOpCase c{op, std::move(a), {}, std::nullopt, std::nullopt, std::move(f), nullptr};
  return c;
}

FunctorOpCase binary(OpId op, Domain a, Domain b, std::function<double(double, double, DType)> f) {
  FunctorOpCase c{op, std::move(a), std::move(b), std::nullopt, std::nullopt, nullptr, std::move(f)};
  return c;
}

template <typename F>
FunctorOpCase with(FunctorOpCase c, F&& edit) {
  edit(c);
  return c;
}

// Small integers as values (in every dtype), so that ties are common.
FunctorOpCase compare(OpId op, bool (*f)(double, double)) {
  return with(binary(op, ints(-2, 2), ints(-2, 2),
                     [f](double x, double y, DType) { return f(x, y) ? 1.0 : 0.0; }),
              [](FunctorOpCase& c) {
                c.exact = true;
                c.int_a = c.int_b = ints(-2, 2);
              });
}

std::vector<FunctorOpCase> make_cases() {
  const auto exact = [](FunctorOpCase& c) { c.exact = true; };
  const auto exact_kink = [](FunctorOpCase& c) { c.exact = c.kink_at_zero = true; };
  const auto cancels = [](FunctorOpCase& c) { c.cancels = true; };
  const auto exact_ties = [](FunctorOpCase& c) {
    c.exact = c.ties = true;
    c.int_a = c.int_b = ints(-3, 3);
  };
  return {
      with(unary(OpId::neg, normal(2), [](double x) { return -x; }), exact),
      unary(OpId::exp, normal(2), [](double x) { return std::exp(x); }),
      unary(OpId::log, uniform(0.05, 5), [](double x) { return std::log(x); }),
      unary(OpId::sqrt, uniform(0, 5), [](double x) { return std::sqrt(x); }),
      unary(OpId::rsqrt, uniform(0.05, 5), [](double x) { return 1 / std::sqrt(x); }),
      with(unary(OpId::abs, normal(2), [](double x) { return std::fabs(x); }), exact_kink),
      unary(OpId::tanh, normal(2), [](double x) { return std::tanh(x); }),
      unary(OpId::sigmoid, normal(3), sigmoid),
      with(unary(OpId::relu, normal(2), relu), exact_kink),
      unary(OpId::silu, normal(3), [](double x) { return x / (1 + std::exp(-x)); }),

      with(binary(OpId::add, normal(2), normal(2), [](double x, double y, DType) { return x + y; }),
           cancels),
      with(binary(OpId::sub, normal(2), normal(2), [](double x, double y, DType) { return x - y; }),
           cancels),
      binary(OpId::mul, normal(2), normal(2), [](double x, double y, DType) { return x * y; }),
      binary(OpId::div, normal(2), away(0.5, 2), [](double x, double y, DType) { return x / y; }),
      // Integer bases away from 0 and exponents of either sign (negative: truncated 1/a^|b|).
      with(binary(OpId::pow, uniform(0.5, 2), normal(1.5),
                  [](double x, double y, DType dt) { return ref::pow(x, y, dt); }),
           [](FunctorOpCase& c) {
             c.int_a = nonzero_ints(-3, 3);
             c.int_b = ints(-2, 5);
           }),
      with(binary(OpId::maximum, normal(2), normal(2),
                  [](double x, double y, DType) { return maximum(x, y); }),
           exact_ties),
      with(binary(OpId::minimum, normal(2), normal(2),
                  [](double x, double y, DType) { return minimum(x, y); }),
           exact_ties),

      compare(OpId::eq, [](double x, double y) { return x == y; }),
      compare(OpId::ne, [](double x, double y) { return x != y; }),
      compare(OpId::lt, [](double x, double y) { return x < y; }),
      compare(OpId::le, [](double x, double y) { return x <= y; }),
      compare(OpId::gt, [](double x, double y) { return x > y; }),
      compare(OpId::ge, [](double x, double y) { return x >= y; }),
  };
}

}  // namespace

const std::vector<FunctorOpCase>& functor_op_cases() {
  static const std::vector<FunctorOpCase> cases = make_cases();
  return cases;
}

const FunctorOpCase* functor_op_case(OpId op) {
  for (const FunctorOpCase& c : functor_op_cases()) {
    if (c.op == op) return &c;
  }
  return nullptr;
}

}  // namespace tessera::ref
