// The op sweep: every op in tensor/op_list.h, over every dtype it supports and every input
// layout, against the f64 reference (tests/reference). See op_sweep.h for the harness and
// the tolerances; the cases live in tests/reference/cases_{elementwise,nn,data,factories,optim}.cc.
//
//   bazel test //tests/tensor:op_sweep_test
//   OP_SWEEP_ONLY=matmul bazel-bin/tests/tensor/op_sweep_test   # one op's sweep only
//   OP_SWEEP_SUMMARY=1 bazel-bin/tests/tensor/op_sweep_test     # dtypes x layouts per op
#include "tests/reference/cases.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <map>

#include "autograd/autograd.h"

namespace tessera::sweep {
namespace {

TEST_CASE("op sweep: every op in the op list has sweep cases") {
  std::map<OpId, int> count;
  for (const OpSweep& s : all_sweeps()) {
    ++count[s.op];
    CHECK_MESSAGE(!s.cases.empty(), op_name(s.op), " has a sweep without cases");
    CHECK_MESSAGE(!s.dtypes.empty(), op_name(s.op), " has a sweep without dtypes");
  }
  for (const OpInfo& info : all_ops()) {
    CHECK_MESSAGE(count[info.id] == 1, "op '", info.name, "' has ", count[info.id],
                  " sweeps (expected exactly one): add its cases to tests/reference/cases_*.cc");
  }
}

TEST_CASE("op sweep: the reference rounds as IEEE 754 says") {
  // The reference's own rounding against exactly known values (so the spec is right).
  CHECK(ref::round_to(1 + 0x1p-11, DType::f16) == 1.0);
  CHECK(ref::round_to(1 + 0x3p-11, DType::f16) == 1 + 0x1p-9);
  CHECK(ref::round_to(65519.0, DType::f16) == 65504.0);
  CHECK(std::isinf(ref::round_to(65520.0, DType::f16)));
  CHECK(ref::round_to(0x3p-26, DType::f16) == 0x1p-24);  // subnormal tie rounds to even
  CHECK(ref::round_to(0x1p-25, DType::f16) == 0.0);
  CHECK(ref::round_to(1 + 0x1p-8, DType::bf16) == 1.0);
  CHECK(ref::round_to(1 + 0x1p-24, DType::f32) == 1.0);
  CHECK(ref::round_to(-2.7, DType::i32) == -2.0);
  CHECK(ref::round_to(0.1, DType::f32) == static_cast<double>(0.1f));
}

TEST_CASE("op sweep: all ops") {
  const char* only = std::getenv("OP_SWEEP_ONLY");
  Coverage cov;
  for (const OpSweep& s : all_sweeps()) {
    if (only != nullptr && op_name(s.op) != only) continue;
    run_sweep(s, cov);
  }
  std::map<int, std::set<std::pair<int, int>>> per_op;
  for (auto [op, dt, layout] : cov.combos) per_op[op].insert({dt, layout});
  MESSAGE(fmt::format(
      "op sweep: {} ops, {} (op, dtype, layout) combinations, {} runs, {} outputs "
      "compared, {} unsupported-dtype rejections checked",
      per_op.size(), cov.combos.size(), cov.runs, cov.outputs_checked, cov.rejections_checked));
  if (std::getenv("OP_SWEEP_SUMMARY") != nullptr) {  // per op: the dtypes x layouts that ran
    std::string table;
    for (const auto& [op, combos] : per_op) {
      std::set<int> dts, layouts;
      for (auto [dt, layout] : combos) {
        dts.insert(dt);
        layouts.insert(layout);
      }
      std::vector<std::string> names;
      for (int dt : dts) names.emplace_back(dtype_name(static_cast<DType>(dt)));
      table +=
          fmt::format("  {:<24} {} dtypes x {} layouts = {} ({})\n", op_name(static_cast<OpId>(op)),
                      dts.size(), layouts.size(), combos.size(), fmt::join(names, " "));
    }
    MESSAGE("\n" << table);
  }
  for (const OpInfo& info : all_ops()) {
    if (only != nullptr) break;
    CHECK_MESSAGE(per_op.count(static_cast<int>(info.id)) == 1, "op '", info.name,
                  "' ran no sweep case");
  }
}

}  // namespace
}  // namespace tessera::sweep
