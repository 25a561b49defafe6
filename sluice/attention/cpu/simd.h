// AVX-512 helpers shared by the CPU kernels (paged_attention.cpp, linear.cpp, fused.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd_common.h"

namespace sluice_simd {

// 2^f for f in [-0.5, 0.5] from the Taylor polynomial of degree kDegree (truncation error: 7,
// < 1e-8, below float32 rounding; 5, < 3e-6, below bf16 rounding).
template <int kDegree = 7>
inline __m512 exp2_fraction(__m512 f) {
  static_assert(kDegree == 5 || kDegree == 7);
  __m512 y;
  if constexpr (kDegree == 7) {
    y = _mm512_set1_ps(1.5252734e-05f);                  // ln2^7 / 7!
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.5403530e-04f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558e-03f));
  } else {
    y = _mm512_set1_ps(1.3333558e-03f);                  // ln2^5 / 5!
  }
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-03f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-02f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-01f));
  return _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
}

// 2^x as 2^round(x) * 2^f with f in [-0.5, 0.5] (exp2_fraction, degree 7). Inputs are clamped
// to [-127, 127]: below, the result is (near) zero.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_fraction(_mm512_sub_ps(x, n)), n);
}

// The first min(n, 16) lanes.
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// 16 bf16 values (masked lanes read as 0) widened to float32.
inline __m512 load_bf16(const bf16* p, __mmask16 m = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// float32 -> bf16, round to nearest even.
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// v rounded to bf16 precision, kept in float32.
inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16)); }

inline void store_bf16(bf16* p, __m512 v, __mmask16 m = 0xFFFF) { _mm256_mask_storeu_epi16(p, m, to_bf16(v)); }

}  // namespace sluice_simd
