// The ISA-neutral half of the packed bfloat16 linear kernels (linear.cpp for AVX-512 BF16,
// linear_avx2.cpp for AVX2 + FMA): input checks and outputs. Each kernel file passes a type `Isa`
// with `template <bool kSiluMul> static void run(x, packed, n, k, bias or nullptr, y)`,
// `static bool set_amx(bool)` (switch AMX on or off; returns whether it is on) and
// `static bool amx_enabled()`.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace sluice_linear {

inline void check_common(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16, rows contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "packed weight must be contiguous bf16");
  TORCH_CHECK(k % 2 == 0 && x.size(1) == k, "K must be even and match x");
  TORCH_CHECK(n % 16 == 0 && packed.numel() == n * k, "N must be a multiple of 16 and match the packed weight");
}

inline const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "bias must be float32 [N]");
  return bias->data_ptr<float>();
}

template <typename Isa>
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  const int64_t k = x.size(1);
  check_common(x, packed, n, k);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0) Isa::template run<false>(x, packed, n, k, bias_ptr(bias, n), y);
  return y;
}

template <typename Isa>
at::Tensor linear_bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                const c10::optional<at::Tensor>& bias) {
  const int64_t k = x.size(1);
  check_common(x, packed, n, k);
  TORCH_CHECK(n % 64 == 0 || n % 64 == 32, "gate/up width must be a multiple of 32 (16 gate + 16 up columns)");
  at::Tensor y = at::empty({x.size(0), n / 2}, x.options());
  if (x.size(0) > 0) Isa::template run<true>(x, packed, n, k, bias_ptr(bias, n), y);
  return y;
}

}  // namespace sluice_linear

// Defines the ops' entry points (ops.h) on a kernel file's Isa type; used once per kernel set.
#define SLUICE_DEFINE_LINEAR_OPS(Isa)                                                                   \
  namespace sluice_ops {                                                                                \
  at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,                      \
                         const c10::optional<at::Tensor>& bias) {                                       \
    return sluice_linear::linear_bf16<Isa>(x, packed, n, bias);                                         \
  }                                                                                                     \
  at::Tensor linear_bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n,             \
                                  const c10::optional<at::Tensor>& bias) {                              \
    return sluice_linear::linear_bf16_silu_mul<Isa>(x, packed, n, bias);                                \
  }                                                                                                     \
  bool linear_set_amx(bool enable) { return Isa::set_amx(enable); }                                     \
  bool linear_amx_enabled() { return Isa::amx_enabled(); }                                              \
  }
