// The ISA-neutral half of the packed bfloat16 linear kernels (linear.cpp for AVX-512 BF16,
// linear_avx2.cpp for AVX2 + FMA): input checks and outputs. Each kernel file passes a type `Isa`
// with `template <bool kSiluMul> static void run(x, packed, n, k, bias or nullptr, y)`,
// `static bool set_amx(bool)` (switch AMX on or off; returns whether it is on) and
// `static bool amx_enabled()`, and `static constexpr bool kBlocks`: whether its run also takes
// weights packed in GGUF blocks (below), and then `static void unpack(packed, n, k, out)` (GGUF
// blocks -> the bf16 packed layout).
//
// GGUF blocks (sluice/model/packed_linear.py's pack_blocks): a file's Q4_1 or Q8_0 blocks (32 k of
// one output column: Q4_1 fp16 d and m and 32 4-bit q, weight d * q + m; Q8_0 fp16 d and 32 int8 q,
// weight d * q) regrouped by 16-column vectors: Q4_1 as a uint8 tensor, Q8_0 as an int8 one.
// Vector v (columns 16 v .. 16 v + 15) holds K / 32 vector blocks, one after the other, and vector
// v + 1 follows it (so a 64-column group is 4 consecutive vectors). A vector block for k in
// [32 b, 32 b + 32): the 16 columns' d as fp16; Q4_1 then their m as fp16; then per k pair p (16
// of them) the q of the bf16 layout's lanes, (column i / 2, k 32 b + 2 p + i % 2) for lane i:
// Q4_1 16 bytes, byte i holding lane i's q in its low nibble and lane 16 + i's in its high one;
// Q8_0 32 bytes, byte i lane i's.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace sluice_linear {

constexpr int64_t kBlockK = 32;           // k per GGUF block
constexpr int64_t kQ4VectorBlock = 320;   // Q4_1 bytes per 16 columns x 32 k: 32 (d) + 32 (m) + 256 (q)
constexpr int64_t kQ8VectorBlock = 544;   // Q8_0: 32 (d) + 512 (q)

// A weight [n, k] in GGUF blocks: its packed bytes (Q4_1 a uint8 tensor, Q8_0 an int8 one).
inline int64_t block_bytes(at::ScalarType type, int64_t n, int64_t k) {
  return n / 16 * (k / kBlockK) * (type == at::kChar ? kQ8VectorBlock : kQ4VectorBlock);
}
inline bool is_blocks(at::ScalarType type) { return type == at::kByte || type == at::kChar; }

inline void check_blocks(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(n % 16 == 0 && k % kBlockK == 0 && packed.numel() == block_bytes(packed.scalar_type(), n, k),
              "GGUF blocks (Q4_1, Q8_0): N must be a multiple of 16, K of 32, and match the packed weight");
}

template <typename Isa>
void check_common(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16, rows contiguous");
  TORCH_CHECK(k % 2 == 0 && x.size(1) == k, "K must be even and match x");
  TORCH_CHECK(packed.is_contiguous(), "packed weight must be contiguous");
  if (is_blocks(packed.scalar_type())) {
    TORCH_CHECK(Isa::kBlocks, "this CPU's kernel set computes from bf16 packed weights only, not GGUF blocks");
    check_blocks(packed, n, k);
    return;
  }
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "packed weight must be bf16, or GGUF blocks (Q4_1 uint8, Q8_0 int8)");
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
at::Tensor linear_unpack_blocks(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(is_blocks(packed.scalar_type()) && packed.is_contiguous(),
              "GGUF blocks must be a contiguous uint8 (Q4_1) or int8 (Q8_0) tensor");
  check_blocks(packed, n, k);
  at::Tensor out = at::empty({n * k}, packed.options().dtype(at::kBFloat16));
  if constexpr (Isa::kBlocks) Isa::unpack(packed, n, k, out.data_ptr<c10::BFloat16>());
  else TORCH_CHECK(false, "this CPU's kernel set computes from bf16 packed weights only, not GGUF blocks");
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
  at::Tensor linear_unpack_blocks(const at::Tensor& packed, int64_t n, int64_t k) {                      \
    return sluice_linear::linear_unpack_blocks<Isa>(packed, n, k);                                      \
  }                                                                                                     \
  bool linear_blocks_supported() { return Isa::kBlocks; }                                               \
  bool linear_set_amx(bool enable) { return Isa::set_amx(enable); }                                     \
  bool linear_amx_enabled() { return Isa::amx_enabled(); }                                              \
  }
