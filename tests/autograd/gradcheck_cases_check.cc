// The checks every gradcheck case goes through (check_op_cases in gradcheck_cases.h), shared
// by the CPU suite and the cuda:0 suite.
#include <fmt/format.h>

#include <cmath>
#include <set>

#include "tests/autograd/gradcheck_cases.h"

namespace tessera::gradcheck_cases {
namespace {

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

}  // namespace

OpResult check_op_cases(const OpInfo& info, const OpCases& cases, uint64_t seed) {
  OpResult result;
  Maker mk(seed);
  const std::string node = cases.node.empty() ? std::string(info.name) : cases.node;
  auto fail = [&](const std::string& message) {
    FAIL_CHECK(message);
    if (result.first_failure.empty()) result.first_failure = message;
  };
  CaseList list;
  try {
    list = cases.make(mk);
  } catch (const std::exception& e) {
    fail(fmt::format("{}: making the cases on {} threw: {}", info.name, case_device(), e.what()));
    ++result.failed;
    return result;
  }
  for (const Case& c : list) {
    const std::string where =
        fmt::format("{} [{}: {}]", info.name, covers_name(c.covers), c.label);
    bool ok = true;
    auto check = [&](bool condition, const std::string& message) {
      if (!condition) {
        ok = false;
        fail(fmt::format("{}: {}", where, message));
      }
    };
    try {
      for (const Tensor& in : c.inputs) {
        if (in.requires_grad()) {
          check(in.is_leaf(), "a differentiable input is not a leaf");
          check(in.dtype() == DType::f64, "a differentiable input is not f64");
        }
      }
      if (c.covers == Covers::noncontiguous) {
        bool any = false;
        for (const Tensor& in : c.inputs) any = any || (in.requires_grad() && !in.is_contiguous());
        check(any, "no input is non-contiguous");
      }
      const Tensor out = c.fn(c.inputs);
      check(graph_contains(out, node), fmt::format("the graph has no {} node", node));

      if (c.covers == Covers::noncontiguous) {
        // The op must compute the same values as on contiguous copies of its inputs.
        NoGradGuard no_grad;
        Tensors copies;
        for (const Tensor& in : c.inputs) copies.push_back(in.requires_grad() ? clone(in) : in);
        const double d = max_diff(out.detach(), c.fn(copies));
        check(d <= 1e-12, fmt::format("non-contiguous forward differs from contiguous by {}", d));
      }

      const autograd::GradcheckResult r = autograd::gradcheck(c.fn, c.inputs, c.options);
      check(r.ok, r.message);
    } catch (const std::exception& e) {
      check(false, fmt::format("threw: {}", e.what()));
    }
    ++result.checked;
    result.failed += ok ? 0 : 1;
  }
  return result;
}

}  // namespace tessera::gradcheck_cases
