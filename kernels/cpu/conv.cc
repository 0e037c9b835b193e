// CPU conv2d (NCHW) by im2col + GEMM (f32: kernels/cpu/gemm.h; f64: Eigen), its input and
// weight gradients (col2im and a
// GEMM against the same columns), and max_pool2d with argmax indices.
#include <Eigen/Core>
#include <limits>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
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

struct ConvGeom {
  int64_t n, c, h, w, o, kh, kw, oh, ow, sh, sw, ph, pw;
  int64_t ckk() const { return c * kh * kw; }
  int64_t ohw() const { return oh * ow; }
};

ConvGeom geometry(const Shape& x, const Shape& w, const Attrs& a) {
  ConvGeom g{x[0], x[1], x[2], x[3], w[0], w[2], w[3], 0, 0, a.stride[0], a.stride[1],
             a.padding[0], a.padding[1]};
  g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  return g;
}

// col[(ci*kh + i)*kw + j, y*ow + x] = img[ci, y*sh - ph + i, x*sw - pw + j] (0 outside).
template <typename T>
void im2col(const T* img, const ConvGeom& g, T* col) {
  for (int64_t ci = 0; ci < g.c; ++ci) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        T* row = col + ((ci * g.kh + i) * g.kw + j) * g.ohw();
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t iy = y * g.sh - g.ph + i;
          T* dst = row + y * g.ow;
          if (iy < 0 || iy >= g.h) {
            std::fill(dst, dst + g.ow, T(0));
            continue;
          }
          const T* src = img + (ci * g.h + iy) * g.w;
          for (int64_t x = 0; x < g.ow; ++x) {
            const int64_t ix = x * g.sw - g.pw + j;
            dst[x] = (ix >= 0 && ix < g.w) ? src[ix] : T(0);
          }
        }
      }
    }
  }
}

// The adjoint of im2col: accumulates columns back into the image.
template <typename T>
void col2im(const T* col, const ConvGeom& g, T* img) {
  std::fill(img, img + g.c * g.h * g.w, T(0));
  for (int64_t ci = 0; ci < g.c; ++ci) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        const T* row = col + ((ci * g.kh + i) * g.kw + j) * g.ohw();
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t iy = y * g.sh - g.ph + i;
          if (iy < 0 || iy >= g.h) continue;
          T* dst = img + (ci * g.h + iy) * g.w;
          for (int64_t x = 0; x < g.ow; ++x) {
            const int64_t ix = x * g.sw - g.pw + j;
            if (ix >= 0 && ix < g.w) dst[ix] += row[y * g.ow + x];
          }
        }
      }
    }
  }
}

// Runs fn(image, col) for every image: in parallel (one GEMM per thread) when there are
// several images, else on the caller's thread so the GEMM itself can use every thread.
// `col` is a [ckk, ohw] scratch buffer allocated once per chunk of images, not per image.
template <typename T, typename F>
void for_images(const ConvGeom& g, F&& fn) {
  parallel_for(0, g.n, 1, [&](int64_t b, int64_t e) {
    std::vector<T> col(g.ckk() * g.ohw());
    for (int64_t i = b; i < e; ++i) fn(i, col.data());
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
  for_images<T>(g, [&](int64_t n, T* col) {
    im2col(xp + n * g.c * g.h * g.w, g, col);
    T* on = op + n * g.o * g.ohw();
    // out[n] [o, ohw] = W [o, ckk] @ col [ckk, ohw]
    gemm<T>(g.o, g.ohw(), g.ckk(), wp, g.ckk(), 1, col, g.ohw(), 1, on);
    if (bp) {
      for (int64_t o = 0; o < g.o; ++o) {
        for (int64_t i = 0; i < g.ohw(); ++i) on[o * g.ohw() + i] += bp[o];
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
  for_images<T>(g, [&](int64_t n, T* col) {
    // col [ckk, ohw] = W^T [ckk, o] @ grad[n] [o, ohw]
    gemm<T>(g.ckk(), g.ohw(), g.o, wp, 1, g.ckk(), gp + n * g.o * g.ohw(), g.ohw(), 1, col);
    col2im(col, g, dp + n * g.c * g.h * g.w);
  });
}

// Inputs: grad, input; attrs.shape = weight shape. Images are summed in order.
template <typename T>
void conv_backward_weight(const Tensor& gt, const Tensor& xt, const Tensor& dw, const Attrs& a) {
  const Tensor gr = contiguous_cpu(gt), x = contiguous_cpu(xt);
  const ConvGeom g = geometry(x.shape(), a.shape, a);
  const T* gp = static_cast<const T*>(gr.raw_data());
  const T* xp = static_cast<const T*>(x.raw_data());
  T* dwp = static_cast<T*>(dw.raw_data());
  std::fill(dwp, dwp + g.o * g.ckk(), T(0));
  std::vector<T> col(g.ckk() * g.ohw());
  for (int64_t n = 0; n < g.n; ++n) {
    im2col(xp + n * g.c * g.h * g.w, g, col.data());
    // dW [o, ckk] += grad[n] [o, ohw] @ col^T [ohw, ckk]
    gemm<T>(g.o, g.ckk(), g.ohw(), gp + n * g.o * g.ohw(), g.ohw(), 1, col.data(), 1, g.ohw(), dwp,
            /*accumulate=*/true);
  }
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

void conv2d_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  in_compute_type(in, out[0], [&]<typename T>(std::span<const Tensor> v, const Tensor& o) {
    conv_forward<T>(v[0], v[1], v[2], o, a);
  });
}

void conv2d_backward_input_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                  const Attrs& a) {
  in_compute_type(in, out[0], [&]<typename T>(std::span<const Tensor> v, const Tensor& o) {
    conv_backward_input<T>(v[0], v[1], o, a);
  });
}

void conv2d_backward_weight_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                   const Attrs& a) {
  in_compute_type(in, out[0], [&]<typename T>(std::span<const Tensor> v, const Tensor& o) {
    conv_backward_weight<T>(v[0], v[1], o, a);
  });
}

// Outputs: values and the argmax as a flat index into the input plane (H * W).
void max_pool2d_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor x = contiguous_cpu(in[0]);
  const int64_t planes = x.shape()[0] * x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  const int64_t oh = out[0].shape()[2], ow = out[0].shape()[3];
  int64_t* ip = static_cast<int64_t*>(out[1].raw_data());
  visit_dtype(x.dtype(), [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using C = compute_t<T>;
      const T* xp = static_cast<const T*>(x.raw_data());
      T* yp = static_cast<T*>(out[0].raw_data());
      parallel_for(0, planes, 1, [&](int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) {
          const T* plane = xp + p * h * w;
          for (int64_t y = 0; y < oh; ++y) {
            for (int64_t xo = 0; xo < ow; ++xo) {
              C best = std::numeric_limits<C>::lowest();
              if constexpr (std::is_floating_point_v<C>) best = -std::numeric_limits<C>::infinity();
              int64_t arg = -1;
              for (int64_t i = 0; i < a.kernel_size[0]; ++i) {
                const int64_t iy = y * a.stride[0] - a.padding[0] + i;
                if (iy < 0 || iy >= h) continue;
                for (int64_t j = 0; j < a.kernel_size[1]; ++j) {
                  const int64_t ix = xo * a.stride[1] - a.padding[1] + j;
                  if (ix < 0 || ix >= w) continue;
                  const C v = C(plane[iy * w + ix]);
                  // The first NaN wins (as in argmax): once best is NaN nothing replaces it.
                  if (arg < 0 || (best == best && (v > best || v != v))) {
                    best = v;
                    arg = iy * w + ix;
                    if (v != v) break;
                  }
                }
              }
              const int64_t o = (p * oh + y) * ow + xo;
              yp[o] = T(best);
              ip[o] = arg;
            }
          }
        }
      });
    }
  });
}

TS_REGISTER_KERNEL(cpu, conv2d, conv2d_kernel);
TS_REGISTER_KERNEL(cpu, conv2d_backward_input, conv2d_backward_input_kernel);
TS_REGISTER_KERNEL(cpu, conv2d_backward_weight, conv2d_backward_weight_kernel);
TS_REGISTER_KERNEL(cpu, max_pool2d, max_pool2d_kernel);

}  // namespace
}  // namespace tessera::cpu
