// The ISA-neutral half of the fused elementwise kernels (fused.cpp for AVX-512 BF16, fused_avx2.cpp
// for AVX2 + FMA): input checks, outputs and the loops over rows. Each kernel file passes a type
// `Isa` with its per-row kernels:
//   Isa::rms_norm_row(x, residual or nullptr, weight, sum or nullptr, out, h, eps)
//     s = bf16(x + residual) into sum (with a residual); n = bf16(s * rsqrt(mean(s^2) + eps));
//     out = bf16(w * n)
//   Isa::rotate_head(x, cos, sin, half): neox rotation of x[:2 half] in float32, in place
//   Isa::argmax_row<kBf16>(row, v): the index of the first maximum, as torch.argmax (NaN wins)
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

#include "simd_common.h"

namespace sluice_fused {

using sluice_simd::bf16;

inline const bf16* cptr(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr<c10::BFloat16>()); }
inline bf16* mptr(at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<c10::BFloat16>()); }

// rms_norm returns (out, s); s is empty when there is no residual (the caller's x is then the
// next residual).
template <typename Isa>
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
    for (int64_t i = begin; i < end; ++i)
      Isa::rms_norm_row(xp + i * ldx, has_res ? rp + i * ldr : nullptr, wp, has_res ? sp + i * h : nullptr, op + i * h,
                        h, feps);
  });
  return {out, sum};
}

template <typename Isa>
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
      for (int64_t h = 0; h < hq; ++h) Isa::rotate_head(qp + i * qs0 + h * qs1, c, s, half);
      for (int64_t h = 0; h < hk; ++h) Isa::rotate_head(kp + i * ks0 + h * ks1, c, s, half);
    }
  });
}

// Index of the first maximum of each row of [B, V] logits (bf16 or float32), as torch.argmax.
// torch's CPU argmax over the last dim is a scalar loop (~5 ns per element, 8 ms for 32 rows of a
// 49k vocabulary); the kernels make it one vector pass.
template <typename Isa>
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
      op[i] = is_bf16 ? Isa::template argmax_row<true>(base + i * row_bytes, v) : Isa::template argmax_row<false>(base + i * row_bytes, v);
  });
  return out;
}

}  // namespace sluice_fused

// Defines the ops' entry points (ops.h) on a kernel file's Isa type; used once per kernel set.
#define SLUICE_DEFINE_FUSED_OPS(Isa)                                                                          \
  namespace sluice_ops {                                                                                      \
  std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, \
                                              const at::Tensor& weight, double eps) {                         \
    return sluice_fused::rms_norm<Isa>(x, residual, weight, eps);                                             \
  }                                                                                                           \
  void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,                \
               const at::Tensor& sin) {                                                                       \
    sluice_fused::rotary_<Isa>(std::move(q), std::move(k), positions, cos, sin);                              \
  }                                                                                                           \
  at::Tensor argmax_rows(const at::Tensor& logits) { return sluice_fused::argmax_rows<Isa>(logits); }         \
  }
