// Sharded op cases: builders, elementwise ops, comparisons, reductions.
#include "tests/parallel/sharded_cases.h"

#include <algorithm>

#include "tensor/ops.h"
#include "tests/reference/op_cases.h"

namespace tessera::parallel::testing {

InputSpec in(Shape shape, double scale) {
  InputSpec s;
  s.shape = std::move(shape);
  s.hi = scale;
  return s;
}

InputSpec positive(Shape shape, double lo, double hi) {
  InputSpec s;
  s.shape = std::move(shape);
  s.domain = Domain::positive;
  s.lo = lo;
  s.hi = hi;
  return s;
}

InputSpec away(Shape shape, double lo, double hi) {
  InputSpec s = positive(std::move(shape), lo, hi);
  s.domain = Domain::away;
  return s;
}

InputSpec integers(Shape shape, int64_t lo, int64_t hi) {
  InputSpec s;
  s.shape = std::move(shape);
  s.domain = Domain::integers;
  s.lo = static_cast<double>(lo);
  s.hi = static_cast<double>(hi);
  return s;
}

InputSpec index(Shape shape, int64_t lo, int64_t hi, DType dtype) {
  InputSpec s = integers(std::move(shape), lo, hi);
  s.domain = Domain::index;
  s.dtype = dtype;
  s.floating = false;
  return s;
}

InputSpec boolean(Shape shape) {
  InputSpec s;
  s.shape = std::move(shape);
  s.domain = Domain::boolean;
  s.dtype = DType::b8;
  s.floating = false;
  return s;
}

InputSpec fixed_index(Shape shape, std::vector<double> values, DType dtype) {
  InputSpec s;
  s.shape = std::move(shape);
  s.domain = Domain::fixed;
  s.values = std::move(values);
  s.dtype = dtype;
  s.floating = false;
  return s;
}

InputSpec absent() {
  InputSpec s;
  s.absent = true;
  return s;
}

OpCase op_case(OpId op, std::string label, std::vector<InputSpec> inputs, Attrs attrs) {
  OpCase c;
  c.op = op;
  c.label = std::move(label);
  c.inputs = std::move(inputs);
  c.attrs = std::move(attrs);
  return c;
}

std::vector<OpCase> sharded_cases() {
  std::vector<OpCase> out;
  for (auto* family : {&elementwise_cases, &nn_cases, &data_cases, &test_case_cases}) {
    for (OpCase& c : (*family)()) out.push_back(std::move(c));
  }
  std::stable_sort(out.begin(), out.end(), [](const OpCase& a, const OpCase& b) {
    return static_cast<int>(a.op) < static_cast<int>(b.op);
  });
  return out;
}

namespace {

// [5, 7]: uneven on 2 and 4 ranks; [2, 3, 5]: dims smaller than 4 (empty blocks).
const Shape kMatrix = {5, 7};
const Shape kCube = {2, 3, 5};

void unary(std::vector<OpCase>& out, OpId op, InputSpec (*make)(Shape), Attrs attrs = {},
           const std::string& suffix = "") {
  for (const Shape& s : {kMatrix, kCube}) {
    out.push_back(op_case(op, shape_str(s) + suffix, {make(s)}, attrs));
  }
}

InputSpec normal2(Shape s) { return in(std::move(s), 2.0); }

// The sharded suite's input for a test case's domain (tests/reference/op_cases.h).
InputSpec input_for(const ref::Domain& d, Shape s) {
  using Kind = ref::Domain::Kind;
  if (d.positive()) return positive(std::move(s));
  if (d.kind == Kind::away_from_zero) return away(std::move(s));
  if (d.kind == Kind::integers) {
    return integers(std::move(s), static_cast<int64_t>(d.a), static_cast<int64_t>(d.b));
  }
  return in(std::move(s), d.kind == Kind::normal ? d.b : 1.0);  // normal: its scale
}

}  // namespace

// The ops with their cases in tests/reference/op_cases.cc, as given.
std::vector<OpCase> test_case_cases() {
  std::vector<OpCase> out;
  for (const ref::OpTestCase& tc : ref::op_test_cases()) {
    std::vector<InputSpec> inputs;
    for (const ref::OpInput& in : tc.inputs) {
      inputs.push_back(in.dtype ? index(in.shape, static_cast<int64_t>(in.domain.a),
                                        static_cast<int64_t>(in.domain.b), *in.dtype)
                                : input_for(in.domain, in.shape));
    }
    out.push_back(op_case(tc.op, tc.label, std::move(inputs), tc.attrs));
  }
  return out;
}

std::vector<OpCase> elementwise_cases() {
  std::vector<OpCase> out;
  // The functor family ops, from their one test case each: unary ops on a [5, 7] and a
  // [2, 3, 5] input; binary ops and comparisons equal, broadcast both ways, 0-d.
  for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
    auto a = [&](Shape s) { return input_for(fc.a, std::move(s)); };
    auto b = [&](Shape s) { return input_for(fc.b, std::move(s)); };
    if (fc.unary) {
      for (const Shape& s : {kMatrix, kCube}) out.push_back(op_case(fc.op, shape_str(s), {a(s)}));
      continue;
    }
    out.push_back(op_case(fc.op, "[5, 7] . [5, 7]", {a({5, 7}), b({5, 7})}));
    out.push_back(op_case(fc.op, "[3, 1, 5] . [4, 1] (broadcast)", {a({3, 1, 5}), b({4, 1})}));
    if (op_info(fc.op).family != OpFamily::Compare) {
      out.push_back(op_case(fc.op, "[5, 6] . 0-d", {a({5, 6}), b({})}));
    }
  }
  unary(out, OpId::gelu, normal2);
  Attrs tanh_form;
  tanh_form.approximate_tanh = true;
  unary(out, OpId::gelu, normal2, tanh_form, " tanh");
  out.push_back(op_case(OpId::gelu_backward, "[5, 7] erf", {in({5, 7}), in({5, 7}, 2)}));
  out.push_back(
      op_case(OpId::gelu_backward, "[3, 4, 5] tanh", {in({3, 4, 5}), in({3, 4, 5}, 2)},
              tanh_form));

  out.push_back(op_case(OpId::where, "[4, 6] x3", {boolean({4, 6}), in({4, 6}), in({4, 6})}));
  out.push_back(op_case(OpId::where, "cond [4, 5], a [3, 1, 5], b [5] (broadcast)",
                        {boolean({4, 5}), in({3, 1, 5}), in({5})}));
  out.push_back(op_case(OpId::where, "a 0-d", {boolean({5, 3}), in({}), in({5, 3})}));

  // Reductions over a [5, 3, 6] tensor: every dim uneven or smaller than 4 somewhere.
  struct R {
    const char* label;
    std::vector<int64_t> dims;
    bool keepdim;
  };
  const R reductions[] = {{"[5, 3, 6] all", {}, false},
                          {"[5, 3, 6] dims {1}", {1}, false},
                          {"[5, 3, 6] dims {0, 2} keepdim", {0, 2}, true},
                          {"[5, 3, 6] dims {-1}", {-1}, false}};
  for (OpId op : {OpId::sum, OpId::mean, OpId::max}) {
    for (const R& r : reductions) {
      Attrs a;
      a.dims = r.dims;
      a.keepdim = r.keepdim;
      out.push_back(op_case(op, r.label, {in({5, 3, 6})}, a));
    }
  }
  struct A {
    const char* label;
    int64_t dim;
    bool keepdim, all;
  };
  for (const A& r : {A{"[5, 3, 6] dim 1", 1, false, false}, A{"[5, 3, 6] dim 0 keepdim", 0, true, false},
                     A{"[5, 3, 6] dim -1", -1, false, false}, A{"[5, 3, 6] all", 0, false, true}}) {
    Attrs a;
    a.dim = r.dim;
    a.keepdim = r.keepdim;
    a.all_dims = r.all;
    out.push_back(op_case(OpId::argmax, r.label, {in({5, 3, 6})}, a));
  }
  struct V {
    const char* label;
    std::vector<int64_t> dims;
    int64_t correction;
    bool keepdim;
  };
  for (const V& v : {V{"[5, 3, 6] all", {}, 1, false}, V{"[5, 3, 6] dims {1} correction 0", {1}, 0, false},
                     V{"[5, 3, 6] dims {0, 2} keepdim correction 2", {0, 2}, 2, true}}) {
    Attrs a;
    a.dims = v.dims;
    a.correction = v.correction;
    a.keepdim = v.keepdim;
    out.push_back(op_case(OpId::var, v.label, {in({5, 3, 6})}, a));
  }
  return out;
}

}  // namespace tessera::parallel::testing
