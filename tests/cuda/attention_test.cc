// GPU-tagged: the fused attention op on CUDA (flash kernels) against the CPU kernel, its
// spec. Needs a GPU and --config=cuda:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:attention_test
//
// Tolerances, norm-wise (||gpu - cpu|| / ||cpu||) over each whole output:
//   f64 1e-12: both compute in f64; only the summation order differs.
//   f32 1e-5: the SIMT kernels compute in f32 (no TF32) in another order than the CPU.
//   f16/bf16 1e-2: the tensor-core kernels round P (and dS) to the input type before their
//     products, as FlashAttention does, where the CPU keeps them in f32: bf16's 2^-9
//     relative rounding per element, plus the outputs' own rounding.
//   lse (f32 for every 16-bit input) 1e-5: computed in f32 on both sides.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "tensor/ops.h"

using namespace tessera;

namespace {

std::vector<double> values(const Tensor& t) {
  return cast(t.to(kCPU), DType::f64).contiguous().to_vector<double>();
}

double rel_norm_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = values(got), w = values(want);
  REQUIRE(g.size() == w.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

double tolerance(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    default: return 1e-2;
  }
}

Tensor input(const Shape& s, DType dt, uint64_t seed) {
  Generator g(seed);
  return cast(randn(s, DType::f32, kCPU, &g), dt);
}

struct Shape4 {
  int64_t B, H, T, D;
};

void check_against_cpu(const Shape4& sh, DType dt, bool causal, double scale = 0.0) {
  const Shape s{sh.B, sh.H, sh.T, sh.D};
  CAPTURE(shape_str(s));
  CAPTURE(dtype_name(dt));
  CAPTURE(causal);
  const Tensor q = input(s, dt, 1), k = input(s, dt, 2), v = input(s, dt, 3), g = input(s, dt, 4);
  NoGradGuard no_grad;
  Attrs a;
  a.causal = causal;
  a.scale = scale;
  const std::vector<Tensor> cpu = call(OpId::attention, {q, k, v}, a);
  const Device dev = cuda(0);
  const std::vector<Tensor> gpu = call(OpId::attention, {q.to(dev), k.to(dev), v.to(dev)}, a);
  REQUIRE(gpu[0].dtype() == dt);
  REQUIRE(gpu[1].dtype() == cpu[1].dtype());
  const double tol = tolerance(dt);
  const double e_out = rel_norm_error(gpu[0], cpu[0]);
  const double e_lse = rel_norm_error(gpu[1], cpu[1]);
  MESSAGE("forward ", dtype_name(dt), " ", shape_str(s), causal ? " causal" : "", ": out ", e_out,
          ", lse ", e_lse);
  CHECK(e_out <= tol);
  CHECK(e_lse <= (dt == DType::f64 ? 1e-12 : 1e-5));

  // The backward from the same out and lse on both devices.
  const std::vector<Tensor> cpu_b =
      attention_backward(g, q, k, v, cpu[0], cpu[1], causal, scale);
  const std::vector<Tensor> gpu_b = attention_backward(g.to(dev), q.to(dev), k.to(dev), v.to(dev),
                                                       cpu[0].to(dev), cpu[1].to(dev), causal, scale);
  const char* names[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    const double e = rel_norm_error(gpu_b[i], cpu_b[i]);
    MESSAGE("backward ", names[i], ": ", e);
    CHECK_MESSAGE(e <= tol, names[i], " error ", e);
  }
  // Deterministic: no atomics, so a second run is bitwise equal.
  const std::vector<Tensor> again = attention_backward(g.to(dev), q.to(dev), k.to(dev), v.to(dev),
                                                       cpu[0].to(dev), cpu[1].to(dev), causal, scale);
  for (int i = 0; i < 3; ++i) CHECK(values(again[i]) == values(gpu_b[i]));
}

}  // namespace

TEST_CASE("attention on CUDA equals the CPU: f32 (SIMT kernels)") {
  for (bool causal : {true, false}) {
    check_against_cpu({2, 3, 100, 64}, DType::f32, causal);
    check_against_cpu({1, 2, 77, 128}, DType::f32, causal);
    check_against_cpu({2, 1, 33, 40}, DType::f32, causal, 0.3);
  }
}

TEST_CASE("attention on CUDA equals the CPU: bf16 and f16 (tensor-core kernels)") {
  for (DType dt : {DType::bf16, DType::f16}) {
    for (bool causal : {true, false}) {
      check_against_cpu({2, 3, 100, 64}, dt, causal);  // T not a multiple of the 64-row tiles
      check_against_cpu({1, 2, 200, 128}, dt, causal);
      check_against_cpu({2, 2, 64, 32}, dt, causal);
      check_against_cpu({1, 1, 3, 64}, dt, causal);  // one partial tile
    }
  }
  // A head dim the tensor-core kernels do not take: the SIMT kernels in f32.
  check_against_cpu({1, 2, 50, 48}, DType::bf16, true);
}

TEST_CASE("attention on CUDA equals the CPU: f64") {
  check_against_cpu({1, 2, 45, 64}, DType::f64, true);
  check_against_cpu({1, 2, 45, 16}, DType::f64, false, 0.5);
}

TEST_CASE("attention reads strided q, k, v in place (GPT's fused projection)") {
  // [B, T, 3C] -> q, k, v [B, H, T, hd] views, as models/gpt does.
  const int64_t B = 2, T = 70, H = 3, hd = 64, C = H * hd;
  for (DType dt : {DType::bf16, DType::f32}) {
    const Tensor qkv = input({B, T, 3 * C}, dt, 7).to(cuda(0));
    const std::vector<Tensor> parts = split(qkv, C, 2);
    auto heads = [&](const Tensor& t) { return t.view({B, T, H, hd}).transpose(1, 2); };
    const Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    const Tensor strided = attention(q, k, v, true);
    const Tensor packed = attention(q.contiguous(), k.contiguous(), v.contiguous(), true);
    CHECK(values(strided) == values(packed));
  }
}

TEST_CASE("autograd through attention on CUDA matches the CPU") {
  const Shape s{2, 2, 37, 64};
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    std::vector<Tensor> grads[2];
    for (int on_gpu = 0; on_gpu < 2; ++on_gpu) {
      const Device dev = on_gpu ? cuda(0) : kCPU;
      Tensor q = input(s, dt, 11).to(dev).requires_grad_();
      Tensor k = input(s, dt, 12).to(dev).requires_grad_();
      Tensor v = input(s, dt, 13).to(dev).requires_grad_();
      const Tensor w = input(s, dt, 14).to(dev);
      autograd::backward({sum(cast(attention(q, k, v, true) * w, DType::f32))});
      grads[on_gpu] = {q.grad(), k.grad(), v.grad()};
    }
    for (int i = 0; i < 3; ++i) CHECK(rel_norm_error(grads[1][i], grads[0][i]) <= tolerance(dt));
  }
}
