// GPU-tagged: every gradcheck case (tests/autograd/gradcheck_cases.h, f64) with its inputs on
// cuda:0: leaves laid out in the records' layouts (permuted, strided with NaN gaps) in
// device memory, indices and conditions copied there. Each case checks its
// graph node, that a non-contiguous forward equals the contiguous one, and autograd::gradcheck
// (central differences, perturbing device elements) with the CPU suite's tolerances: the
// device computes f64 in f64 too. A per-op table of passed / failed cases is printed; a
// missing kernel fails its op's cases without hiding the others.
//
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:cuda_gradcheck_test
//   GRADCHECK_ONLY=matmul bazel-bin/tests/cuda/cuda_gradcheck_test   # one op
#include <doctest/doctest.h>

#ifdef TESSERA_CUDA

#include <fmt/format.h>

#include <cstdlib>
#include <string>

#include "kernels/cuda/runtime.h"
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

struct OnDevice {
  explicit OnDevice(Device d) { sweep::set_sweep_device(d); }
  ~OnDevice() { sweep::set_sweep_device(kCPU); }
};

TEST_CASE("gradcheck on cuda:0: analytical gradients match central differences for every Diff op") {
  REQUIRE(cuda_kernels::device_count() > 0);
  const char* only = std::getenv("GRADCHECK_ONLY");
  OnDevice on(cuda(0));
  int checked = 0, failed = 0;
  std::string report;
  for (const OpInfo& info : all_ops()) {
    if (!info.differentiable) continue;
    if (only != nullptr && info.name != std::string_view(only)) continue;
    const auto it = table().find(info.id);
    // The CPU suite reports ops without cases.
    if (it == table().end()) continue;
    const OpResult r = check_op_cases(info, it->second, 1000 + static_cast<uint64_t>(info.id));
    checked += r.checked;
    failed += r.failed;
    std::string first = r.first_failure.substr(0, r.first_failure.find('\n'));
    if (first.size() > 200) first = first.substr(0, 200) + "...";
    report += fmt::format("  {:<16} {:>3} cases {:>3} failed{}\n", info.name, r.checked, r.failed,
                          r.failed ? "   first: " + first : "");
  }
  MESSAGE(fmt::format("gradcheck on cuda:0: {} cases, {} failed\n{}", checked, failed, report));
  CHECK(failed == 0);
  if (only == nullptr) CHECK(checked > 100);
}

TEST_CASE("gradcheck perturbs device inputs in place and restores them") {
  // A strided f64 leaf on the device: after gradcheck its values (and its NaN gaps) are as
  // before, and a wrong derivative is caught.
  OnDevice on(cuda(0));
  const Tensor x = Maker::leaf({3, 4}, {0.5, -1, 2, 0.25, 1.5, -0.75, 3, -2, 1, 0.125, -0.5, 2.5},
                               Memory::strided);
  REQUIRE(x.device() == cuda(0));
  const std::vector<double> before = x.to_vector<double>();
  const auto ok = autograd::gradcheck([](const Tensors& in) { return in[0] * in[0]; }, {x});
  CHECK_MESSAGE(ok.ok, ok.message);
  CHECK(x.to_vector<double>() == before);
  // The strided layout (tests/reference/cases_harness.cc) holds the 12 values in a [4, 9]
  // buffer: an extra first row, and every other element of rows of 2 x 4 + 1.
  const Tensor whole = Tensor::from_storage(x.storage(), {4, 9}, {9, 1}, 0, DType::f64).to(kCPU);
  const std::vector<double> w = whole.to_vector<double>();
  int nans = 0;
  for (double v : w) nans += std::isnan(v);
  CHECK(nans == 4 * 9 - 12);  // the gaps were not written
  // detach() hides the gradient of the second factor: analytical x vs numerical 2x.
  const auto bad = autograd::gradcheck([](const Tensors& in) { return in[0] * in[0].detach(); },
                                       {x});
  CHECK_FALSE(bad.ok);
}

}  // namespace
}  // namespace tessera

#endif  // TESSERA_CUDA
