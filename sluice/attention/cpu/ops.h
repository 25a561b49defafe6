// The CPU kernels' C++ entry points: each kernel set (see extension.py) defines them all, ops.cpp
// registers them as torch.ops.sluice.<name>, and kernels call each other through them without the
// dispatcher (stack.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace sluice_ops {

// fused.cpp
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor argmax_rows(const at::Tensor& logits);

// linear.cpp
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias);
at::Tensor linear_bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                const c10::optional<at::Tensor>& bias);
// A weight in GGUF blocks (Q4_1, Q8_0; linear_common.h) -> the bf16 packed layout, [N * K]; whether
// this kernel set computes from GGUF blocks.
at::Tensor linear_unpack_blocks(const at::Tensor& packed, int64_t n, int64_t k);
bool linear_blocks_supported();
// Whether the linears run on AMX tiles (CPUs that have them): set (returns the state now) and read.
bool linear_set_amx(bool enable);
bool linear_amx_enabled();

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale);

// stack.cpp
at::Tensor decoder_stack(const at::Tensor& x_in, const at::Tensor& positions, at::TensorList input_norms,
                         at::TensorList qkv, at::TensorList o_proj, at::TensorList post_norms, at::TensorList gate_up,
                         at::TensorList down, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& final_norm, const c10::List<c10::optional<at::Tensor>>& qkv_bias,
                         const c10::List<c10::optional<at::Tensor>>& o_bias,
                         const c10::List<c10::optional<at::Tensor>>& gate_up_bias,
                         const c10::List<c10::optional<at::Tensor>>& down_bias, at::TensorList q_norms,
                         at::TensorList k_norms, int64_t num_heads, int64_t head_dim, int64_t intermediate_size,
                         double eps, double scale);

}  // namespace sluice_ops
