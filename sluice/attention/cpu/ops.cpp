// Registers the CPU kernels' ops, torch.ops.sluice.<name>, for whichever kernel set is built
// with this file (see extension.py); ops.h declares them, the set's files define them.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(sluice, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, float scale) -> Tensor",
      &sluice_ops::paged_attention);
  m.def("linear_bf16(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &sluice_ops::linear_bf16);
  m.def("linear_bf16_silu_mul(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &sluice_ops::linear_bf16_silu_mul);
  m.def("linear_unpack_blocks(Tensor packed, int n, int k) -> Tensor", &sluice_ops::linear_unpack_blocks);
  m.def("linear_blocks_supported() -> bool", &sluice_ops::linear_blocks_supported);
  m.def("linear_set_amx(bool enable) -> bool", &sluice_ops::linear_set_amx);
  m.def("linear_amx_enabled() -> bool", &sluice_ops::linear_amx_enabled);
  m.def("argmax_rows(Tensor logits) -> Tensor", &sluice_ops::argmax_rows);
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)", &sluice_ops::rms_norm);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()", &sluice_ops::rotary_);
  m.def(
      "decoder_stack(Tensor x, Tensor positions, Tensor[] input_norms, Tensor[] qkv, Tensor[] o_proj, "
      "Tensor[] post_norms, Tensor[] gate_up, Tensor[] down, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, Tensor cos, Tensor sin, "
      "Tensor final_norm, Tensor?[] qkv_bias, Tensor?[] o_bias, Tensor?[] gate_up_bias, Tensor?[] down_bias, "
      "Tensor[] q_norms, Tensor[] k_norms, int num_heads, int head_dim, int intermediate_size, float eps, float scale) -> Tensor",
      &sluice_ops::decoder_stack);
}
