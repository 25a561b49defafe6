// A Llama decoder stack in one call, registered as torch.ops.sluice.decoder_stack.
//
// Runs what LlamaForCausalLM.forward runs on the CPU kernels (sluice/model/llama.py with
// `use_cpu_kernels`), layer after layer, calling the same kernels in the same order on the same
// tensors, so its output is bit-identical to that Python loop. What it removes is the loop's
// own cost: ~10 Python module calls and ~8 dispatcher round trips per layer, ~4-6 ms per step of
// SmolLM2's 30 layers whatever the batch (docs/benchmarks.md, "The decoder stack in C++").
//
// Per layer (x: [T, hidden] bf16; the first layer's residual is its input):
//   h, residual = rms_norm(x, residual, input_norm)
//   q, k, v     = split(h @ qkv^T)                       q: [T, heads, dim], k, v: [T, kv_heads, dim]
//   rotary_(q, k, positions)                            in place
//   x           = paged_attention(q, k, v, caches, ...) @ o^T
//   h, residual = rms_norm(x, residual, post_norm)
//   x           = silu_mul(h @ gate_up^T) @ down^T      (gate_up packed by pack_gate_up)
// then rms_norm(x, residual, final_norm). No biases, no q/k norms: other layer shapes stay on the
// Python loop (sluice/model/compiled_stack.py decides).

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "ops.h"

#include <cstdint>
#include <tuple>

namespace {

at::Tensor decoder_stack(const at::Tensor& x_in, const at::Tensor& positions, at::TensorList input_norms,
                         at::TensorList qkv, at::TensorList o_proj, at::TensorList post_norms, at::TensorList gate_up,
                         at::TensorList down, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& final_norm, int64_t num_heads, int64_t head_dim, int64_t intermediate_size,
                         double eps, double scale) {
  const size_t layers = input_norms.size();
  for (at::TensorList l : {qkv, o_proj, post_norms, gate_up, down, k_caches, v_caches})
    TORCH_CHECK(l.size() == layers, "decoder_stack: one tensor per layer in every list");
  TORCH_CHECK(layers > 0 && x_in.dim() == 2, "decoder_stack: x must be [T, hidden]");
  const int64_t t = x_in.size(0), hidden = x_in.size(1);
  const int64_t kv_heads = k_caches[0].size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
  at::Tensor x = x_in, residual;
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor h;
    if (residual.defined()) {
      std::tie(h, residual) = sluice_ops::rms_norm(x, residual, input_norms[i], eps);
    } else {
      h = std::get<0>(sluice_ops::rms_norm(x, c10::nullopt, input_norms[i], eps));
      residual = x;
    }
    const at::Tensor y = sluice_ops::linear_bf16(h, qkv[i], q_size + 2 * kv_size, c10::nullopt);  // [T, q + 2 kv]
    at::Tensor q = y.narrow(1, 0, q_size).view({t, num_heads, head_dim});
    at::Tensor k = y.narrow(1, q_size, kv_size).view({t, kv_heads, head_dim});
    const at::Tensor v = y.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads, head_dim});
    sluice_ops::rotary_(q, k, positions, cos, sin);
    const at::Tensor o = sluice_ops::paged_attention(q, k, v, k_caches[i], v_caches[i], slot_mapping, query_start_loc,
                                                     seq_lens, block_tables, scale);          // [T, heads, dim]
    x = sluice_ops::linear_bf16(o.view({t, q_size}), o_proj[i], hidden, c10::nullopt);
    std::tie(h, residual) = sluice_ops::rms_norm(x, residual, post_norms[i], eps);
    const at::Tensor act = sluice_ops::linear_bf16_silu_mul(h, gate_up[i], 2 * intermediate_size, c10::nullopt);
    x = sluice_ops::linear_bf16(act, down[i], hidden, c10::nullopt);
  }
  return std::get<0>(sluice_ops::rms_norm(x, residual, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def(
      "decoder_stack(Tensor x, Tensor positions, Tensor[] input_norms, Tensor[] qkv, Tensor[] o_proj, "
      "Tensor[] post_norms, Tensor[] gate_up, Tensor[] down, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, Tensor cos, Tensor sin, "
      "Tensor final_norm, int num_heads, int head_dim, int intermediate_size, float eps, float scale) -> Tensor",
      &decoder_stack);
}
