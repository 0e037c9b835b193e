// Small SIMD building blocks shared by the CPU kernels (GEMM packing, conv layout changes).
//
//   __m512 rows[16];  ...  transpose16x16(rows);   // rows[j] now holds column j
//   __m256 rows[8];   ...  transpose8x8(rows);     // the same for 8 x 8 (AVX2 builds)
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tessera::cpu {

#if defined(__AVX2__)
// Transposes 8 rows of 8 floats (r[i] = row i) in place: afterwards r[j] holds column j.
// 32-bit pairs, 64-bit pairs, then the two 128-bit halves.
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4q + e] holds, in 128-bit half H, rows 4q..4q+3 of column 4H + e.
  __m256 u[8];
  for (int q = 0; q < 2; ++q) {
    const __m256d t0 = _mm256_castps_pd(t[4 * q]), t1 = _mm256_castps_pd(t[4 * q + 1]);
    const __m256d t2 = _mm256_castps_pd(t[4 * q + 2]), t3 = _mm256_castps_pd(t[4 * q + 3]);
    u[4 * q + 0] = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
    u[4 * q + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
    u[4 * q + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
    u[4 * q + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3));
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);      // low halves: column e
    r[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);  // high halves: column 4 + e
  }
}
#endif

#if defined(__AVX512F__)

// Transposes 16 rows of 16 floats (r[i] = row i) in place: afterwards r[j] holds column j.
// Three rounds of shuffles: 32-bit pairs, 64-bit pairs, then 128-bit lanes.
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4q + e] holds, in 128-bit lane L, rows 4q..4q+3 of column 4L + e.
  __m512 u[16];
  for (int q = 0; q < 4; ++q) {
    const __m512d t0 = _mm512_castps_pd(t[4 * q]), t1 = _mm512_castps_pd(t[4 * q + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * q + 2]), t3 = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  // Gather lane L of u[e], u[4 + e], u[8 + e], u[12 + e] into column 4L + e.
  for (int e = 0; e < 4; ++e) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88);  // lanes 0, 2
    const __m512 v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);  // lanes 1, 3
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[4 + e] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

#endif

}  // namespace tessera::cpu
