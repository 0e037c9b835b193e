// Linked into every GPU-tagged suite (tests/cuda, tests/parallel's cuda_parallel_test and
// comm_nccl_test): the binary fails before running anything unless it was built with
// --config=cuda and a CUDA device is visible. Without this a GPU suite built for the CPU
// compiles its cases away (or sends them to a backend that is not there) and, started by
// hand or by tools/gpu_tests.sh, would report success having checked nothing.
#include <string>

#include "tests/suite_requirements.h"

#ifdef TESSERA_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace tessera::testing {
namespace {

std::string cuda_device_present() {
#ifdef TESSERA_CUDA
  const int n = cuda_kernels::device_count();
  if (n > 0) return "";
  return "no CUDA device is visible (cudaGetDeviceCount found none; check nvidia-smi and "
         "CUDA_VISIBLE_DEVICES)";
#else
  return "it was built without --config=cuda, so it has no CUDA backend; run it with "
         "`bazel test --config=cuda --test_tag_filters=gpu <target>` on a machine with a GPU "
         "(or from a tools/gpu_bundle.sh bundle)";
#endif
}

const bool registered = add_suite_requirement("a CUDA device", cuda_device_present);

}  // namespace
}  // namespace tessera::testing
