// Device-side helpers shared by every .cu file of the CUDA backend: element types, dtype
// dispatch, 16-byte vectors, grid sizing, launch checks (the strided index arithmetic is
// kernels/cuda/strided_index.h, which the CPU tests check too).
//
//   TS_CUDA_DISPATCH_ALL(x.dtype, "exp", [&] { using T = scalar_t; ... });
//
// 16-bit floats are stored as __half / __nv_bfloat16 (the same bits as Tessera's Half and
// BFloat16) and computed in f32 (acc_type), rounding to nearest even once per result, as
// the CPU kernels do.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda/dev_tensor.h"
#include "kernels/cuda/strided_index.h"

namespace tessera::cuda_kernels {

inline void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaLaunchError(std::string(what) + ": " + cudaGetErrorString(e));
}

template <typename T> struct AccType { using type = T; };
template <> struct AccType<__half> { using type = float; };
template <> struct AccType<__nv_bfloat16> { using type = float; };
template <> struct AccType<bool> { using type = bool; };
template <typename T> using acc_type = typename AccType<T>::type;

// The CPU's conversions (tensor/dtype.h), bit for bit, NaN payloads included, so that a
// result rounded to f16/bf16 on the device equals the CPU's.
__device__ __forceinline__ uint16_t f32_to_f16_bits(float f) {
  uint32_t x = __float_as_uint(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a < 0x38800000u) {
    const float af = __uint_as_float(a) + 0.5f;
    return static_cast<uint16_t>(sign | (__float_as_uint(af) - 0x3f000000u));
  }
  const uint32_t odd = (a >> 13) & 1u;
  a += 0xc8000fffu + odd;
  return static_cast<uint16_t>(sign | (a >> 13));
}
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
  uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}
// d rounded to f32 "to odd" (see tensor/dtype.h): rounding that to 16 bits rounds d once.
__device__ __forceinline__ float f64_to_f32_round_odd(double d) {
  const float f = __double2float_rn(d);
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7f800000u) == 0x7f800000u || static_cast<double>(f) == d) return f;
  uint32_t mag = bits;
  if (fabs(static_cast<double>(f)) > fabs(d)) mag -= 1;
  return __uint_as_float(mag | 1u);
}

// Loads/stores with the 16-bit types going through f32.
template <typename T> __device__ __forceinline__ acc_type<T> to_acc(T v) { return v; }
template <> __device__ __forceinline__ float to_acc<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_acc<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T, typename A> __device__ __forceinline__ T from_acc(A v) {
  return static_cast<T>(v);
}
template <> __device__ __forceinline__ __half from_acc<__half, float>(float v) {
  return __ushort_as_half(f32_to_f16_bits(v));
}
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) {
  return __ushort_as_bfloat16(f32_to_bf16_bits(v));
}

template <typename T> inline constexpr bool is_16bit_float_v =
    std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

// The CPU's convert<To>(From) (kernels/cpu/copy.cc): casts between any two dtypes.
template <typename To, typename From>
__device__ __forceinline__ To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<To, bool>) {
    if constexpr (is_16bit_float_v<From>) return to_acc(v) != 0.0f;
    else return v != From(0);
  } else if constexpr (is_16bit_float_v<To>) {
    if constexpr (std::is_same_v<From, double> || std::is_integral_v<From>) {
      return from_acc<To, float>(f64_to_f32_round_odd(static_cast<double>(v)));
    } else if constexpr (is_16bit_float_v<From>) {
      return from_acc<To, float>(to_acc(v));
    } else {
      return from_acc<To, float>(static_cast<float>(v));
    }
  } else if constexpr (std::is_same_v<To, uint8_t> && !std::is_integral_v<From>) {
    // Floats truncate toward zero, then wrap modulo 256 as integers do (the CPU's rule).
    return static_cast<uint8_t>(static_cast<long long>(static_cast<double>(to_acc(v))));
  } else if constexpr (is_16bit_float_v<From>) {
    return static_cast<To>(to_acc(v));
  } else {
    return static_cast<To>(v);
  }
}

// Grid sizing for grid-stride loops: enough blocks to fill the chip several times over.
inline int grid_for(int64_t n, int threads = 256, int max_blocks = 132 * 32) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<int>(b);
}

// 16 bytes (or fewer) of consecutive elements, for vector loads and stores.
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

template <typename T> __host__ __device__ __forceinline__ T* typed(const DevTensor& t) {
  return static_cast<T*>(t.data);
}

}  // namespace tessera::cuda_kernels

// Dispatch on a DevDType value: the body sees `scalar_t`.
#define TS_CUDA_CASE(DT, TYPE, ...) \
  case DT: { using scalar_t = TYPE; __VA_ARGS__(); break; }
#define TS_CUDA_UNSUPPORTED(dtype, what)                                              \
  default: throw ::tessera::cuda_kernels::CudaLaunchError(                            \
      std::string(what) + ": unsupported dtype " + std::to_string(dtype));
#define TS_CUDA_CASES_FLOATS(...)                                                     \
  TS_CUDA_CASE(::tessera::cuda_kernels::kF32, float, __VA_ARGS__)                     \
  TS_CUDA_CASE(::tessera::cuda_kernels::kF64, double, __VA_ARGS__)                    \
  TS_CUDA_CASE(::tessera::cuda_kernels::kF16, __half, __VA_ARGS__)                    \
  TS_CUDA_CASE(::tessera::cuda_kernels::kBF16, __nv_bfloat16, __VA_ARGS__)
#define TS_CUDA_CASES_ALL(...)                                                        \
  TS_CUDA_CASES_FLOATS(__VA_ARGS__)                                                   \
  TS_CUDA_CASE(::tessera::cuda_kernels::kI32, int32_t, __VA_ARGS__)                   \
  TS_CUDA_CASE(::tessera::cuda_kernels::kI64, int64_t, __VA_ARGS__)                   \
  TS_CUDA_CASE(::tessera::cuda_kernels::kB8, bool, __VA_ARGS__)
#define TS_CUDA_DISPATCH_FLOATS(dtype, what, ...)                                     \
  switch (dtype) { TS_CUDA_CASES_FLOATS(__VA_ARGS__) TS_CUDA_UNSUPPORTED(dtype, what) }
// Every dtype but u8 (codes are never computed on).
#define TS_CUDA_DISPATCH_ALL(dtype, what, ...)                                        \
  switch (dtype) { TS_CUDA_CASES_ALL(__VA_ARGS__) TS_CUDA_UNSUPPORTED(dtype, what) }
// Every dtype including u8 (codes: moved and cast), for copies.
#define TS_CUDA_DISPATCH_STORAGE(dtype, what, ...)                                    \
  switch (dtype) {                                                                    \
    TS_CUDA_CASES_ALL(__VA_ARGS__)                                                    \
    TS_CUDA_CASE(::tessera::cuda_kernels::kU8, uint8_t, __VA_ARGS__)                  \
    TS_CUDA_UNSUPPORTED(dtype, what)                                                  \
  }
