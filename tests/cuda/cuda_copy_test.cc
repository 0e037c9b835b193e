// GPU-tagged: the CUDA backend's byte movers (to_device, copy_ on each of its paths, clone,
// cast, full) against the CPU. Needs a GPU and --config=cuda:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:all
#include <doctest/doctest.h>

#include <functional>
#include <vector>

#include "kernels/cuda/strided_index.h"
#include "tensor/ops.h"
#ifdef TESSERA_CUDA
#include "kernels/cuda/runtime.h"
#endif

using namespace tessera;
using cuda_kernels::CopyPath;

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

#ifdef TESSERA_CUDA
// Values that repeat only after 4,099 elements, every third one 0 (so b8 is a pattern of
// false and true), cast to `dt`: a misplaced element shows.
Tensor distinct(const Shape& shape, DType dt) {
  std::vector<double> v(static_cast<size_t>(numel_of(shape)));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = i % 3 == 0 ? 0.0 : static_cast<double>((i * 7919) % 4099) - 2049.0 + 0.25 * static_cast<double>(i % 4);
  }
  return cast(Tensor::from_vector<double>(v, shape), dt);
}

TEST_CASE("every path of the device copy (plan_copy) against the CPU's copy") {
  using View = std::function<Tensor(const Tensor&)>;
  const View whole = [](const Tensor& t) { return t; };
  struct Case {
    const char* what;
    Shape src_base;
    DType src_dtype;
    View src_view;
    Shape dst_base;
    DType dst_dtype;
    View dst_view;
    CopyPath path;
  };
  const std::vector<Case> cases = {
      {"f32 -> f32, contiguous", {8, 16}, DType::f32, whole, {8, 16}, DType::f32, whole, CopyPath::memcpy},
      {"f32 -> bf16 cast", {33, 64}, DType::f32, whole, {33, 64}, DType::bf16, whole, CopyPath::vector},
      {"f32 -> bf16 cast into a view 2 bytes off", {1000}, DType::f32, whole, {1001}, DType::bf16,
       [](const Tensor& t) { return t.slice(0, 1, 1001); }, CopyPath::flat},
      {"bf16 columns 0..63 of [8, 128]", {8, 128}, DType::bf16, [](const Tensor& t) { return t.slice(1, 0, 64); },
       {8, 64}, DType::bf16, whole, CopyPath::vector},
      {"bf16 columns 0..63 of [8, 100]", {8, 100}, DType::bf16, [](const Tensor& t) { return t.slice(1, 0, 64); },
       {8, 64}, DType::bf16, whole, CopyPath::strided},
      {"f32 transpose [32, 64] -> [64, 32]", {32, 64}, DType::f32, [](const Tensor& t) { return t.transpose(0, 1); },
       {64, 32}, DType::f32, whole, CopyPath::strided},
      {"f32 bias row broadcast to [2, 3, 128]", {128}, DType::f32,
       [](const Tensor& t) { return t.expand({2, 3, 128}); }, {2, 3, 128}, DType::f32, whole, CopyPath::vector},
      {"f64 -> f16, columns 0..5 of [3, 8]", {3, 8}, DType::f64, [](const Tensor& t) { return t.slice(1, 0, 6); },
       {3, 6}, DType::f16, whole, CopyPath::vector},
      {"b8 -> f32", {4, 8}, DType::b8, whole, {4, 8}, DType::f32, whole, CopyPath::vector},
      {"f32 into columns 8..15 of [4, 32]", {4, 8}, DType::f32, whole, {4, 32}, DType::f32,
       [](const Tensor& t) { return t.slice(1, 8, 16); }, CopyPath::vector},
      {"i64 -> f32, a 3-d permute", {5, 6, 7}, DType::i64, [](const Tensor& t) { return t.permute({2, 0, 1}); },
       {7, 5, 6}, DType::f32, whole, CopyPath::strided},
      {"bf16 heads [2, 64, 4, 32] -> [2, 4, 64, 32]", {2, 64, 4, 32}, DType::bf16,
       [](const Tensor& t) { return t.permute({0, 2, 1, 3}); }, {2, 4, 64, 32}, DType::bf16, whole,
       CopyPath::vector},
  };
  int counts[4] = {0, 0, 0, 0};
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const Tensor hs = distinct(c.src_base, c.src_dtype), hd = distinct(c.dst_base, c.dst_dtype);
    const Tensor ds = hs.to(cuda(0)), dd = hd.to(cuda(0));
    const Tensor hsv = c.src_view(hs), hdv = c.dst_view(hd);
    const Tensor dsv = c.src_view(ds), ddv = c.dst_view(dd);
    const cuda_kernels::CopyPlan plan =
        cuda_kernels::plan_copy(cuda_kernels::dev_tensor(ddv), cuda_kernels::dev_tensor_broadcast(dsv, ddv.shape()));
    CHECK(plan.path == c.path);
    ++counts[static_cast<int>(plan.path)];
    hdv.copy_(hsv);
    ddv.copy_(dsv);
    // The whole destination buffer: the copied view and the elements around it.
    CHECK(dd.to(kCPU).to_vector<double>() == hd.to_vector<double>());
  }
  CHECK(counts[static_cast<int>(CopyPath::memcpy)] == 1);
  CHECK(counts[static_cast<int>(CopyPath::flat)] == 1);
  CHECK(counts[static_cast<int>(CopyPath::vector)] == 7);
  CHECK(counts[static_cast<int>(CopyPath::strided)] == 3);
}
#endif  // TESSERA_CUDA

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
