// The ISA-neutral half of the paged-attention kernels (paged_attention.cpp for AVX-512 BF16,
// paged_attention_avx2.cpp for AVX2 + FMA): the problem and work-item description, the split of a
// step into work items, the KV write, the input checks and the entry point. Each kernel file
// provides an item runner, `Runner<T, D>`: constructed with the softmax scale, `run(pb, item, q,
// k_cache, v_cache, out)` writes the attention output of one work item.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "simd_common.h"

namespace sluice_attention {

using sluice_simd::bf16;

// Query rows (token x head) per work item: a prompt chunk is split into tiles of kTileRows, or,
// where a kernel's runner asks for larger ones (Runner::tile_rows(): AMX), of up to kMaxRows as
// long as the step still has about four items per thread. Each item loads and rearranges its
// sequence's K/V anew, which larger tiles do less often: on AMX that rearranging was ~20% of a
// prompt's attention (session 45: 512 tokens after 1,024, 2,018 -> 1,600-1,675 us a layer); the vector
// kernels are bound by their products and gain nothing. A row's result does not depend on its
// item's size. Short queries (decodes, verifications) of up to kTileRows rows cover all kv heads.
constexpr int kMaxRows = 384;
constexpr int kTileRows = 96;
constexpr int kMaxHeadDim = 128;
// Below this much work per thread (query rows x keys; 4-8 ns each on one thread) a step runs on
// fewer threads: waking a thread costs more than it saves, and far more when the cores are
// oversubscribed. Session 46 (AMX host, 2 threads): 16,384 kept decodes of up to ~8 sequences at
// 256 tokens (b=8: 150 us a layer, 70 at 4,096) or one at 2,048 (138 -> 98 us) on one thread, the
// decode step at b=8, 256 tokens 17.7 -> 15.3 ms; one decode at 256 tokens (2,304) stays on one.
constexpr int64_t kMinCostPerThread = 4096;

struct Problem {
  int64_t num_heads, num_kv_heads, group, block_size_log2;
  int64_t q_stride_t, q_stride_h, out_stride_t;  // element strides
  int64_t cache_row;                             // elements per cache slot: num_kv_heads * head_dim
  int64_t table_width;
  const int32_t* query_start;
  const int32_t* seq_lens;
  const int32_t* block_tables;
};

struct WorkItem {
  int32_t seq;
  int32_t kv_begin, kv_end;  // kv heads [kv_begin, kv_end)
  int32_t q_begin, q_end;    // query tokens [q_begin, q_end) of the sequence's chunk
  int64_t cost;              // query rows x keys
};

// Calls f(j, run, slot) for the runs of keys [start, start + n) that share a block.
template <typename F>
inline void for_block_runs(const Problem& pb, const int32_t* table, int32_t start, int n, F&& f) {
  const int32_t block_size = 1 << pb.block_size_log2;
  for (int j = 0; j < n;) {
    const int32_t pos = start + j;
    const int32_t offset = pos & (block_size - 1);
    const int run = std::min(n - j, block_size - offset);
    f(j, run, (static_cast<int64_t>(table[pos >> pb.block_size_log2]) << pb.block_size_log2) + offset);
    j += run;
  }
}

struct Plan {
  std::vector<WorkItem> items;  // most expensive first
  int threads;
};

// Threads from the step's total work (see kMinCostPerThread), then items of the two shapes
// described at the top of paged_attention.cpp; decodes cover all kv heads unless that leaves threads idle.
inline Plan plan_work(const Problem& pb, int64_t num_seqs, int max_threads, int max_tile_rows = kTileRows) {
  int64_t total = 0, whole = 0, all_rows = 0, whole_rows = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int64_t rows = (pb.query_start[i + 1] - pb.query_start[i]) * pb.num_heads;
    total += rows * pb.seq_lens[i];
    all_rows += rows;
    if (rows <= kTileRows) {
      ++whole;
      whole_rows += rows;
    }
  }
  Plan plan;
  plan.threads = static_cast<int>(std::clamp<int64_t>(total / kMinCostPerThread, 1, max_threads));
  const bool group_heads = plan.threads == 1 || whole >= 2 * plan.threads;
  const int32_t kv_heads = static_cast<int32_t>(pb.num_kv_heads);
  // Query tokens per tile of a split sequence: kTileRows' worth, or more (up to max_tile_rows)
  // while the split rows still make about four items per thread.
  const int64_t split_rows = group_heads ? all_rows - whole_rows : all_rows;
  const int64_t wanted = (split_rows + 4 * plan.threads - 1) / (4 * plan.threads);
  const int64_t tile_rows = std::clamp<int64_t>(wanted, kTileRows, std::min(max_tile_rows, kMaxRows));
  const int32_t tile = static_cast<int32_t>(std::max<int64_t>(1, tile_rows / pb.group));
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int32_t qlen = pb.query_start[i + 1] - pb.query_start[i];
    const int32_t context = pb.seq_lens[i] - qlen;
    if (group_heads && qlen * pb.num_heads <= kTileRows) {
      plan.items.push_back({i, 0, kv_heads, 0, qlen, static_cast<int64_t>(qlen) * pb.num_heads * (context + qlen)});
      continue;
    }
    for (int32_t b = 0; b < qlen; b += tile) {
      const int32_t e = std::min(qlen, b + tile);
      for (int32_t h = 0; h < kv_heads; ++h)
        plan.items.push_back({i, h, h + 1, b, e, static_cast<int64_t>(e - b) * pb.group * (context + e)});
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  plan.threads = std::min<int>(plan.threads, static_cast<int>(plan.items.size()));
  return plan;
}

template <template <typename, int> class Runner, typename T, int D>
void run_attention(const Problem& pb, int64_t num_seqs, const T* q, const T* k_cache, const T* v_cache, T* out,
                   float scale) {
  const Plan plan = plan_work(pb, num_seqs, at::get_num_threads(), Runner<T, D>::tile_rows());
  std::atomic<size_t> next{0};
  auto work = [&](int64_t, int64_t) {
    // Each thread keeps its runner (~0.3-0.5 MB of buffers, sized for kMaxRows) between calls rather than allocating and
    // faulting it in anew on every layer's call; the scale only changes between models.
    static thread_local std::unique_ptr<Runner<T, D>> runner;
    static thread_local float runner_scale = 0.0f;
    if (!runner || runner_scale != scale) {
      runner = std::make_unique<Runner<T, D>>(scale);
      runner_scale = scale;
    }
    for (size_t i = next.fetch_add(1); i < plan.items.size(); i = next.fetch_add(1))
      runner->run(pb, plan.items[i], q, k_cache, v_cache, out);
  };
  if (plan.threads <= 1) work(0, 1);
  else at::parallel_for(0, plan.threads, 1, work);
}

template <typename T>
void write_kv(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, int64_t num_tokens) {
  const int64_t kv_heads = cache.size(2), dim = cache.size(3);
  const T* src = x.data_ptr<T>();
  T* dst = cache.data_ptr<T>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(dst + (slots[t] * kv_heads + h) * dim, src + t * st + h * sh, dim * sizeof(T));
  });
}

inline void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                  const at::Tensor& seq_lens, const at::Tensor& block_tables) {
  for (const at::Tensor* t : {&q, &k, &v, &k_cache, &v_cache, &slot_mapping, &query_start_loc, &seq_lens, &block_tables})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_attention supports float32 and bfloat16 caches");
  for (const at::Tensor* t : {&q, &k, &v, &v_cache})
    TORCH_CHECK(t->scalar_type() == dtype, "q, k, v and the caches must share one dtype");
  const int64_t d = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(d == 64 || d == 128, "paged_attention supports head_dim 64 and 128");
  TORCH_CHECK(k_cache.size(3) == d && k.size(2) == d && v.size(2) == d, "head_dim mismatch");
  TORCH_CHECK(k.size(1) == kv_heads && v.size(1) == kv_heads, "k/v heads must match the cache");
  TORCH_CHECK(q.size(1) % kv_heads == 0 && q.size(1) / kv_heads <= kMaxRows, "unsupported query/kv head ratio");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && slot_mapping.numel() == q.size(0), "token count mismatch");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v need a contiguous head_dim");
  const int64_t bs = k_cache.size(1);
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "block_size must be a power of two");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata index tensors must be contiguous int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.numel() &&
                  query_start_loc.numel() == seq_lens.numel() + 1, "metadata shape mismatch");
}

// Out-of-range indices would read or write outside the caches; refuse them up front.
inline void check_indices(const Problem& pb, int64_t num_seqs, int64_t num_tokens, const int64_t* slots, int64_t num_blocks) {
  const int64_t num_slots = num_blocks << pb.block_size_log2;
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping entry out of range");
  TORCH_CHECK(pb.query_start[0] == 0 && pb.query_start[num_seqs] == num_tokens, "query_start_loc must span all tokens");
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t qlen = pb.query_start[i + 1] - pb.query_start[i], len = pb.seq_lens[i];
    TORCH_CHECK(qlen >= 1 && len >= qlen, "each sequence needs 1 <= query_len <= seq_len");
    const int64_t blocks = (len + (1 << pb.block_size_log2) - 1) >> pb.block_size_log2;
    TORCH_CHECK(blocks <= pb.table_width, "block table too narrow for seq_len");
    for (int64_t j = 0; j < blocks; ++j) {
      const int32_t blk = pb.block_tables[i * pb.table_width + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block table entry out of range");
    }
  }
}

template <template <typename, int> class Runner>
at::Tensor paged_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale) {
  check_inputs(q, k, v, k_cache, v_cache, slot_mapping, query_start_loc, seq_lens, block_tables);
  const int64_t num_tokens = q.size(0), num_seqs = seq_lens.numel(), d = q.size(2);
  Problem pb;
  pb.num_heads = q.size(1);
  pb.num_kv_heads = k_cache.size(2);
  pb.group = pb.num_heads / pb.num_kv_heads;
  pb.block_size_log2 = __builtin_ctzll(static_cast<uint64_t>(k_cache.size(1)));
  pb.q_stride_t = q.stride(0);
  pb.q_stride_h = q.stride(1);
  pb.out_stride_t = pb.num_heads * d;
  pb.cache_row = pb.num_kv_heads * d;
  pb.table_width = block_tables.size(1);
  pb.query_start = query_start_loc.data_ptr<int32_t>();
  pb.seq_lens = seq_lens.data_ptr<int32_t>();
  pb.block_tables = block_tables.data_ptr<int32_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  check_indices(pb, num_seqs, num_tokens, slots, k_cache.size(0));

  at::Tensor out = at::empty({num_tokens, pb.num_heads, d}, q.options());
  if (num_tokens == 0) return out;
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16) {
    write_kv<c10::BFloat16>(k, k_cache, slots, num_tokens);
    write_kv<c10::BFloat16>(v, v_cache, slots, num_tokens);
    auto ptr = [](const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<c10::BFloat16>()); };
    if (d == 64) run_attention<Runner, bf16, 64>(pb, num_seqs, ptr(q), ptr(k_cache), ptr(v_cache), ptr(out), s);
    else run_attention<Runner, bf16, 128>(pb, num_seqs, ptr(q), ptr(k_cache), ptr(v_cache), ptr(out), s);
  } else {
    write_kv<float>(k, k_cache, slots, num_tokens);
    write_kv<float>(v, v_cache, slots, num_tokens);
    auto ptr = [](const at::Tensor& t) { return t.data_ptr<float>(); };
    if (d == 64) run_attention<Runner, float, 64>(pb, num_seqs, ptr(q), ptr(k_cache), ptr(v_cache), ptr(out), s);
    else run_attention<Runner, float, 128>(pb, num_seqs, ptr(q), ptr(k_cache), ptr(v_cache), ptr(out), s);
  }
  return out;
}

}  // namespace sluice_attention

// Defines the op's entry point (ops.h) on a kernel file's item runner; used once per kernel set.
#define SLUICE_DEFINE_PAGED_ATTENTION(Runner)                                                                     \
  namespace sluice_ops {                                                                                          \
  at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,   \
                             at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, \
                             const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale) {          \
    return sluice_attention::paged_attention_impl<Runner>(q, k, v, std::move(k_cache), std::move(v_cache),       \
                                                          slot_mapping, query_start_loc, seq_lens, block_tables,  \
                                                          scale);                                                 \
  }                                                                                                               \
  }
