// gradcheck cases for elementwise ops, reductions, copies and views.
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
                 {Layout::contiguous, "[3, 4]", {draw(mk, d, {3, 4}, Memory::contiguous)}, on1(f)},
                 {Layout::contiguous, "0-d", {draw(mk, d, {}, Memory::contiguous)}, on1(f)},
                 {Layout::noncontiguous,
                  "transposed [3, 4]",
                  {draw(mk, d, {3, 4}, Memory::transposed)},
                  on1(f)},
                 {Layout::noncontiguous,
                  "permuted [2, 3, 4]",
                  {draw(mk, d, {2, 3, 4}, Memory::permuted)},
                  on1(f)},
                 {Layout::noncontiguous,
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
            {Layout::contiguous, "[3, 4] and [3, 4]", {a({3, 4}, C), b({3, 4}, C)}, on2(f)},
            {Layout::broadcast, "[3, 1, 4] and [2, 4]", {a({3, 1, 4}, C), b({2, 4}, C)}, on2(f)},
            {Layout::broadcast, "[2, 4] and [3, 1, 4]", {a({2, 4}, C), b({3, 1, 4}, C)}, on2(f)},
            {Layout::broadcast, "[3, 4] and 0-d", {a({3, 4}, C), b({}, C)}, on2(f)},
            {Layout::noncontiguous,
             "transposed [3, 4] and strided [3, 4]",
             {a({3, 4}, Memory::transposed), b({3, 4}, Memory::strided)},
             on2(f)},
            {Layout::noncontiguous,
             "permuted [3, 1, 4] and strided [2, 4] (broadcast)",
             {a({3, 1, 4}, Memory::permuted), b({2, 4}, Memory::strided)},
             on2(f)},
        };
      },
      ""};
}

// Reductions: cases over all dims, one dim, several dims with keepdim, on each layout.
using Reduce = std::function<Tensor(const Tensor&, const std::vector<int64_t>&, bool)>;
void add_reduction(Table& t, OpId op, Reduce f, bool ties) {
  t[op] = {[=](Maker& mk) {
             auto x = [&](const Shape& s, Memory m) {
               return ties ? mk.distinct(s, 0, m) : mk.normal(s, m);
             };
             auto fn = [f](std::vector<int64_t> dims, bool keepdim) {
               return GradcheckFn([=](const Tensors& in) { return f(in[0], dims, keepdim); });
             };
             return CaseList{
                 {Layout::contiguous, "all dims", {x({3, 4}, Memory::contiguous)}, fn({}, false)},
                 {Layout::contiguous, "dim 1", {x({2, 3, 4}, Memory::contiguous)}, fn({1}, false)},
                 {Layout::contiguous,
                  "dims {0, 2} keepdim",
                  {x({2, 3, 4}, Memory::contiguous)},
                  fn({0, 2}, true)},
                 {Layout::contiguous,
                  "dims {-1, -3} over a size-1 dim",
                  {x({2, 1, 4}, Memory::contiguous)},
                  fn({-1, -3}, false)},
                 {Layout::contiguous, "0-d input", {x({}, Memory::contiguous)}, fn({}, false)},
                 {Layout::noncontiguous,
                  "permuted, dim -1",
                  {x({2, 3, 4}, Memory::permuted)},
                  fn({-1}, false)},
                 {Layout::noncontiguous,
                  "strided, dims {0, 1} keepdim",
                  {x({2, 3, 4}, Memory::strided)},
                  fn({0, 1}, true)},
                 {Layout::noncontiguous,
                  "transposed, all dims",
                  {x({3, 4}, Memory::transposed)},
                  fn({}, true)},
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
  t[OpId::gelu] = {[](Maker& mk) {
                     auto exact = on1([](const Tensor& x) { return gelu(x, false); });
                     auto approx = on1([](const Tensor& x) { return gelu(x, true); });
                     return CaseList{
                         {Layout::contiguous, "erf", {mk.normal({3, 4})}, exact},
                         {Layout::contiguous, "tanh approximation", {mk.normal({3, 4})}, approx},
                         {Layout::noncontiguous,
                          "erf, transposed",
                          {mk.normal({3, 4}, Memory::transposed)},
                          exact},
                         {Layout::noncontiguous,
                          "tanh approximation, strided",
                          {mk.normal({2, 3, 4}, Memory::strided)},
                          approx},
                     };
                   },
                   ""};

  {
    // pow: the binary cases (positive base, real exponent) plus a scalar exponent.
    auto binary_cases = t[OpId::pow].make;
    t[OpId::pow].make = [binary_cases](Maker& mk) {
      CaseList cases = binary_cases(mk);
      auto scalar = on1([](const Tensor& x) { return pow(x, 2.5); });
      cases.push_back({Layout::contiguous, "scalar exponent 2.5", {mk.positive({3, 4})}, scalar});
      cases.push_back({Layout::noncontiguous,
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
            {Layout::contiguous,
             "[3, 4] everywhere",
             {mk.normal({3, 4}), mk.normal({3, 4})},
             fn(c34)},
            {Layout::broadcast,
             "cond [4], a [3, 1, 4], b [2, 4]",
             {mk.normal({3, 1, 4}), mk.normal({2, 4})},
             fn(c4)},
            {Layout::broadcast,
             "cond [3, 1, 1], a [2, 4], b 0-d",
             {mk.normal({2, 4}), mk.normal({})},
             fn(c31)},
            {Layout::noncontiguous,
             "transposed cond, a transposed, b strided",
             {mk.normal({3, 4}, Memory::transposed), mk.normal({3, 4}, Memory::strided)},
             fn(c43t)},
        };
      },
      ""};

  // ---- reductions ----
  add_reduction(
      t, OpId::sum,
      [](const Tensor& x, const std::vector<int64_t>& d, bool k) { return sum(x, d, k); }, false);
  add_reduction(
      t, OpId::mean,
      [](const Tensor& x, const std::vector<int64_t>& d, bool k) { return mean(x, d, k); }, false);
  add_reduction(
      t, OpId::max,
      [](const Tensor& x, const std::vector<int64_t>& d, bool k) { return max(x, d, k); }, true);
  t[OpId::var] = {
      [](Maker& mk) {
        auto fn = [](std::vector<int64_t> dims, int64_t correction, bool keepdim) {
          return GradcheckFn(
              [=](const Tensors& in) { return var(in[0], dims, correction, keepdim); });
        };
        return CaseList{
            {Layout::contiguous, "all dims, unbiased", {mk.normal({3, 4})}, fn({}, 1, false)},
            {Layout::contiguous, "dim 1, biased", {mk.normal({2, 3, 4})}, fn({1}, 0, false)},
            {Layout::contiguous,
             "dims {0, 2} keepdim",
             {mk.normal({2, 3, 4})},
             fn({0, 2}, 1, true)},
            {Layout::noncontiguous,
             "permuted, dim -1",
             {mk.normal({2, 3, 4}, Memory::permuted)},
             fn({-1}, 1, false)},
            {Layout::noncontiguous,
             "strided, dims {0, 1}",
             {mk.normal({2, 3, 4}, Memory::strided)},
             fn({0, 1}, 1, true)},
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
            {Layout::contiguous, "f64 -> f32 -> f64", {mk.dyadic({3, 4})}, fn, exact_step},
            {Layout::noncontiguous,
             "transposed",
             {mk.dyadic({3, 4}, Memory::transposed)},
             fn,
             exact_step},
            {Layout::noncontiguous,
             "strided",
             {mk.dyadic({2, 3, 4}, Memory::strided)},
             fn,
             exact_step},
        };
      },
      ""};
  t[OpId::to_device] = {
      [](Maker& mk) {
        // to() returns its input when the device already matches; call the op itself (cpu ->
        // cpu, or within the device the case runs on).
        auto fn = on1([](const Tensor& x) {
          Attrs a;
          a.device = x.device();
          return call1(OpId::to_device, {x}, a) * x;
        });
        return CaseList{
            {Layout::contiguous, "cpu -> cpu", {mk.normal({3, 4})}, fn},
            {Layout::noncontiguous, "transposed", {mk.normal({3, 4}, Memory::transposed)}, fn},
            {Layout::noncontiguous, "strided", {mk.normal({2, 3, 4}, Memory::strided)}, fn},
        };
      },
      ""};
  t[OpId::clone] = {
      [](Maker& mk) {
        auto fn = on1([](const Tensor& x) { return clone(x) * x; });
        return CaseList{
            {Layout::contiguous, "[3, 4]", {mk.normal({3, 4})}, fn},
            {Layout::noncontiguous, "permuted", {mk.normal({2, 3, 4}, Memory::permuted)}, fn},
            {Layout::noncontiguous, "strided", {mk.normal({2, 3, 4}, Memory::strided)}, fn},
        };
      },
      ""};

  // ---- views (each result is multiplied by a function of itself so the gradient is not
  // just a copy of the projection) ----
  auto view_case = [](Layout l, std::string label, Tensor x, Unary f) {
    return Case{l, std::move(label), {std::move(x)}, on1([f](const Tensor& in) {
                  const Tensor y = f(in);
                  return y * tanh(y);
                })};
  };
  t[OpId::view] = {[=](Maker& mk) {
                     return CaseList{
                         view_case(Layout::contiguous, "[3, 4] -> [2, 6]", mk.normal({3, 4}),
                                   [](const Tensor& x) {
                                     return view(x, {2, 6});
                                   }),
                         view_case(Layout::contiguous, "[2, 3, 4] -> [-1]", mk.normal({2, 3, 4}),
                                   [](const Tensor& x) { return view(x, {-1}); }),
                         // Splitting and merging dims that stay contiguous within a strided tensor.
                         view_case(Layout::noncontiguous, "strided [2, 3, 4] -> [6, 2, 2]",
                                   mk.normal({2, 3, 4}, Memory::strided),
                                   [](const Tensor& x) {
                                     return view(x, {6, 2, 2});
                                   }),
                         view_case(Layout::noncontiguous, "transposed [4, 3] -> [2, 2, 3]",
                                   mk.normal({4, 3}, Memory::transposed),
                                   [](const Tensor& x) {
                                     return view(x, {2, 2, 3});
                                   }),
                     };
                   },
                   ""};
  t[OpId::permute] = {[=](Maker& mk) {
                        auto p = [](const Tensor& x) { return permute(x, {2, 0, 1}); };
                        return CaseList{
                            view_case(Layout::contiguous, "{2, 0, 1}", mk.normal({2, 3, 4}), p),
                            view_case(Layout::noncontiguous, "permuted input",
                                      mk.normal({2, 3, 4}, Memory::permuted), p),
                            view_case(Layout::noncontiguous, "strided input",
                                      mk.normal({2, 3, 4}, Memory::strided), p),
                        };
                      },
                      ""};
  t[OpId::slice] = {
      [=](Maker& mk) {
        return CaseList{
            view_case(Layout::contiguous, "dim 1 [1, 4)", mk.normal({3, 5}),
                      [](const Tensor& x) { return slice(x, 1, 1, 4); }),
            view_case(Layout::contiguous, "dim 0, step 2, negative start", mk.normal({5, 3}),
                      [](const Tensor& x) { return slice(x, 0, -4, 5, 2); }),
            view_case(Layout::contiguous, "dim -1, step 3, end past the size", mk.normal({2, 7}),
                      [](const Tensor& x) { return slice(x, -1, 1, 100, 3); }),
            view_case(Layout::contiguous, "step larger than the dim", mk.normal({3, 5}),
                      [](const Tensor& x) { return slice(x, 1, 1, 5, 7); }),
            view_case(Layout::contiguous, "negative end", mk.normal({3, 6}),
                      [](const Tensor& x) { return slice(x, 1, 1, -1, 2); }),
            view_case(Layout::noncontiguous, "transposed, dim 0 step 2",
                      mk.normal({5, 3}, Memory::transposed),
                      [](const Tensor& x) { return slice(x, 0, 0, 5, 2); }),
            view_case(Layout::noncontiguous, "strided, dim -1 step 2",
                      mk.normal({2, 3, 5}, Memory::strided),
                      [](const Tensor& x) { return slice(x, -1, 1, 5, 2); }),
        };
      },
      ""};
  t[OpId::expand] = {[=](Maker& mk) {
                       return CaseList{
                           view_case(Layout::contiguous, "[3, 1] -> [2, 3, 4]", mk.normal({3, 1}),
                                     [](const Tensor& x) {
                                       return expand(x, {2, 3, 4});
                                     }),
                           view_case(Layout::broadcast, "[1, 4] -> [3, -1]", mk.normal({1, 4}),
                                     [](const Tensor& x) {
                                       return expand(x, {3, -1});
                                     }),
                           view_case(Layout::noncontiguous, "permuted [3, 1, 2]",
                                     mk.normal({3, 1, 2}, Memory::permuted),
                                     [](const Tensor& x) {
                                       return expand(x, {2, 3, 5, 2});
                                     }),
                           view_case(Layout::noncontiguous, "strided [3, 1, 2]",
                                     mk.normal({3, 1, 2}, Memory::strided),
                                     [](const Tensor& x) {
                                       return expand(x, {3, 4, 2});
                                     }),
                       };
                     },
                     ""};
  t[OpId::squeeze] = {
      [=](Maker& mk) {
        return CaseList{
            view_case(Layout::contiguous, "all size-1 dims", mk.normal({3, 1, 4, 1}),
                      [](const Tensor& x) { return squeeze(x); }),
            view_case(Layout::contiguous, "dim 1 only", mk.normal({3, 1, 4, 1}),
                      [](const Tensor& x) { return squeeze(x, {1}); }),
            view_case(Layout::noncontiguous, "permuted", mk.normal({3, 1, 4, 1}, Memory::permuted),
                      [](const Tensor& x) { return squeeze(x); }),
            view_case(Layout::noncontiguous, "strided", mk.normal({3, 1, 4}, Memory::strided),
                      [](const Tensor& x) { return squeeze(x, {-2}); }),
        };
      },
      ""};
  t[OpId::unsqueeze] = {[=](Maker& mk) {
                          return CaseList{
                              view_case(Layout::contiguous, "dim 0", mk.normal({3, 4}),
                                        [](const Tensor& x) { return unsqueeze(x, 0); }),
                              view_case(Layout::contiguous, "dim -1", mk.normal({3, 4}),
                                        [](const Tensor& x) { return unsqueeze(x, -1); }),
                              view_case(Layout::noncontiguous, "transposed, dim 1",
                                        mk.normal({3, 4}, Memory::transposed),
                                        [](const Tensor& x) { return unsqueeze(x, 1); }),
                              view_case(Layout::noncontiguous, "strided, dim 2",
                                        mk.normal({2, 3, 4}, Memory::strided),
                                        [](const Tensor& x) { return unsqueeze(x, 2); }),
                          };
                        },
                        ""};
}

}  // namespace tessera::gradcheck_cases
