// GPU-tagged: the op sweep (tests/reference/cases.h) on cuda:0. Every op x dtype x layout x
// case runs with its inputs on the device (the same strided / permuted / expanded views of a
// device buffer), and its outputs are read back and compared with the CPU sweep's f64
// reference and bounds (device_bounds() in cases_harness.cc lists the few that differ).
// A missing kernel fails its op's runs without hiding the others: the suite prints a
// per-op table of passed / failed runs with each op's first failure, then fails.
//
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:cuda_op_sweep_test
//   OP_SWEEP_ONLY=matmul bazel-bin/tests/cuda/cuda_op_sweep_test   # one op
//   OP_SWEEP_PRINT=50 ...                    # failure messages printed per op (default 3)
#include <doctest/doctest.h>

#ifdef TESSERA_CUDA

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>

#include "kernels/cuda/runtime.h"
#include "tensor/random.h"
#include "tests/reference/cases.h"

namespace tessera::sweep {
namespace {

// Sets the sweep's device for a scope (the CPU again afterwards).
struct OnDevice {
  explicit OnDevice(Device d) { set_sweep_device(d); }
  ~OnDevice() { set_sweep_device(kCPU); }
};

std::string first_line(const std::string& s, size_t max_len = 220) {
  std::string line = s.substr(0, s.find('\n'));
  if (line.size() > max_len) line = line.substr(0, max_len) + "...";
  return line;
}

TEST_CASE("op sweep on cuda:0: every op, dtype, layout and case against the reference") {
  REQUIRE(cuda_kernels::device_count() > 0);
  // f32 products must be true f32 (the bounds assume it): TF32 stays off unless asked for.
  REQUIRE_MESSAGE(!cuda_kernels::allow_tf32(),
                  "TF32 is on (TESSERA_ALLOW_TF32?): the f32 bounds assume it off");
  const char* only = std::getenv("OP_SWEEP_ONLY");
  const char* print = std::getenv("OP_SWEEP_PRINT");
  Coverage cov;
  cov.print_limit_per_op = print != nullptr ? std::atoll(print) : 3;
  {
    OnDevice on(cuda(0));
    for (const OpSweep& s : all_sweeps()) {
      if (only != nullptr && op_name(s.op) != only) continue;
      run_sweep(s, cov);
    }
    cuda_kernels::synchronize(cuda(0));
  }

  int64_t passed = 0, failed = 0, ops_failed = 0;
  std::string table;
  for (const auto& [op, t] : cov.per_op) {
    passed += t.passed;
    failed += t.failed;
    ops_failed += t.failed > 0;
    table += fmt::format("  {:<24} {:>5} passed {:>5} failed{}\n", op_name(op), t.passed,
                         t.failed, t.failed ? "   first: " + first_line(t.first_failure) : "");
  }
  MESSAGE(fmt::format(
      "op sweep on cuda:0: {} ops, {} (op, dtype, layout) combinations, {} runs, {} outputs "
      "compared, {} rejections checked; {} runs passed, {} failed ({} ops with failures)\n{}",
      cov.per_op.size(), cov.combos.size(), cov.runs, cov.outputs_checked,
      cov.rejections_checked, passed, failed, ops_failed, table));
  for (const auto& [op, t] : cov.per_op) {
    CHECK_MESSAGE(t.failed == 0, op_name(op), " on cuda:0: ", t.failed, " of ",
                  t.passed + t.failed, " runs failed; first: ", first_line(t.first_failure, 2000));
  }
  if (only == nullptr) {
    for (const OpInfo& info : all_ops()) {
      CHECK_MESSAGE(cov.per_op.count(info.id) == 1, "op '", info.name,
                    "' has no sweep on cuda:0");
    }
  }
}

// ---- randomness: the device draws the CPU's numbers ------------------------------------------

// The device tensor's values, as doubles.
std::vector<double> values(const Tensor& t) { return t.to(kCPU).to_vector<double>(); }

TEST_CASE("rand on cuda:0 equals the CPU bitwise; randn within a few ulps; generators advance alike") {
  for (DType dt : kFloats) {
    CAPTURE(dtype_name(dt));
    for (const Shape& shape : {Shape{1000}, Shape{7, 9}, Shape{3, 1, 513}}) {
      Generator gc(42), gd(42);
      const Tensor uc = rand(shape, dt, kCPU, &gc), ud = rand(shape, dt, cuda(0), &gd);
      CHECK(ud.device() == cuda(0));
      CHECK(values(ud) == uc.to_vector<double>());
      // The second draw continues from the same offset on both.
      const Tensor zc = randn(shape, dt, kCPU, &gc), zd = randn(shape, dt, cuda(0), &gd);
      CHECK(gc.offset() == gd.offset());
      const std::vector<double> a = values(zd), b = zc.to_vector<double>();
      // 2^-22 relative (device_bounds in cases_harness.cc); 16-bit: one rounding of that.
      const double rel = dt == DType::f64   ? 1e-12
                         : dt == DType::f32 ? 0x1p-22
                         : dt == DType::f16 ? 0x1p-10
                                            : 0x1p-7;
      double worst = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        const double bound = rel * std::abs(b[i]) + 0x1p-24;
        worst = std::max(worst, std::abs(a[i] - b[i]) / bound);
      }
      CHECK_MESSAGE(worst <= 1.0, "randn ", shape_str(shape), ": worst error ", worst,
                    " x its bound");
    }
  }
  // The thread's default generator: same seed, same numbers on both devices.
  manual_seed(7);
  const std::vector<double> c = rand({333}).to_vector<double>();
  manual_seed(7);
  CHECK(values(rand({333}, DType::f32, cuda(0))) == c);
}

TEST_CASE("dropout on cuda:0 draws the CPU's masks bitwise") {
  for (DType dt : kFloats) {
    for (double p : {0.1, 0.3, 0.5}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(p);
      Generator gx(3);
      const Tensor x = randn({4, 33, 17}, dt, kCPU, &gx);
      Generator gc(11), gd(11);
      const Tensor yc = dropout(x, p, true, &gc);
      const Tensor yd = dropout(x.to(cuda(0)), p, true, &gd);
      CHECK(gc.offset() == gd.offset());
      const std::vector<double> a = values(yd), b = yc.to_vector<double>();
      REQUIRE(a.size() == b.size());
      // Kept values are x / (1 - p) evaluated in f32 (f64 for f64) and rounded once; a kernel
      // may multiply by 1 / (1 - p) instead: allow an ulp or two of the output dtype.
      const double rel = dt == DType::f64   ? 1e-15
                         : dt == DType::f32 ? 0x1p-23
                         : dt == DType::f16 ? 0x1p-10
                                            : 0x1p-7;
      int64_t mask_diff = 0, value_diff = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        mask_diff += (a[i] == 0) != (b[i] == 0);
        value_diff += std::abs(a[i] - b[i]) > rel * std::abs(b[i]);
      }
      CHECK_MESSAGE(mask_diff == 0, mask_diff, " mask elements differ");
      CHECK_MESSAGE(value_diff == 0, value_diff, " kept values differ by more than ", rel,
                    " relative");
      // Non-contiguous input: the mask is keyed by logical index, so it is the same.
      Generator gt(11);
      const Tensor xt = x.to(cuda(0)).transpose(0, 2).contiguous().transpose(0, 2);
      CHECK(values(dropout(xt, p, true, &gt)) == a);
    }
  }
}

}  // namespace
}  // namespace tessera::sweep

#endif  // TESSERA_CUDA
