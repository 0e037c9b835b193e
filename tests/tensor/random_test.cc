// Counter-based RNG: element i of a draw at (seed, offset) depends only on (seed, offset + i),
// so any slice or block of a tensor can be drawn on its own and matches the full draw.
#include <doctest/doctest.h>

#include <cmath>
#include <thread>

#include "tensor/ops.h"

using namespace tessera;

namespace {

Tensor draw(uint64_t seed, uint64_t offset, const Shape& shape, bool normal = false,
            DType dt = DType::f32) {
  Generator g;
  g.set_state(seed, offset);
  return normal ? randn(shape, dt, kCPU, &g) : rand(shape, dt, kCPU, &g);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.to_vector<double>() == b.to_vector<double>();
}

}  // namespace

TEST_CASE("the same (seed, offset) reproduces bitwise; another seed differs") {
  for (bool normal : {false, true}) {
    for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
      CHECK(bitwise_equal(draw(7, 100, {33, 5}, normal, dt), draw(7, 100, {33, 5}, normal, dt)));
    }
    CHECK(!bitwise_equal(draw(7, 0, {64}, normal), draw(8, 0, {64}, normal)));
  }
}

TEST_CASE("rows of a drawn tensor equal a draw of those rows at the right offset") {
  const uint64_t seed = 42, offset = 1000;
  for (bool normal : {false, true}) {
    Tensor full = draw(seed, offset, {8, 16}, normal);
    Tensor rows = draw(seed, offset + 3 * 16, {3, 16}, normal);  // rows 3..5
    CHECK(bitwise_equal(full.narrow(0, 3, 3).contiguous(), rows));
    // A flat run that starts mid-row.
    Tensor run = draw(seed, offset + 21, {10}, normal);
    CHECK(bitwise_equal(full.reshape({-1}).narrow(0, 21, 10).contiguous(), run));
  }
}

TEST_CASE("any block of the logical tensor can be drawn alone (sharded init)") {
  const uint64_t seed = 3, offset = 77;
  const Shape global = {6, 10, 4};
  for (bool normal : {false, true}) {
    Tensor full = draw(seed, offset, global, normal);
    // A block split on dims 1 and 2, as a 2-D sharding of the tensor would give.
    const RngView view{global, {2, 5, 2}};
    const Shape block = {3, 4, 2};
    Tensor b = normal ? randn_block(block, view, seed, offset) : rand_block(block, view, seed, offset);
    Tensor expected = full.slice(0, 2, 5).slice(1, 5, 9).slice(2, 2, 4).contiguous();
    CHECK(bitwise_equal(b, expected));
  }
  CHECK_THROWS_AS(rand_block({3, 4}, RngView{{4, 4}, {2, 0}}, 1, 0), Error);  // past the end
}

TEST_CASE("the default generator advances by numel and is per thread") {
  manual_seed(11);
  Tensor a = rand({5, 7});
  CHECK(default_generator().offset() == 35);
  Tensor b = rand({4});
  CHECK(bitwise_equal(a, draw(11, 0, {5, 7})));
  CHECK(bitwise_equal(b, draw(11, 35, {4})));
  manual_seed(11);
  CHECK(bitwise_equal(rand({5, 7}), a));
  // Another thread that seeds alike draws alike (each simulated rank is a thread).
  Tensor other;
  std::thread t([&] {
    manual_seed(11);
    other = rand({5, 7});
  });
  t.join();
  CHECK(bitwise_equal(other, a));
}

TEST_CASE("distribution: range and moments") {
  const int64_t n = 1 << 20;
  const std::vector<double> u = draw(1, 0, {n}).to_vector<double>();
  double mean = 0, m2 = 0, lo = 1, hi = 0;
  for (double v : u) {
    mean += v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  mean /= n;
  for (double v : u) m2 += (v - mean) * (v - mean);
  // Standard errors at n = 2^20: mean 0.29/sqrt(n) = 2.8e-4, variance ~1e-4; 10 sigma bounds.
  CHECK(lo >= 0.0);
  CHECK(hi < 1.0);
  CHECK(std::abs(mean - 0.5) < 3e-3);
  CHECK(std::abs(m2 / n - 1.0 / 12) < 1e-3);
  const std::vector<double> z = draw(2, 0, {n}, true).to_vector<double>();
  double zm = 0, zv = 0, z3 = 0;
  for (double v : z) zm += v;
  zm /= n;
  for (double v : z) {
    zv += (v - zm) * (v - zm);
    z3 += v * v * v;
  }
  CHECK(std::abs(zm) < 1e-2);       // 10 / sqrt(n)
  CHECK(std::abs(zv / n - 1) < 2e-2);
  CHECK(std::abs(z3 / n) < 3e-2);   // symmetric
  // Low precision draws stay below 1 after rounding.
  for (DType dt : {DType::bf16, DType::f16}) {
    const auto v = draw(5, 0, {1 << 16}, false, dt).to_vector<double>();
    CHECK(*std::max_element(v.begin(), v.end()) < 1.0);
  }
}

TEST_CASE("dropout masks are the uniform draws at the same counters") {
  const double p = 0.3;
  Generator g;
  g.set_state(9, 500);
  Tensor x = arange(1, 1 + 4 * 50).reshape({4, 50});
  Tensor y = dropout(x, p, true, &g);
  CHECK(g.offset() == 700);
  const auto u = draw(9, 500, {4, 50}).to_vector<float>();
  const auto xv = x.to_vector<float>(), yv = y.to_vector<float>();
  int64_t kept = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    const bool keep = u[i] >= static_cast<float>(p);
    kept += keep;
    CHECK(yv[i] == doctest::Approx(keep ? xv[i] / (1 - p) : 0.0).epsilon(1e-6));
  }
  CHECK(kept > 100);  // ~140 of 200 expected
  CHECK(kept < 180);
  // The mask is keyed by the logical index, so a non-contiguous input gets the same mask.
  Generator g2;
  g2.set_state(9, 500);
  Tensor xt = x.t().contiguous().t();  // same values, column-major layout
  CHECK(bitwise_equal(dropout(xt, p, true, &g2), y));
  // Evaluation mode and p = 0 are the identity.
  CHECK(dropout(x, p, false).is_same(x));
  CHECK(dropout(x, 0.0).is_same(x));
}

TEST_CASE("inside a batch slice, dropout draws those rows of the whole batch's mask") {
  // One device: the whole [6, 3, 4] batch, two dropouts in a row. Split: rows [2, 5) only,
  // each dropout from the same generator state: the same rows of both masks, and the
  // generator ends where the whole batch's did.
  const Tensor x = ones({6, 3, 4}, DType::f64);
  Generator whole(11), part(11);
  const Tensor a1 = dropout(x, 0.5, true, &whole), a2 = dropout(x, 0.5, true, &whole);
  Tensor b1, b2;
  {
    const BatchSliceScope slice({6, 2, 3});
    REQUIRE(current_batch_slice() != nullptr);
    const Tensor rows = x.slice(0, 2, 5);
    b1 = dropout(rows, 0.5, true, &part);
    b2 = dropout(rows, 0.5, true, &part);
    CHECK_THROWS_WITH_AS(dropout(ones({4, 3}), 0.5, true, &part),
                         doctest::Contains("does not lead with the batch"), Error);
  }
  CHECK(current_batch_slice() == nullptr);
  CHECK(bitwise_equal(b1, a1.slice(0, 2, 5)));
  CHECK(bitwise_equal(b2, a2.slice(0, 2, 5)));
  CHECK_FALSE(bitwise_equal(b1, b2));
  CHECK(part.offset() == whole.offset());
  CHECK_THROWS_WITH_AS(BatchSliceScope({6, 4, 3}), doctest::Contains("not inside a batch of 6"),
                       Error);
}
