// gradcheck cases for the functor family ops (from their FunctorOpCase), where (broadcast
// conditions) and cast (exact values through a narrower float): the ops whose cases are not
// read from their record (gradcheck_records.cc).
#include "tests/autograd/gradcheck_cases.h"
#include "tests/reference/op_cases.h"

namespace tessera::gradcheck_cases {
namespace {

// Values an op is checked on: smooth everywhere, in [0.5, 1.5), or away from 0.
enum class Domain { real, positive, nonzero };

// The gradcheck domain of a test case's values (tests/reference/op_cases.h).
Domain domain_of(const ref::Domain& d) {
  if (d.positive()) return Domain::positive;
  if (d.kind == ref::Domain::Kind::away_from_zero) return Domain::nonzero;
  return Domain::real;
}

Tensor draw(Maker& mk, Domain d, const Shape& s, Memory m) {
  switch (d) {
    case Domain::real: return mk.normal(s, m);
    case Domain::positive: return mk.positive(s, m);
    case Domain::nonzero: return mk.nonzero(s, m);
  }
  return Tensor();
}

void add_unary(Table& t, OpId op, Domain d, Unary f) {
  t[op] = {[=](Maker& mk) {
             return CaseList{
                 {Covers::contiguous, "[3, 4]", {draw(mk, d, {3, 4}, Memory::contiguous)}, on1(f)},
                 {Covers::contiguous, "0-d", {draw(mk, d, {}, Memory::contiguous)}, on1(f)},
                 {Covers::noncontiguous,
                  "transposed [3, 4]",
                  {draw(mk, d, {3, 4}, Memory::permuted)},
                  on1(f)},
                 {Covers::noncontiguous,
                  "permuted [2, 3, 4]",
                  {draw(mk, d, {2, 3, 4}, Memory::permuted)},
                  on1(f)},
                 {Covers::noncontiguous,
                  "strided [2, 3, 4]",
                  {draw(mk, d, {2, 3, 4}, Memory::strided)},
                  on1(f)},
             };
           },
           ""};
}

// a and b draw from `da`/`db`; `ties` draws distinct values (a even grid, b odd grid).
void add_binary(Table& t, OpId op, Domain da, Domain db, Binary f, bool ties = false) {
  t[op] = {
      [=](Maker& mk) {
        auto a = [&](const Shape& s, Memory m) {
          return ties ? mk.distinct(s, 0, m) : draw(mk, da, s, m);
        };
        auto b = [&](const Shape& s, Memory m) {
          return ties ? mk.distinct(s, 1, m) : draw(mk, db, s, m);
        };
        const Memory C = Memory::contiguous;
        return CaseList{
            {Covers::contiguous, "[3, 4] and [3, 4]", {a({3, 4}, C), b({3, 4}, C)}, on2(f)},
            {Covers::broadcast, "[3, 1, 4] and [2, 4]", {a({3, 1, 4}, C), b({2, 4}, C)}, on2(f)},
            {Covers::broadcast, "[2, 4] and [3, 1, 4]", {a({2, 4}, C), b({3, 1, 4}, C)}, on2(f)},
            {Covers::broadcast, "[3, 4] and 0-d", {a({3, 4}, C), b({}, C)}, on2(f)},
            {Covers::noncontiguous,
             "transposed [3, 4] and strided [3, 4]",
             {a({3, 4}, Memory::permuted), b({3, 4}, Memory::strided)},
             on2(f)},
            {Covers::noncontiguous,
             "permuted [3, 1, 4] and strided [2, 4] (broadcast)",
             {a({3, 1, 4}, Memory::permuted), b({2, 4}, Memory::strided)},
             on2(f)},
        };
      },
      ""};
}

}  // namespace

void add_elementwise_cases(Table& t) {
  // ---- the functor family ops, from their one test case each (tests/reference) ----
  for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
    if (!op_info(fc.op).differentiable) continue;
    const OpId op = fc.op;
    if (fc.unary) {
      add_unary(t, op, fc.kink_at_zero ? Domain::nonzero : domain_of(fc.a),
                [op](const Tensor& x) { return call1(op, {x}); });
    } else {
      add_binary(
          t, op, domain_of(fc.a), domain_of(fc.b),
          [op](const Tensor& a, const Tensor& b) { return call1(op, {a, b}); }, fc.ties);
    }
  }

  {
    // pow: the binary cases (positive base, real exponent) plus a scalar exponent.
    auto binary_cases = t[OpId::pow].make;
    t[OpId::pow].make = [binary_cases](Maker& mk) {
      CaseList cases = binary_cases(mk);
      auto scalar = on1([](const Tensor& x) { return pow(x, 2.5); });
      cases.push_back({Covers::contiguous, "scalar exponent 2.5", {mk.positive({3, 4})}, scalar});
      cases.push_back({Covers::noncontiguous,
                       "scalar exponent 2.5, strided",
                       {mk.positive({3, 4}, Memory::strided)},
                       scalar});
      return cases;
    };
  }
  t[OpId::where] = {
      [](Maker& mk) {
        auto fn = [](const Tensor& cond) {
          return GradcheckFn([cond](const Tensors& in) { return where(cond, in[0], in[1]); });
        };
        const Tensor c34 = on_device(Tensor::from_vector<bool>(
            {true, false, false, true, false, true, true, false, true, true, false, false}, {3, 4}));
        const Tensor c4 = on_device(Tensor::from_vector<bool>({true, false, true, false}, {4}));
        const Tensor c31 = on_device(Tensor::from_vector<bool>({false, true, true}, {3, 1, 1}));
        const Tensor c43t = transpose(
            on_device(Tensor::from_vector<bool>(
                {true, true, false, false, true, false, true, false, false, true, false, true},
                {4, 3})),
            0, 1);
        return CaseList{
            {Covers::contiguous,
             "[3, 4] everywhere",
             {mk.normal({3, 4}), mk.normal({3, 4})},
             fn(c34)},
            {Covers::broadcast,
             "cond [4], a [3, 1, 4], b [2, 4]",
             {mk.normal({3, 1, 4}), mk.normal({2, 4})},
             fn(c4)},
            {Covers::broadcast,
             "cond [3, 1, 1], a [2, 4], b 0-d",
             {mk.normal({2, 4}), mk.normal({})},
             fn(c31)},
            {Covers::noncontiguous,
             "transposed cond, a transposed, b strided",
             {mk.normal({3, 4}, Memory::permuted), mk.normal({3, 4}, Memory::strided)},
             fn(c43t)},
        };
      },
      ""};

  // ---- copies and conversions ----
  t[OpId::cast] = {
      [](Maker& mk) {
        // f64 -> f32 -> f64 is the identity only where f32 is exact. Dyadic inputs (k/64, |x| <= 2)
        // perturbed by eps = 2^-12 stay exact in f32 (14 significant bits), so the central
        // difference is exact; the default 1e-6 step would be rounded away by the f32 cast.
        GradcheckOptions exact_step;
        exact_step.eps = 1.0 / 4096.0;
        auto fn = on1([](const Tensor& x) { return cast(cast(x, DType::f32), DType::f64) * x; });
        return CaseList{
            {Covers::contiguous, "f64 -> f32 -> f64", {mk.dyadic({3, 4})}, fn, exact_step},
            {Covers::noncontiguous,
             "transposed",
             {mk.dyadic({3, 4}, Memory::permuted)},
             fn,
             exact_step},
            {Covers::noncontiguous,
             "strided",
             {mk.dyadic({2, 3, 4}, Memory::strided)},
             fn,
             exact_step},
        };
      },
      ""};
}

}  // namespace tessera::gradcheck_cases
