// Finite-difference gradient checks (f64, autograd::gradcheck) for every differentiable op in
// the op list, each with contiguous inputs, broadcast inputs (binary ops, where) and
// non-contiguous inputs (transposed / permuted / strided-slice views of f64 leaves).
//
// The case table is keyed by OpId; "every Diff op has cases" walks all_ops(), so an op added
// to the list without a gradcheck here fails this suite. Each case also checks that its
// graph really contains the op's node, and (non-contiguous cases) that the forward equals the
// forward on contiguous copies, so a kernel that ignores strides cannot pass by being
// consistently wrong.
//
// Inputs stay inside each op's domain and away from kinks and ties (see Maker): positive
// bases for log/sqrt/pow, |x| bounded away from 0 for abs/relu, distinct values on a grid for
// max/maximum/minimum/max_pool2d. Tolerances are gradcheck's defaults unless a case says why.
// The cases live in gradcheck_cases_*.cc (Maker and the Table type in gradcheck_cases.h).
#include <doctest/doctest.h>

#include <cmath>
#include <set>

#include "tests/autograd/gradcheck_cases.h"

namespace tessera {
namespace {

using namespace gradcheck_cases;

const Table& table() {
  static const Table* t = [] {
    auto* table = new Table;
    add_elementwise_cases(*table);
    add_nn_cases(*table);
    return table;
  }();
  return *t;
}

// ---- checks ---------------------------------------------------------------------------------

bool graph_contains(const Tensor& out, std::string_view name) {
  std::vector<autograd::Node*> stack;
  std::set<autograd::Node*> seen;
  if (out.grad_fn()) stack.push_back(out.grad_fn().get());
  while (!stack.empty()) {
    autograd::Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    if (n->name() == name) return true;
    for (const autograd::Edge& e : n->next_edges()) {
      if (e.valid()) stack.push_back(e.fn.get());
    }
  }
  return false;
}

// Max |a - b| over elements; infinity when shapes differ or a value is NaN.
double max_diff(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return INFINITY;
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = std::abs(x[i] - y[i]);
    if (std::isnan(d)) return INFINITY;  // e.g. a kernel that read the NaN gaps of a strided leaf
    m = std::max(m, d);
  }
  return m;
}

TEST_CASE("every differentiable op has gradcheck cases for each layout it must cover") {
  const std::set<OpId> broadcasting = {OpId::add, OpId::sub,     OpId::mul,     OpId::div,
                                       OpId::pow, OpId::maximum, OpId::minimum, OpId::where};
  int diff_ops = 0;
  for (const OpInfo& info : all_ops()) {
    const auto it = table().find(info.id);
    if (!info.differentiable) {
      CHECK_MESSAGE(it == table().end(), info.name, " is NoDiff but has gradcheck cases");
      continue;
    }
    ++diff_ops;
    CAPTURE(info.name);
    CHECK_MESSAGE(it != table().end(), info.name,
                  " is marked Diff in tensor/op_list.h but has no gradcheck case here");
    if (it == table().end()) continue;
    Maker mk(1);
    std::set<Layout> layouts;
    for (const Case& c : it->second.make(mk)) layouts.insert(c.layout);
    CHECK_MESSAGE(layouts.count(Layout::contiguous), info.name, ": no contiguous case");
    CHECK_MESSAGE(layouts.count(Layout::noncontiguous), info.name, ": no non-contiguous case");
    if (broadcasting.count(info.id)) {
      CHECK_MESSAGE(layouts.count(Layout::broadcast), info.name, ": no broadcast case");
    }
  }
  CHECK(diff_ops == static_cast<int>(table().size()));
}

TEST_CASE("gradcheck: analytical gradients match central differences for every Diff op") {
  int checked = 0;
  for (const OpInfo& info : all_ops()) {
    if (!info.differentiable) continue;
    const auto it = table().find(info.id);
    if (it == table().end()) continue;  // reported by the coverage test
    Maker mk(1000 + static_cast<uint64_t>(info.id));
    const std::string node = it->second.node.empty() ? std::string(info.name) : it->second.node;
    for (const Case& c : it->second.make(mk)) {
      const std::string where =
          fmt::format("{} [{}: {}]", info.name, layout_name(c.layout), c.label);
      CAPTURE(where);
      for (const Tensor& in : c.inputs) {
        if (in.requires_grad()) {
          REQUIRE(in.is_leaf());
          REQUIRE(in.dtype() == DType::f64);
        }
      }
      if (c.layout == Layout::noncontiguous) {
        bool any = false;
        for (const Tensor& in : c.inputs) any = any || (in.requires_grad() && !in.is_contiguous());
        CHECK_MESSAGE(any, where, ": no input is non-contiguous");
      }
      const Tensor out = c.fn(c.inputs);
      CHECK_MESSAGE(graph_contains(out, node), where, ": the graph has no ", node, " node");

      if (c.layout == Layout::noncontiguous) {
        // The op must compute the same values as on contiguous copies of its inputs.
        NoGradGuard no_grad;
        Tensors copies;
        for (const Tensor& in : c.inputs) copies.push_back(in.requires_grad() ? clone(in) : in);
        const double d = max_diff(out.detach(), c.fn(copies));
        CHECK_MESSAGE(d <= 1e-12, where, ": non-contiguous forward differs from contiguous by ", d);
      }

      const autograd::GradcheckResult r = autograd::gradcheck(c.fn, c.inputs, c.options);
      CHECK_MESSAGE(r.ok, where, ": ", r.message);
      ++checked;
    }
  }
  MESSAGE("gradchecked ", checked, " cases");
  CHECK(checked > 100);
}

}  // namespace
}  // namespace tessera
