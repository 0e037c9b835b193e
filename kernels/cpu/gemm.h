// Single-precision GEMM for the CPU kernels: C = A * B or C += A * B, BLIS/GotoBLAS-style
// (cache blocking, packed panels, a register-blocked AVX-512 or AVX2 micro-kernel).
//
//   // C[m, n] = X[m, k] * W^T where W is stored [n, k]: a transpose is just other strides.
//   sgemm(m, n, k, {x, k, 1}, {w, 1, k}, c, /*ldc=*/n);
//   // C += A^T * B (A stored [k, m]), e.g. accumulating a weight gradient.
//   sgemm(m, n, k, {a, 1, m}, {b, n, 1}, c, n, /*accumulate=*/true);
//
// Results are bitwise reproducible across thread counts: K is blocked by a function of K
// alone, each block's sums start from zero, and the blocks are added to C in increasing
// order whichever thread computes them (threads split C's rows or columns, or, for a small
// C with a long K, the K blocks: see gemm.cc).
#pragma once

#include <cstdint>

namespace tessera::cpu {

// A read-only f32 matrix view: element (i, j) is data[i * row_stride + j * col_stride].
// Any strides are accepted (transposed, non-contiguous, 0 for broadcast): packing gathers
// the operand into contiguous panels, so no layout needs a copy beforehand.
struct StridedMatrix {
  const float* data;
  int64_t row_stride;
  int64_t col_stride;
};

// Work on C's elements once their sums are final (linear's bias and activation): fn(ctx, i0,
// rows, j0, cols) is called for disjoint blocks [i0, i0 + rows) x [j0, j0 + cols) covering C,
// each right after the GEMM wrote it (at most kMR rows: the block is still in L1/L2), from
// the GEMM's threads. What it does to an element must not depend on the block it is in.
struct GemmEpilogue {
  void (*fn)(const void* ctx, int64_t i0, int64_t rows, int64_t j0, int64_t cols);
  const void* ctx;
};

// A triangular band in a product, as causal attention's products have (a block of query
// rows starting at position `offset` against keys from 0). The GEMM then does only the work
// the band needs, in whole register tiles and slivers; what it computes, it computes as
// without the band, in the same order. So a wanted element keeps its bits, except where a
// left-out zero term would have changed them: a -0 sum, or NaN from 0 x inf.
//   kLowerC: only C(i, j) with j <= i + offset is wanted. Register tiles wholly above the
//            band are not computed; an element above it holds either its product (a tile
//            the band crosses is computed in full) or what it held before.
//   kLowerA: A(i, p) == 0 for p > i + offset: those terms are left out of C(i, :).
//   kUpperA: A(i, p) == 0 for p < i - offset: those terms are left out of C(i, :).
struct GemmBand {
  enum Kind { kLowerC, kLowerA, kUpperA };
  Kind kind;
  int64_t offset;
};

// C[m, n] (row-major, leading dimension ldc >= n) = A[m, k] * B[k, n]; with `accumulate`
// (beta = 1) C += A * B instead. k == 0 gives C = 0 (or leaves C as is when accumulating).
// Runs on num_threads() threads (kernels/cpu/parallel.h; 1 inside a part of a parallel job).
// C must not overlap A or B. Throws tessera::Error on negative sizes, ldc < n, or a band
// together with an epilogue.
void sgemm(int64_t m, int64_t n, int64_t k, StridedMatrix a, StridedMatrix b, float* c, int64_t ldc,
           bool accumulate = false, const GemmEpilogue* epilogue = nullptr,
           const GemmBand* band = nullptr);

// The micro-kernel compiled into this build, e.g. "avx512 12x32" (for benchmark reports).
const char* sgemm_kernel_name();

namespace internal {
// Whether an AVX2 build's sgemm reads a row-major A in place (true, the default) or packs it
// as it packs every other layout (the bits are the same either way): for the tests and the
// benchmark that compare the two. Process-wide (a call running meanwhile may use either
// setting, rectangle by rectangle: the same bits); returns the previous setting. Builds
// whose kernel always packs ignore it.
bool set_sgemm_a_in_place(bool enabled);
// Whether sgemm may split K across threads (see gemm.cc; the bits are the same either way):
// 0 when its cost model says so (the default), 1 never, 2 always when K has two or more
// blocks and there is no epilogue or band (however small the product: a part per thread, at
// most one per K block; up to the buffers' cap). Process-wide, for the tests and the
// benchmark that compare them; returns the previous mode. Throws tessera::Error for other
// values.
int set_sgemm_k_split(int mode);
// How many sgemm calls have split K in this process (so a test can tell that it did).
int64_t sgemm_k_split_count();
}  // namespace internal

}  // namespace tessera::cpu
