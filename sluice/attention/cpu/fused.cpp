// Fused bfloat16 elementwise layers for x86 CPUs with AVX-512 BF16, the ops (registered in ops.cpp; their
// ISA-neutral half is fused_common.h) torch.ops.sluice.rms_norm, rotary_ and argmax_rows.
//
// Each replaces a chain of 8-20 small torch ops per layer (casts, pow, mean, rsqrt, chunk, cat,
// ...), whose dispatch costs more than their arithmetic at decode batch sizes. Both compute what
// the torch path in sluice/model/layers.py computes, with the same roundings to bfloat16:
//   rms_norm: s = bf16(x + residual); n = bf16(s * rsqrt(mean(s^2) + eps)); out = bf16(w * n)
// rms_norm returns (out, s); s is empty when there is no residual (the caller's x is then the
// next residual).
//   rotary_:  neox-style rotation of the first rotary_dim dims of q and k, in float32, in place.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <immintrin.h>

#include "fused_common.h"
#include "ops.h"
#include "simd.h"

#include <cmath>
#include <limits>
#include <cstdint>
#include <tuple>

namespace {

using sluice_simd::bf16;
using sluice_simd::load_bf16;
using sluice_simd::round_bf16;
using sluice_simd::store_bf16;
using sluice_simd::tail_mask;

// One row of rms_norm (see fused_common.h): sr receives bf16(x + residual) when rr is given.
inline void rms_norm_row(const bf16* xr, const bf16* rr, const bf16* wp, bf16* sr, bf16* orow, int64_t h, float eps) {
  const bf16* src = xr;
  if (rr) {  // s = bf16(x + residual), kept: it is the next residual
    for (int64_t j = 0; j < h; j += 16) {
      const __mmask16 m = tail_mask(h - j);
      store_bf16(sr + j, _mm512_add_ps(load_bf16(xr + j, m), load_bf16(rr + j, m)), m);
    }
    src = sr;
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < h; j += 16) {
    const __m512 v = load_bf16(src + j, tail_mask(h - j));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float var = _mm512_reduce_add_ps(acc) / static_cast<float>(h);
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(var + eps));
  for (int64_t j = 0; j < h; j += 16) {
    const __mmask16 m = tail_mask(h - j);
    const __m512 n = round_bf16(_mm512_mul_ps(load_bf16(src + j, m), r));
    store_bf16(orow + j, _mm512_mul_ps(load_bf16(wp + j, m), n), m);
  }
}

// x[..., :rd] of one head, rotated by (cos, sin) rows of rd / 2 float32 each.
inline void rotate_head(bf16* x, const float* c, const float* s, int64_t half) {
  for (int64_t j = 0; j < half; j += 16) {
    const __mmask16 m = tail_mask(half - j);
    const __m512 x1 = load_bf16(x + j, m), x2 = load_bf16(x + half + j, m);
    const __m512 cv = _mm512_maskz_loadu_ps(m, c + j), sv = _mm512_maskz_loadu_ps(m, s + j);
    const __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
    const __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
    store_bf16(x + j, o1, m);
    store_bf16(x + half + j, o2, m);
  }
}

// Index of the first maximum of each row of [B, V] logits (bf16 or float32), as torch.argmax: a
// lane keeps its first strict maximum, then the lanes holding the row's maximum give their
// smallest index. torch's CPU argmax over the last dim is a scalar loop (~5 ns per element, 8 ms
// for 32 rows of a 49k vocabulary); this is one vector pass.
template <bool kBf16>
int64_t argmax_row(const void* row, int64_t v) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_idx = _mm512_set1_epi32(-1);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t j = 0; j < v; j += 16) {
    const __mmask16 m = tail_mask(v - j);
    __m512 x;
    if constexpr (kBf16) {
      x = load_bf16(static_cast<const bf16*>(row) + j, m);
    } else {
      x = _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + j);
    }
    // NaN compares unordered-true here, so a NaN wins like it does in torch.argmax.
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, x, best, _CMP_NLE_UQ) & ~_mm512_mask_cmp_ps_mask(m, best, best, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, gt, x);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  alignas(64) float vals[16];
  alignas(64) int32_t ids[16];
  _mm512_store_ps(vals, best);
  _mm512_store_si512(ids, best_idx);
  int64_t out = -1;  // all lanes still -1: every logit is -inf, and torch.argmax answers 0
  float top = 0.0f;
  bool top_nan = false;
  for (int l = 0; l < 16; ++l) {
    if (ids[l] < 0) continue;
    const bool nan = std::isnan(vals[l]);
    bool better;
    if (out < 0) better = true;
    else if (nan != top_nan) better = nan;
    else if (nan) better = ids[l] < out;
    else better = vals[l] > top || (vals[l] == top && ids[l] < out);
    if (better) {
      top = vals[l];
      out = ids[l];
      top_nan = nan;
    }
  }
  return out < 0 ? 0 : out;
}

struct Avx512 {
  static void rms_norm_row(const bf16* xr, const bf16* rr, const bf16* wp, bf16* sr, bf16* orow, int64_t h, float eps) {
    ::rms_norm_row(xr, rr, wp, sr, orow, h, eps);
  }
  static void rotate_head(bf16* x, const float* c, const float* s, int64_t half) { ::rotate_head(x, c, s, half); }
  template <bool kBf16>
  static int64_t argmax_row(const void* row, int64_t v) { return ::argmax_row<kBf16>(row, v); }
};

}  // namespace

SLUICE_DEFINE_FUSED_OPS(Avx512)
