// CPU conv2d (NCHW) and its input and weight gradients by im2col + GEMM (f32:
// kernels/cpu/gemm.h; f64: Eigen; f16/bf16 run in f32 and round once).
//
// Images are processed in chunks whose im2col columns fit in L2, so each GEMM is large
// (P = images x OH x OW pixels) and the columns are still cached when the GEMM packs them:
//   forward:          res [P, O] = col^T @ W^T, transposed into out (NCHW) with the bias
//                     (shallow or narrow layers: W @ col per image, straight into out)
//   backward_input:   dcol [C*kh*kw, P] = W^T @ grad [O, P], then col2im into dx
//   backward_weight:  dW^T [C*kh*kw, O] = sum over images of col @ grad^T
// with col [C*kh*kw, P] the chunk's im2col (pixels contiguous).
//
// Determinism: chunks are a function of the shapes alone (never of the thread count) and
// every output element is computed by one thread. The weight gradient sums its images in
// a fixed number of groups (shape-dependent), each on one thread, and adds the groups'
// partial sums in group order, so 1 and N threads give the same bits.
#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// C[m, n] (row-major, contiguous) = A * B, or += with `accumulate`; A and B are read at
// any (row, column) strides, so transposes need no copy.
template <typename T>
void gemm(int64_t m, int64_t n, int64_t k, const T* a, int64_t ars, int64_t acs, const T* b,
          int64_t brs, int64_t bcs, T* c, bool accumulate = false) {
  if constexpr (std::is_same_v<T, float>) {
    sgemm(m, n, k, StridedMatrix{a, ars, acs}, StridedMatrix{b, brs, bcs}, c, n, accumulate);
  } else {
    using Strided = Eigen::Map<const RowMat<T>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;
    const Strided am(a, m, k, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(ars, acs));
    const Strided bm(b, k, n, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(brs, bcs));
    Eigen::Map<RowMat<T>> cm(c, m, n);
    if (accumulate) cm.noalias() += am * bm;
    else cm.noalias() = am * bm;
  }
}

// A per-thread scratch buffer that only grows (to the largest chunk seen, as gemm.cc's
// packing buffers do): OpenMP keeps its workers, so after the first call no chunk allocates
// or page-faults again. `slot` tells concurrent uses apart.
template <typename T>
T* scratch(int slot, int64_t count) {
  thread_local std::vector<T> buffers[2];
  std::vector<T>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < count) b.resize(count);
  return b.data();
}

struct ConvGeom {
  int64_t n, c, h, w, o, kh, kw, oh, ow, sh, sw, ph, pw;
  int64_t ckk() const { return c * kh * kw; }
  int64_t ohw() const { return oh * ow; }
  int64_t chw() const { return c * h * w; }
};

ConvGeom geometry(const Shape& x, const Shape& w, const Attrs& a) {
  ConvGeom g{x[0], x[1], x[2], x[3], w[0], w[2], w[3], 0, 0, a.stride[0], a.stride[1],
             a.padding[0], a.padding[1]};
  g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  return g;
}

// The output positions [begin, end) along one axis whose input position out * stride - pad
// + k falls inside [0, size_in): the rest read padding.
struct Range {
  int64_t begin, end;
};
Range inside(int64_t size_in, int64_t size_out, int64_t stride, int64_t pad, int64_t k) {
  const int64_t lo = pad - k, hi = size_in - 1 + pad - k;
  const int64_t begin = std::min(size_out, lo <= 0 ? 0 : (lo + stride - 1) / stride);
  const int64_t end = hi < 0 ? 0 : std::min(size_out, hi / stride + 1);
  return {begin, std::max(begin, end)};
}

#if defined(__AVX512F__)
// Lanes [lo, hi) of a 16-lane mask (0 <= lo <= hi <= 16).
inline __mmask16 lanes(int64_t lo, int64_t hi) {
  const uint32_t below_hi = (1u << hi) - 1, below_lo = (1u << lo) - 1;
  return static_cast<__mmask16>(below_hi & ~below_lo);
}
#endif

// One row of im2col: dst[x] = src[(x - begin) * stride] for x in [begin, end), 0 for the
// rest of [0, n). Rows are short, so f32 at stride 1 is one masked expand-load per 16
// outputs rather than fill / copy / fill library calls.
template <typename T>
inline void gather_row(const T* src, int64_t begin, int64_t end, int64_t n, int64_t stride,
                       T* dst) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (stride == 1) {
      for (int64_t x0 = 0; x0 < n; x0 += 16) {
        const int64_t width = std::min<int64_t>(16, n - x0);
        const int64_t lo = std::clamp(begin, x0, x0 + width), hi = std::clamp(end, lo, x0 + width);
        const __m512 v = hi > lo ? _mm512_maskz_expandloadu_ps(lanes(lo - x0, hi - x0),
                                                               src + (lo - begin))
                                 : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(dst + x0, lanes(0, width), v);
      }
      return;
    }
  }
#endif
  for (int64_t x = 0; x < begin; ++x) dst[x] = T(0);
  for (int64_t x = begin; x < end; ++x) dst[x] = src[(x - begin) * stride];
  for (int64_t x = std::max(begin, end); x < n; ++x) dst[x] = T(0);
}

// The adjoint of gather_row: dst[(x - begin) * stride] += src[x] for x in [begin, end).
template <typename T>
inline void scatter_add_row(const T* src, int64_t begin, int64_t end, int64_t stride, T* dst) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (stride == 1) {
      for (int64_t x0 = begin; x0 < end; x0 += 16) {
        const __mmask16 m = lanes(0, std::min<int64_t>(16, end - x0));
        float* d = dst + (x0 - begin);
        _mm512_mask_storeu_ps(
            d, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, d), _mm512_maskz_loadu_ps(m, src + x0)));
      }
      return;
    }
  }
#endif
  for (int64_t x = begin; x < end; ++x) dst[(x - begin) * stride] += src[x];
}

// col[(ci*kh + i)*kw + j, y*ow + x] (row stride ld) = img[ci, y*sh - ph + i, x*sw - pw + j],
// 0 outside the image.
template <typename T>
void im2col(const T* img, const ConvGeom& g, T* col, int64_t ld) {
  for (int64_t ci = 0; ci < g.c; ++ci) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        T* row = col + ((ci * g.kh + i) * g.kw + j) * ld;
        const Range xs = inside(g.w, g.ow, g.sw, g.pw, j);
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t iy = y * g.sh - g.ph + i;
          T* dst = row + y * g.ow;
          if (iy < 0 || iy >= g.h || xs.begin == xs.end) {
            std::fill(dst, dst + g.ow, T(0));
            continue;
          }
          const T* src = img + (ci * g.h + iy) * g.w + (xs.begin * g.sw - g.pw + j);
          gather_row(src, xs.begin, xs.end, g.ow, g.sw, dst);
        }
      }
    }
  }
}

// The adjoint of im2col: img = 0, then each column row is added back in (ci, i, j) order.
template <typename T>
void col2im(const T* col, int64_t ld, const ConvGeom& g, T* img) {
  std::fill(img, img + g.chw(), T(0));
  for (int64_t ci = 0; ci < g.c; ++ci) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        const T* row = col + ((ci * g.kh + i) * g.kw + j) * ld;
        const Range xs = inside(g.w, g.ow, g.sw, g.pw, j);
        if (xs.begin == xs.end) continue;
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t iy = y * g.sh - g.ph + i;
          if (iy < 0 || iy >= g.h) continue;
          T* dst = img + (ci * g.h + iy) * g.w + (xs.begin * g.sw - g.pw + j);
          scatter_add_row(row + y * g.ow, xs.begin, xs.end, g.sw, dst);
        }
      }
    }
  }
}

// Stride-1 convs whose output rows are as wide as the input's (ow == w: 3x3 with padding 1,
// 1x1): column row (ci, i, j) is channel ci's plane read at a flat shift of
// (i - ph) * w + (j - pw), with positions that fall outside the image or wrap into the
// neighbouring row zeroed. With AVX-512 a row is then ceil(OH * OW / 16) masked vector
// loads and stores, the lane masks (one set per (i, j)) computed once per call, instead of
// OH short rows. The order of additions in col2im is that of the generic path.
#if defined(__AVX512F__)
class ShiftedPlanes {
 public:
  explicit ShiftedPlanes(const ConvGeom& g)
      : g_(g), vectors_((g.ohw() + 15) / 16), masks_(g.kh * g.kw * vectors_, 0) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        __mmask16* m = masks_.data() + (i * g.kw + j) * vectors_;
        for (int64_t q = 0; q < g.ohw(); ++q) {
          const int64_t iy = q / g.ow - g.ph + i, ix = q % g.ow - g.pw + j;
          if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) m[q / 16] |= static_cast<__mmask16>(1u << (q % 16));
        }
      }
    }
  }
  static bool applies(const ConvGeom& g) { return g.sh == 1 && g.sw == 1 && g.ow == g.w; }

  void im2col(const float* img, float* col, int64_t ld) const {
    const int64_t ohw = g_.ohw();
    const __mmask16 tail = lanes(0, ohw - (vectors_ - 1) * 16);
    for (int64_t ci = 0; ci < g_.c; ++ci) {
      for (int64_t ij = 0; ij < g_.kh * g_.kw; ++ij) {
        const float* src = shifted(img + ci * g_.h * g_.w, ij);
        const __mmask16* m = masks_.data() + ij * vectors_;
        float* dst = col + (ci * g_.kh * g_.kw + ij) * ld;
        for (int64_t v = 0; v + 1 < vectors_; ++v) {
          _mm512_storeu_ps(dst + 16 * v, _mm512_maskz_loadu_ps(m[v], src + 16 * v));
        }
        const int64_t v = vectors_ - 1;
        _mm512_mask_storeu_ps(dst + 16 * v, tail, _mm512_maskz_loadu_ps(m[v], src + 16 * v));
      }
    }
  }

  void col2im(const float* col, int64_t ld, float* img) const {
    std::fill(img, img + g_.chw(), 0.0f);
    for (int64_t ci = 0; ci < g_.c; ++ci) {
      for (int64_t ij = 0; ij < g_.kh * g_.kw; ++ij) {
        float* dst = const_cast<float*>(shifted(img + ci * g_.h * g_.w, ij));
        const __mmask16* m = masks_.data() + ij * vectors_;
        const float* src = col + (ci * g_.kh * g_.kw + ij) * ld;
        for (int64_t v = 0; v < vectors_; ++v) {
          const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], dst + 16 * v),
                                           _mm512_maskz_loadu_ps(m[v], src + 16 * v));
          _mm512_mask_storeu_ps(dst + 16 * v, m[v], sum);
        }
      }
    }
  }

 private:
  // The plane's address shifted for tap ij. It may point before or past the plane: only
  // lanes whose mask bit is set are ever accessed, and those lie inside it. Computed on
  // integers, as the pointer itself may lie outside any object.
  const float* shifted(const float* plane, int64_t ij) const {
    const int64_t shift = (ij / g_.kw - g_.ph) * g_.w + (ij % g_.kw - g_.pw);
    return reinterpret_cast<const float*>(reinterpret_cast<intptr_t>(plane) +
                                          static_cast<intptr_t>(shift * sizeof(float)));
  }

  ConvGeom g_;
  int64_t vectors_;
  std::vector<__mmask16> masks_;
};
#endif

// im2col / col2im through ShiftedPlanes where it applies (f32 with AVX-512), else the
// generic loops.
template <typename T>
class Columns {
 public:
  explicit Columns(const ConvGeom& g) : g_(g) {
#if defined(__AVX512F__)
    if (std::is_same_v<T, float> && ShiftedPlanes::applies(g)) shifted_.emplace_back(g);
#endif
  }
  void im2col(const T* img, T* col, int64_t ld) const {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      if (!shifted_.empty()) return shifted_[0].im2col(img, col, ld);
    }
#endif
    cpu::im2col(img, g_, col, ld);
  }
  void col2im(const T* col, int64_t ld, T* img) const {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      if (!shifted_.empty()) return shifted_[0].col2im(col, ld, img);
    }
#endif
    cpu::col2im(col, ld, g_, img);
  }

 private:
  ConvGeom g_;
#if defined(__AVX512F__)
  std::vector<ShiftedPlanes> shifted_;  // empty or one
#endif
};

// out[o, q] = res[q, o] + bias[o] for q < rows, o < cols: one image's GEMM result (pixels x
// channels) into NCHW. bias may be null.
template <typename T>
void transpose_add_bias(const T* res, int64_t rows, int64_t cols, const T* bias, T* out) {
  int64_t o0 = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    int64_t q0 = 0;
    const int64_t full_q = rows / 16 * 16, full_o = cols / 16 * 16;
    for (; o0 < full_o; o0 += 16) {
      const __m512 b = bias ? _mm512_loadu_ps(bias + o0) : _mm512_setzero_ps();
      for (q0 = 0; q0 < full_q; q0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_add_ps(_mm512_loadu_ps(res + (q0 + i) * cols + o0), b);
        transpose16x16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + (o0 + i) * rows + q0, r[i]);
      }
    }
    // Scalar loops below finish the q >= full_q columns of the vector rows and all o >= full_o.
    for (int64_t o = 0; o < full_o; ++o) {
      const T bo = bias ? bias[o] : T(0);
      for (int64_t q = full_q; q < rows; ++q) out[o * rows + q] = res[q * cols + o] + bo;
    }
  }
#endif
  for (int64_t o = o0; o < cols; ++o) {
    const T bo = bias ? bias[o] : T(0);
    for (int64_t q = 0; q < rows; ++q) out[o * rows + q] = res[q * cols + o] + bo;
  }
}

// Columns per chunk of images: about 512 KiB of f32, so the im2col buffer and its packed
// copy stay in a core's L2.
constexpr int64_t kColumnBudget = int64_t{1} << 17;

// Splits the batch into equal chunks of images that fit the column budget (and at least 8
// chunks when there are 8 images, so threads have work to share): a function of the
// shapes alone. fn(first_image, count) runs once per chunk, chunks spread over threads.
template <typename F>
void for_image_chunks(const ConvGeom& g, F&& fn) {
  if (g.n == 0) return;
  const int64_t fit = std::max<int64_t>(1, kColumnBudget / std::max<int64_t>(1, g.ckk() * g.ohw()));
  const int64_t chunks = std::max((g.n + fit - 1) / fit, std::min<int64_t>(g.n, 8));
  const int64_t per = (g.n + chunks - 1) / chunks;
  parallel_for(0, (g.n + per - 1) / per, 1, [&](int64_t b, int64_t e) {
    for (int64_t chunk = b; chunk < e; ++chunk) {
      const int64_t first = chunk * per;
      fn(first, std::min(per, g.n - first));
    }
  });
}

template <typename T>
void conv_forward(const Tensor& xt, const Tensor& wt, const Tensor& bt, const Tensor& out,
                  const Attrs& a) {
  const Tensor x = contiguous_cpu(xt), w = contiguous_cpu(wt);
  const ConvGeom g = geometry(x.shape(), w.shape(), a);
  const T* xp = static_cast<const T*>(x.raw_data());
  const Tensor b = bt.defined() ? contiguous_cpu(bt) : Tensor();
  const T* bp = b.defined() ? static_cast<const T*>(b.raw_data()) : nullptr;
  T* op = static_cast<T*>(out.raw_data());
  const T* wp = static_cast<const T*>(w.raw_data());
  const int64_t ohw = g.ohw(), ckk = g.ckk();
  if (ckk == 0) {  // no input channels (a sharded block can be empty): the bias alone
    for (int64_t i = 0; i < out.numel(); ++i) op[i] = bp != nullptr ? bp[i / ohw % g.o] : T(0);
    return;
  }
  // Pixels as GEMM rows when O fills whole register tiles (16 or 32 wide) and the GEMM is
  // deep enough that transposing its result back to NCHW is cheap next to it: no padded
  // tile is computed. Otherwise one GEMM per image writes NCHW directly.
  const bool pixel_rows = g.o % 16 == 0 && ckk >= 32;
  const Columns<T> columns(g);
  for_image_chunks(g, [&](int64_t first, int64_t count) {
    const int64_t p = count * ohw;
    T* col = scratch<T>(0, ckk * p);
    for (int64_t i = 0; i < count; ++i) columns.im2col(xp + (first + i) * g.chw(), col + i * ohw, p);
    if (pixel_rows) {
      // res [p, o] = col^T [p, ckk] @ W^T [ckk, o]
      T* res = scratch<T>(1, p * g.o);
      gemm<T>(p, g.o, ckk, col, 1, p, wp, 1, ckk, res);
      for (int64_t i = 0; i < count; ++i) {
        transpose_add_bias(res + i * ohw * g.o, ohw, g.o, bp, op + (first + i) * g.o * ohw);
      }
      return;
    }
    for (int64_t i = 0; i < count; ++i) {
      // out[n] [o, ohw] = W [o, ckk] @ col[i] [ckk, ohw]
      T* on = op + (first + i) * g.o * ohw;
      gemm<T>(g.o, ohw, ckk, wp, ckk, 1, col + i * ohw, p, 1, on);
      if (bp) {
        for (int64_t o = 0; o < g.o; ++o) {
          for (int64_t q = 0; q < ohw; ++q) on[o * ohw + q] += bp[o];
        }
      }
    }
  });
}

// Inputs: grad [N, O, OH, OW], weight; attrs.shape = input shape.
template <typename T>
void conv_backward_input(const Tensor& gt, const Tensor& wt, const Tensor& dx, const Attrs& a) {
  const Tensor gr = contiguous_cpu(gt), w = contiguous_cpu(wt);
  const ConvGeom g = geometry(a.shape, w.shape(), a);
  const T* gp = static_cast<const T*>(gr.raw_data());
  T* dp = static_cast<T*>(dx.raw_data());
  const T* wp = static_cast<const T*>(w.raw_data());
  const int64_t ohw = g.ohw(), ckk = g.ckk();
  const Columns<T> columns(g);
  for_image_chunks(g, [&](int64_t first, int64_t count) {
    const int64_t p = count * ohw;
    // The chunk's gradient as one [o, p] matrix (images side by side), for one wide GEMM.
    T* gs = scratch<T>(1, g.o * p);
    for (int64_t o = 0; o < g.o; ++o) {
      for (int64_t i = 0; i < count; ++i) {
        const T* src = gp + ((first + i) * g.o + o) * ohw;
        std::copy(src, src + ohw, gs + o * p + i * ohw);
      }
    }
    // dcol [ckk, p] = W^T [ckk, o] @ grad [o, p]
    T* dcol = scratch<T>(0, ckk * p);
    gemm<T>(ckk, p, g.o, wp, 1, ckk, gs, p, 1, dcol);
    for (int64_t i = 0; i < count; ++i) columns.col2im(dcol + i * ohw, p, dp + (first + i) * g.chw());
  });
}

// Inputs: grad, input; attrs.shape = weight shape.
template <typename T>
void conv_backward_weight(const Tensor& gt, const Tensor& xt, const Tensor& dw, const Attrs& a) {
  const Tensor gr = contiguous_cpu(gt), x = contiguous_cpu(xt);
  const ConvGeom g = geometry(x.shape(), a.shape, a);
  const T* gp = static_cast<const T*>(gr.raw_data());
  const T* xp = static_cast<const T*>(x.raw_data());
  T* dwp = static_cast<T*>(dw.raw_data());
  const int64_t ohw = g.ohw(), ckk = g.ckk();
  const Columns<T> columns(g);
  // Few column rows (conv1 of an MNIST CNN has 9) are padded with zero rows to a multiple of
  // 12, the AVX-512 GEMM tile height (and a multiple of the AVX2 and scalar ones): the GEMM
  // then packs whole slivers with its vector transpose instead of element by element,
  // which otherwise costs more than the multiply-adds.
  const int64_t rows = ckk < 48 ? (ckk + 11) / 12 * 12 : ckk;
  const int64_t wsize = rows * g.o;
  // Up to 16 groups of images (fewer when the partial sums would pass 64 MiB of f32).
  const int64_t groups = std::clamp<int64_t>((int64_t{16} << 20) / std::max<int64_t>(1, wsize), 1,
                                             std::min<int64_t>(g.n, 16));
  const Tensor partial_t = Tensor::empty({groups, rows, g.o}, dw.dtype(), kCPU);
  T* partial = static_cast<T*>(partial_t.raw_data());
  parallel_for(0, groups, 1, [&](int64_t b, int64_t e) {
    T* col = scratch<T>(0, rows * ohw);
    std::fill(col + ckk * ohw, col + rows * ohw, T(0));
    for (int64_t grp = b; grp < e; ++grp) {
      T* acc = partial + grp * wsize;
      const int64_t first = grp * g.n / groups, last = (grp + 1) * g.n / groups;
      for (int64_t n = first; n < last; ++n) {
        columns.im2col(xp + n * g.chw(), col, ohw);
        // acc [rows, o] (+)= col [rows, ohw] @ grad[n]^T [ohw, o]
        gemm<T>(rows, g.o, ohw, col, ohw, 1, gp + n * g.o * ohw, 1, ohw, acc,
                /*accumulate=*/n > first);
      }
    }
  });
  // dw [o, ckk] = the groups' partial sums (stored transposed), added in group order: each
  // row r of dW^T is summed contiguously (vectorised), then written as column r of dw.
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, g.o * groups));
  parallel_for(0, ckk, grain, [&](int64_t b, int64_t e) {
    std::vector<T> sum(g.o);
    for (int64_t r = b; r < e; ++r) {
      std::copy(partial + r * g.o, partial + (r + 1) * g.o, sum.begin());
      for (int64_t grp = 1; grp < groups; ++grp) {
        const T* part = partial + grp * wsize + r * g.o;
        for (int64_t o = 0; o < g.o; ++o) sum[o] += part[o];
      }
      for (int64_t o = 0; o < g.o; ++o) dwp[o * ckk + r] = sum[o];
    }
  });
}

// f16/bf16 convs run in f32 and round once.
template <typename F>
void in_compute_type(std::span<const Tensor> in, const Tensor& out, F&& f) {
  if (out.dtype() == DType::f32) return f.template operator()<float>(in, out);
  if (out.dtype() == DType::f64) return f.template operator()<double>(in, out);
  std::vector<Tensor> wide;
  for (const Tensor& t : in) wide.push_back(t.defined() ? to_compute_cpu(t) : Tensor());
  Tensor o = Tensor::empty(out.shape(), DType::f32, out.device());
  f.template operator()<float>(std::span<const Tensor>(wide), o);
  copy_cpu(out, o);
}

// Backward passes over an empty batch, or with no channels on the other side, produce
// zeros (a sharded block can be empty); all-zero bits are 0 in every float dtype.
bool zero_if_empty(std::span<const Tensor> in, const Tensor& out) {
  if (out.numel() == 0) return true;
  if (in[0].numel() != 0 && in[1].numel() != 0) return false;
  std::memset(out.raw_data(), 0, static_cast<size_t>(out.nbytes()));
  return true;
}

void conv2d_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  if (out[0].numel() == 0) return;
  in_compute_type(in, out[0], [&]<typename T>(std::span<const Tensor> v, const Tensor& o) {
    conv_forward<T>(v[0], v[1], v[2], o, a);
  });
}

void conv2d_backward_input_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                  const Attrs& a) {
  if (zero_if_empty(in, out[0])) return;
  in_compute_type(in, out[0], [&]<typename T>(std::span<const Tensor> v, const Tensor& o) {
    conv_backward_input<T>(v[0], v[1], o, a);
  });
}

void conv2d_backward_weight_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                   const Attrs& a) {
  if (zero_if_empty(in, out[0])) return;
  in_compute_type(in, out[0], [&]<typename T>(std::span<const Tensor> v, const Tensor& o) {
    conv_backward_weight<T>(v[0], v[1], o, a);
  });
}

TS_REGISTER_KERNEL(cpu, conv2d, conv2d_kernel);
TS_REGISTER_KERNEL(cpu, conv2d_backward_input, conv2d_backward_input_kernel);
TS_REGISTER_KERNEL(cpu, conv2d_backward_weight, conv2d_backward_weight_kernel);

}  // namespace
}  // namespace tessera::cpu
