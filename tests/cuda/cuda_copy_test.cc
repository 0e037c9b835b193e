// GPU-tagged: the CUDA backend's byte movers (to_device, copy_, clone, cast, full) against
// the CPU. Needs a GPU and --config=cuda:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:all
#include <doctest/doctest.h>

#include "tensor/ops.h"

using namespace tessera;

TEST_CASE("host -> device -> host round trips every dtype") {
  for (DType dt : kAllDTypes) {
    Tensor h = cast(arange(-6, 6).reshape({3, 4}), dt);
    Tensor d = h.to(cuda(0));
    CHECK(d.device() == cuda(0));
    CHECK(d.to(kCPU).to_vector<double>() == h.to_vector<double>());
  }
}

TEST_CASE("non-contiguous and broadcast copies on the device") {
  Tensor h = arange(0, 24).reshape({2, 3, 4});
  Tensor d = h.to(cuda(0));
  CHECK(d.permute({2, 0, 1}).clone().to(kCPU).to_vector<float>() ==
        h.permute({2, 0, 1}).contiguous().to_vector<float>());
  Tensor dst = zeros({2, 3, 4}, DType::f32, cuda(0));
  dst.slice(2, 1, 3).copy_(Tensor::from_vector<float>({7, 8}, {2}).to(cuda(0)));
  std::vector<float> expected(24, 0.0f);
  for (int i = 0; i < 6; ++i) {
    expected[i * 4 + 1] = 7;
    expected[i * 4 + 2] = 8;
  }
  CHECK(dst.to(kCPU).to_vector<float>() == expected);
  // copy_ from the host into a device view, with a cast.
  dst.copy_(ones({4}, DType::f64));
  CHECK(dst.to(kCPU).to_vector<float>() == std::vector<float>(24, 1.0f));
}

TEST_CASE("fill and cast on the device") {
  Tensor f = full({1000}, 2.5, DType::bf16, cuda(0));
  CHECK(f.to(kCPU).to_vector<float>() == std::vector<float>(1000, 2.5f));
  CHECK(cast(f, DType::f32).to(kCPU).to_vector<float>() == std::vector<float>(1000, 2.5f));
}

TEST_CASE("mixing devices in one op is a clear error") {
  Tensor a = ones({2});
  Tensor b = ones({2}, DType::f32, cuda(0));
  CHECK_THROWS_AS(add(a, b), Error);
}
