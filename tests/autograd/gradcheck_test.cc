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
// Most cases are read from the ops' records (tests/reference/cases.h, gradcheck_records.cc:
// their domains, drawn continuous, with the cases at IEEE specials, ties and NaN outputs
// left out); the functor family ops' come from their FunctorOpCase, with inputs away from
// kinks and ties (Maker: positive bases for log/sqrt/pow, |x| bounded away from 0 for
// abs/relu, distinct values for maximum/minimum); a few are written by hand where a record
// cannot say it (gradcheck_cases_*.cc). Tolerances are gradcheck's defaults unless a case
// says why. The per-case checks are in gradcheck_cases_check.cc (shared with
// tests/cuda/cuda_gradcheck_test.cc).
#include <doctest/doctest.h>

#include <cmath>
#include <set>

#include "tests/autograd/gradcheck_cases.h"

namespace tessera {
namespace {

using namespace gradcheck_cases;

const Table& table() {
  static const Table* t = [] {
    return new Table(make_table());
  }();
  return *t;
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
    std::set<Covers> layouts;
    for (const Case& c : it->second.make(mk)) layouts.insert(c.covers);
    CHECK_MESSAGE(layouts.count(Covers::contiguous), info.name, ": no contiguous case");
    CHECK_MESSAGE(layouts.count(Covers::noncontiguous), info.name, ": no non-contiguous case");
    if (broadcasting.count(info.id)) {
      CHECK_MESSAGE(layouts.count(Covers::broadcast), info.name, ": no broadcast case");
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
    checked += check_op_cases(info, it->second, 1000 + static_cast<uint64_t>(info.id)).checked;
  }
  MESSAGE("gradchecked ", checked, " cases");
  CHECK(checked > 100);
}

}  // namespace
}  // namespace tessera
