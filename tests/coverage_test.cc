// The coverage table: every op of tensor/op_list.h against every layer and every runner,
// printed in one place and checked. Columns: the op's family; a CPU kernel, a CUDA kernel
// (registered under --config=cuda only), shape inference, a derivative, a sharding rule;
// the cases of its record (tests/reference/cases_*.cc, run by the op sweep), of gradcheck
// and of the sharded suite (most read from the record); whether a functor family op has
// its FunctorOpCase (tests/reference/op_cases.cc) that builds its record; and the runners
// that also have cases written by hand, outside the record (g: gradcheck, s: sharded).
//
//   bazel test //tests:coverage_test --test_output=all     # prints the table
//
// Adding an op without an entry in some layer or runner fails here, naming what is missing.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>
#include <string>

#include "autograd/autograd.h"
#include "parallel/sharding_rule.h"
#include "tests/autograd/gradcheck_cases.h"
#include "tests/parallel/sharded_cases.h"
#include "tests/reference/op_cases.h"
#include "tests/reference/cases.h"

namespace tessera {
namespace {

const char* family_name(OpFamily f) {
  switch (f) {
    case OpFamily::UnaryFloat: return "unary-float";
    case OpFamily::UnaryNumeric: return "unary-numeric";
    case OpFamily::Binary: return "binary";
    case OpFamily::BinaryFloat: return "binary-float";
    case OpFamily::Compare: return "compare";
    case OpFamily::Pointwise: return "pointwise";
    case OpFamily::Reduce: return "reduce";
    case OpFamily::Linear: return "linear";
    case OpFamily::Fused: return "fused";
    case OpFamily::Index: return "index";
    case OpFamily::Join: return "join";
    case OpFamily::Copy: return "copy";
    case OpFamily::InplaceUpdate: return "inplace-update";
    case OpFamily::View: return "view";
    case OpFamily::Factory: return "factory";
  }
  return "?";
}

struct Row {
  int64_t sweep = 0, grad = 0, sharded = 0;
  std::string hand;  // runners with cases written outside the op's record: g(radcheck), s(harded)
};

std::map<OpId, Row> case_counts() {
  std::map<OpId, Row> rows;
  for (const sweep::OpSweep& s : sweep::all_sweeps()) rows[s.op].sweep += static_cast<int64_t>(s.cases.size());
  const gradcheck_cases::Table table = gradcheck_cases::make_table();
  gradcheck_cases::Table by_hand;
  gradcheck_cases::add_elementwise_cases(by_hand);
  gradcheck_cases::add_nn_cases(by_hand);
  for (const auto& [op, cases] : by_hand) {
    if (!is_functor_family(op_info(op).family)) rows[op].hand += "g";
  }
  for (const parallel::testing::OpCase& c : parallel::testing::data_cases()) {
    if (rows[c.op].hand.find('s') == std::string::npos) rows[c.op].hand += "s";
  }
  gradcheck_cases::Maker maker(1);
  for (const auto& [op, cases] : table) rows[op].grad = static_cast<int64_t>(cases.make(maker).size());
  for (const parallel::testing::OpCase& c : parallel::testing::sharded_cases()) ++rows[c.op].sharded;
  return rows;
}

TEST_CASE("coverage: every op has its entry in every layer and every runner") {
  const std::map<OpId, Row> rows = case_counts();
  std::string table = fmt::format("{:<24} {:<15} {:>4} {:>4} {:>4} {:>4} {:>4} {:>6} {:>5} {:>7} {:>4} {:>4}\n",
                                  "op", "family", "cpu", "cuda", "meta", "grad", "rule",
                                  "record", "gradc", "sharded", "case", "hand");
  int functor_ops = 0, functor_cases = 0;
  for (const OpInfo& info : all_ops()) {
    CAPTURE(info.name);
    const Row row = rows.count(info.id) ? rows.at(info.id) : Row{};
    const bool cpu = kernel_fn(DeviceType::cpu, info.id) != nullptr;
    const bool cuda = kernel_fn(DeviceType::cuda, info.id) != nullptr;
    const bool meta = meta_fn(info.id) != nullptr;
    const bool grad = autograd::derivative_for(info.id) != nullptr;
    const bool rule = parallel::sharding_rule_for(info.id) != nullptr;
    const bool functor = is_functor_family(info.family);
    const bool has_case = ref::functor_op_case(info.id) != nullptr;
    auto mark = [](bool b) { return b ? "x" : "-"; };
    table += fmt::format("{:<24} {:<15} {:>4} {:>4} {:>4} {:>4} {:>4} {:>6} {:>5} {:>7} {:>4} {:>4}\n",
                         info.name, family_name(info.family), mark(cpu), mark(cuda), mark(meta),
                         mark(grad), mark(rule), row.sweep, row.grad, row.sharded,
                         functor ? mark(has_case) : "", row.hand);
    const bool computes = info.kind == OpKind::Compute || info.kind == OpKind::Factory;
    if (computes) {
      CHECK_MESSAGE(cpu, info.name, ": no CPU kernel");
      CHECK_MESSAGE(meta, info.name, ": no shape inference");
    }
    CHECK_MESSAGE(rule, info.name, ": no sharding rule");
    CHECK_MESSAGE(row.sweep > 0, info.name, ": no op sweep case");
    CHECK_MESSAGE(row.sharded > 0, info.name, ": no sharded case");
    if (info.differentiable && info.kind != OpKind::Composite) {
      CHECK_MESSAGE(grad, info.name, ": no derivative");
      CHECK_MESSAGE(row.grad > 0, info.name, ": no gradcheck case");
    }
    if (functor) {
      ++functor_ops;
      CHECK_MESSAGE(has_case, info.name, ": a functor family op without its test case in "
                                         "tests/reference/op_cases.cc");
      functor_cases += has_case ? 1 : 0;
    } else {
      CHECK_MESSAGE(!has_case, info.name, ": a test case in op_cases.cc but not a functor op");
    }
  }
  MESSAGE("\n" << table);
  // Every record of op_cases.cc is one functor op, each op once.
  CHECK(functor_cases == functor_ops);
  CHECK(static_cast<int>(ref::functor_op_cases().size()) == functor_ops);
}

}  // namespace
}  // namespace tessera
