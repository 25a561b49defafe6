// AVX2 + FMA helpers shared by the CPU kernels for x86 CPUs without AVX-512 BF16
// (paged_attention_avx2.cpp, linear_avx2.cpp, fused_avx2.cpp): 8 float32 lanes per vector,
// bfloat16 values widened to float32 on load and rounded (to nearest even) on store.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd_common.h"

namespace sluice_simd {

// 8 bf16 values widened to float32 (a bf16 is the top half of a float32).
inline __m256 load8_bf16(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// The first n (< 8) bf16 values, the other lanes 0.
inline __m256 load8_bf16_tail(const bf16* p, int64_t n) {
  alignas(16) bf16 tmp[8] = {};
  std::memcpy(tmp, p, n * sizeof(bf16));
  return load8_bf16(tmp);
}

inline __m256 load8_f32_tail(const float* p, int64_t n) {
  alignas(32) float tmp[8] = {};
  std::memcpy(tmp, p, n * sizeof(float));
  return _mm256_load_ps(tmp);
}

// float32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN), as c10::BFloat16 does.
inline __m128i to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline void store8_bf16(bf16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16x8(v)); }

inline void store8_bf16_tail(bf16* p, __m256 v, int64_t n) {
  alignas(16) bf16 tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), to_bf16x8(v));
  std::memcpy(p, tmp, n * sizeof(bf16));
}

inline void store8_f32_tail(float* p, __m256 v, int64_t n) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(p, tmp, n * sizeof(float));
}

// v rounded to bf16 precision, kept in float32.
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(v)), 16));
}

// 2^x as 2^round(x) * 2^f with f in [-0.5, 0.5] (Taylor polynomial of degree 7, truncation error
// < 1e-8). Inputs are clamped to [-126, 127]; x <= -126 comes out as exactly 0 (a float's
// exponent field cannot hold 2^-127), so exp2(-inf) = 0.
inline __m256 exp2_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LE_OQ);  // also catches -inf
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 y = _mm256_set1_ps(1.5252734e-05f);  // ln2^7 / 7!
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.5403530e-04f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3333558e-03f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.6181291e-03f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.5504109e-02f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.4022651e-01f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.9314718e-01f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// In-place transpose of an 8x8 matrix of float32 held as 8 row vectors.
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int g = 0; g < 8; g += 4) {
    u[g + 0] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
    u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
    u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  // u[c] (rows 0-3) and u[4 + c] (rows 4-7), 128-bit half h: elements 4h + c' of those rows.
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

}  // namespace sluice_simd
