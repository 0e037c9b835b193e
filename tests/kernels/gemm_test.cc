// sgemm (kernels/cpu/gemm.h) against a plain f64 triple loop: many shapes (1x1x1, primes,
// tall and skinny, K = 1, sizes either side of the register tile and cache blocks), all four
// transpose combinations, strided operands, accumulate on and off; bitwise determinism across
// thread counts; a row-major A read in place against packed, bit for bit; and matmul through
// the op API (batched, broadcast, transposed views; f16/bf16 operands in any layout against
// the rounded f32 product).
//
// Tolerance. Each element is a K-term f32 dot product. A product passes through at most
// kc roundings inside its K block (one per fused multiply-add), then one per K block added
// into C (or C's old value): kc + ceil(K / kc) + 1 <= K + 2 roundings of unit roundoff
// u = 2^-24. Hence |computed - exact| <= (K + 3) u (sum_k |a_ik b_kj| + |c_ij|), with one
// rounding to spare (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3). The
// bound is rigorous (the test cannot flake) yet below what a real bug does: a wrong, missing
// or doubled term is off by |a_ik b_kj|, 0.25 on average with these operands in [-1, 1),
// while the bound is about (K + 3) u K / 4: 6e-6 at K = 10, 1.5e-2 at K = 1000. Edge-tile and
// packing bugs hit whole rows or columns of C, far more than one term.
#include "kernels/cpu/gemm.h"

#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "tensor/ops.h"

using namespace tessera;
using tessera::cpu::sgemm;
using tessera::cpu::StridedMatrix;

namespace {

constexpr double kUnitRoundoff = 1.0 / (1 << 24);

// Deterministic values in [-1, 1) from an index (a hash, so neighbours are unrelated).
float value_at(uint64_t seed, uint64_t i) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<double>(x >> 40) / (1ull << 23) - 1.0);
}

// A logical rows x cols matrix laid out in memory with given strides inside a buffer that
// also holds padding (filled with NaN, so reading it by mistake poisons the result).
struct Operand {
  std::vector<float> storage;
  StridedMatrix view;
};

Operand lay_out(const std::vector<float>& logical, int64_t rows, int64_t cols, bool transposed,
                bool strided) {
  // Row-major: (i, j) at i * ld + j. Transposed (column-major): (i, j) at j * ld + i.
  // Strided adds a gap to the leading dimension and doubles the unit stride.
  const int64_t inner = transposed ? rows : cols, outer = transposed ? cols : rows;
  const int64_t unit = strided ? 2 : 1;
  const int64_t ld = inner * unit + (strided ? 3 : 0);
  Operand op;
  op.storage.assign(static_cast<size_t>(std::max<int64_t>(outer * ld, 1)), NAN);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t at = transposed ? j * ld + i * unit : i * ld + j * unit;
      op.storage[at] = logical[i * cols + j];
    }
  }
  op.view = transposed ? StridedMatrix{op.storage.data(), unit, ld}
                       : StridedMatrix{op.storage.data(), ld, unit};
  return op;
}

struct Reference {
  std::vector<double> product;  // exact-ish A * B in f64
  std::vector<double> abs_sum;  // sum_k |a_ik b_kj|, for the error bound
};

Reference naive(const std::vector<float>& a, const std::vector<float>& b, int64_t m, int64_t n,
                int64_t k) {
  Reference r{std::vector<double>(m * n, 0.0), std::vector<double>(m * n, 0.0)};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      const double av = a[i * k + p];
      for (int64_t j = 0; j < n; ++j) {
        r.product[i * n + j] += av * b[p * n + j];
        r.abs_sum[i * n + j] += std::fabs(av * b[p * n + j]);
      }
    }
  }
  return r;
}

std::vector<float> random_matrix(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> v(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) v[i] = value_at(seed, i);
  return v;
}

// Checks C (m x n, leading dimension ldc) against ref (+ c0 when accumulating); returns the
// number of elements outside the bound (reported once per case by the caller).
int64_t count_bad(const float* c, int64_t ldc, const Reference& ref, const std::vector<float>* c0,
                  int64_t m, int64_t n, int64_t k) {
  int64_t bad = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double old = c0 ? (*c0)[i * n + j] : 0.0;
      const double want = ref.product[i * n + j] + old;
      const double bound = (k + 3) * kUnitRoundoff * (ref.abs_sum[i * n + j] + std::fabs(old));
      const double got = c[i * ldc + j];
      if (!(std::fabs(got - want) <= bound)) ++bad;  // NaN counts as bad
    }
  }
  return bad;
}

// Restores the calling thread's kernel thread count when a test ends.
struct ThreadCountGuard {
  int saved = cpu::num_threads();
  ~ThreadCountGuard() { cpu::set_num_threads(saved); }
};

}  // namespace

TEST_CASE("sgemm matches a f64 triple loop for all layouts, shapes and accumulate") {
  // {m, n, k}: trivial, primes, tall/skinny, K = 1, and sizes either side of the register
  // tile (12 x 32 with AVX-512, 6 x 16 with AVX2), the K block (384, balanced), the B block
  // (512 columns) and the A panel (3072 rows).
  const std::vector<std::array<int64_t, 3>> shapes = {
      {1, 1, 1},       {1, 1, 7},      {7, 1, 1},      {1, 9, 1},       {2, 3, 4},
      {37, 53, 71},    {13, 17, 19},   {97, 89, 101},  {1000, 3, 17},   {3, 1000, 17},
      {517, 1, 33},    {1, 517, 33},   {64, 64, 1},    {45, 77, 1},     {6, 16, 8},
      {12, 32, 384},   {11, 31, 383},  {13, 33, 385},  {25, 65, 769},   {5, 7, 1000},
      {100, 513, 100}, {24, 1025, 50}, {3073, 20, 10}, {130, 300, 400},
  };
  uint64_t seed = 0;
  // Plain variables, not a structured binding: CAPTURE captures them (clang < 16 rejects that).
  for (const std::array<int64_t, 3>& shape : shapes) {
    const int64_t m = shape[0], n = shape[1], k = shape[2];
    const std::vector<float> a = random_matrix(m, k, ++seed), b = random_matrix(k, n, ++seed);
    const std::vector<float> c0 = random_matrix(m, n, ++seed);
    const Reference ref = naive(a, b, m, n, k);
    // Packing copies every layout into the same panels, so all eight give the same bits
    // (the vector packers - transposes through registers - against the scalar gathers; on
    // AVX2 a row-major A is read in place instead, against the packed transposed one).
    std::vector<float> first[2];
    for (int layout = 0; layout < 8; ++layout) {
      const bool ta = layout & 1, tb = layout & 2, strided = layout & 4;
      const Operand ao = lay_out(a, m, k, ta, strided), bo = lay_out(b, k, n, tb, strided);
      for (bool accumulate : {false, true}) {
        // C with a wider leading dimension; the gap must stay untouched.
        const int64_t ldc = n + 5;
        std::vector<float> c(m * ldc, -7.0f);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = accumulate ? c0[i * n + j] : NAN;
        }
        sgemm(m, n, k, ao.view, bo.view, c.data(), ldc, accumulate);
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(k);
        CAPTURE(ta);
        CAPTURE(tb);
        CAPTURE(strided);
        CAPTURE(accumulate);
        CHECK(count_bad(c.data(), ldc, ref, accumulate ? &c0 : nullptr, m, n, k) == 0);
        int64_t gap_touched = 0;
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = n; j < ldc; ++j) gap_touched += c[i * ldc + j] != -7.0f;
        }
        CHECK(gap_touched == 0);
        std::vector<float>& same = first[accumulate];
        if (layout == 0) same = c;
        CHECK(std::memcmp(c.data(), same.data(), sizeof(float) * c.size()) == 0);
      }
    }
  }
}

TEST_CASE("sgemm with broadcast (stride 0) operands and k == 0") {
  // Every row of A is the same row: stride 0 between rows.
  const int64_t m = 20, n = 45, k = 33;
  const std::vector<float> row = random_matrix(1, k, 7), b = random_matrix(k, n, 8);
  std::vector<float> c(m * n);
  sgemm(m, n, k, {row.data(), 0, 1}, {b.data(), n, 1}, c.data(), n);
  const Reference ref = naive(row, b, 1, n, k);
  for (int64_t i = 0; i < m; ++i) CHECK(count_bad(c.data() + i * n, n, ref, nullptr, 1, n, k) == 0);

  // k == 0: C = 0, or C unchanged when accumulating.
  std::vector<float> z(6, 3.0f);
  sgemm(2, 3, 0, {nullptr, 0, 1}, {nullptr, 3, 1}, z.data(), 3, /*accumulate=*/true);
  CHECK(z == std::vector<float>(6, 3.0f));
  sgemm(2, 3, 0, {nullptr, 0, 1}, {nullptr, 3, 1}, z.data(), 3);
  CHECK(z == std::vector<float>(6, 0.0f));
}

TEST_CASE("sgemm rejects bad sizes with tessera::Error") {
  std::vector<float> buf(16, 1.0f);
  CHECK_THROWS_AS(sgemm(2, 4, 2, {buf.data(), 2, 1}, {buf.data(), 4, 1}, buf.data(), 3), Error);
  CHECK_THROWS_AS(sgemm(-1, 4, 2, {buf.data(), 2, 1}, {buf.data(), 4, 1}, buf.data(), 4), Error);
}

TEST_CASE("sgemm is bitwise identical for 1, 2, 3 and 4 threads") {
  ThreadCountGuard guard;
  const std::vector<std::array<int64_t, 3>> shapes = {
      {300, 300, 300}, {517, 130, 800}, {64, 1000, 77}, {1000, 40, 900}, {129, 257, 1025}};
  uint64_t seed = 100;
  for (const std::array<int64_t, 3>& shape : shapes) {
    const int64_t m = shape[0], n = shape[1], k = shape[2];
    const std::vector<float> a = random_matrix(m, k, ++seed), b = random_matrix(k, n, ++seed);
    const std::vector<float> c0 = random_matrix(m, n, ++seed);
    for (bool accumulate : {false, true}) {
      std::vector<float> first;
      for (int threads : {1, 2, 3, 4}) {
        cpu::set_num_threads(threads);
        std::vector<float> c = c0;
        sgemm(m, n, k, {a.data(), k, 1}, {b.data(), n, 1}, c.data(), n, accumulate);
        if (first.empty()) {
          first = c;
          continue;
        }
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(k);
        CAPTURE(threads);
        CHECK(std::memcmp(c.data(), first.data(), c.size() * sizeof(float)) == 0);
      }
      // Inside a part of a parallel job sgemm runs single-threaded; still the same bits. So
      // inside an OpenMP region (a user's).
      cpu::set_num_threads(2);
      std::vector<float> inside = c0, in_omp = c0;
      cpu::parallel_parts(2, [&](int part) {
        if (part == 1) sgemm(m, n, k, {a.data(), k, 1}, {b.data(), n, 1}, inside.data(), n, accumulate);
      });
      CHECK(std::memcmp(inside.data(), first.data(), inside.size() * sizeof(float)) == 0);
#pragma omp parallel num_threads(2)
      {
#pragma omp single
        sgemm(m, n, k, {a.data(), k, 1}, {b.data(), n, 1}, in_omp.data(), n, accumulate);
      }
      CHECK(std::memcmp(in_omp.data(), first.data(), in_omp.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("sgemm under a causal band: the wanted elements' bits, the left-out tiles untouched") {
  // The band's three kinds against the same product without it, on 1 and 2 threads, with
  // offsets either side of 0, shapes off the register tile and past the K block (384). The
  // operands are positive, so no sum is -0, and A is zero off its band for the A kinds (as
  // attention's P and dS are), so the bits must be the band-free product's. Past 16 of
  // those zeros (more than a register tile's rows) A holds NaN instead: the band must leave
  // those terms out, or they would poison the row.
  ThreadCountGuard guard;
  using cpu::GemmBand;
  const std::vector<std::array<int64_t, 3>> shapes = {
      {64, 64, 32}, {64, 128, 32}, {37, 53, 71}, {130, 300, 400}, {7, 1000, 900}, {300, 40, 777}};
  const std::vector<int64_t> offsets = {-9, 0, 5, 64, 700};
  int64_t cases = 0, left_out_elements = 0, poisoned_terms = 0;
  uint64_t seed = 500;
  for (const std::array<int64_t, 3>& shape : shapes) {
    const int64_t m = shape[0], n = shape[1], k = shape[2];
    std::vector<float> a = random_matrix(m, k, ++seed), b = random_matrix(k, n, ++seed);
    for (float& x : a) x = std::fabs(x);
    for (float& x : b) x = std::fabs(x);
    for (int64_t offset : offsets) {
      for (GemmBand::Kind kind : {GemmBand::kLowerC, GemmBand::kLowerA, GemmBand::kUpperA}) {
        // The A kinds: A zero off the band, NaN from 16 past it in the copy the band reads.
        std::vector<float> banded_a = a, poisoned_a = a;
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t p = 0; p < k; ++p) {
            const int64_t past = kind == GemmBand::kLowerA   ? p - (i + offset)
                                 : kind == GemmBand::kUpperA ? (i - offset) - p
                                                             : 0;
            if (past > 0) banded_a[i * k + p] = poisoned_a[i * k + p] = 0.0f;
            if (past > 16) {
              poisoned_a[i * k + p] = NAN;
              ++poisoned_terms;
            }
          }
        }
        for (bool accumulate : {false, true}) {
          const std::vector<float> c0 = random_matrix(m, n, ++seed);
          std::vector<float> plain = c0;
          sgemm(m, n, k, {banded_a.data(), k, 1}, {b.data(), n, 1}, plain.data(), n, accumulate);
          for (int threads : {1, 2}) {
            cpu::set_num_threads(threads);
            // -7 marks elements the band must leave as they were when not accumulating.
            std::vector<float> c = accumulate ? c0 : std::vector<float>(m * n, -7.0f);
            const GemmBand band{kind, offset};
            sgemm(m, n, k, {poisoned_a.data(), k, 1}, {b.data(), n, 1}, c.data(), n, accumulate,
                  nullptr, &band);
            int64_t wrong = 0, untouched = 0;
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                const float got = c[i * n + j], want = plain[i * n + j];
                const bool wanted = kind != GemmBand::kLowerC || j <= i + offset;
                if (wanted) {
                  wrong += std::memcmp(&got, &want, sizeof(float)) != 0;
                } else if (std::memcmp(&got, &want, sizeof(float)) != 0) {
                  // Not computed: as it was.
                  const float before = accumulate ? c0[i * n + j] : -7.0f;
                  wrong += std::memcmp(&got, &before, sizeof(float)) != 0;
                  ++untouched;
                }
              }
            }
            CAPTURE(m);
            CAPTURE(n);
            CAPTURE(k);
            CAPTURE(offset);
            CAPTURE(static_cast<int>(kind));
            CAPTURE(accumulate);
            CAPTURE(threads);
            CHECK(wrong == 0);
            left_out_elements += untouched;
            ++cases;
          }
        }
      }
    }
  }
  CHECK(cases == 6 * 5 * 3 * 2 * 2);
  // The band did leave work out: tiles untouched, NaN terms not read.
  CHECK(left_out_elements > 0);
  CHECK(poisoned_terms > 0);
  // A band with an epilogue is refused.
  std::vector<float> buf(16, 1.0f);
  const GemmBand band{GemmBand::kLowerC, 0};
  const cpu::GemmEpilogue epilogue{[](const void*, int64_t, int64_t, int64_t, int64_t) {}, nullptr};
  CHECK_THROWS_AS(sgemm(2, 2, 2, {buf.data(), 2, 1}, {buf.data(), 2, 1}, buf.data() + 8, 2, false,
                        &epilogue, &band),
                  Error);
}

TEST_CASE("sgemm split along K across threads gives the serial nest's bits") {
  // internal::set_sgemm_k_split(2) makes every product with two or more K blocks split K
  // across the threads (part 0 into C, each later block into a buffer of its own, added in
  // block order). Against one thread and against the grid (mode 1): the same bits, for K
  // blocks that divide unevenly among 2, 3 and 4 threads, a column-major A (a weight
  // gradient's x^T) and a row-major one, a transposed B, accumulate, and a C whose leading
  // dimension has a gap that must stay untouched. The values must also be within the
  // triple loop's bound.
  ThreadCountGuard guard;
  struct Restore {
    int saved = cpu::internal::set_sgemm_k_split(0);
    ~Restore() { cpu::internal::set_sgemm_k_split(saved); }
  } restore;
  CHECK_THROWS_AS(cpu::internal::set_sgemm_k_split(3), Error);
  const std::vector<std::array<int64_t, 3>> shapes = {
      {128, 128, 2048}, {7, 33, 769}, {131, 17, 1025}, {40, 70, 5000}, {1, 1, 800},
      {3100, 3, 769}};  // the last: two A panels (kMB = 3072 rows) in each block
  int64_t cases = 0;
  uint64_t seed = 1300;
  for (const std::array<int64_t, 3>& shape : shapes) {
    const int64_t m = shape[0], n = shape[1], k = shape[2], ldc = n + 3;
    const std::vector<float> a = random_matrix(m, k, ++seed), b = random_matrix(k, n, ++seed);
    const std::vector<float> c0 = random_matrix(m, n, ++seed);
    const Reference ref = naive(a, b, m, n, k);
    for (int layout = 0; layout < 2; ++layout) {
      // 0: A column-major, B row-major (x^T g); 1: A row-major, B transposed (x W^T).
      const Operand ao = lay_out(a, m, k, layout == 0, false);
      const Operand bo = lay_out(b, k, n, layout == 1, false);
      for (bool accumulate : {false, true}) {
        std::vector<float> c0_wide(m * ldc, -7.0f);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) c0_wide[i * ldc + j] = accumulate ? c0[i * n + j] : NAN;
        }
        const auto run = [&](int threads, int mode) {
          cpu::set_num_threads(threads);
          cpu::internal::set_sgemm_k_split(mode);
          std::vector<float> c = c0_wide;
          sgemm(m, n, k, ao.view, bo.view, c.data(), ldc, accumulate);
          return c;
        };
        const std::vector<float> serial = run(1, 1);
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(k);
        CAPTURE(layout);
        CAPTURE(accumulate);
        CHECK(count_bad(serial.data(), ldc, ref, accumulate ? &c0 : nullptr, m, n, k) == 0);
        for (int threads : {2, 3, 4}) {
          CAPTURE(threads);
          const int64_t splits = cpu::internal::sgemm_k_split_count();
          const std::vector<float> split = run(threads, 2);
          CHECK(cpu::internal::sgemm_k_split_count() == splits + 1);  // it did split
          const std::vector<float> grid = run(threads, 1);
          CHECK(cpu::internal::sgemm_k_split_count() == splits + 1);  // and this did not
          CHECK(std::memcmp(split.data(), serial.data(), sizeof(float) * serial.size()) == 0);
          CHECK(std::memcmp(grid.data(), serial.data(), sizeof(float) * serial.size()) == 0);
          ++cases;
        }
      }
    }
  }
  CHECK(cases == 6 * 2 * 2 * 3);
  // The cost model's choices at 2 threads: a weight gradient over 2048 tokens splits, a
  // product with one K block, an epilogue or too large a C does not.
  cpu::set_num_threads(2);
  cpu::internal::set_sgemm_k_split(0);
  const auto splits_in = [](int64_t m, int64_t n, int64_t k, const cpu::GemmEpilogue* epilogue) {
    std::vector<float> a(m * k, 0.5f), b(k * n, 0.25f), c(m * n);
    const int64_t before = cpu::internal::sgemm_k_split_count();
    sgemm(m, n, k, {a.data(), 1, m}, {b.data(), n, 1}, c.data(), n, false, epilogue);
    return cpu::internal::sgemm_k_split_count() - before;
  };
  const cpu::GemmEpilogue noop{[](const void*, int64_t, int64_t, int64_t, int64_t) {}, nullptr};
  CHECK(splits_in(128, 128, 2048, nullptr) == 1);
  CHECK(splits_in(512, 128, 2048, nullptr) == 1);
  CHECK(splits_in(128, 128, 2048, &noop) == 0);
  CHECK(splits_in(512, 512, 300, nullptr) == 0);     // one K block
  CHECK(splits_in(1024, 1040, 769, nullptr) == 0);  // more than 8 MiB of buffers
}

TEST_CASE("sgemm reads a row-major A in place with the packed path's bits") {
  // An AVX2 build's kernel reads a row-major A where it lies (kInPlaceA in gemm.cc); the
  // same product with the A pack forced (internal::set_sgemm_a_in_place(false)) must give
  // the same bits: shapes off the register tile (edge slivers repeat their last row
  // pointer) and past the K block, a row stride with a gap, accumulate, 1 and 2 threads, and
  // the three bands (kUpperA starts a sliver's rows past depth 0 of a block, kLowerA stops
  // them early, kLowerC skips tiles). Builds whose kernel always packs run both settings
  // through the same path.
  ThreadCountGuard guard;
  using cpu::GemmBand;
  struct Restore {
    bool saved = cpu::internal::set_sgemm_a_in_place(true);
    ~Restore() { cpu::internal::set_sgemm_a_in_place(saved); }
  } restore;
  const std::vector<std::array<int64_t, 3>> shapes = {
      {1, 16, 5}, {5, 17, 33}, {6, 16, 384}, {13, 40, 385}, {130, 300, 400}, {301, 64, 800}};
  int64_t cases = 0;
  uint64_t seed = 900;
  for (const std::array<int64_t, 3>& shape : shapes) {
    const int64_t m = shape[0], n = shape[1], k = shape[2], lda = k + 5;
    std::vector<float> a(m * lda, NAN);  // the gap holds NaN: reading it poisons a row
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t p = 0; p < k; ++p) a[i * lda + p] = std::fabs(value_at(seed, i * k + p));
    }
    std::vector<float> b = random_matrix(k, n, ++seed);
    for (float& x : b) x = std::fabs(x);
    const std::vector<float> c0 = random_matrix(m, n, ++seed);
    for (int band_kind = -1; band_kind < 3; ++band_kind) {
      const GemmBand band{static_cast<GemmBand::Kind>(std::max(band_kind, 0)), 3};
      for (bool accumulate : {false, true}) {
        for (int threads : {1, 2}) {
          cpu::set_num_threads(threads);
          std::vector<float> c[2];
          for (int in_place = 0; in_place < 2; ++in_place) {
            cpu::internal::set_sgemm_a_in_place(in_place == 1);
            c[in_place] = accumulate ? c0 : std::vector<float>(m * n, -7.0f);
            sgemm(m, n, k, {a.data(), lda, 1}, {b.data(), n, 1}, c[in_place].data(), n, accumulate,
                  nullptr, band_kind < 0 ? nullptr : &band);
          }
          int64_t nan = 0;
          for (float x : c[1]) nan += std::isnan(x);
          CAPTURE(m);
          CAPTURE(n);
          CAPTURE(k);
          CAPTURE(band_kind);
          CAPTURE(accumulate);
          CAPTURE(threads);
          CHECK(nan == 0);
          CHECK(std::memcmp(c[0].data(), c[1].data(), sizeof(float) * c[0].size()) == 0);
          ++cases;
        }
      }
    }
  }
  CHECK(cases == 6 * 4 * 2 * 2);
}

TEST_CASE("matmul (f32) through the op API: batched, broadcast and transposed views") {
  ThreadCountGuard guard;
  // Compares out[batch] with the triple loop of the batch's operands.
  auto check_batch = [](const Tensor& out, const Tensor& a, const Tensor& b) {
    const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
    const std::vector<float> av = a.contiguous().to_vector<float>();
    const std::vector<float> bv = b.contiguous().to_vector<float>();
    const std::vector<float> ov = out.to_vector<float>();
    REQUIRE(ov.size() == static_cast<size_t>(m * n));
    CHECK(count_bad(ov.data(), n, naive(av, bv, m, n, k), nullptr, m, n, k) == 0);
  };
  for (int threads : {1, 2}) {
    cpu::set_num_threads(threads);
    CAPTURE(threads);
    // A batch of 3 against one shared right operand (batch broadcast).
    const Tensor a = Tensor::from_vector<float>(random_matrix(3 * 37, 53, 1), {3, 37, 53});
    const Tensor b = Tensor::from_vector<float>(random_matrix(53, 71, 2), {53, 71});
    const Tensor c = matmul(a, b);
    REQUIRE(c.shape() == Shape{3, 37, 71});
    for (int64_t i = 0; i < 3; ++i) check_batch(c.select(0, i), a.select(0, i), b);

    // Transposed views on both sides (x^T @ w^T), no copies made by the caller.
    const Tensor x = Tensor::from_vector<float>(random_matrix(129, 65, 3), {129, 65});
    const Tensor w = Tensor::from_vector<float>(random_matrix(70, 129, 4), {70, 129});
    const Tensor xt = x.t(), wt = w.t();
    const Tensor y = matmul(xt, wt);
    REQUIRE(y.shape() == Shape{65, 70});
    check_batch(y, xt, wt);

    // A sliced (non-contiguous rows and columns) left operand.
    const Tensor big = Tensor::from_vector<float>(random_matrix(80, 90, 5), {80, 90});
    const Tensor sl = big.slice(0, 3, 80, 2).slice(1, 1, 90, 3);
    const Tensor z = matmul(sl, b.slice(0, 0, sl.size(1)));
    check_batch(z, sl, b.slice(0, 0, sl.size(1)));

    // Many small products (the one-product-per-thread path).
    const Tensor p = Tensor::from_vector<float>(random_matrix(64 * 9, 7, 6), {64, 9, 7});
    const Tensor q = Tensor::from_vector<float>(random_matrix(64 * 7, 11, 7), {64, 7, 11});
    const Tensor r = matmul(p, q);
    for (int64_t i = 0; i < 64; i += 9) check_batch(r.select(0, i), p.select(0, i), q.select(0, i));
  }
  // One big product through matmul: identical bits with 1 and 2 threads.
  const Tensor a = Tensor::from_vector<float>(random_matrix(300, 500, 8), {300, 500});
  const Tensor b = Tensor::from_vector<float>(random_matrix(500, 260, 9), {500, 260});
  cpu::set_num_threads(1);
  const std::vector<float> one = matmul(a, b).to_vector<float>();
  cpu::set_num_threads(2);
  const std::vector<float> two = matmul(a, b).to_vector<float>();
  CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)) == 0);
}

// f16/bf16 matmul widens its operands, multiplies in f32 and rounds once
// (kernels/cpu/matmul.cc). A transposed or permuted operand is widened in its own memory order
// and keeps its layout; a sliced one is widened into a contiguous copy. Either way the result
// is bitwise the f32 product of the widened values, rounded, and that f32 product is within
// the triple loop's bound.
TEST_CASE("matmul (f16/bf16): transposed, permuted and sliced operands give the f32 product's bits, rounded once") {
  ThreadCountGuard guard;
  const auto same = [](const Tensor& a, const Tensor& b) {
    const std::vector<float> av = a.to_vector<float>(), bv = b.to_vector<float>();
    return av.size() == bv.size() && std::memcmp(av.data(), bv.data(), av.size() * sizeof(float)) == 0;
  };
  int checked = 0;
  for (int threads : {1, 2}) {
    cpu::set_num_threads(threads);
    for (DType dt : {DType::bf16, DType::f16}) {
      const std::string dtype(dtype_name(dt));
      CAPTURE(threads);
      CAPTURE(dtype);
      const Tensor x = Tensor::from_vector<float>(random_matrix(129, 65, 11), {129, 65}).cast(dt);
      const Tensor w = Tensor::from_vector<float>(random_matrix(70, 129, 12), {70, 129}).cast(dt);
      const Tensor p = Tensor::from_vector<float>(random_matrix(5 * 37, 53, 13), {5, 37, 53}).cast(dt);
      const Tensor q = Tensor::from_vector<float>(random_matrix(53, 11, 14), {53, 11}).cast(dt);
      const Tensor big = Tensor::from_vector<float>(random_matrix(80, 90, 15), {80, 90}).cast(dt);
      struct Pair {
        const char* what;
        Tensor a, b;
      };
      const Pair pairs[] = {
          {"x^T w^T (a weight gradient's layout on both sides)", x.t(), w.t()},
          {"a batch of transposed matrices", p.transpose(1, 2), p.select(0, 1)},
          {"batch and row dims swapped ([37, 5, 53], dense in memory)", p.permute({1, 0, 2}), q},
          {"sliced operands (not dense: widened contiguous)", big.slice(0, 3, 80, 2).slice(1, 1, 90, 3),
           big.slice(0, 10, 40).slice(1, 0, 90, 4)},
      };
      for (const Pair& pr : pairs) {
        const std::string what = pr.what;
        CAPTURE(what);
        const Tensor got = matmul(pr.a, pr.b);
        REQUIRE(got.dtype() == dt);
        const Tensor wide = matmul(pr.a.cast(DType::f32), pr.b.cast(DType::f32));
        CHECK(same(got, wide.cast(dt)));
        CHECK(same(got, matmul(pr.a.contiguous(), pr.b.contiguous())));
        // The f32 product against the triple loop, batch by batch.
        const Tensor a3 = pr.a.dim() == 2 ? pr.a.unsqueeze(0) : pr.a;
        const Tensor w3 = wide.dim() == 2 ? wide.unsqueeze(0) : wide;
        for (int64_t i = 0; i < a3.size(0); ++i) {
          const Tensor ai = a3.select(0, i).cast(DType::f32);
          const Tensor bi = (pr.b.dim() == 3 ? pr.b.select(0, i) : pr.b).cast(DType::f32);
          const int64_t m = ai.size(0), k = ai.size(1), n = bi.size(1);
          const std::vector<float> ov = w3.select(0, i).to_vector<float>();
          CHECK(count_bad(ov.data(), n, naive(ai.contiguous().to_vector<float>(), bi.contiguous().to_vector<float>(), m, n, k),
                          nullptr, m, n, k) == 0);
        }
        ++checked;
      }
    }
  }
  CHECK(checked == 16);
}
