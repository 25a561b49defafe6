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
//   q, k, v     = split(h @ qkv^T + qkv_bias)            q: [T, heads, dim], k, v: [T, kv_heads, dim]
//   q, k        = head_norm(q, q_norm), head_norm(k, k_norm)   (Qwen3: only when given)
//   rotary_(q, k, positions)                            in place
//   x           = paged_attention(q, k, v, caches, ...) @ o^T + o_bias
//   h, residual = rms_norm(x, residual, post_norm)
//   x           = silu_mul(h @ gate_up^T + gate_up_bias) @ down^T + down_bias   (gate_up packed by pack_gate_up)
// then rms_norm(x, residual, final_norm). Each bias list is empty (no such biases) or holds one
// entry per layer, None where that layer has none: Llama's attention_bias / mlp_bias, Qwen2's q/k/v
// biases. q_norms / k_norms are empty or one weight per layer: each head's q and k RMS-normalized
// before the rotary embedding (Qwen3), with the torch ops RMSNorm runs on a [T, heads, dim] view,
// in the same order, so the rounding is the same. Other layer shapes stay on the Python loop
// (sluice/model/compiled_stack.py decides).

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/util/Optional.h>

#include "ops.h"

#include <cstdint>
#include <tuple>

namespace {

using OptionalTensors = c10::List<c10::optional<at::Tensor>>;

c10::optional<at::Tensor> layer_bias(const OptionalTensors& biases, size_t layer) {
  return biases.empty() ? c10::nullopt : biases.get(layer);
}

// RMSNorm._norm of sluice/model/layers.py over the last dim, op for op (float32 math, one rounding
// to the input's dtype, then the weight's product in that dtype).
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  return weight * (xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type());
}

}  // namespace

namespace sluice_ops {

at::Tensor decoder_stack(const at::Tensor& x_in, const at::Tensor& positions, at::TensorList input_norms,
                         at::TensorList qkv, at::TensorList o_proj, at::TensorList post_norms, at::TensorList gate_up,
                         at::TensorList down, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& final_norm, const OptionalTensors& qkv_bias, const OptionalTensors& o_bias,
                         const OptionalTensors& gate_up_bias, const OptionalTensors& down_bias,
                         at::TensorList q_norms, at::TensorList k_norms, int64_t num_heads,
                         int64_t head_dim, int64_t intermediate_size, double eps, double scale) {
  const size_t layers = input_norms.size();
  for (at::TensorList l : {qkv, o_proj, post_norms, gate_up, down, k_caches, v_caches})
    TORCH_CHECK(l.size() == layers, "decoder_stack: one tensor per layer in every list");
  for (const OptionalTensors* l : {&qkv_bias, &o_bias, &gate_up_bias, &down_bias})
    TORCH_CHECK(l->empty() || l->size() == layers, "decoder_stack: a bias list is empty or has one entry per layer");
  TORCH_CHECK(q_norms.size() == k_norms.size() && (q_norms.empty() || q_norms.size() == layers),
              "decoder_stack: q_norms and k_norms are both empty or have one weight per layer");
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
    const at::Tensor y = sluice_ops::linear_bf16(h, qkv[i], q_size + 2 * kv_size, layer_bias(qkv_bias, i));  // [T, q + 2 kv]
    at::Tensor q = y.narrow(1, 0, q_size).view({t, num_heads, head_dim});
    at::Tensor k = y.narrow(1, q_size, kv_size).view({t, kv_heads, head_dim});
    const at::Tensor v = y.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads, head_dim});
    if (!q_norms.empty()) {
      q = head_norm(q, q_norms[i], eps);
      k = head_norm(k, k_norms[i], eps);
    }
    sluice_ops::rotary_(q, k, positions, cos, sin);
    const at::Tensor o = sluice_ops::paged_attention(q, k, v, k_caches[i], v_caches[i], slot_mapping, query_start_loc,
                                                     seq_lens, block_tables, scale);          // [T, heads, dim]
    x = sluice_ops::linear_bf16(o.view({t, q_size}), o_proj[i], hidden, layer_bias(o_bias, i));
    std::tie(h, residual) = sluice_ops::rms_norm(x, residual, post_norms[i], eps);
    const at::Tensor act = sluice_ops::linear_bf16_silu_mul(h, gate_up[i], 2 * intermediate_size, layer_bias(gate_up_bias, i));
    x = sluice_ops::linear_bf16(act, down[i], hidden, layer_bias(down_bias, i));
  }
  return std::get<0>(sluice_ops::rms_norm(x, residual, final_norm, eps));
}

}  // namespace sluice_ops
