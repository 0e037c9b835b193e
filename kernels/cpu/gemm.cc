// sgemm: the GotoBLAS/BLIS loop nest with row-major C and vectors along N.
//
// Loop nest (per thread, over its own rectangle of C):
//   for ib in rows, step kMB:            A panel  (mb x kc, packed, lives in L3)
//     for pb in K, step kc:              the K blocking: a function of K alone
//       pack A[ib.., pb..]               (AVX2, row-major A: read in place, see kInPlaceA)
//       for jb in cols, step kNB:        B block  (kc x nb, packed, lives in L2)
//         pack B[pb.., jb..]
//         for ir in mb, step kMR:        A sliver (kMR x kc), reused for the whole block
//           for jr in nb, step kNR:      B sliver (kc x kNR) streams from L2
//             micro-kernel: C[ir.., jr..] (+)= A sliver * B sliver
//
// The micro-kernel holds a kMR x kNR tile of C in registers: per k it loads kNR/16 vectors of
// the packed B row and broadcasts kMR values of the packed A column (an outer product).
// Packing makes both streams contiguous and aligned whatever the operands' strides, which is
// why transposed views need no copy (an AVX2 build reads a row-major A in place instead: see
// kInPlaceA). Edge tiles are computed in full from zero-padded panels (in place, an edge
// sliver's missing rows repeat its last row) into a scratch tile, and only the valid part is
// written to C.
//
// Determinism: every element of C is accumulated as  c = 0; for k in block: c = fma(a, b, c)
// per K block (a separate multiply and add in the scalar fallback), and the blocks are added
// to C in increasing order. That holds in full tiles, edge tiles and on any thread, so the
// thread count (which only chooses who computes which rectangle of C, or which K blocks
// when threads split K) never changes a bit of the result.
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/simd.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <new>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels/cpu/parallel.h"
#include "tensor/error.h"

namespace tessera::cpu {
namespace {

// Register tile and cache blocks per instruction set. kMR x kNR accumulators must fit the
// register file with room for the B row and a broadcast: 24 of 32 zmm, 12 of 16 ymm.
#if defined(__AVX512F__)
constexpr int kMR = 12, kNR = 32;
constexpr const char* kKernelName = "avx512 12x32";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMR = 6, kNR = 16;
constexpr const char* kKernelName = "avx2+fma 6x16";
#else
constexpr int kMR = 4, kNR = 8;
constexpr const char* kKernelName = "scalar 4x8";
#endif

// Sized for Zen 4 (32 KiB L1d, 1 MiB L2 per core, 32 MiB L3). kKC: long enough that loading
// and storing the C tile once per K block is noise (A sliver 18 KiB). kNB: the B block
// (kKC x kNB, at most 1.1 MiB) sits in L2, with L3 catching the overflow. kMB: the A panel
// (kMB x kKC) fits in L3, so B is repacked at most once per kMB rows. Blocks are balanced
// (see balanced_block). On Zen 4, KC 256..480, NB 512..1024 and tiles 12x32, 8x48, 6x64,
// 14x32 all measured within noise of each other (~100 GFLOP/s on one core).
constexpr int64_t kKC = 384;
constexpr int64_t kNB = 768;
constexpr int64_t kMB = 3072;
static_assert(kNB % kNR == 0 && kMB % kMR == 0);

// Whether the micro-kernel reads a row-major A (unit column stride) where it lies, through
// one pointer per row of the sliver, instead of from a packed sliver. The kernel does the
// same FMAs in the same order on the same values either way, so the bits do not change;
// what is saved is the pack, an 8 x 8 transpose of every A element per column of the thread
// grid. GPT-mini's products have K and N of 128..512, so a packed A element serves only
// N / 16 micro-kernel calls, and those packs took 4.6% of its step's samples on Zen 3
// (BENCHMARKS.md, ninth CPU section). The AVX2 kernel has the registers for six row
// pointers; the AVX-512 kernel's twelve would spill, so it packs. B stays packed: read in
// place, a sliver's kc rows lie a row stride apart (2 KiB for N = 512), so they fall in a
// few L1 sets and evict each other; GPT-mini's products with a row-major B ran 5-27% slower
// that way (the same section).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool kInPlaceA = true;
#else
constexpr bool kInPlaceA = false;
#endif
std::atomic<bool> g_a_in_place{true};  // internal::set_sgemm_a_in_place

// Below this many multiply-adds per thread, waking another thread costs more than it saves.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 18;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- micro-kernels -------------------------------------------------------------------------
// c[kMR x kNR] (row stride ldc) = or += sum_p a[p * kMR + r] * b[p * kNR + j] over p < kc.
// `a` and `b` are packed slivers (the AVX2 kernel can also read A in place); `b` is 64-byte
// aligned.

#if defined(__AVX512F__)
inline void micro_kernel(int64_t kc, const float* __restrict a, const float* __restrict b, float* c,
                         int64_t ldc, bool accumulate) {
  constexpr int kNV = kNR / 16;  // vectors per row of the tile
  __m512 acc[kMR][kNV];
  // The tile is written at the end; start fetching it now so the stores do not stall.
#pragma GCC unroll 16
  for (int r = 0; r < kMR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      acc[r][v] = _mm512_setzero_ps();
      _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc + 16 * v), _MM_HINT_T0);
    }
  }
  for (int64_t p = 0; p < kc; ++p) {
    __m512 bv[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) bv[v] = _mm512_load_ps(b + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < kMR; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r]);
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
    a += kMR;
    b += kNR;
  }
#pragma GCC unroll 16
  for (int r = 0; r < kMR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      float* cv = c + r * ldc + 16 * v;
      if (accumulate) acc[r][v] = _mm512_add_ps(_mm512_loadu_ps(cv), acc[r][v]);
      _mm512_storeu_ps(cv, acc[r][v]);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// With `a_rows` set, A is read where it lies (see kInPlaceA): row r's value at depth p is
// a_rows[r][p]. Otherwise `a` is a packed sliver.
template <bool kRowsA>
inline void micro_kernel_avx2(int64_t kc, const float* __restrict a, const float* const* a_rows,
                              const float* __restrict b, float* c, int64_t ldc, bool accumulate) {
  __m256 c0[kMR], c1[kMR];
#pragma GCC unroll 6
  for (int r = 0; r < kMR; ++r) {
    c0[r] = _mm256_setzero_ps();
    c1[r] = _mm256_setzero_ps();
  }
  const float* ar[kMR];
  if constexpr (kRowsA) {
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) ar[r] = a_rows[r];
  }
#pragma GCC unroll 4
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      const __m256 av = _mm256_broadcast_ss(kRowsA ? ar[r] + p : a + r);
      c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
    }
    if constexpr (!kRowsA) a += kMR;
    b += kNR;
  }
#pragma GCC unroll 6
  for (int r = 0; r < kMR; ++r) {
    float* cr = c + r * ldc;
    if (accumulate) {
      c0[r] = _mm256_add_ps(_mm256_loadu_ps(cr), c0[r]);
      c1[r] = _mm256_add_ps(_mm256_loadu_ps(cr + 8), c1[r]);
    }
    _mm256_storeu_ps(cr, c0[r]);
    _mm256_storeu_ps(cr + 8, c1[r]);
  }
}

inline void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                         bool accumulate) {
  micro_kernel_avx2<false>(kc, a, nullptr, b, c, ldc, accumulate);
}
#else
inline void micro_kernel(int64_t kc, const float* __restrict a, const float* __restrict b, float* c,
                         int64_t ldc, bool accumulate) {
  float acc[kMR][kNR] = {};
  for (int64_t p = 0; p < kc; ++p) {
    for (int r = 0; r < kMR; ++r) {
      for (int j = 0; j < kNR; ++j) acc[r][j] += a[r] * b[j];
    }
    a += kMR;
    b += kNR;
  }
  for (int r = 0; r < kMR; ++r) {
    for (int j = 0; j < kNR; ++j) {
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + acc[r][j] : acc[r][j];
    }
  }
}
#endif

// One tile of C: the micro-kernel straight into C when the tile is full, else into a
// scratch tile of which the valid rows x cols are copied (the same additions, so edge
// elements round exactly like interior ones). A is the packed sliver `a`, or with `a_rows`
// set (kInPlaceA) one pointer per sliver row, each at the tile's first depth.
inline void compute_tile(int64_t kc, const float* a, const float* const* a_rows, const float* b,
                         float* c, int64_t ldc, int64_t rows, int64_t cols, bool accumulate) {
  const auto kernel = [&](float* dst, int64_t ld, bool acc) {
    // (#if, not if constexpr: outside a template a discarded branch must still compile, and
    // micro_kernel_avx2 exists only in AVX2 builds.)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (a_rows != nullptr) return micro_kernel_avx2<true>(kc, nullptr, a_rows, b, dst, ld, acc);
#else
    (void)a_rows;  // always null here: kInPlaceA is false
#endif
    micro_kernel(kc, a, b, dst, ld, acc);
  };
  if (rows == kMR && cols == kNR) {
    kernel(c, ldc, accumulate);
    return;
  }
  alignas(64) float tile[kMR * kNR];
  kernel(tile, kNR, false);
  for (int64_t r = 0; r < rows; ++r) {
    float* cr = c + r * ldc;
    const float* tr = tile + r * kNR;
    if (accumulate) {
      for (int64_t j = 0; j < cols; ++j) cr[j] += tr[j];
    } else {
      for (int64_t j = 0; j < cols; ++j) cr[j] = tr[j];
    }
  }
}

// ---- packing ------------------------------------------------------------------------------
#if defined(__AVX512F__)
// A sliver from a row-major A (unit column stride): rows <= kMR rows, each contiguous in k,
// become kc columns of kMR (rows past `rows` zero). 16 k at a time through a 16x16
// transpose (rows kMR.. are don't-care). Returns how many k were packed; the caller
// finishes the rest.
inline int64_t pack_a_sliver_rows(const float* src, int64_t rs, int64_t rows, int64_t kc, float* dst) {
  static_assert(kMR <= 16);
  constexpr __mmask16 kRowMask = (1u << kMR) - 1;
  int64_t p = 0;
  for (; p + 16 <= kc; p += 16) {
    __m512 r[16];
    // A fixed-length loop, so r stays in registers.
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_ps(src + i * rs + p) : _mm512_setzero_ps();
    transpose16x16(r);
    for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(dst + (p + j) * kMR, kRowMask, r[j]);
  }
  return p;
}

// A B sliver from a column-major B (unit row stride, e.g. W^T): cols <= kNR columns, each
// contiguous in k, become kc rows of kNR, 16 x 16 at a time; columns past `cols` are zero in
// the 16-column chunks it writes, and the caller zeroes the chunks past those. Returns how
// many k were packed.
inline int64_t pack_b_sliver_cols(const float* src, int64_t cs, int64_t cols, int64_t kc, float* dst) {
  static_assert(kNR % 16 == 0);
  int64_t p = 0;
  for (; p + 16 <= kc; p += 16) {
    for (int j0 = 0; j0 < cols; j0 += 16) {  // the columns past: zeroed by the caller
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = j0 + i < cols ? _mm512_loadu_ps(src + (j0 + i) * cs + p) : _mm512_setzero_ps();
      }
      transpose16x16(r);
      for (int k = 0; k < 16; ++k) _mm512_store_ps(dst + (p + k) * kNR + j0, r[k]);
    }
  }
  return p;
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same two through 8 x 8 transposes: a row-major A sliver 8 k at a time (rows kMR..7
// are don't-care; a column's kMR = 6 values leave as 4 + 2), a column-major B sliver 8 k by
// 8 columns at a time.
inline int64_t pack_a_sliver_rows(const float* src, int64_t rs, int64_t rows, int64_t kc, float* dst) {
  static_assert(kMR == 6);
  int64_t p = 0;
  for (; p + 8 <= kc; p += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = i < rows ? _mm256_loadu_ps(src + i * rs + p) : _mm256_setzero_ps();
    transpose8x8(r);
    for (int j = 0; j < 8; ++j) {
      float* d = dst + (p + j) * kMR;
      _mm_storeu_ps(d, _mm256_castps256_ps128(r[j]));
      _mm_storel_pi(reinterpret_cast<__m64*>(d + 4), _mm256_extractf128_ps(r[j], 1));
    }
  }
  return p;
}

inline int64_t pack_b_sliver_cols(const float* src, int64_t cs, int64_t cols, int64_t kc, float* dst) {
  static_assert(kNR % 8 == 0);
  int64_t p = 0;
  for (; p + 8 <= kc; p += 8) {
    for (int j0 = 0; j0 < cols; j0 += 8) {  // the columns past: zeroed by the caller
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        r[i] = j0 + i < cols ? _mm256_loadu_ps(src + (j0 + i) * cs + p) : _mm256_setzero_ps();
      }
      transpose8x8(r);
      for (int k = 0; k < 8; ++k) _mm256_store_ps(dst + (p + k) * kNR + j0, r[k]);
    }
  }
  return p;
}
#else
inline int64_t pack_a_sliver_rows(const float*, int64_t, int64_t, int64_t, float*) { return 0; }
inline int64_t pack_b_sliver_cols(const float*, int64_t, int64_t, int64_t, float*) { return 0; }
#endif

// Packs A[i0 : i0 + mb, p0 : p0 + kc] into slivers of kMR rows: sliver s is kc columns of
// kMR values, dst[s * kc * kMR + p * kMR + r] = A(i0 + s * kMR + r, p0 + p); rows past mb
// are zero.
void pack_a(const StridedMatrix& a, int64_t i0, int64_t mb, int64_t p0, int64_t kc, float* dst) {
  const int64_t rs = a.row_stride, cs = a.col_stride;
  if (rs == 1 && cs != 1) {
    // Column-major A (a transposed view, as a weight gradient's x^T): walk each source
    // column once, front to back, dealing kMR values to each sliver. Sliver by sliver would
    // read kc values a column stride apart per sliver, and a power-of-two stride (2 KiB for
    // 512 rows) puts them in a few cache sets, so every sliver refetched them from L3.
    const int64_t full = mb / kMR, rem = mb - full * kMR;
    if (rem > 0) std::fill(dst + full * kc * kMR, dst + (full + 1) * kc * kMR, 0.0f);
    for (int64_t p = 0; p < kc; ++p) {
      const float* src = a.data + i0 + (p0 + p) * cs;
      float* d = dst + p * kMR;
      for (int64_t s = 0; s < full; ++s) {
        std::memcpy(d + s * kc * kMR, src + s * kMR, sizeof(float) * kMR);
      }
      if (rem > 0) std::memcpy(d + full * kc * kMR, src + full * kMR, sizeof(float) * rem);
    }
    return;
  }
  for (int64_t s = 0; s * kMR < mb; ++s) {
    const int64_t rows = std::min<int64_t>(kMR, mb - s * kMR);
    const float* src = a.data + (i0 + s * kMR) * rs + p0 * cs;
    float* d = dst + s * kc * kMR;
    // An edge sliver's padding rows: zeroed once, not per k.
    if (rows < kMR) std::fill(d, d + kc * kMR, 0.0f);
    int64_t p = 0;
    if (cs == 1) p = pack_a_sliver_rows(src, rs, rows, kc, d);
    for (; p < kc; ++p) {
      for (int64_t r = 0; r < rows; ++r) d[p * kMR + r] = src[r * rs + p * cs];
    }
  }
}

// Packs B[p0 : p0 + kc, j0 : j0 + nb] into slivers of kNR columns: sliver s is kc rows of
// kNR values, dst[s * kc * kNR + p * kNR + j] = B(p0 + p, j0 + s * kNR + j); columns past nb
// are zero.
void pack_b(const StridedMatrix& b, int64_t p0, int64_t kc, int64_t j0, int64_t nb, float* dst) {
  const int64_t rs = b.row_stride, cs = b.col_stride;
  const int64_t full = nb / kNR;  // slivers without padding
  if (cs == 1) {
    // Row-major B: walk each source row once, front to back, so the hardware prefetcher
    // streams it (sliver by sliver would jump a whole row stride per kNR floats).
    for (int64_t p = 0; p < kc; ++p) {
      const float* src = b.data + (p0 + p) * rs + j0;
      for (int64_t s = 0; s < full; ++s) {
        std::memcpy(dst + s * kc * kNR + p * kNR, src + s * kNR, sizeof(float) * kNR);
      }
    }
  }
  for (int64_t s = cs == 1 ? full : 0; s * kNR < nb; ++s) {
    const int64_t cols = std::min<int64_t>(kNR, nb - s * kNR);
    const float* src = b.data + p0 * rs + (j0 + s * kNR) * cs;
    float* d = dst + s * kc * kNR;
    // An edge sliver's padding columns: zeroed once, not per k.
    if (cols < kNR) std::fill(d, d + kc * kNR, 0.0f);
    int64_t p = 0;
    if (rs == 1) p = pack_b_sliver_cols(src, cs, cols, kc, d);
    for (; p < kc; ++p) {
      for (int64_t j = 0; j < cols; ++j) d[p * kNR + j] = src[p * rs + j * cs];
    }
  }
}

// ---- buffers and the serial loop nest -----------------------------------------------------
// A 64-byte aligned scratch buffer that only grows. Thread-local, so OpenMP's persistent
// workers keep theirs across calls and no call pays for fresh pages.
class PackBuffer {
 public:
  ~PackBuffer() { std::free(data_); }
  float* get(int64_t count) {
    if (count > capacity_) {
      std::free(data_);
      const size_t bytes = (static_cast<size_t>(count) * sizeof(float) + 63) / 64 * 64;
      data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
      capacity_ = data_ ? count : 0;
      if (!data_) throw std::bad_alloc();
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  int64_t capacity_ = 0;
};

PackBuffer& a_buffer() {
  thread_local PackBuffer buffer;
  return buffer;
}
PackBuffer& b_buffer() {
  thread_local PackBuffer buffer;
  return buffer;
}

struct Problem {
  int64_t m, n, k;
  StridedMatrix a, b;
  float* c;
  int64_t ldc;
  bool accumulate;
  int64_t kc;  // K block: depends on k only (see balanced_block)
  const GemmEpilogue* epilogue;
  const GemmBand* band;
};

// The part [lo, hi) of K block [pb, pb + kc) that rows [i, i + rows) need under the band.
struct DepthRange {
  int64_t lo, hi;
};
DepthRange band_depth(const GemmBand* band, int64_t i, int64_t rows, int64_t pb, int64_t kc) {
  if (band == nullptr) return {0, kc};
  if (band->kind == GemmBand::kLowerA) {
    // The sliver's last row reaches furthest: p <= i + rows - 1 + offset.
    return {0, std::clamp<int64_t>(i + rows + band->offset - pb, 0, kc)};
  }
  if (band->kind == GemmBand::kUpperA) {
    // Its first row starts earliest: p >= i - offset.
    return {std::clamp<int64_t>(i - band->offset - pb, 0, kc), kc};
  }
  return {0, kc};
}

// Whether the band leaves out the whole tile at rows [i, i + rows), columns from j.
bool band_skips_tile(const GemmBand* band, int64_t i, int64_t rows, int64_t j) {
  return band != nullptr && band->kind == GemmBand::kLowerC && j > i + rows - 1 + band->offset;
}

// The block size that splits `extent` into equal blocks of at most `max_block`, rounded up
// to a multiple of `unit`: no thin remainder block. For K it is a function of k alone, so
// the summation order never depends on m, n or the threads.
int64_t balanced_block(int64_t extent, int64_t max_block, int64_t unit) {
  const int64_t blocks = ceil_div(extent, max_block);
  return std::min(max_block, ceil_div(ceil_div(extent, blocks), unit) * unit);
}

// The part of the product from depths [p0, p1) (whole K blocks: p0 a multiple of pr.kc) for
// rows [i0, i1) and columns [j0, j1), into c (leading dimension ldc, indexed as C is): the
// first block is added to c's values when `accumulate`, else written over them, and every
// later block is added, in increasing order. On the calling thread.
void gemm_rect(const Problem& pr, int64_t i0, int64_t i1, int64_t j0, int64_t j1, int64_t p0,
               int64_t p1, float* c, int64_t ldc, bool accumulate_first) {
  if (i0 >= i1 || j0 >= j1) return;
  const int64_t mb_max = balanced_block(i1 - i0, kMB, kMR);
  const int64_t nb_max = balanced_block(j1 - j0, kNB, kNR);
  const bool a_in_place =
      kInPlaceA && pr.a.col_stride == 1 && g_a_in_place.load(std::memory_order_relaxed);
  float* apack = a_in_place ? nullptr : a_buffer().get(mb_max * pr.kc);
  float* bpack = b_buffer().get(nb_max * pr.kc);
  for (int64_t ib = i0; ib < i1; ib += mb_max) {
    const int64_t mb = std::min(mb_max, i1 - ib);
    for (int64_t pb = p0; pb < p1; pb += pr.kc) {
      const int64_t kc = std::min(pr.kc, p1 - pb);
      const bool accumulate = accumulate_first || pb > p0;
      const bool last = pb + kc >= pr.k;
      if (!a_in_place) pack_a(pr.a, ib, mb, pb, kc, apack);
      for (int64_t jb = j0; jb < j1; jb += nb_max) {
        const int64_t nb = std::min(nb_max, j1 - jb);
        pack_b(pr.b, pb, kc, jb, nb, bpack);
        for (int64_t ir = 0; ir < mb; ir += kMR) {
          float* crow = c + (ib + ir) * ldc + jb;
          const int64_t rows = std::min<int64_t>(kMR, mb - ir);
          // Under a band only depths [lo, hi) of this block reach the sliver; an empty range
          // still writes its zeros when it is the first block.
          const DepthRange d = band_depth(pr.band, ib + ir, rows, pb, kc);
          if (d.lo >= d.hi && accumulate) continue;
          // In place: the sliver's rows from depth pb + d.lo; rows past the edge repeat the
          // last one (their results are never stored).
          const float* a_rows[kMR];
          if (a_in_place) {
            for (int64_t r = 0; r < kMR; ++r) {
              const int64_t row = ib + ir + std::min(r, rows - 1);
              a_rows[r] = pr.a.data + row * pr.a.row_stride + pb + d.lo;
            }
          }
          const float* a_sliver = a_in_place ? nullptr : apack + ir * kc + d.lo * kMR;
          for (int64_t jr = 0; jr < nb; jr += kNR) {
            if (band_skips_tile(pr.band, ib + ir, rows, jb + jr)) break;
            compute_tile(d.hi - d.lo, a_sliver, a_in_place ? a_rows : nullptr,
                         bpack + jr * kc + d.lo * kNR, crow + jr, ldc, rows,
                         std::min<int64_t>(kNR, nb - jr), accumulate);
          }
          if (last && pr.epilogue != nullptr) pr.epilogue->fn(pr.epilogue->ctx, ib + ir, rows, jb, nb);
        }
      }
    }
  }
}

// ---- threads ------------------------------------------------------------------------------
// Threads tile C as a tm x tn grid of rectangles (whole kMR x kNR tiles each) and run
// independently: no barrier, no shared buffer. A thread packs (or, in place, reads) the A
// rows and packs the B columns of its own rectangle, so splitting N repeats A's in every
// column of the grid and splitting M repacks B; the grid is chosen by a cost model of the
// busiest thread.
//
// Or, when K has several blocks and C is small (a weight gradient: K = the batch's 2048
// tokens, C = 128 x 128), threads split K instead, by whole K blocks: part 0 adds its blocks
// straight into C, and each block of a later part is computed into a buffer of its own, then
// the buffers are added to C in block order. Every block's sums start from zero in both
// nests and meet C through the same additions in the same order, so the bits are the serial
// nest's. A grid repeats the packs of A (or B) in every column (row) of the grid, which is
// as much as the product itself once C is that small; a K split packs each element once.
struct Grid {
  int tm = 1, tn = 1;
  int k_parts = 1;  // > 1: the K split (tm = tn = 1)
};

// Cost of packing one element, in multiply-adds (one 16-lane FMA per cycle, so 16 of them
// per cycle of packing). A copy along the panel's rows is cheapest, a transpose through
// registers next, a scalar gather (any other stride) dearest. An A read in place is counted
// as a copy: its values still come through the caches once per column of the grid.
double pack_cost(const StridedMatrix& x, bool is_a) {
  const bool in_place = is_a && kInPlaceA && x.col_stride == 1;
  const bool copy = is_a ? x.row_stride == 1 || in_place : x.col_stride == 1;
  const bool transpose = is_a ? x.col_stride == 1 : x.row_stride == 1;
  return copy ? 4.0 : transpose ? 8.0 : 24.0;
}

// Adding one buffered element into C, in the same units (a load, an add, a store).
constexpr double kReduceCost = 4.0;
// The K split's buffers at most (floats, 8 MiB): past that C is large enough for a grid.
constexpr double kMaxSplitBuffer = double{1 << 21};
// A packed element read from memory against one from the caches (pack_cost's prices are
// for cached operands). With 4, every GPT-mini weight gradient splits; on 2 threads (Zen 3,
// `cpu_bench --only gemm_k_split`, BENCHMARKS.md's twelfth CPU section) the split ran them
// at 1.06-1.32x the grid's speed with cold operands and 1.01-1.28x with cached ones (five
// runs), where the cached-price model had kept the grid for the two with a 512-wide side.
constexpr double kColdPack = 4.0;

std::atomic<int> g_k_split{0};  // internal::set_sgemm_k_split: 0 chosen, 1 never, 2 always

Grid choose_grid(const Problem& pr, int max_threads) {
  const int64_t tiles_m = ceil_div(pr.m, kMR), tiles_n = ceil_div(pr.n, kNR);
  const int64_t by_work = std::max<int64_t>(1, pr.m * pr.n * pr.k / kMinWorkPerThread);
  const int threads = static_cast<int>(std::min<int64_t>(max_threads, by_work));
  const double cost_a = pack_cost(pr.a, true), cost_b = pack_cost(pr.b, false);
  // The busiest thread's cost for `rows` x `cols` of C over `depth`: its tiles, its A rows
  // packed once, its B columns packed once per A panel, each pack priced `pack_price` times
  // pack_cost's cached price.
  const auto rect_cost = [&](int64_t rows, int64_t cols, int64_t depth, double pack_price = 1.0) {
    const double panels = static_cast<double>(ceil_div(rows, kMB));
    const double packs = cost_a * rows + cost_b * cols * panels;
    return static_cast<double>(depth) * (static_cast<double>(rows) * cols + pack_price * packs);
  };
  Grid best;
  double best_cost = std::numeric_limits<double>::infinity();
  for (int t = 1; t <= threads; ++t) {
    for (int tm = 1; tm <= t; ++tm) {
      if (t % tm != 0) continue;
      const int tn = t / tm;
      if (tm > tiles_m || tn > tiles_n) continue;
      const double cost = rect_cost(ceil_div(tiles_m, tm) * kMR, ceil_div(tiles_n, tn) * kNR, pr.k);
      if (cost < best_cost * 0.98) {  // more threads must win clearly, not by rounding
        best_cost = cost;
        best = Grid{tm, tn, 1};
      }
    }
  }
  // The K split: whole K blocks per part (an epilogue needs C's final sums, and a band's
  // blocks are uneven, so neither splits). Its busiest part is one with the most blocks;
  // the buffered blocks' additions into C are shared by all threads. Against the grid, each
  // packed element is priced as read from memory (kColdPack): a grid reads the operand it
  // splits across once per thread, and in a training step the operands are cold (a weight
  // gradient's x was written in the forward pass).
  // (Mode 2, for the tests, splits however small the product: a part per thread, at most
  // one per K block.)
  const int mode = g_k_split.load(std::memory_order_relaxed);
  const int64_t blocks = ceil_div(pr.k, pr.kc);
  const int split_threads = mode == 2 ? max_threads : threads;
  if (mode == 1 || pr.epilogue != nullptr || pr.band != nullptr || blocks < 2 ||
      split_threads < 2) {
    return best;
  }
  const int parts = static_cast<int>(std::min<int64_t>(split_threads, blocks));
  const double buffered = static_cast<double>(blocks - blocks / parts) * pr.m * pr.n;
  if (buffered > kMaxSplitBuffer) return best;
  if (mode == 2) return Grid{1, 1, parts};
  const int64_t rows = ceil_div(tiles_m, best.tm) * kMR, cols = ceil_div(tiles_n, best.tn) * kNR;
  const double grid_cost = rect_cost(rows, cols, pr.k, kColdPack);
  const double split_cost =
      rect_cost(tiles_m * kMR, tiles_n * kNR, ceil_div(blocks, parts) * pr.kc, kColdPack) +
      kReduceCost * buffered / parts;
  // A near tie keeps the grid: GPT-2's MLP-down input gradient, dy [256, 768] W [768, 3072]
  // (the two within 0.01% here), ran 1-2% slower split.
  return split_cost < 0.99 * grid_cost ? Grid{1, 1, parts} : best;
}

PackBuffer& split_buffer() {
  thread_local PackBuffer buffer;
  return buffer;
}

std::atomic<int64_t> g_k_split_count{0};  // internal::sgemm_k_split_count

// The K split's nest (see Grid): part p of `parts` takes K blocks [blocks * p / parts,
// blocks * (p + 1) / parts).
void gemm_k_split(const Problem& pr, int parts) {
  g_k_split_count.fetch_add(1, std::memory_order_relaxed);
  const int64_t blocks = ceil_div(pr.k, pr.kc);
  const int64_t direct = blocks / parts;  // part 0's blocks, added into C as they finish
  const int64_t block_elems = pr.m * pr.n;
  float* buffers = split_buffer().get((blocks - direct) * block_elems);
  parallel_parts(parts, [&](int part) {
    const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
    if (part == 0) {
      gemm_rect(pr, 0, pr.m, 0, pr.n, 0, std::min(pr.k, b1 * pr.kc), pr.c, pr.ldc, pr.accumulate);
      return;
    }
    for (int64_t b = b0; b < b1; ++b) {
      gemm_rect(pr, 0, pr.m, 0, pr.n, b * pr.kc, std::min(pr.k, (b + 1) * pr.kc),
                buffers + (b - direct) * block_elems, pr.n, /*accumulate_first=*/false);
    }
  });
  // C += each buffered block, in block order; rows split over the threads.
  parallel_for(0, pr.m, std::max<int64_t>(1, 16384 / std::max<int64_t>(pr.n, 1)),
               [&](int64_t i0, int64_t i1) {
                 for (int64_t i = i0; i < i1; ++i) {
                   float* ci = pr.c + i * pr.ldc;
                   for (int64_t b = 0; b < blocks - direct; ++b) {
                     const float* bi = buffers + b * block_elems + i * pr.n;
                     for (int64_t j = 0; j < pr.n; ++j) ci[j] += bi[j];
                   }
                 }
               });
}

// First row (or column) of part `i` of `parts`, splitting whole tiles evenly.
int64_t split_point(int64_t extent, int64_t tile, int parts, int i) {
  const int64_t tiles = ceil_div(extent, tile);
  return std::min(extent, tiles * i / parts * tile);
}

}  // namespace

void sgemm(int64_t m, int64_t n, int64_t k, StridedMatrix a, StridedMatrix b, float* c, int64_t ldc,
           bool accumulate, const GemmEpilogue* epilogue, const GemmBand* band) {
  TS_CHECK(m >= 0 && n >= 0 && k >= 0, "sgemm: negative size m={} n={} k={}", m, n, k);
  TS_CHECK(ldc >= n, "sgemm: ldc={} is less than n={}", ldc, n);
  TS_CHECK(band == nullptr || epilogue == nullptr,
           "sgemm: a band (kind {}, offset {}) with an epilogue: the epilogue would see tiles the "
           "band leaves out", band ? static_cast<int>(band->kind) : 0, band ? band->offset : 0);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) {
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    }
    if (epilogue != nullptr) {
      for (int64_t i = 0; i < m; i += kMR) epilogue->fn(epilogue->ctx, i, std::min<int64_t>(kMR, m - i), 0, n);
    }
    return;
  }
  const Problem pr{m, n, k, a, b, c, ldc, accumulate, balanced_block(k, kKC, 1), epilogue, band};
  const Grid grid = choose_grid(pr, num_threads());
  if (grid.k_parts > 1) return gemm_k_split(pr, grid.k_parts);
  const int parts = grid.tm * grid.tn;
  if (parts == 1) {
    gemm_rect(pr, 0, m, 0, n, 0, k, c, ldc, accumulate);
    return;
  }
  // Rectangles are claimed by whichever pool thread is free (kernels/cpu/parallel.h): who
  // computes one never changes its bits.
  parallel_parts(parts, [&](int part) {
    const int pi = part / grid.tn, pj = part % grid.tn;
    gemm_rect(pr, split_point(m, kMR, grid.tm, pi), split_point(m, kMR, grid.tm, pi + 1),
              split_point(n, kNR, grid.tn, pj), split_point(n, kNR, grid.tn, pj + 1), 0, k, c, ldc,
              accumulate);
  });
}

const char* sgemm_kernel_name() { return kKernelName; }

namespace internal {
bool set_sgemm_a_in_place(bool enabled) { return g_a_in_place.exchange(enabled); }
int64_t sgemm_k_split_count() { return g_k_split_count.load(std::memory_order_relaxed); }
int set_sgemm_k_split(int mode) {
  TS_CHECK(mode >= 0 && mode <= 2,
           "set_sgemm_k_split: mode {} is not 0 (chosen), 1 (never) or 2 (always)", mode);
  return g_k_split.exchange(mode);
}
}  // namespace internal

}  // namespace tessera::cpu
