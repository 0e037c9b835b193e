// Compressed saved activations (autograd/saved_compression.h): the int8 packing against the
// bound its definition gives (checked element by element in f64 from the tensor's own
// values), bf16 as a plain rounding, what is and is not compressed (parameters, small and
// integer tensors, other threads), the bytes the graph holds (from the allocator), gradients
// through compressed tensors, and the in-place check.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/checkpoint.h"
#include "autograd/saved_compression.h"
#include "tensor/allocator.h"
#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace tessera::autograd {
namespace {

using Mode = SavedCompression::Mode;

std::vector<double> values(const Tensor& t) { return cast(t, DType::f64).to_vector<double>(); }

// Checks one int8 packing of x: the layout (codes padded to whole blocks, one scale per
// block), every code in [0, 254], the block's largest |x| at an end code, and every value
// back within half a step (step = the block's absmax / 127) of x, up to the rounding of the
// step and of the product in the compute dtype.
void check_int8(const Tensor& x) {
  CAPTURE(dtype_name(x.dtype()));
  CAPTURE(x.numel());
  const PackedTensor p = compress_int8(x);
  const int64_t n = x.numel(), blocks = (n + 255) / 256;
  const DType cd = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  REQUIRE(p.mode == SavedCompression::int8);
  REQUIRE(p.data.dtype() == DType::u8);
  REQUIRE(p.data.numel() == blocks * 256);
  REQUIRE(p.scale.dtype() == cd);
  REQUIRE(p.scale.numel() == blocks);
  CHECK(p.bytes() == blocks * 256 + blocks * static_cast<int64_t>(dtype_size(cd)));
  const Tensor back = unpack_saved(p);
  REQUIRE(back.dtype() == x.dtype());
  REQUIRE(back.shape() == x.shape());
  const std::vector<double> xv = values(x), bv = values(back), sv = values(p.scale);
  const std::vector<double> codes = values(p.data);
  const double ulp = cd == DType::f64 ? 0x1p-52 : 0x1p-23;
  // A 16-bit original is rounded back to its dtype: one more rounding of the value.
  const double out_ulp = x.dtype() == DType::bf16 ? 0x1p-8 : x.dtype() == DType::f16 ? 0x1p-11 : 0;
  int bad = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    double absmax = 0;
    for (int64_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) absmax = std::max(absmax, std::abs(xv[i]));
    const double step = sv[b];
    // The step is absmax / 127 rounded once.
    CHECK(std::abs(step - absmax / 127) <= absmax / 127 * ulp);
    bool end_code = absmax == 0;
    for (int64_t i = b * 256; i < (b + 1) * 256; ++i) {
      const double c = codes[i];
      if (c < 0 || c > 254 || c != std::floor(c)) ++bad;
      if (i >= n) continue;
      if (std::abs(xv[i]) == absmax && absmax > 0) end_code = end_code || c == 0 || c == 254;
      const double bound = step / 2 + 4 * absmax * ulp + std::abs(xv[i]) * out_ulp;
      if (!(std::abs(bv[i] - xv[i]) <= bound)) ++bad;
    }
    CHECK_MESSAGE(end_code, "block ", b, ": its largest |x| is not at code 0 or 254");
  }
  CHECK_MESSAGE(bad == 0, bad, " codes or values out of bounds");
}

TEST_CASE("int8 packing: codes, scales and values within half a step, every float dtype") {
  int checked = 0;
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (int64_t n : {1, 255, 256, 257, 1000, 4096}) {
      Generator gen(static_cast<uint64_t>(n) + 7);
      Tensor x = cast(randn({n}, DType::f64, kCPU, &gen) * 3.0, dt);
      if (n >= 1000) {  // a block of zeros, and a block with one large value
        x.narrow(0, 256, 256).copy_(zeros({256}, dt));
        x.narrow(0, 600, 1).copy_(full({1}, 1000.0, dt));
      }
      check_int8(x);
      ++checked;
    }
  }
  // In chunks of 1, 2 and 3 blocks (the last one short): the same codes, scales and values.
  {
    Generator g(31);
    const Tensor x = randn({1000}, DType::f32, kCPU, &g);
    const PackedTensor whole = compress_int8(x);
    for (int64_t chunk : {1, 2, 3}) {
      const PackedTensor p = compress_int8(x, chunk);
      CHECK(values(p.data) == values(whole.data));
      CHECK(values(p.scale) == values(whole.scale));
      CHECK(values(unpack_saved(p, chunk)) == values(unpack_saved(whole)));
    }
  }
  // Not contiguous, several dims: packed in row-major order of the logical tensor.
  Generator gen(3);
  const Tensor m = randn({40, 30}, DType::f32, kCPU, &gen).t();
  check_int8(m);
  const PackedTensor p = compress_int8(m);
  CHECK(values(unpack_saved(p)) == values(unpack_saved(compress_int8(m.contiguous()))));
  CHECK(checked == 24);
}

TEST_CASE("int8 packing: a block of zeros comes back zeros; a non-finite block comes back NaN") {
  std::vector<float> v(768, 0.5f);
  for (int i = 0; i < 256; ++i) v[i] = 0.0f;
  v[300] = INFINITY;
  v[600] = NAN;
  const Tensor x = Tensor::from_vector(v, {768});
  const std::vector<double> back = values(unpack_saved(compress_int8(x)));
  for (int i = 0; i < 256; ++i) CHECK(back[i] == 0.0);
  for (int i = 256; i < 768; ++i) CHECK(std::isnan(back[i]));
  const std::vector<float> w(256, -2.0f);
  CHECK(values(unpack_saved(compress_int8(Tensor::from_vector(w, {256})))) ==
        std::vector<double>(256, -2.0));  // -absmax is code 0 exactly: (0 - 127) x 2 / 127
}

TEST_CASE("int8 packing: empty and 0-d tensors; codes stay in [0, 254] for any input") {
  const Tensor empty = zeros({0, 3});
  const PackedTensor pe = compress_int8(empty);
  CHECK(pe.data.numel() == 0);
  CHECK(unpack_saved(pe).shape() == Shape{0, 3});
  const Tensor scalar = full({}, -3.5);
  const Tensor back = unpack_saved(compress_int8(scalar));
  CHECK(back.shape() == Shape{});
  CHECK(back.item<double>() == -3.5);  // the block's absmax: code 0, exactly -127 x 3.5 / 127
  // A subnormal absmax (absmax / 127 loses precision) and a NaN beside a huge value: every
  // code in range, the NaN block NaN, the subnormal block's values within its absmax of x.
  std::vector<float> v(512, 0.0f);
  for (int i = 0; i < 256; ++i) v[i] = (i % 2 ? 1.0f : -1.0f) * 190.0f * 0x1p-149f * float(i % 7) / 6;
  v[300] = NAN;
  v[301] = 3e38f;
  const Tensor x = Tensor::from_vector(v, {512});
  const PackedTensor p = compress_int8(x);
  for (double c : values(p.data)) CHECK((c >= 0 && c <= 254));
  const std::vector<double> b = values(unpack_saved(p)), xv = values(x);
  double absmax = 0;
  for (int i = 0; i < 256; ++i) absmax = std::max(absmax, std::abs(xv[i]));
  REQUIRE(absmax < 0x1p-126);  // subnormal
  for (int i = 0; i < 256; ++i) CHECK(std::abs(b[i] - xv[i]) <= absmax);
  for (int i = 256; i < 512; ++i) CHECK(std::isnan(b[i]));
}

TEST_CASE("bf16 packing: the tensor rounded to bf16 once; 16-bit tensors kept as they are") {
  Generator gen(5);
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor x = randn({3, 500}, dt, kCPU, &gen);
    const PackedTensor p = compress_bf16(x);
    CHECK(p.mode == SavedCompression::bf16);
    CHECK(p.bytes() == 1500 * 2);
    const Tensor back = unpack_saved(p);
    CHECK(back.dtype() == dt);
    CHECK(values(back) == values(cast(cast(x, DType::bf16), dt)));
  }
  const Tensor h = randn({700}, DType::bf16, kCPU, &gen);
  const PackedTensor p = compress_bf16(h);
  CHECK(p.mode == SavedCompression::none);
  CHECK(p.data.storage() == h.storage());
}

TEST_CASE("what is compressed: floating, large enough, not excluded, this thread only") {
  Generator gen(9);
  const Tensor big = randn({5000}, DType::f32, kCPU, &gen);
  const Tensor small = randn({100}, DType::f32, kCPU, &gen);
  const Tensor ints = full({5000}, 3.0, DType::i64);
  const Tensor param = randn({5000}, DType::f32, kCPU, &gen);
  const Tensor leaf = randn({5000}, DType::f32, kCPU, &gen).requires_grad_();
  CHECK(pack_saved(big).mode == SavedCompression::none);  // no guard
  {
    SavedCompressionGuard g({.mode = SavedCompression::int8}, {param});
    CHECK(pack_saved(big).mode == SavedCompression::int8);
    CHECK(pack_saved(small).mode == SavedCompression::none);
    CHECK(pack_saved(ints).mode == SavedCompression::none);
    CHECK(pack_saved(param).mode == SavedCompression::none);
    CHECK(pack_saved(param.narrow(0, 10, 4990)).mode == SavedCompression::none);  // a view
    CHECK(pack_saved(leaf).mode == SavedCompression::none);  // a leaf that requires grad
    CHECK(pack_saved(leaf * 2.0).mode == SavedCompression::int8);  // made from it by math
    // Packing that would not shrink: an expanded view, a view of a smaller storage.
    CHECK(pack_saved(full({1}, 2.0).expand({5000})).mode == SavedCompression::none);
    {
      SavedCompressionGuard inner({.mode = SavedCompression::bf16, .min_numel = 10});
      CHECK(pack_saved(small).mode == SavedCompression::bf16);
      CHECK(pack_saved(param).mode == SavedCompression::bf16);  // not excluded here
    }
    CHECK(pack_saved(small).mode == SavedCompression::none);  // the outer setting again
    Mode other = Mode::int8;
    std::thread([&] { other = pack_saved(big).mode; }).join();
    CHECK(other == SavedCompression::none);
  }
  CHECK(pack_saved(big).mode == SavedCompression::none);
  CHECK_THROWS_WITH(parse_saved_compression("int4", "--act_compress"),
                    doctest::Contains("--act_compress: 'int4' is not a compression of saved "
                                      "activations; choose none, int8 or bf16"));
  CHECK_THROWS_WITH(SavedCompressionGuard({.mode = SavedCompression::int8, .min_numel = -1}),
                    doctest::Contains("min_numel is -1"));
}

// exp(exp(exp(x))): each exp saves its output; after the forward only those (and the loss)
// remain. Returns the bytes the graph holds and x's gradient.
std::pair<int64_t, Tensor> exp_chain(const Tensor& x0, Mode mode) {
  const Tensor x = x0.detach().requires_grad_();
  const int64_t before = process_memory().current();
  Tensor loss;
  int64_t held = 0;
  {
    SavedCompressionGuard g({.mode = mode});
    const Tensor y = exp(exp(exp(x)));
    loss = sum(y);
  }
  held = process_memory().current() - before;
  loss.backward();
  return {held, x.grad()};
}

TEST_CASE("the graph holds the compressed bytes (allocator), and gradients pass through them") {
  const int64_t n = 256 * 64;
  Generator gen(11);
  const Tensor x = rand({n}, DType::f32, kCPU, &gen) - 0.5;  // exp^3 of [-0.5, 0.5): no overflow
  const auto [plain_bytes, plain_grad] = exp_chain(x, Mode::none);
  const auto [int8_bytes, int8_grad] = exp_chain(x, Mode::int8);
  const auto [bf16_bytes, bf16_grad] = exp_chain(x, Mode::bf16);
  // Three saved outputs and the 0-d loss.
  CHECK(plain_bytes == 3 * 4 * n + 4);
  CHECK(int8_bytes == 3 * (n + 4 * n / 256) + 4);
  CHECK(bf16_bytes == 3 * 2 * n + 4);
  const std::vector<double> exact = values(plain_grad), g8 = values(int8_grad), g16 = values(bf16_grad);
  // d/dx = y3 y2 y1: each factor within half an int8 step of its block's absmax (relative
  // 1/254 of the largest), so the product within ~3/254 of the largest gradient, and not
  // bitwise (the compression did happen).
  double largest = 0, err8 = 0, err16 = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    largest = std::max(largest, std::abs(exact[i]));
    err8 = std::max(err8, std::abs(g8[i] - exact[i]));
    err16 = std::max(err16, std::abs(g16[i] - exact[i]) / std::abs(exact[i]));
  }
  CHECK(err8 > 0);
  CHECK(err8 <= 3.0 / 254 * largest * 1.01);
  CHECK(err16 > 0);
  CHECK(err16 <= 3 * 0x1p-8 + 1e-6);  // three factors, each rounded to bf16 (relative 2^-8)
}

TEST_CASE("parameters stay exact: a matmul's input gradient is bitwise, its weight's is not") {
  Generator gen(13);
  const Tensor x0 = randn({64, 96}, DType::f32, kCPU, &gen);
  const Tensor w = randn({96, 80}, DType::f32, kCPU, &gen).requires_grad_();
  auto grads = [&](Mode mode) {
    const Tensor leaf = x0.detach().requires_grad_();
    w.set_grad(Tensor());
    {
      SavedCompressionGuard g({.mode = mode, .min_numel = 1000});
      const Tensor x = leaf * 1.0;  // an activation (a leaf that requires grad is kept)
      sum(matmul(x, w)).backward();
    }
    return std::pair{values(leaf.grad()), values(w.grad())};
  };
  const auto [gx, gw] = grads(Mode::none);
  const auto [gx8, gw8] = grads(Mode::int8);
  CHECK(gx8 == gx);  // ones @ w^T: w is a parameter, saved as it is
  CHECK(gw8 != gw);  // x^T @ ones: x was saved in 8 bits
  double err = 0, scale = 0;
  for (size_t i = 0; i < gw.size(); ++i) {
    err = std::max(err, std::abs(gw8[i] - gw[i]));
    scale = std::max(scale, std::abs(gw[i]));
  }
  CHECK(err <= scale / 10);  // 64 rows of errors within half a step each
}

TEST_CASE("made from a parameter by views and casts: a transposed weight, autocast's bf16 copy") {
  Generator gen(19);
  const Tensor x0 = randn({64, 96}, DType::f32, kCPU, &gen);
  const Tensor w = randn({80, 96}, DType::f32, kCPU, &gen).requires_grad_();
  for (bool autocast : {false, true}) {
    CAPTURE(autocast);
    auto grad_x = [&](Mode mode) {
      const Tensor x = x0.detach().requires_grad_();
      {
        SavedCompressionGuard g({.mode = mode, .min_numel = 1000});
        std::unique_ptr<AutocastGuard> ac;
        if (autocast) ac = std::make_unique<AutocastGuard>(DType::bf16);
        sum(cast(matmul(x, transpose(w, 0, 1)), DType::f32)).backward();
      }
      return values(x.grad());
    };
    // ones @ w: w's transpose (and under autocast its bf16 copy) is saved as it is.
    CHECK(grad_x(Mode::int8) == grad_x(Mode::none));
  }
}

TEST_CASE("recomputation: exact inputs, an uncompressed replay, so the plain gradients") {
  Generator gen(29);
  const Tensor x0 = randn({5000}, DType::f32, kCPU, &gen);
  auto grad = [&](Mode mode) {
    const Tensor x = x0.detach().requires_grad_();
    {
      SavedCompressionGuard g({.mode = mode});
      const Tensor h = x * 1.5;  // a checkpoint input that is not a leaf
      const std::vector<Tensor> y =
          checkpoint([](const std::vector<Tensor>& in) { return std::vector<Tensor>{exp(exp(in[0]))}; },
                     {h});
      sum(y[0]).backward();
    }
    return values(x.grad());
  };
  CHECK(grad(Mode::int8) == grad(Mode::none));
}

TEST_CASE("an in-place change of a compressed tensor's original is still reported") {
  Generator gen(17);
  const Tensor x = randn({5000}, DType::f32, kCPU, &gen).requires_grad_();
  Tensor y, loss;
  {
    SavedCompressionGuard g({.mode = SavedCompression::int8});
    y = exp(x);
    loss = sum(y * y);
  }
  {
    NoGradGuard ng;
    y.copy_(y + 1.0);
  }
  CHECK_THROWS_WITH(loss.backward(), doctest::Contains("was modified in place"));
}

}  // namespace
}  // namespace tessera::autograd
