// The ISA-neutral half of the packed bfloat16 linear kernels (linear.cpp for AVX-512 BF16,
// linear_avx2.cpp for AVX2 + FMA): input checks and outputs. Each kernel file passes a type `Isa`
// with `template <bool kSiluMul> static void run(x, packed, n, k, bias or nullptr, y)`,
// `static bool set_amx(bool)` (switch AMX on or off; returns whether it is on) and
// `static bool amx_enabled()`, and `static constexpr bool kQ4`: whether its run takes Q4_1
// packed weights (below) as well, and then `static void q4_unpack(q4, n, k, out)` (Q4_1 packed ->
// the bf16 packed layout).
//
// Packed Q4_1 (uint8; sluice/model/packed_linear.py's pack_q4_1): a GGUF's Q4_1 blocks (32 k of
// one output column: fp16 d and m, 32 4-bit q; weight = d * q + m) regrouped by 16-column vectors.
// Vector v (columns 16 v .. 16 v + 15) holds K / 32 vector blocks, one after the other, and vector
// v + 1 follows it (so a 64-column group is 4 consecutive vectors). A vector block (kQ4VectorBlock
// bytes) for k in [32 b, 32 b + 32): the 16 columns' d as fp16, their m as fp16, then per k pair
// p (16 of them) 16 bytes, byte i = q(column i / 2, k 32 b + 2 p + i % 2) in its low nibble and
// q(column 8 + i / 2, same k) in its high nibble: the bf16 layout's lane order.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace sluice_linear {

constexpr int64_t kQ4BlockK = 32;         // k per Q4_1 block
constexpr int64_t kQ4VectorBlock = 320;   // bytes per 16 columns x 32 k: 32 (d) + 32 (m) + 256 (q)

inline int64_t q4_bytes(int64_t n, int64_t k) { return n / 16 * (k / kQ4BlockK) * kQ4VectorBlock; }

template <typename Isa>
void check_common(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16, rows contiguous");
  TORCH_CHECK(k % 2 == 0 && x.size(1) == k, "K must be even and match x");
  TORCH_CHECK(packed.is_contiguous(), "packed weight must be contiguous");
  if (packed.scalar_type() == at::kByte) {
    TORCH_CHECK(Isa::kQ4, "this CPU's kernel set computes from bf16 packed weights only, not Q4_1");
    TORCH_CHECK(n % 16 == 0 && k % kQ4BlockK == 0 && packed.numel() == q4_bytes(n, k),
                "Q4_1: N must be a multiple of 16, K of 32, and match the packed weight");
    return;
  }
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "packed weight must be bf16 or Q4_1 (uint8)");
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
  check_common<Isa>(x, packed, n, k);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0) Isa::template run<false>(x, packed, n, k, bias_ptr(bias, n), y);
  return y;
}

template <typename Isa>
at::Tensor linear_bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                const c10::optional<at::Tensor>& bias) {
  const int64_t k = x.size(1);
  check_common<Isa>(x, packed, n, k);
  TORCH_CHECK(n % 64 == 0 || n % 64 == 32, "gate/up width must be a multiple of 32 (16 gate + 16 up columns)");
  at::Tensor y = at::empty({x.size(0), n / 2}, x.options());
  if (x.size(0) > 0) Isa::template run<true>(x, packed, n, k, bias_ptr(bias, n), y);
  return y;
}

template <typename Isa>
at::Tensor linear_q4_unpack(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "Q4_1 packed weight must be contiguous uint8");
  TORCH_CHECK(n % 16 == 0 && k % kQ4BlockK == 0 && packed.numel() == q4_bytes(n, k),
              "Q4_1: N must be a multiple of 16, K of 32, and match the packed weight");
  at::Tensor out = at::empty({n * k}, packed.options().dtype(at::kBFloat16));
  if constexpr (Isa::kQ4) Isa::q4_unpack(packed.data_ptr<uint8_t>(), n, k, out.data_ptr<c10::BFloat16>());
  else TORCH_CHECK(false, "this CPU's kernel set computes from bf16 packed weights only, not Q4_1");
  return out;
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
  at::Tensor linear_q4_unpack(const at::Tensor& packed, int64_t n, int64_t k) {                          \
    return sluice_linear::linear_q4_unpack<Isa>(packed, n, k);                                          \
  }                                                                                                     \
  bool linear_q4_supported() { return Isa::kQ4; }                                                       \
  bool linear_set_amx(bool enable) { return Isa::set_amx(enable); }                                     \
  bool linear_amx_enabled() { return Isa::amx_enabled(); }                                              \
  }
