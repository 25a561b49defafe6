// The CPU kernels' C++ entry points, for kernels that call each other without going through the
// dispatcher (stack.cpp). Each is also registered as torch.ops.sluice.<name>; see its file.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace sluice_ops {

// fused.cpp
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);

// linear.cpp
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias);
at::Tensor linear_bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                const c10::optional<at::Tensor>& bias);

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale);

}  // namespace sluice_ops
