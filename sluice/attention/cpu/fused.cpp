// Fused bfloat16 elementwise layers for x86 CPUs with AVX-512 BF16, registered as
// torch.ops.sluice.rms_norm and torch.ops.sluice.rotary_.
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
#include <torch/library.h>

#include <immintrin.h>

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

const bf16* cptr(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr<c10::BFloat16>()); }
bf16* mptr(at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<c10::BFloat16>()); }

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [T, H] bf16");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == h, "weight must be bf16 [H]");
  const bool has_res = residual.has_value();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kBFloat16 && residual->stride(1) == 1,
                "residual must match x");
  at::Tensor out = at::empty({t, h}, x.options());
  at::Tensor sum = at::empty({has_res ? t : 0, h}, x.options());  // empty without a residual
  const bf16* xp = cptr(x);
  const bf16* rp = has_res ? cptr(*residual) : nullptr;
  const bf16* wp = cptr(weight);
  bf16* sp = has_res ? mptr(sum) : nullptr;
  bf16* op = mptr(out);
  const int64_t ldx = x.stride(0), ldr = has_res ? residual->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* xr = xp + i * ldx;
      const bf16* src = xr;
      if (has_res) {  // s = bf16(x + residual), kept: it is the next residual
        const bf16* rr = rp + i * ldr;
        bf16* sr = sp + i * h;
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
      const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(var + feps));
      bf16* orow = op + i * h;
      for (int64_t j = 0; j < h; j += 16) {
        const __mmask16 m = tail_mask(h - j);
        const __m512 n = round_bf16(_mm512_mul_ps(load_bf16(src + j, m), r));
        store_bf16(orow + j, _mm512_mul_ps(load_bf16(wp + j, m), n), m);
      }
    }
  });
  return {out, sum};
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

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0), "q, k must be [T, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16, "q, k must be bf16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "head rows must be contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2, "cos/sin must be float32 [P, rd/2]");
  const int64_t t = q.size(0), half = cos.size(1), max_pos = cos.size(0);
  TORCH_CHECK(2 * half <= q.size(2) && 2 * half <= k.size(2), "rotary_dim exceeds head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == t,
              "positions must be contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position out of the rotary table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  bf16* qp = mptr(q);
  bf16* kp = mptr(k);
  const int64_t hq = q.size(1), hk = k.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + pos[i] * half;
      const float* s = sp + pos[i] * half;
      for (int64_t h = 0; h < hq; ++h) rotate_head(qp + i * qs0 + h * qs1, c, s, half);
      for (int64_t h = 0; h < hk; ++h) rotate_head(kp + i * ks0 + h * ks1, c, s, half);
    }
  });
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

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [B, V] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat, "logits must be bf16 or float32");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), "vocabulary size out of range");
  const int64_t b = logits.size(0), v = logits.size(1), ld = logits.stride(0);
  at::Tensor out = at::empty({b}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const bool is_bf16 = logits.scalar_type() == at::kBFloat16;
  const char* base = static_cast<const char*>(logits.data_ptr());
  const int64_t row_bytes = ld * (is_bf16 ? 2 : 4);
  at::parallel_for(0, b, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      op[i] = is_bf16 ? argmax_row<true>(base + i * row_bytes, v) : argmax_row<false>(base + i * row_bytes, v);
  });
  return out;
}

}  // namespace

// The entry points other kernels call directly (stack.cpp); the registered ops are the same functions.
namespace sluice_ops {

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  return ::rms_norm(x, residual, weight, eps);
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  ::rotary_(std::move(q), std::move(k), positions, cos, sin);
}

}  // namespace sluice_ops

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor", &argmax_rows);
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)", &rms_norm);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()", &rotary_);
}
