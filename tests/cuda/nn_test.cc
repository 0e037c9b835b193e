// GPU-tagged: the CUDA fused nn ops (softmax, log_softmax, layer_norm and its backward,
// cross_entropy and its backward), the indexing ops (embedding, index_select, index_add,
// gather, scatter_add, cat) and max_pool2d (+ backward) against the CPU kernels (the spec),
// on the shapes that take each kernel path (warp-per-row, block-per-row, strided,
// misaligned rows, non-contiguous inputs). Needs a GPU and --config=cuda:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:nn_test
//
// Tolerances: f32 1e-5 relative (device expf/logf within 2 ulp, sums in another order), f64
// 1e-12, f16/bf16 one 16-bit rounding (2^-10 / 2^-7 relative: the f32 result may straddle a
// rounding boundary), each with an absolute floor stated per check for results that cancel
// (log_softmax near 0, gradients that sum to ~0). Copies, gathers, index_add, scatter_add,
// max_pool2d and its backward are bitwise: they add in the CPU's order.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tensor/op.h"
#include "tensor/ops.h"
#include "tests/cuda/device_compare.h"
#include "tests/testing.h"

using namespace tessera;
using tessera::cuda_testing::check_close;
using tessera::cuda_testing::kGpu;
using tessera::cuda_testing::Tol;
using tessera::testing::contains;
using tessera::testing::error_of;

namespace {

constexpr DType kFloats[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

Tol tol_for(DType dt, double abs = 1e-6) {
  switch (dt) {
    case DType::f32: return {1e-5, abs};
    case DType::f64: return {1e-12, abs * 1e-6};
    case DType::f16: return {1.0 / 1024, abs};
    case DType::bf16: return {1.0 / 128, abs};
    default: return {0, 0};
  }
}
const Tol kExact{0, 0};

std::string name(const char* what, DType dt) { return std::string(what) + " " + std::string(dtype_name(dt)); }


// Random values in dtype `dt` on the CPU (the same values go to the device).
Tensor rnd(const Shape& s, DType dt, double scale = 1.0, uint64_t seed = 1) {
  Generator g(seed);
  return cast(mul(randn(s, DType::f64, kCPU, &g), full({}, scale, DType::f64)), dt);
}

Tensor ints(const std::vector<int64_t>& v, DType dt = DType::i64) {
  return cast(Tensor::from_vector<int64_t>(v, {static_cast<int64_t>(v.size())}), dt);
}

// Indices in [0, n) drawn from a seed (repeats included).
std::vector<int64_t> rand_indices(int64_t count, int64_t n, uint64_t seed) {
  std::vector<int64_t> v(count);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& x : v) {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    x = static_cast<int64_t>(s % static_cast<uint64_t>(n));
  }
  return v;
}

}  // namespace

TEST_CASE("softmax and log_softmax: last dim (warp, block, misaligned), other dims, -inf") {
  for (DType dt : kFloats) {
    for (Shape s : {Shape{37, 768}, Shape{3, 5000}, Shape{6, 50}, Shape{5, 7}, Shape{4, 2048}}) {
      const Tensor x = rnd(s, dt, 3.0);
      const Tensor xd = x.to(kGpu);
      check_close(softmax(xd, -1), softmax(x, -1), name("softmax", dt), tol_for(dt, 1e-7));
      check_close(log_softmax(xd, -1), log_softmax(x, -1), name("log_softmax", dt), tol_for(dt, 2e-5));
    }
    const Tensor x = rnd({4, 9, 6}, dt, 2.0, 3);
    const Tensor xd = x.to(kGpu);
    for (int64_t dim : {0, 1}) {
      check_close(softmax(xd, dim), softmax(x, dim), name("softmax strided", dt), tol_for(dt, 1e-7));
      check_close(log_softmax(xd, dim), log_softmax(x, dim), name("log_softmax strided", dt),
                  tol_for(dt, 2e-5));
    }
    // Non-contiguous input.
    check_close(softmax(xd.permute({2, 0, 1}), -1), softmax(x.permute({2, 0, 1}), -1),
                name("softmax permuted", dt), tol_for(dt, 1e-7));
  }
  // Masked entries (-inf), as in causal attention scores.
  std::vector<float> v(4 * 40);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 40; ++c) v[r * 40 + c] = c > r * 10 ? -INFINITY : 0.1f * c;
  }
  const Tensor x = Tensor::from_vector<float>(v, {4, 40});
  check_close(softmax(x.to(kGpu)), softmax(x), "softmax -inf", tol_for(DType::f32, 1e-7));
  check_close(log_softmax(x.to(kGpu)), log_softmax(x), "log_softmax -inf", tol_for(DType::f32, 1e-5));
}

TEST_CASE("layer_norm forward: weight/bias optional, normalized_ndim 2, long and odd rows") {
  for (DType dt : kFloats) {
    struct Case { Shape x; Shape norm; };
    for (const Case& c : {Case{{64, 768}, {768}}, Case{{3, 5, 40}, {5, 40}}, Case{{9, 3000}, {3000}},
                          Case{{7, 33}, {33}}, Case{{2, 6, 16}, {16}}}) {
      const Tensor x = add(rnd(c.x, dt, 2.0), full({}, 0.5, dt));
      const Tensor w = rnd(c.norm, dt, 1.0, 7), b = rnd(c.norm, dt, 1.0, 8);
      const Tensor xd = x.to(kGpu), wd = w.to(kGpu), bd = b.to(kGpu);
      check_close(layer_norm(xd, c.norm, wd, bd), layer_norm(x, c.norm, w, b), name("layer_norm", dt),
                  tol_for(dt, 1e-5));
      check_close(layer_norm(xd, c.norm), layer_norm(x, c.norm), name("layer_norm no affine", dt),
                  tol_for(dt, 1e-5));
      check_close(layer_norm(xd, c.norm, wd), layer_norm(x, c.norm, w), name("layer_norm weight only", dt),
                  tol_for(dt, 1e-5));
    }
  }
  // The saved statistics, and a non-contiguous input.
  const Tensor x = rnd({12, 64}, DType::f32, 1.0, 5);
  Attrs a;
  a.normalized_ndim = 1;
  const auto got = call(OpId::layer_norm, {x.to(kGpu).permute({1, 0}), Tensor(), Tensor()}, a);
  const auto want = call(OpId::layer_norm, {x.permute({1, 0}), Tensor(), Tensor()}, a);
  for (int i = 0; i < 3; ++i) check_close(got[i], want[i], "layer_norm outputs", tol_for(DType::f32, 1e-5));
}

TEST_CASE("layer_norm_backward: dx, dw, db on the fused and fallback paths") {
  for (DType dt : kFloats) {
    struct Case { Shape x; int64_t nd; };
    for (const Case& c : {Case{{1000, 768}, 1}, Case{{5000, 64}, 1}, Case{{30, 101}, 1},
                          Case{{4, 3, 40}, 2}, Case{{6, 2500}, 1}}) {
      const Shape norm(c.x.end() - c.nd, c.x.end());
      const Tensor x = rnd(c.x, dt, 1.5, 11), g = rnd(c.x, dt, 1.0, 12);
      const Tensor w = rnd(norm, dt, 1.0, 13), b = rnd(norm, dt, 1.0, 14);
      Attrs a;
      a.normalized_ndim = c.nd;
      const auto fwd = call(OpId::layer_norm, {x, w, b}, a);
      for (bool affine : {true, false}) {
        const Tensor wc = affine ? w : Tensor(), bc = affine ? b : Tensor();
        const auto want = layer_norm_backward(g, x, fwd[1], fwd[2], wc, bc, c.nd);
        const auto got = layer_norm_backward(g.to(kGpu), x.to(kGpu), fwd[1].to(kGpu), fwd[2].to(kGpu),
                                             affine ? w.to(kGpu) : Tensor(),
                                             affine ? b.to(kGpu) : Tensor(), c.nd);
        check_close(got[0], want[0], name("layer_norm_backward dx", dt), tol_for(dt, 1e-5));
        if (affine) {
          // Column sums over up to 5000 rows: the floor scales with sqrt(rows).
          const double floor = 1e-5 * std::sqrt(static_cast<double>(x.numel() / numel_of(norm)));
          check_close(got[1], want[1], name("layer_norm_backward dw", dt), tol_for(dt, floor));
          check_close(got[2], want[2], name("layer_norm_backward db", dt), tol_for(dt, floor));
        } else {
          CHECK(!got[1].defined());
          CHECK(!got[2].defined());
        }
      }
    }
  }
}

TEST_CASE("cross_entropy forward and backward: GPT-2 vocab, ignore_index, reductions") {
  for (DType dt : kFloats) {
    for (int64_t c : {int64_t{50257}, int64_t{10}, int64_t{1000}}) {
      const int64_t n = dt == DType::f64 ? 8 : 24;
      const Tensor logits = rnd({n, c}, dt, 2.0, 21);
      std::vector<int64_t> t = rand_indices(n, c, 22);
      t[3] = -100;
      t[n - 1] = -100;
      for (DType tdt : {DType::i64, DType::i32}) {
        const Tensor target = ints(t, tdt);
        for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
          Attrs a;
          a.reduction = red;
          const auto want = call(OpId::cross_entropy, {logits, target}, a);
          const auto got = call(OpId::cross_entropy, {logits.to(kGpu), target.to(kGpu)}, a);
          check_close(got[0], want[0], name("cross_entropy loss", dt), tol_for(dt, 1e-6));
          check_close(got[1], want[1], name("cross_entropy lse", dt), tol_for(dt, 1e-6));
          // The loss is f32 for 16-bit logits (their dtype otherwise), and so is its gradient.
          const DType ldt = want[0].dtype();
          const Tensor g = red == Reduction::none ? rnd({n}, ldt, 1.0, 23) : full({}, 0.75, ldt);
          const Tensor dwant = cross_entropy_backward(g, logits, target, want[1], red, -100);
          const Tensor dgot = cross_entropy_backward(g.to(kGpu), logits.to(kGpu), target.to(kGpu),
                                                     want[1].to(kGpu), red, -100);
          // f16 gradients of ~1e-6 are subnormal: one rounding there is 2^-24 absolute.
          check_close(dgot, dwant, name("cross_entropy_backward", dt),
                      tol_for(dt, dt == DType::f16 ? 1e-7 : 1e-12));
        }
      }
    }
  }
  // A slice of a wider tensor: logits that start off a 16-byte boundary.
  const Tensor wide = rnd({6, 1001}, DType::f32, 1.0, 24);
  const Tensor logits = wide.slice(1, 1, 1001);
  const Tensor target = ints({1, 2, 3, 999, 0, 5});
  check_close(cross_entropy(logits.to(kGpu), target.to(kGpu)), cross_entropy(logits, target),
              "cross_entropy sliced", tol_for(DType::f32));
}

TEST_CASE("embedding and index_select: rows of any width, i32/i64 indices, non-contiguous") {
  for (DType dt : {DType::f32, DType::bf16, DType::f64, DType::i32, DType::b8}) {
    for (int64_t d : {int64_t{768}, int64_t{3}, int64_t{40}}) {
      const Tensor w = cast(rnd({100, d}, DType::f32, 5.0, 31), dt);
      for (DType idt : {DType::i64, DType::i32}) {
        const Tensor idx = cast(ints(rand_indices(4 * 33, 100, 32)).reshape({4, 33}), idt);
        check_close(embedding(w.to(kGpu), idx.to(kGpu)), embedding(w, idx), name("embedding", dt), kExact);
      }
    }
    const Tensor x = cast(rnd({5, 6, 7}, DType::f32, 5.0, 33), dt);
    const Tensor idx = ints({4, 0, 4, 2, 1});
    for (int64_t dim : {0, 1, 2}) {
      check_close(index_select(x.to(kGpu), dim, idx.to(kGpu)), index_select(x, dim, idx),
                  name("index_select", dt), kExact);
      check_close(index_select(x.to(kGpu).permute({2, 1, 0}), dim, idx.to(kGpu)),
                  index_select(x.permute({2, 1, 0}), dim, idx), name("index_select permuted", dt), kExact);
    }
  }
}

TEST_CASE("index_add: embedding-backward shape with repeats, other dims; bitwise in every dtype") {
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    // [V, C] += [N, C] at N indices with many repeats (few distinct rows): C 768 takes the
    // block-per-run kernel with 16-byte accesses, 33 the same without, 5 the thread-per-element
    // kernel of narrow rows.
    for (int64_t c : {int64_t{768}, int64_t{33}, int64_t{5}}) {
      const Tensor base = cast(rnd({50, c}, DType::f32, 4.0, 41), dt);
      const Tensor src = cast(rnd({3000, c}, DType::f32, 4.0, 42), dt);
      const Tensor idx = ints(rand_indices(3000, 7, 43));
      check_close(index_add(base.to(kGpu), 0, idx.to(kGpu), src.to(kGpu)), index_add(base, 0, idx, src),
                  name("index_add dim 0", dt), kExact);
    }
    {  // One index over long rows (GPT's q/k/v slice backward): the thread-per-element kernel.
      const Tensor wide = cast(rnd({3, 4000}, DType::f32, 4.0, 52), dt);
      const Tensor one = cast(rnd({1, 4000}, DType::f32, 4.0, 53), dt);
      const Tensor at = ints({2});
      check_close(index_add(wide.to(kGpu), 0, at.to(kGpu), one.to(kGpu)), index_add(wide, 0, at, one),
                  name("index_add one index", dt), kExact);
    }
    const Tensor base = cast(rnd({3, 8, 5}, DType::f32, 4.0, 44), dt);
    const Tensor src = cast(rnd({3, 20, 5}, DType::f32, 4.0, 45), dt);
    const Tensor idx = cast(ints(rand_indices(20, 8, 46)), DType::i32);
    check_close(index_add(base.to(kGpu), 1, idx.to(kGpu), src.to(kGpu)), index_add(base, 1, idx, src),
                name("index_add dim 1", dt), kExact);
    const Tensor src2 = cast(rnd({3, 8, 9}, DType::f32, 4.0, 47), dt);
    const Tensor idx2 = ints(rand_indices(9, 5, 48));
    const Tensor src2t = src2.permute({2, 1, 0}).contiguous().to(kGpu).permute({2, 1, 0});
    check_close(index_add(base.to(kGpu), 2, idx2.to(kGpu), src2t),
                index_add(base, 2, idx2, src2), name("index_add dim 2", dt), kExact);
  }
  // Embedding backward through autograd on the device.
  const Tensor w = rnd({30, 16}, DType::f32, 1.0, 49);
  const Tensor idx = ints(rand_indices(200, 30, 50)).reshape({10, 20});
  const Tensor g = rnd({10, 20, 16}, DType::f32, 1.0, 51);
  const Tensor wd = w.to(kGpu).requires_grad_(true);
  embedding(wd, idx.to(kGpu)).backward(g.to(kGpu));
  const Tensor wc = w.clone().requires_grad_(true);
  embedding(wc, idx).backward(g);
  check_close(wd.grad(), wc.grad(), "embedding grad", kExact);
}

TEST_CASE("gather and scatter_add: every dim, strided operands, bitwise") {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i64}) {
    const Tensor x = cast(rnd({4, 5, 6}, DType::f32, 3.0, 61), dt);
    for (int64_t dim : {0, 1, 2}) {
      Shape is = {3, 4, 5};
      is[dim] = 7;
      const Tensor idx = ints(rand_indices(numel_of(is), x.shape()[dim], 62 + dim)).reshape(is);
      check_close(gather(x.to(kGpu), dim, idx.to(kGpu)), gather(x, dim, idx), name("gather", dt), kExact);
      // The same values with transposed strides on the device.
      const Tensor xt = x.permute({2, 1, 0}).contiguous().to(kGpu).permute({2, 1, 0});
      check_close(gather(xt, dim, idx.to(kGpu)),
                  gather(x, dim, idx), name("gather view", dt), kExact);
      const Tensor src = cast(rnd({8, 8, 8}, DType::f32, 3.0, 63 + dim), dt);
      check_close(scatter_add(x.to(kGpu), dim, idx.to(kGpu), src.to(kGpu)),
                  scatter_add(x, dim, idx, src), name("scatter_add", dt), kExact);
      const Tensor srcp = cast(rnd({8, 8, 8}, DType::f32, 3.0, 64), dt);
      check_close(scatter_add(x.to(kGpu), dim, idx.to(kGpu), srcp.to(kGpu).permute({2, 1, 0})),
                  scatter_add(x, dim, idx, srcp.permute({2, 1, 0})), name("scatter_add strided src", dt),
                  kExact);
    }
  }
}

TEST_CASE("cat along every dim, mixed contiguity") {
  const Tensor a = rnd({2, 3, 4}, DType::f32, 1.0, 71), b = rnd({2, 3, 4}, DType::f32, 1.0, 72);
  for (int64_t dim : {0, 1, 2, -1}) {
    const Tensor c = rnd({2, 3, 4}, DType::f32, 1.0, 73 + dim);
    const Tensor bt = b.permute({2, 1, 0}).contiguous().to(kGpu).permute({2, 1, 0});
    check_close(cat({a.to(kGpu), bt, c.to(kGpu)}, dim), cat({a, b, c}, dim),
                "cat", kExact);
  }
  const Tensor t = rnd({4, 3}, DType::bf16, 1.0, 74);
  check_close(cat({t.to(kGpu).permute({1, 0}), t.to(kGpu).permute({1, 0})}, 1),
              cat({t.permute({1, 0}), t.permute({1, 0})}, 1), "cat permuted bf16", kExact);
  check_close(cat({t.to(kGpu), t.to(kGpu).slice(0, 0, 0)}, 0), cat({t, t.slice(0, 0, 0)}, 0), "cat empty",
              kExact);
}

TEST_CASE("max_pool2d and its backward: 2x2, overlapping 3x3 with padding, bitwise") {
  struct Case { std::array<int64_t, 2> k, s, p; };
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    for (const Case& c : {Case{{2, 2}, {2, 2}, {0, 0}}, Case{{3, 3}, {2, 2}, {1, 1}},
                          Case{{3, 2}, {1, 1}, {1, 0}}}) {
      // Values in steps of 1/4 so windows have ties (the first wins).
      const Tensor q = cast(cast(mul(rnd({2, 3, 9, 8}, DType::f32, 4.0, 81), full({}, 4.0)), DType::i32),
                            DType::f32);
      const Tensor x = cast(div(q, full({}, 4.0)), dt);
      Attrs a;
      a.kernel_size = c.k;
      a.stride = c.s;
      a.padding = c.p;
      const auto want = call(OpId::max_pool2d, {x}, a);
      const auto got = call(OpId::max_pool2d, {x.to(kGpu)}, a);
      check_close(got[0], want[0], name("max_pool2d", dt), kExact);
      check_close(got[1], want[1], "max_pool2d indices", kExact);
      Attrs b = a;
      b.shape = x.shape();
      const Tensor g = rnd(want[0].shape(), dt, 1.0, 82);
      check_close(call1(OpId::max_pool2d_backward, {g.to(kGpu), got[1]}, b),
                  call1(OpId::max_pool2d_backward, {g, want[1]}, b), name("max_pool2d_backward", dt),
                  kExact);
      // Attrs without the window (a hand-made call): the plane-by-plane path.
      Attrs plain;
      plain.shape = x.shape();
      check_close(call1(OpId::max_pool2d_backward, {g.to(kGpu), got[1]}, plain),
                  call1(OpId::max_pool2d_backward, {g, want[1]}, plain),
                  name("max_pool2d_backward planes", dt), kExact);
    }
  }
  const Tensor xi = cast(rnd({1, 2, 6, 6}, DType::f32, 10.0, 83), DType::i32);
  CHECK(max_pool2d(xi.to(kGpu), {2, 2}).to(kCPU).to_vector<int32_t>() ==
        max_pool2d(xi, {2, 2}).to_vector<int32_t>());
}

TEST_CASE("out-of-range indices on the device throw at the next indexing op") {
  const Tensor w = ones({10, 4}, DType::f32, kGpu);
  const Tensor bad = ints({1, 12, 3}).to(kGpu);
  const Tensor out = embedding(w, bad);  // queued; the error is found on the device
  // The bad row reads as zeros, the others are copied.
  CHECK(out.to(kCPU).to_vector<float>() ==
        std::vector<float>{1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1});  // to(kCPU) waits for the device
  const std::string msg = error_of([&] { embedding(w, ints({0}).to(kGpu)); });
  CHECK(contains(msg, "embedding: index 12 is out of range for dim 0 of size 10"));
  // Reported once: the next call is clean.
  CHECK(embedding(w, ints({0}).to(kGpu)).to(kCPU).to_vector<float>() == std::vector<float>(4, 1.0f));
  CHECK(error_of([&] { embedding(w, ints({0}).to(kGpu)).to(kCPU); }).empty());

  const Tensor logits = zeros({2, 5}, DType::f32, kGpu);
  cross_entropy(logits, ints({1, 7}).to(kGpu)).to(kCPU);
  CHECK(contains(error_of([&] { embedding(w, ints({0}).to(kGpu)); }),
                 "cross_entropy: target 7 at row 1 is out of range for 5 classes"));
}
