// Fused bfloat16 elementwise layers for x86 CPUs with AVX2 + FMA but no AVX-512 BF16: the ops of
// fused.cpp (torch.ops.sluice.rms_norm, rotary_ and argmax_rows), same definitions and the same
// roundings to bfloat16, on 8-lane vectors:
//   rms_norm: s = bf16(x + residual); n = bf16(s * rsqrt(mean(s^2) + eps)); out = bf16(w * n)
//   rotary_:  neox-style rotation of the first rotary_dim dims of q and k, in float32, in place.
//   argmax_rows: index of the first maximum of each row, as torch.argmax (NaN wins).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <immintrin.h>

#include "fused_common.h"
#include "ops.h"
#include "simd_avx2.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#if !(defined(__AVX2__) && defined(__FMA__))
#error "sluice's AVX2 fused kernels need AVX2 and FMA"
#endif

namespace {

using sluice_simd::bf16;
using sluice_simd::load8_bf16;
using sluice_simd::load8_bf16_tail;
using sluice_simd::round_bf16;
using sluice_simd::store8_bf16;
using sluice_simd::store8_bf16_tail;

inline __m256 load(const bf16* p, int64_t n) { return n >= 8 ? load8_bf16(p) : load8_bf16_tail(p, n); }
inline void store(bf16* p, __m256 v, int64_t n) {
  if (n >= 8) store8_bf16(p, v);
  else store8_bf16_tail(p, v, n);
}
inline __m256 load_f32(const float* p, int64_t n) { return n >= 8 ? _mm256_loadu_ps(p) : sluice_simd::load8_f32_tail(p, n); }

// One row of rms_norm (see fused_common.h): sr receives bf16(x + residual) when rr is given.
inline void rms_norm_row(const bf16* xr, const bf16* rr, const bf16* wp, bf16* sr, bf16* orow, int64_t h, float eps) {
  const bf16* src = xr;
  if (rr) {  // s = bf16(x + residual), kept: it is the next residual
    for (int64_t j = 0; j < h; j += 8) store(sr + j, _mm256_add_ps(load(xr + j, h - j), load(rr + j, h - j)), h - j);
    src = sr;
  }
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < h; j += 8) {
    const __m256 v = load(src + j, h - j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float var = sluice_simd::hsum(acc) / static_cast<float>(h);
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(var + eps));
  for (int64_t j = 0; j < h; j += 8) {
    const __m256 n = round_bf16(_mm256_mul_ps(load(src + j, h - j), r));
    store(orow + j, _mm256_mul_ps(load(wp + j, h - j), n), h - j);
  }
}

// x[..., :rd] of one head, rotated by (cos, sin) rows of rd / 2 float32 each.
inline void rotate_head(bf16* x, const float* c, const float* s, int64_t half) {
  for (int64_t j = 0; j < half; j += 8) {
    const int64_t n = half - j;
    const __m256 x1 = load(x + j, n), x2 = load(x + half + j, n);
    const __m256 cv = load_f32(c + j, n), sv = load_f32(s + j, n);
    const __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
    const __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
    store(x + j, o1, n);
    store(x + half + j, o2, n);
  }
}

// Index of the first maximum of a row of v logits, as torch.argmax: each lane keeps its first
// strict maximum (a NaN wins and stays), then the lanes' winners are compared in index order.
template <bool kBf16>
int64_t argmax_row(const void* row, int64_t v) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i best_idx = _mm256_set1_epi32(-1);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  const int64_t full = v / 8 * 8;
  for (int64_t j = 0; j < full; j += 8) {
    __m256 x;
    if constexpr (kBf16) {
      x = load8_bf16(static_cast<const bf16*>(row) + j);
    } else {
      x = _mm256_loadu_ps(static_cast<const float*>(row) + j);
    }
    // x > best, or x is NaN, unless best is already NaN
    const __m256 gt = _mm256_andnot_ps(_mm256_cmp_ps(best, best, _CMP_UNORD_Q), _mm256_cmp_ps(x, best, _CMP_NLE_UQ));
    best = _mm256_blendv_ps(best, x, gt);
    best_idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_idx), _mm256_castsi256_ps(idx), gt));
    idx = _mm256_add_epi32(idx, step);
  }
  alignas(32) float vals[8];
  alignas(32) int32_t ids[8];
  _mm256_store_ps(vals, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ids), best_idx);
  int64_t out = -1;  // no candidate yet
  float top = 0.0f;
  bool top_nan = false;
  auto offer = [&](float val, int64_t id) {
    const bool nan = std::isnan(val);
    bool better;
    if (out < 0) better = true;
    else if (nan != top_nan) better = nan;
    else if (nan) better = id < out;
    else better = val > top || (val == top && id < out);
    if (better) {
      top = val;
      out = id;
      top_nan = nan;
    }
  };
  for (int l = 0; l < 8; ++l)
    if (ids[l] >= 0) offer(vals[l], ids[l]);
  for (int64_t j = full; j < v; ++j) {
    const float x = kBf16 ? static_cast<float>(c10::BFloat16(static_cast<const bf16*>(row)[j], c10::BFloat16::from_bits()))
                          : static_cast<const float*>(row)[j];
    // no candidate yet stands for -inf, as the vector lanes' start value
    if (std::isnan(x) || x > (out < 0 ? -std::numeric_limits<float>::infinity() : top)) offer(x, j);
  }
  return out < 0 ? 0 : out;  // every logit -inf: torch.argmax answers 0
}

struct Avx2 {
  static void rms_norm_row(const bf16* xr, const bf16* rr, const bf16* wp, bf16* sr, bf16* orow, int64_t h, float eps) {
    ::rms_norm_row(xr, rr, wp, sr, orow, h, eps);
  }
  static void rotate_head(bf16* x, const float* c, const float* s, int64_t half) { ::rotate_head(x, c, s, half); }
  template <bool kBf16>
  static int64_t argmax_row(const void* row, int64_t v) { return ::argmax_row<kBf16>(row, v); }
};

}  // namespace

SLUICE_DEFINE_FUSED_OPS(Avx2)
