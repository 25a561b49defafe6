// Paged attention for x86 CPUs with AVX2 + FMA but no AVX-512 BF16, registered as
// torch.ops.sluice.paged_attention: the op of paged_attention.cpp (same schema, the same split of
// a step into work items and the same KV write, from attention_common.h) with an item runner on
// 8-lane float32 vectors.
//
// Within an item, the rows of one kv head are (query token, query head of the group) pairs; keys
// are consumed in chunks of 32 with an online softmax in float32 (base 2: the queries are
// multiplied by scale * log2 e when loaded). Per chunk and kv head:
//   K: the chunk's 32 key rows transposed in 8x8 blocks (bfloat16 ones as 16-bit values, then
//      widened) into kt, so that one vector holds one head-dim element of 8 keys: a score vector
//      is 8 keys of one row, with no horizontal sums; 3 rows (a GQA group's query heads) x 4 key
//      tiles are 12 independent FMA chains. (Transposing into registers and skipping kt leaves
//      a decode's 3 rows 3-6 chains: latency-bound, measured no faster.)
//   Softmax: per row, lazily rescaled: the row's reference maximum m moves (to the chunk's
//      maximum, with the factor alpha that rescales what the row has accumulated) only when a
//      score exceeds it by more than kSlack = 8, so probabilities stay below 2^8 and most chunks
//      skip the horizontal maximum, the exp2 of the shift and the rescales; then the
//      probabilities (exp2 by polynomial) and the denominator, kept as 8 lane sums until the end.
//      (Against recomputing m every chunk: prefill attention 5-6% faster here, session 30.)
//   V: the chunk's value rows widened to float32 (bfloat16 ones in a permuted dim order, see
//      kVPerm); 3 rows x 4 vectors of the head dim accumulate p_j v_j over the chunk's keys.
// Nothing is rounded to bfloat16 but the output. A row's result does not depend on the item it is
// in or the rows beside it (every row's sums run in the same order), so a decode and the same
// position verified among drafts agree to the bit, as speculative decoding needs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include "attention_common.h"
#include "ops.h"
#include "simd_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if !(defined(__AVX2__) && defined(__FMA__))
#error "sluice's AVX2 paged attention needs AVX2 and FMA"
#endif

namespace {

using sluice_attention::for_block_runs;
using sluice_attention::kMaxHeadDim;
using sluice_attention::kMaxRows;
using sluice_attention::Problem;
using sluice_attention::WorkItem;
using sluice_simd::bf16;
using sluice_simd::for_row_tiles;

constexpr int kChunk = 32;  // keys per online-softmax step: four 8-key score vectors
constexpr int kTiles = kChunk / 8;
static_assert(kTiles == 4, "softmax's unmasked maximum takes four score vectors");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kSlack = 8.0f;  // base-2 headroom of the lazily moved softmax reference (see softmax)

alignas(32) const float kZeroRow[kMaxHeadDim] = {};  // stands in for keys past the chunk's end

inline __m256 load8(const bf16* p) { return sluice_simd::load8_bf16(p); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(bf16* p, __m256 v) { sluice_simd::store8_bf16(p, v); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// Attention of one work item. Rows are grouped by kv head, then token, then query head:
// row r = (kv head kv_begin + r / per_head, token q_begin + (r % per_head) / group, query head
// group * kv head + r % group) with per_head = tokens * group.
template <typename T, int D>
struct ItemRunner {
  static constexpr int kVecs = D / 8;
  // bfloat16 values (and so acc) are held per 16 dims in the order 0-3, 8-11, 4-7, 12-15: the
  // order unpacking 16 of them with zeros gives. acc is put back in order when stored.
  static constexpr bool kVPerm = std::is_same_v<T, bf16>;
  static_assert(D % 32 == 0, "the PV pass takes the head dim 32 elements at a time");

  alignas(32) float q[kMaxRows][D];      // query rows, float32, times scale * log2 e
  alignas(32) float kt[D][kChunk];       // the chunk's keys transposed: kt[d][j] = k_j[d]
  alignas(32) float v[kChunk][D];        // the chunk's values
  alignas(32) float p[kMaxRows][kChunk]; // the chunk's probabilities (0 past a row's horizon)
  alignas(32) float acc[kMaxRows][D];
  alignas(32) float l[kMaxRows][8];  // per row, the denominator as 8 partial sums (one per lane)
  float m[kMaxRows], alpha[kMaxRows];  // m in base-2 score units
  int32_t qpos[kMaxRows];
  int64_t out_offset[kMaxRows];
  const T* kslots[kChunk];  // the chunk's cache slots at head kv_begin
  const T* vslots[kChunk];
  const float score_scale;  // softmax scale * log2(e): scores in base 2
  // The next chunk's K and V rows (one segment per key and cache, K first), prefetched a few
  // lines at a time between this chunk's loads: a burst of hundreds of prefetches at the chunk's
  // start stalls on the line-fill buffers, spread out they overlap the compute.
  const char* pf_seg[2 * kChunk];
  // The prefetch plan and where it stands: load_k and load_v copy it into a local and write it
  // back when done, so that it lives in registers (as members, every tick stored and reloaded
  // them: the kernel's vector stores may alias any member).
  struct PfCursor {
    int next = 0, count = 0, per_tick = 0;
    int64_t off = 0, bytes = 0;
  } pf_cursor;

  explicit ItemRunner(float scale) : score_scale(scale * kLog2e) {}
  static int tile_rows() { return sluice_attention::kTileRows; }  // bound by its products (attention_common.h)

  void run(const Problem& pb, const WorkItem& it, const T* qp, const T* k_cache, const T* v_cache, T* out) {
    const int g = static_cast<int>(pb.group);
    const int per_head = (it.q_end - it.q_begin) * g;
    const int heads = it.kv_end - it.kv_begin;
    const int rows = heads * per_head;
    const int32_t first_token = pb.query_start[it.seq];
    const int32_t context = pb.seq_lens[it.seq] - (pb.query_start[it.seq + 1] - first_token);  // before the chunk
    const __m256 c = _mm256_set1_ps(score_scale);
    for (int r = 0; r < rows; ++r) {
      const int token = it.q_begin + (r % per_head) / g;
      const int64_t head = static_cast<int64_t>(it.kv_begin + r / per_head) * g + r % g;
      const T* src = qp + (first_token + token) * pb.q_stride_t + head * pb.q_stride_h;
      for (int d = 0; d < D; d += 8) _mm256_store_ps(q[r] + d, _mm256_mul_ps(load8(src + d), c));
      out_offset[r] = (first_token + token) * pb.out_stride_t + head * D;
      qpos[r] = context + token;
      m[r] = kNegInf;
      _mm256_store_ps(l[r], _mm256_setzero_ps());
    }
    std::memset(acc, 0, sizeof(float) * D * rows);

    const int32_t* table = pb.block_tables + it.seq * pb.table_width;
    const int32_t num_keys = context + it.q_end;  // the last row's causal horizon
    for (int32_t start = 0; start < num_keys; start += kChunk) {
      const int n = std::min<int32_t>(kChunk, num_keys - start);
      for_block_runs(pb, table, start, n, [&](int j, int run, int64_t slot) {
        for (int i = 0; i < run; ++i) {
          kslots[j + i] = k_cache + (slot + i) * pb.cache_row + it.kv_begin * D;
          vslots[j + i] = v_cache + (slot + i) * pb.cache_row + it.kv_begin * D;
        }
      });
      plan_prefetch(pb, table, start + kChunk, std::min<int32_t>(kChunk, num_keys - start - kChunk), k_cache, v_cache,
                    it.kv_begin, heads, n);
      for (int hh = 0; hh < heads; ++hh) {
        const int r0 = hh * per_head;
        load_k(hh, n);
        // Rows three at a time (a decode's GQA group of 3 query heads in one pass over the
        // chunk), then 2 or 1; every row's sums run in the same order whatever its neighbours.
        for_row_tiles<3>(per_head, [&](int64_t i, auto tile) {
          scores_softmax<decltype(tile)::value>(r0 + static_cast<int>(i), start, n);
        });
        load_v(hh, n);
        for_row_tiles<3>(per_head, [&](int64_t i, auto tile) {
          accumulate<decltype(tile)::value>(r0 + static_cast<int>(i), n);
        });
      }
    }
    for (int r = 0; r < rows; ++r) {
      const __m256 inv = _mm256_set1_ps(1.0f / sluice_simd::hsum(_mm256_load_ps(l[r])));
      if constexpr (kVPerm) {
        for (int d = 0; d < D; d += 16) {
          const __m256 a = _mm256_mul_ps(_mm256_load_ps(acc[r] + d), inv);      // dims 0-3, 8-11
          const __m256 b = _mm256_mul_ps(_mm256_load_ps(acc[r] + d + 8), inv);  // dims 4-7, 12-15
          store8(out + out_offset[r] + d, _mm256_permute2f128_ps(a, b, 0x20));
          store8(out + out_offset[r] + d + 8, _mm256_permute2f128_ps(a, b, 0x31));
        }
      } else {
        for (int d = 0; d < D; d += 8) store8(out + out_offset[r] + d, _mm256_mul_ps(_mm256_load_ps(acc[r] + d), inv));
      }
    }
  }

 private:
  // Sets up the prefetch of keys [start, start + n) (none if n <= 0) over the ticks of a chunk of
  // `cur` keys: one per 8x8 block of K and one per key of V, for every kv head.
  void plan_prefetch(const Problem& pb, const int32_t* table, int32_t start, int n, const T* k_cache,
                     const T* v_cache, int kv_begin, int heads, int cur) {
    pf_cursor = {};
    if (n <= 0) return;
    for_block_runs(pb, table, start, n, [&](int j, int run, int64_t slot) {
      for (int i = 0; i < run; ++i) {
        pf_seg[j + i] = reinterpret_cast<const char*>(k_cache + (slot + i) * pb.cache_row + kv_begin * D);
        pf_seg[n + j + i] = reinterpret_cast<const char*>(v_cache + (slot + i) * pb.cache_row + kv_begin * D);
      }
    });
    PfCursor& c = pf_cursor;
    c.count = 2 * n;
    c.bytes = static_cast<int64_t>(heads) * D * sizeof(T);
    const int64_t lines = c.count * ((c.bytes + 63) / 64);
    const int64_t ticks = static_cast<int64_t>(heads) * (kTiles * (D / 8) + cur);
    c.per_tick = static_cast<int>((lines + ticks - 1) / ticks);
  }

  inline void prefetch_tick(PfCursor& c) const {
    for (int i = 0; i < c.per_tick && c.next < c.count; ++i) {
      _mm_prefetch(pf_seg[c.next] + c.off, _MM_HINT_T0);
      c.off += 64;
      if (c.off >= c.bytes) {
        c.off = 0;
        ++c.next;
      }
    }
  }

  // kt from the first n keys of the chunk at kv head kv_begin + hh (zeros past n).
  void load_k(int hh, int n) {
    PfCursor pf = pf_cursor;
    for (int t = 0; t < kTiles; ++t) {
      const T* src[8];
      for (int j = 0; j < 8; ++j) {
        const int key = 8 * t + j;
        src[j] = key < n ? kslots[key] + hh * D : reinterpret_cast<const T*>(kZeroRow);
      }
      if constexpr (std::is_same_v<T, bf16>) {
        load_k_tile_bf16(src, t, pf);
      } else {
        for (int d = 0; d < D; d += 8) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j) r[j] = load8(src[j] + d);
          sluice_simd::transpose8x8(r);
          for (int i = 0; i < 8; ++i) _mm256_store_ps(kt[d + i] + 8 * t, r[i]);
          prefetch_tick(pf);
        }
      }
    }
    pf_cursor = pf;
  }

  // kt's columns [8t, 8t + 8) from 8 bfloat16 key rows: transposed as 16-bit values, widened last.
  // Per 8 dims: key j's and key j + 4's 8 values share a vector (lanes 0 and 1); two rounds of
  // 16- and 32-bit unpacks leave, per 128-bit lane, dims d and d + 1 of 4 keys; unpacking those
  // with zeros puts each bf16 in the top half of a float32 lane: dim d of keys 0-7 in order. 20
  // shuffles per 8x8 block where widening first and transposing float32 takes 40.
  inline void load_k_tile_bf16(const T* const (&src)[8], int t, PfCursor& pf) {
    const __m256i zero = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int d = 0; d < D; d += 8) {
      __m256i y[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        y[j] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(src[j + 4] + d),
                                   reinterpret_cast<const __m128i*>(src[j] + d));
      const __m256i a01l = _mm256_unpacklo_epi16(y[0], y[1]), a01h = _mm256_unpackhi_epi16(y[0], y[1]);
      const __m256i a23l = _mm256_unpacklo_epi16(y[2], y[3]), a23h = _mm256_unpackhi_epi16(y[2], y[3]);
      const __m256i b[4] = {_mm256_unpacklo_epi32(a01l, a23l), _mm256_unpackhi_epi32(a01l, a23l),
                            _mm256_unpacklo_epi32(a01h, a23h), _mm256_unpackhi_epi32(a01h, a23h)};
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        _mm256_store_ps(kt[d + 2 * i] + 8 * t, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, b[i])));
        _mm256_store_ps(kt[d + 2 * i + 1] + 8 * t, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, b[i])));
      }
      prefetch_tick(pf);
    }
  }

  // v from the chunk's first n keys. bfloat16 values are widened 16 at a time by unpacking with
  // zeros, which leaves them in kVPerm order (see below).
  void load_v(int hh, int n) {
    PfCursor pf = pf_cursor;
    for (int j = 0; j < n; ++j) {
      const T* src = vslots[j] + hh * D;
      if constexpr (kVPerm) {
        const __m256i zero = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int d = 0; d < D; d += 16) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
          _mm256_store_ps(v[j] + d, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)));
          _mm256_store_ps(v[j] + d + 8, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)));
        }
      } else {
        for (int d = 0; d < D; d += 8) _mm256_store_ps(v[j] + d, load8(src + d));
      }
      prefetch_tick(pf);
    }
    pf_cursor = pf;
  }

  // Scores of rows [rb, rb + N) against the chunk's keys [start, start + n) and their online
  // softmax step: new maxima m, rescale factors alpha, denominators l, probabilities p.
  template <int N>
  void scores_softmax(int rb, int32_t start, int n) {
    // The sums in a local array that nothing else sees, copied out after the loop: an array whose
    // address reaches softmax() stays in memory (__m256 may alias float), and GCC then stored all
    // eight accumulators to the stack after every d (~2x slower prefill and verification).
    __m256 s[N][kTiles];
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i)
#pragma GCC unroll 8
      for (int t = 0; t < kTiles; ++t) s[i][t] = _mm256_setzero_ps();
    // Per d: the N rows' query elements broadcast once, then one key tile at a time against them
    // (N x 4 sums + N broadcasts + 1 key vector: 16 registers at N = 3, a GQA group's heads).
#pragma GCC unroll 4
    for (int d = 0; d < D; ++d) {
      __m256 qv[N];
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) qv[i] = _mm256_broadcast_ss(q[rb + i] + d);
#pragma GCC unroll 8
      for (int t = 0; t < kTiles; ++t) {
        const __m256 k = _mm256_load_ps(kt[d] + 8 * t);
#pragma GCC unroll 8
        for (int i = 0; i < N; ++i) s[i][t] = _mm256_fmadd_ps(k, qv[i], s[i][t]);
      }
    }
    __m256 a[N][kTiles];
    for (int i = 0; i < N; ++i)
      for (int t = 0; t < kTiles; ++t) a[i][t] = s[i][t];
    softmax<N>(rb, start, n, a);
  }

  // The online softmax step of rows [rb, rb + N) given their scores a against the chunk's keys
  // [start, start + n) (lanes past n or past a row's horizon are ignored).
  template <int N>
  void softmax(int rb, int32_t start, int n, __m256 (&a)[N][kTiles]) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < N; ++i) {
      const int r = rb + i;
      const int valid = std::min(n, qpos[r] - start + 1);  // keys this row sees (may be <= 0)
      if (valid <= 0) {  // the whole chunk is in this row's future
        alpha[r] = 1.0f;
        std::memset(p[r], 0, sizeof(p[r]));
        continue;
      }
      __m256 mx;
      if (valid < kChunk) {  // keys past n or past the row's horizon score -inf
        mx = _mm256_set1_ps(kNegInf);
        for (int t = 0; t < kTiles; ++t) {
          const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * t));
          const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), idx));
          a[i][t] = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), a[i][t], keep);
          mx = _mm256_max_ps(mx, a[i][t]);
        }
      } else {
        mx = _mm256_max_ps(_mm256_max_ps(a[i][0], a[i][1]), _mm256_max_ps(a[i][2], a[i][3]));
      }
      // Lazy rescaling: the reference m moves only when a score exceeds it by more than kSlack
      // (base 2), so probabilities stay below 2^kSlack, far from float32's range, and most
      // chunks need no horizontal maximum, no exp2 of the shift and no rescale of acc and l.
      // The first chunk's m is -inf: every score exceeds it, alpha is 0 and scales zeros.
      if (_mm256_movemask_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(m[r] + kSlack), _CMP_GT_OQ))) {
        const float m_new = sluice_simd::hmax(mx);
        alpha[r] = std::exp2(m[r] - m_new);
        m[r] = m_new;
      } else {
        alpha[r] = 1.0f;
      }
      const __m256 mv = _mm256_set1_ps(m[r]);
      __m256 sum = _mm256_setzero_ps();
      for (int t = 0; t < kTiles; ++t) {
        const __m256 e = sluice_simd::exp2_ps(_mm256_sub_ps(a[i][t], mv));  // -inf (masked) -> 0
        _mm256_store_ps(p[r] + 8 * t, e);
        sum = _mm256_add_ps(sum, e);
      }
      __m256 lv = _mm256_load_ps(l[r]);
      if (alpha[r] != 1.0f) lv = _mm256_mul_ps(lv, _mm256_set1_ps(alpha[r]));
      _mm256_store_ps(l[r], _mm256_add_ps(lv, sum));
    }
  }

  // acc[r] = acc[r] * alpha[r] + sum over the chunk's first n keys of p[r][j] v_j, r in [rb, rb + N).
  template <int N>
  void accumulate(int rb, int n) {
    for (int d0 = 0; d0 < D; d0 += 32) {
      __m256 a[N][4];
      for (int i = 0; i < N; ++i) {
        const __m256 s = _mm256_set1_ps(alpha[rb + i]);
        for (int c = 0; c < 4; ++c) a[i][c] = _mm256_mul_ps(_mm256_load_ps(acc[rb + i] + d0 + 8 * c), s);
      }
      // Unrolled as the scores loop is: rolled, this loop ran the same FMAs ~30% slower than that
      // one in a prefill (perf annotate).
#pragma GCC unroll 4
      for (int j = 0; j < n; ++j) {
        // As in scores_softmax: N broadcasts, then one value vector at a time.
        __m256 pj[N];
        for (int i = 0; i < N; ++i) pj[i] = _mm256_broadcast_ss(p[rb + i] + j);
        for (int c = 0; c < 4; ++c) {
          __m256 vv = _mm256_load_ps(v[j] + d0 + 8 * c);
          // Keeps vv in its register: GCC otherwise folds the load into each row's FMA, three
          // loads of one vector, and the loop then waits on the load ports (PV took 40% of a
          // prefill's attention against the scores' 30% for the same FMAs).
          asm("" : "+x"(vv));
          for (int i = 0; i < N; ++i) a[i][c] = _mm256_fmadd_ps(pj[i], vv, a[i][c]);
        }
      }
      for (int i = 0; i < N; ++i)
        for (int c = 0; c < 4; ++c) _mm256_store_ps(acc[rb + i] + d0 + 8 * c, a[i][c]);
    }
  }
};

}  // namespace

SLUICE_DEFINE_PAGED_ATTENTION(ItemRunner)
