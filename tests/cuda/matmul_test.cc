// GPU-tagged: CUDA matmul (cuBLASLt) and conv2d with its gradients (cuDNN) against the CPU
// kernels. Needs a GPU and --config=cuda:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:matmul_test
//
// Tolerances are norm-wise relative errors ||gpu - cpu|| / ||cpu||, the two differing only in
// the order of their sums (and, for 16-bit floats, in which sums round to a neighbouring
// value): f64 1e-12; f32 1e-5 with TF32 off (sums of a few hundred products of N(0, 1)
// values, f32 eps 6e-8); f32 with TF32 2e-3 (10-bit mantissa inputs, eps 1e-3 / sqrt
// of the averaging); f16 and bf16 1e-2 (one rounding of the result: bf16 eps 4e-3).
#include <doctest/doctest.h>

#include <cmath>

#include "tensor/ops.h"
#include "tensor/random.h"
#ifdef TESSERA_CUDA
#include "kernels/cuda/runtime.h"
#endif

using namespace tessera;

namespace {

double tolerance(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    default: return 1e-2;
  }
}

// ||x - ref|| / ||ref|| over all elements (x on any device), shapes checked equal.
double rel_error(const Tensor& x, const Tensor& ref) {
  REQUIRE(x.shape() == ref.shape());
  const std::vector<double> a = x.to(kCPU).to_vector<double>(), b = ref.to(kCPU).to_vector<double>();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

Tensor random(const Shape& shape, DType dt, uint64_t seed) {
  Generator g(seed);
  return randn(shape, dt, kCPU, &g);
}

const Device kGpu = cuda(0);
constexpr DType kFloatTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

// matmul of a and b (CPU tensors, any views) on the GPU, with the same views taken of the
// device copies of their bases by `view`, against the CPU.
template <typename View>
void check_matmul(const Tensor& a_base, const Tensor& b_base, View view, double tol) {
  // Plain variables, not a structured binding: INFO captures them (clang < 16 rejects that).
  const auto cpu = view(a_base, b_base);
  const auto gpu = view(a_base.to(kGpu), b_base.to(kGpu));
  const Tensor& a = cpu.first;
  const Tensor& b = cpu.second;
  const Tensor ref = matmul(a, b);
  const Tensor got = matmul(gpu.first, gpu.second);
  CHECK(got.device() == kGpu);
  CHECK(got.dtype() == ref.dtype());
  INFO("a ", a.str(), " b ", b.str());
  CHECK(rel_error(got, ref) <= tol);
}

auto plain = [](const Tensor& a, const Tensor& b) { return std::pair{a, b}; };

}  // namespace

TEST_CASE("matmul on CUDA matches the CPU: 2-D, batched, broadcast, 1-D") {
  for (DType dt : kFloatTypes) {
    CAPTURE(dt);
    const double tol = tolerance(dt);
    uint64_t seed = 1;
    auto run = [&](const Shape& sa, const Shape& sb) {
      CAPTURE(shape_str(sa));
      CAPTURE(shape_str(sb));
      check_matmul(random(sa, dt, seed), random(sb, dt, seed + 1), plain, tol);
      seed += 2;
    };
    run({33, 47}, {47, 29});
    run({1, 64}, {64, 1});
    run({3, 17, 40}, {3, 40, 23});
    run({4, 7, 32}, {32, 16});          // one GEMM with 28 rows
    run({16, 24}, {5, 24, 8});          // a broadcast: batch stride 0
    run({2, 1, 16, 24}, {3, 24, 8});    // loop over the outer batch dim
    run({20, 1, 6, 8}, {1, 3, 8, 5});   // too many outer calls: operands copied
    run({2, 3, 4, 6, 8}, {3, 1, 8, 5}); // several broadcast batch dims
    run({32}, {32, 5});                 // 1-D promotion
    run({6, 32}, {32});
    run({32}, {32});
    run({3, 4, 32}, {32});
    run({7}, {2, 7, 3});
  }
}

TEST_CASE("matmul on CUDA reads transposed and sliced views without changing the result") {
  for (DType dt : kFloatTypes) {
    CAPTURE(dt);
    const double tol = tolerance(dt);
    // nn::Linear: x @ W^T with W [out, in].
    check_matmul(random({8, 24}, dt, 1), random({16, 24}, dt, 2),
                 [](const Tensor& x, const Tensor& w) { return std::pair{x, w.t()}; }, tol);
    check_matmul(random({4, 5, 24}, dt, 3), random({16, 24}, dt, 4),
                 [](const Tensor& x, const Tensor& w) { return std::pair{x, w.t()}; }, tol);
    // a^T @ b, and both transposed.
    check_matmul(random({30, 12}, dt, 5), random({30, 9}, dt, 6),
                 [](const Tensor& a, const Tensor& b) { return std::pair{a.t(), b}; }, tol);
    check_matmul(random({30, 12}, dt, 7), random({9, 30}, dt, 8),
                 [](const Tensor& a, const Tensor& b) { return std::pair{a.t(), b.t()}; }, tol);
    // Attention's q @ k^T with k [B, H, T, D].
    check_matmul(random({2, 3, 10, 16}, dt, 9), random({2, 3, 12, 16}, dt, 10),
                 [](const Tensor& q, const Tensor& k) { return std::pair{q, k.transpose(-2, -1)}; }, tol);
    // Column slices (row stride > columns, odd start: an unaligned pointer).
    check_matmul(random({10, 40}, dt, 11), random({40, 40}, dt, 12),
                 [](const Tensor& a, const Tensor& b) {
                   return std::pair{a.slice(1, 3, 33), b.slice(0, 5, 35).slice(1, 1, 20)};
                 },
                 tol);
    // Neither stride 1 (every other column): copied first.
    check_matmul(random({10, 40}, dt, 13), random({20, 6}, dt, 14),
                 [](const Tensor& a, const Tensor& b) { return std::pair{a.slice(1, 0, 40, 2), b}; }, tol);
    // Permuted batch dims.
    check_matmul(random({5, 2, 6, 8}, dt, 15), random({2, 5, 8, 3}, dt, 16),
                 [](const Tensor& a, const Tensor& b) { return std::pair{a.permute({1, 0, 2, 3}), b}; }, tol);
  }
}

TEST_CASE("matmul on CUDA: empty inner dimension gives zeros, empty outputs are fine") {
  for (DType dt : kFloatTypes) {
    const Tensor z = matmul(ones({3, 0}, dt, kGpu), ones({0, 4}, dt, kGpu));
    CHECK(z.shape() == Shape{3, 4});
    CHECK(z.to(kCPU).to_vector<double>() == std::vector<double>(12, 0.0));
    CHECK(matmul(ones({0, 5}, dt, kGpu), ones({5, 3}, dt, kGpu)).shape() == Shape{0, 3});
    CHECK(matmul(ones({2, 0, 4, 5}, dt, kGpu), ones({5, 3}, dt, kGpu)).shape() == Shape{2, 0, 4, 3});
  }
}

TEST_CASE("matmul on CUDA: larger 16-bit products and repeatable results") {
  for (DType dt : {DType::bf16, DType::f16}) {
    CAPTURE(dt);
    const Tensor a = random({256, 512}, dt, 21), b = random({512, 384}, dt, 22);
    const Tensor ga = a.to(kGpu), gb = b.to(kGpu);
    const Tensor first = matmul(ga, gb);
    CHECK(rel_error(first, matmul(a, b)) <= 1e-2);
    // The cached plan gives the same bits the second time.
    CHECK(matmul(ga, gb).to(kCPU).to_vector<double>() == first.to(kCPU).to_vector<double>());
  }
}

TEST_CASE("matmul on CUDA: large 16-bit products with rows off 16-byte alignment") {
  // GPT-2's 50257-wide head in small: 16-bit matrices whose leading dimension is not a
  // multiple of 8 (cuBLASLt's slower kernels; staged through aligned copies by default, and
  // the next case runs both ways), in the forward's shapes (every matrix unaligned), the
  // input gradient's (a transposed weight) and the weight gradient's (a transposed
  // activation), against the CPU, and the same bits twice.
  for (DType dt : {DType::bf16, DType::f16}) {
    CAPTURE(dt);
    const Tensor x = random({1024, 770}, dt, 31), w = random({770, 8195}, dt, 32);
    check_matmul(x, w, plain, 1e-2);
    const Tensor g = random({1024, 8195}, dt, 33), v = random({776, 8195}, dt, 34);
    check_matmul(g, v, [](const Tensor& a, const Tensor& b) { return std::pair{a, b.t()}; }, 1e-2);
    const Tensor h = random({1024, 776}, dt, 35);
    check_matmul(h, g, [](const Tensor& a, const Tensor& b) { return std::pair{a.t(), b}; }, 1e-2);
    const Tensor gx = x.to(kGpu), gw = w.to(kGpu);
    const Tensor first = matmul(gx, gw);
    CHECK(matmul(gx, gw).to(kCPU).to_vector<double>() == first.to(kCPU).to_vector<double>());
  }
}

#ifdef TESSERA_CUDA
TEST_CASE("matmul on CUDA: unaligned 16-bit products staged through aligned copies and not") {
  // The three head-like products of the case above, each with at least 128 FLOPs per byte
  // its staged copies move, so each runs on aligned copies (kernels/cuda/matmul.cc) when
  // staging is on and on the matrices as they lie when it is off: both against the CPU, and
  // the staged count rises by exactly one per product only while it is on. The first
  // product's left operand is also a view one column into its base (a pointer 2 bytes off
  // 16-byte alignment).
  const auto first_cols = [](const Tensor& a, const Tensor& b) { return std::pair{a.narrow(1, 1, 770), b}; };
  const auto b_t = [](const Tensor& a, const Tensor& b) { return std::pair{a, b.t()}; };
  const auto a_t = [](const Tensor& a, const Tensor& b) { return std::pair{a.t(), b}; };
  for (bool on : {true, false}) {
    cuda_kernels::set_stage_unaligned_gemms(on);
    for (DType dt : {DType::bf16, DType::f16}) {
      CAPTURE(on);
      CAPTURE(dt);
      const int64_t before = cuda_kernels::staged_gemm_count();
      const Tensor x = random({1024, 771}, dt, 41), w = random({770, 8195}, dt, 42);
      check_matmul(x, w, first_cols, 1e-2);
      const Tensor g = random({1024, 8195}, dt, 43), v = random({776, 8195}, dt, 44);
      check_matmul(g, v, b_t, 1e-2);
      const Tensor h = random({1024, 776}, dt, 45);
      check_matmul(h, g, a_t, 1e-2);
      CHECK(cuda_kernels::staged_gemm_count() - before == (on ? 3 : 0));
    }
  }
  cuda_kernels::set_stage_unaligned_gemms(true);
  // A product below both thresholds (K = 8: ~4 FLOPs per byte its copies would move, 5e8
  // FLOPs) runs unstaged.
  const int64_t before = cuda_kernels::staged_gemm_count();
  check_matmul(random({4096, 8}, DType::bf16, 46), random({8, 8195}, DType::bf16, 47), plain, 1e-2);
  CHECK(cuda_kernels::staged_gemm_count() == before);
}

TEST_CASE("matmul on CUDA with TF32 allowed stays within TF32's precision") {
  cuda_kernels::set_allow_tf32(true);
  const Tensor a = random({64, 256}, DType::f32, 31), b = random({256, 48}, DType::f32, 32);
  const double err = rel_error(matmul(a.to(kGpu), b.to(kGpu)), matmul(a, b));
  cuda_kernels::set_allow_tf32(false);
  CHECK(err <= 2e-3);
  // Back off: full f32 again.
  CHECK(rel_error(matmul(a.to(kGpu), b.to(kGpu)), matmul(a, b)) <= 1e-5);
}
#endif

namespace {

struct ConvCase {
  Shape x, w;
  std::array<int64_t, 2> stride, padding;
  bool bias;
};

}  // namespace

TEST_CASE("conv2d and its gradients on CUDA match the CPU") {
  const ConvCase cases[] = {
      {{2, 3, 9, 11}, {4, 3, 3, 3}, {1, 1}, {1, 1}, true},
      {{2, 3, 10, 9}, {5, 3, 3, 3}, {2, 2}, {0, 1}, false},  // last input row uncovered
      {{3, 8, 6, 6}, {16, 8, 1, 1}, {1, 1}, {0, 0}, true},
      {{1, 2, 7, 5}, {3, 2, 5, 3}, {1, 2}, {2, 0}, true},
      {{4, 16, 14, 14}, {32, 16, 3, 3}, {1, 1}, {1, 1}, true},
  };
  for (DType dt : kFloatTypes) {
    CAPTURE(dt);
    const double tol = tolerance(dt);
    uint64_t seed = 100;
    for (const ConvCase& c : cases) {
      CAPTURE(shape_str(c.x));
      CAPTURE(shape_str(c.w));
      const Tensor x = random(c.x, dt, seed++), w = random(c.w, dt, seed++);
      const Tensor b = c.bias ? random({c.w[0]}, dt, seed++) : Tensor();
      const Tensor ref = conv2d(x, w, b, c.stride, c.padding);
      const Tensor got = conv2d(x.to(kGpu), w.to(kGpu), c.bias ? b.to(kGpu) : Tensor(), c.stride, c.padding);
      CHECK(got.device() == kGpu);
      CHECK(rel_error(got, ref) <= tol);

      const Tensor grad = random(ref.shape(), dt, seed++);
      const Tensor dx_ref = conv2d_backward_input(grad, w, c.x, c.stride, c.padding);
      const Tensor dx = conv2d_backward_input(grad.to(kGpu), w.to(kGpu), c.x, c.stride, c.padding);
      CHECK(rel_error(dx, dx_ref) <= tol);
      const Tensor dw_ref = conv2d_backward_weight(grad, x, c.w, c.stride, c.padding);
      const Tensor dw = conv2d_backward_weight(grad.to(kGpu), x.to(kGpu), c.w, c.stride, c.padding);
      CHECK(rel_error(dw, dw_ref) <= tol);
      // Deterministic algorithms: the same bits again.
      CHECK(conv2d_backward_weight(grad.to(kGpu), x.to(kGpu), c.w, c.stride, c.padding).to(kCPU).to_vector<double>() ==
            dw.to(kCPU).to_vector<double>());
    }
  }
}

TEST_CASE("conv2d on CUDA: non-contiguous input, no input channels, empty batch") {
  const Tensor x = random({2, 9, 9, 3}, DType::f32, 200).permute({0, 3, 1, 2});  // NHWC memory
  const Tensor w = random({4, 3, 3, 3}, DType::f32, 201);
  CHECK(rel_error(conv2d(random({2, 9, 9, 3}, DType::f32, 200).to(kGpu).permute({0, 3, 1, 2}), w.to(kGpu),
                         Tensor(), {1, 1}, {1, 1}),
                  conv2d(x, w, Tensor(), {1, 1}, {1, 1})) <= 1e-5);
  // No input channels: the bias alone.
  const Tensor bias = Tensor::from_vector<float>({1, 2, 3}, {3});
  const Tensor y = conv2d(zeros({2, 0, 4, 4}, DType::f32, kGpu), zeros({3, 0, 3, 3}, DType::f32, kGpu),
                          bias.to(kGpu), {1, 1}, {1, 1});
  CHECK(rel_error(y, conv2d(zeros({2, 0, 4, 4}), zeros({3, 0, 3, 3}), bias, {1, 1}, {1, 1})) == 0.0);
  const Tensor dw = conv2d_backward_weight(zeros({0, 3, 4, 4}, DType::f32, kGpu), zeros({0, 2, 4, 4}, DType::f32, kGpu),
                                           {3, 2, 3, 3}, {1, 1}, {1, 1});
  CHECK(dw.to(kCPU).to_vector<float>() == std::vector<float>(54, 0.0f));
}
