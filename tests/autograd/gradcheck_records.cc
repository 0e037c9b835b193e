// gradcheck cases derived from each op's record (tests/reference/cases.h): the same inputs,
// domains, attributes and run as the op sweep, in f64, differentiated through output
// `grad_output`. A case is gradchecked when it says so (Case::grad, default true), its op is
// differentiable, it runs in f64, that output is floating, and its floating inputs are
// drawn (no fixed values: those are IEEE specials and masks, not points where a derivative
// exists), hold no integer-valued domain (ties), and hold between 1 and kMaxValues values in
// all (finite differences cost two runs per value).
//
// Each case runs contiguous and, where an input can be laid out, with every floating input
// in the sweep's permuted layout or, where that leaves it contiguous (rank < 2, size-1
// dims), its strided layout: f64 leaves that are views of a larger buffer (gaps hold NaN).
#include "tests/autograd/gradcheck_cases.h"
#include "tests/reference/cases.h"

#include <algorithm>

namespace tessera::gradcheck_cases {
namespace {

constexpr int64_t kMaxValues = 600;

using sweep::Arg;
using Kind = ref::Domain::Kind;

bool floating_arg(const Arg& a) { return !a.absent && !a.dtype; }

bool eligible(const sweep::OpSweep& s, const sweep::Case& c) {
  if (!c.grad || c.grad_output < 0 || !op_info(s.op).differentiable) return false;
  if (!sweep::runs_in(s, c, DType::f64)) return false;
  if (c.out_dtype && !is_floating(c.out_dtype(DType::f64, static_cast<size_t>(c.grad_output)))) {
    return false;
  }
  int64_t values = 0;
  for (const Arg& a : c.args) {
    if (!floating_arg(a)) continue;
    const Kind k = a.domain.kind;
    if (k == Kind::fixed || k == Kind::integers || k == Kind::nonzero_integers ||
        k == Kind::boolean) {
      return false;
    }
    values += numel_of(a.shape);
  }
  return values > 0 && values <= kMaxValues;
}

// The inputs of case ci in f64, floating ones as leaves laid out as `layout` (or contiguous
// where that layout changes nothing for them). `laid_out`: some leaf is not contiguous.
Tensors inputs_of(const sweep::OpSweep& s, const sweep::Case& c, size_t ci, sweep::Layout layout,
                  bool& laid_out) {
  NoGradGuard no_grad;
  const sweep::Arrays vals = sweep::draw_inputs(s, c, ci, DType::f64);
  Tensors in;
  laid_out = false;
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    if (a.absent) continue;  // gradcheck's inputs are defined tensors: with_absent() adds it
    if (!floating_arg(a)) {
      in.push_back(sweep::build(vals[i], sweep::arg_dtype(a, DType::f64), sweep::Layout::contiguous, i).tensor);
      continue;
    }
    sweep::Built b = sweep::build(vals[i], DType::f64, layout, i);
    if (layout == sweep::Layout::permuted && b.tensor.is_contiguous()) {
      b = sweep::build(vals[i], DType::f64, sweep::Layout::strided, i);  // rank < 2, size-1 dims
    }
    laid_out = laid_out || !b.tensor.is_contiguous();
    in.push_back(b.tensor.requires_grad_());
  }
  return in;
}

// The op's inputs from gradcheck's: undefined tensors where the case's inputs are absent.
Tensors with_absent(const sweep::Case& c, const Tensors& given) {
  Tensors in;
  size_t k = 0;
  for (const Arg& a : c.args) in.push_back(a.absent ? Tensor() : given.at(k++));
  return in;
}

}  // namespace

void add_record_cases(Table& t) {
  for (const sweep::OpSweep& s : sweep::all_sweeps()) {
    std::vector<size_t> picked;
    for (size_t ci = 0; ci < s.cases.size(); ++ci) {
      if (eligible(s, s.cases[ci])) picked.push_back(ci);
    }
    if (picked.empty()) continue;
    OpCases& entry = t[s.op];
    // A composite op's graph holds the ops it is made of.
    if (s.op == OpId::stack) entry.node = "cat";
    if (s.op == OpId::split) entry.node = "slice";
    auto previous = entry.make;
    const sweep::OpSweep* sp = &s;  // all_sweeps() lives as long as the program
    entry.make = [previous, sp, picked](Maker& mk) {
      const sweep::OpSweep& s = *sp;
      CaseList cases = previous ? previous(mk) : CaseList{};
      for (size_t ci : picked) {
        const sweep::Case* cp = &s.cases[ci];
        const sweep::Case& c = *cp;
        const GradcheckFn fn = [sp, cp](const Tensors& in) {
          return sweep::run_case(*sp, *cp, with_absent(*cp, in), DType::f64)
              .at(static_cast<size_t>(cp->grad_output));
        };
        bool laid_out = false;
        cases.push_back({Covers::contiguous, c.label,
                         inputs_of(s, c, ci, sweep::Layout::contiguous, laid_out), fn});
        const auto allows = [&c](sweep::Layout l) {
          return std::find(c.layouts.begin(), c.layouts.end(), l) != c.layouts.end();
        };
        if (!allows(sweep::Layout::permuted) || !allows(sweep::Layout::strided)) continue;
        Tensors strided = inputs_of(s, c, ci, sweep::Layout::permuted, laid_out);
        if (laid_out) {
          cases.push_back({Covers::noncontiguous, c.label + ", permuted/strided", std::move(strided), fn});
        }
      }
      return cases;
    };
  }
}

}  // namespace tessera::gradcheck_cases
