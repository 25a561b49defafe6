// Paged attention for x86 CPUs with AVX-512 (F, BW, VL, BF16), registered as
// torch.ops.sluice.paged_attention.
//
// One call per layer: writes the step's new K/V into the paged cache through slot_mapping, then
// attends every query token of the flattened batch (decodes and prefill chunks alike) to its
// sequence's context, reading K/V rows in place through the block table.
//
// Work is split into items, run largest first by the threads pulling from an atomic counter:
//   - a short query (a decode) covers all kv heads of its sequence, when there are enough such
//     sequences to keep the threads busy: it then reads whole cache rows, in address order;
//   - otherwise (sequence, kv head, tile of query tokens: 96 / group, larger on AMX; attention_common.h).
// While an item computes one 64-key chunk, the next chunk's K/V lines are prefetched into L2, a
// few per iteration of the compute loops (otherwise a decode waits on memory: a blocking read
// sweep per chunk took ~40% of a verification's time).
// Within an item, the rows of one kv head are (query token, query head of the group) pairs, so
// each K/V row is loaded and rearranged once per group. Keys are consumed in chunks of 64 with an
// online softmax in float32 (base 2: scores are multiplied by scale * log2 e). Per chunk:
//   K: four 16-key tiles transposed so one vector holds a head-dim slice of 16 keys; a score
//      vector is 16 keys of one row, with no horizontal sums.
//   Scores and softmax: blocks of 4 rows, their 16 score vectors kept in registers; the 4 rows'
//      maxima come from one shared shuffle tree, the softmax denominators are summed lane-wise
//      (reduced once, at the end), and exp2 runs without range clamps (arguments are <= 0; keys
//      a row may not see are zeroed by the final scale's mask).
//   V: bfloat16 rows of adjacent keys interleaved into (key j, key j+1) pairs so `vdpbf16ps`
//      accumulates p_j v_j + p_j+1 v_j+1 (this permutes the head dim inside the accumulator,
//      undone on output); float32 V rows are used in place with plain FMAs.
// bfloat16 QK^T and PV use `vdpbf16ps` (bf16 products, float32 sums; the probabilities are
// rounded to bf16 for PV, as torch's CPU flash attention does); float32 runs in float32 FMAs.
//
// On CPUs with AMX (amx.h) the bfloat16 products run on tiles instead, for every row of every
// item (so a row's bits do not depend on the item it falls in): the transposed K tiles above are
// B tiles as they stand (16 d pairs x 16 keys), query rows A tiles, and a kv head's scores for 16
// rows at a time land in a float32 buffer the softmax reads; for PV the probabilities (bf16 key
// pairs) are A tiles and the interleaved V rows B tiles (16 key pairs x 16 dims), and the chunk's
// products are added to the rescaled accumulators after. Rows past a kv head's last are computed
// on whatever the buffers hold there and dropped.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include "amx.h"
#include "attention_common.h"
#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__))
#error "sluice's CPU paged attention needs AVX-512 F, BW, VL and BF16"
#endif

namespace {

constexpr int kChunk = 64;     // keys per online-softmax step: four 16-key score vectors
constexpr int kTiles = kChunk / 16;
static_assert(kTiles == 4, "scores_softmax combines exactly four score tiles per row");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using sluice_simd::bf16;
using sluice_attention::for_block_runs;
using sluice_attention::kMaxHeadDim;
using sluice_attention::kMaxRows;
using sluice_attention::Problem;
using sluice_attention::WorkItem;

alignas(64) const float kZeroRow[kMaxHeadDim] = {};  // stands in for keys past the chunk's end

// 2^x for x <= 0 (or -inf / NaN in lanes outside `keep`, which come out 0): simd.h's exp2_ps
// without its clamps, with a polynomial of degree kDegree (sluice_simd::exp2_fraction).
template <int kDegree>
inline __m512 exp2_nonpositive(__m512 x, __mmask16 keep) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_maskz_scalef_ps(keep, sluice_simd::exp2_fraction<kDegree>(_mm512_sub_ps(x, n)), n);
}

// The maxima of four vectors: lanes 4i .. 4i + 3 of the result all hold max(v[i]).
inline __m512 max4x16(const __m512 v[4]) {
  const __m512 ab = _mm512_max_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 cd = _mm512_max_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  // 128-bit lane i now holds four partial maxima of v[i]
  __m512 x = _mm512_max_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
  return _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
}


// In-place transpose of a 16x16 matrix of 32-bit elements held as 16 row vectors.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + c], 128-bit lane L: element 4L + c of rows 4g .. 4g + 3.
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g + 0] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  // Column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Calls f.template operator()<N>() for the runtime n in [1, kMax].
template <int kMax, typename F>
inline void dispatch_rows(int n, F&& f) {
  if constexpr (kMax >= 1) {
    if (n == kMax) {
      f.template operator()<kMax>();
    } else {
      dispatch_rows<kMax - 1>(n, f);
    }
  }
}

// Applies block<N>(first_row) over rows [begin, end) in blocks of kBlock rows.
template <int kBlock, typename F>
inline void for_row_blocks(int begin, int end, F&& block) {
  int r = begin;
  for (; r + kBlock <= end; r += kBlock) block.template operator()<kBlock>(r);
  if (r < end) {
    dispatch_rows<kBlock - 1>(end - r, [&]<int N>() { block.template operator()<N>(r); });
  }
}

// Per-dtype pieces of the chunk loop. Each provides:
//   Q/KT/P buffers, load_q, load_k, scores, store_p, load_v, accumulate, store_out.
template <typename T, int D>
struct Ops;

// bfloat16 cache, queries and output.
template <int D>
struct Ops<bf16, D> {
  static constexpr int kPairs = D / 2;    // (d, d+1) pairs per row: the dwords of a bf16 row
  static constexpr int kVecs = D / 16;    // float32 vectors per accumulator row
  static constexpr int kPvRows = 24 / kVecs;

  static constexpr int kExpDegree = 5;   // the probabilities are rounded to bf16 anyway

  // +16 rows: an AMX tile load of 16 rows may start at any row below kMaxRows.
  struct Buffers {
    alignas(64) uint32_t q[kMaxRows + 16][kPairs];        // query rows as bf16 pairs
    alignas(64) __m512i kt[kTiles][kPairs];               // [key tile][d pair]: that pair of 16 keys
    alignas(64) __m512i vp[kChunk / 2][kVecs];            // [key pair][vector]: interleaved V rows
    alignas(64) uint32_t p[kMaxRows + 16][kChunk / 2];    // probabilities as bf16 (key j, key j+1) pairs
    alignas(64) float s[kMaxRows + 16][kChunk];           // AMX: scores of the chunk
    alignas(64) float pv[16][D];                          // AMX: a row tile's P V of the chunk
  };

  static void load_q(Buffers& b, int r, const bf16* src) { std::memcpy(b.q[r], src, D * sizeof(bf16)); }

  static void load_k(Buffers& b, const bf16* const* rows) {
    for (int tile = 0; tile < kTiles; ++tile) {
      for (int h = 0; h < D / 32; ++h) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[16 * tile + j] + 32 * h);
        transpose16x16(r);
        for (int j = 0; j < 16; ++j) b.kt[tile][16 * h + j] = r[j];
      }
    }
  }

  // acc[i][t] = q_(r0+i) . k_j for the 16 keys of tile t (N <= 4 rows: up to 16 independent chains).
  static constexpr int kScoreSteps = kPairs;  // calls of `tick` per scores()

  template <int N, typename Tick>
  static void scores(const Buffers& b, int r0, __m512 (&acc)[N][kTiles], Tick&& tick) {
    for (int i = 0; i < N; ++i)
      for (int t = 0; t < kTiles; ++t) acc[i][t] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int p = 0; p < kPairs; ++p) {
      tick();
      __m512i k[kTiles];
      for (int t = 0; t < kTiles; ++t) k[t] = b.kt[t][p];
      for (int i = 0; i < N; ++i) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(b.q[r0 + i][p]);
        for (int t = 0; t < kTiles; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], (__m512bh)k[t], qv);
      }
    }
  }

#if SLUICE_HAVE_AMX
  // A prefetch tick after each tile product (the tiles run while the prefetches issue).
  static constexpr int kAmxScoreTicks = D / 32 * 4;                   // per row tile
  static constexpr int kAmxPvTicks = kVecs / 4 * (kChunk / 32) * 4;   // per row tile

  // s[r][key] for rows [begin, end) (in tiles of 16 from begin) against the chunk's 64 keys.
  // Tiles: C 0-3 (one per key tile), A 4 (query rows), B 6-7 (transposed keys).
  template <typename Tick>
  static void scores_amx(Buffers& b, int begin, int end, Tick&& tick) {
    for (int r0 = begin; r0 < end; r0 += 16) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int st = 0; st < D / 32; ++st) {
        _tile_loadd(4, &b.q[r0][16 * st], kPairs * 4);
        _tile_loadd(6, &b.kt[0][16 * st], 64);
        _tile_loadd(7, &b.kt[1][16 * st], 64);
        _tile_dpbf16ps(0, 4, 6);
        tick();
        _tile_dpbf16ps(1, 4, 7);
        tick();
        _tile_loadd(6, &b.kt[2][16 * st], 64);
        _tile_loadd(7, &b.kt[3][16 * st], 64);
        _tile_dpbf16ps(2, 4, 6);
        tick();
        _tile_dpbf16ps(3, 4, 7);
        tick();
      }
      _tile_stored(0, &b.s[r0][0], kChunk * 4);
      _tile_stored(1, &b.s[r0][16], kChunk * 4);
      _tile_stored(2, &b.s[r0][32], kChunk * 4);
      _tile_stored(3, &b.s[r0][48], kChunk * 4);
    }
  }

  // acc[r] = acc[r] * alpha[r] + sum over the chunk's keys of p[r][j] v_j, r in [begin, end), all
  // 64 keys (the probabilities of keys past the chunk's end are 0, their V pairs zeroed by load_v).
  // Tiles: C 0-3 (16 accumulator columns each), A 4 (probabilities), B 6-7 (V pairs).
  template <typename Tick>
  static void accumulate_amx(Buffers& b, int begin, int end, const float* alpha, float (*acc)[D], Tick&& tick) {
    for (int r0 = begin; r0 < end; r0 += 16) {
      for (int c0 = 0; c0 < kVecs; c0 += 4) {  // output columns in passes of 4 tiles (D = 128: two)
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int st = 0; st < kChunk / 32; ++st) {
          _tile_loadd(4, &b.p[r0][16 * st], (kChunk / 2) * 4);
          _tile_loadd(6, &b.vp[16 * st][c0 + 0], kVecs * 64);
          _tile_loadd(7, &b.vp[16 * st][c0 + 1], kVecs * 64);
          _tile_dpbf16ps(0, 4, 6);
          tick();
          _tile_dpbf16ps(1, 4, 7);
          tick();
          _tile_loadd(6, &b.vp[16 * st][c0 + 2], kVecs * 64);
          _tile_loadd(7, &b.vp[16 * st][c0 + 3], kVecs * 64);
          _tile_dpbf16ps(2, 4, 6);
          tick();
          _tile_dpbf16ps(3, 4, 7);
          tick();
        }
        _tile_stored(0, &b.pv[0][16 * c0], D * 4);
        _tile_stored(1, &b.pv[0][16 * c0 + 16], D * 4);
        _tile_stored(2, &b.pv[0][16 * c0 + 32], D * 4);
        _tile_stored(3, &b.pv[0][16 * c0 + 48], D * 4);
      }
      const int rows = std::min(16, end - r0);
      for (int i = 0; i < rows; ++i) {
        const __m512 scale = _mm512_set1_ps(alpha[r0 + i]);
        float* a = acc[r0 + i];
        for (int c = 0; c < kVecs; ++c)
          _mm512_store_ps(a + 16 * c, _mm512_fmadd_ps(_mm512_load_ps(a + 16 * c), scale, _mm512_load_ps(&b.pv[i][16 * c])));
      }
    }
  }
#endif

  static void store_p(Buffers& b, int r, const __m512 (&p)[kTiles]) {
    for (int t = 0; t < kTiles; t += 2)
      _mm512_store_si512(b.p[r] + 8 * t, (__m512i)_mm512_cvtne2ps_pbh(p[t + 1], p[t]));
  }

  // V rows of keys [j0, j1) (j0 even; a key past the chunk's end is a zero row) as key pairs.
  static void load_v_pairs(Buffers& b, const bf16* const* rows, int j0, int j1) {
    for (int j = j0; j < j1; j += 2) {
      for (int h = 0; h < D / 32; ++h) {
        const __m512i a = _mm512_loadu_si512(rows[j] + 32 * h);
        const __m512i c = _mm512_loadu_si512(rows[j + 1] + 32 * h);
        b.vp[j / 2][2 * h] = _mm512_unpacklo_epi16(a, c);
        b.vp[j / 2][2 * h + 1] = _mm512_unpackhi_epi16(a, c);
      }
    }
  }

  // AMX multiplies all 32 pairs (by probability 0 past n): no stale NaN may sit there.
  static void zero_v_tail(Buffers& b, int n) {
    for (int jp = (n + 1) / 2; jp < kChunk / 2; ++jp)
      for (int c = 0; c < kVecs; ++c) b.vp[jp][c] = _mm512_setzero_si512();
  }

  static void load_v(Buffers& b, const bf16* const* rows, int n) {
    load_v_pairs(b, rows, 0, n);
    zero_v_tail(b, n);
  }

  // acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v_j over the first n keys of the chunk, r in [begin, end).
  static constexpr int accumulate_steps(int n) { return (n + 1) / 2; }  // calls of `tick` per row block

  template <typename Tick>
  static void accumulate(const Buffers& b, const bf16* const*, int n, int begin, int end, const float* alpha,
                         float (*acc)[D], Tick&& tick) {
    const int pairs = (n + 1) / 2;
    for_row_blocks<kPvRows>(begin, end, [&]<int N>(int r0) {
      __m512 a[N][kVecs];
      for (int i = 0; i < N; ++i) {
        const __m512 scale = _mm512_set1_ps(alpha[r0 + i]);
        for (int c = 0; c < kVecs; ++c) a[i][c] = _mm512_mul_ps(_mm512_load_ps(acc[r0 + i] + 16 * c), scale);
      }
      for (int jp = 0; jp < pairs; ++jp) {
        tick();
        for (int i = 0; i < N; ++i) {
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(b.p[r0 + i][jp]);
          for (int c = 0; c < kVecs; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], pp, (__m512bh)b.vp[jp][c]);
        }
      }
      for (int i = 0; i < N; ++i)
        for (int c = 0; c < kVecs; ++c) _mm512_store_ps(acc[r0 + i] + 16 * c, a[i][c]);
    });
  }

  // Undoes the pair interleave: accumulator vectors 2h (low words) and 2h+1 (high words) hold
  // d = 32h + 8L + 4s + i at lane 4L + i of vector 2h + s.
  static void store_out(const float* acc, float inv_l, bf16* dst) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 scale = _mm512_set1_ps(inv_l);
    for (int h = 0; h < D / 32; ++h) {
      const __m512 lo = _mm512_load_ps(acc + 32 * h), hi = _mm512_load_ps(acc + 32 * h + 16);
      const __m512 x0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale);
      const __m512 x1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale);
      _mm512_storeu_si512(dst + 32 * h, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
    }
  }
};

// float32 cache, queries and output.
template <int D>
struct Ops<float, D> {
  static constexpr int kVecs = D / 16;
  static constexpr int kPvRows = 24 / kVecs;

  static constexpr int kExpDegree = 7;

  struct Buffers {
    alignas(64) float q[kMaxRows][D];
    alignas(64) __m512 kt[kTiles][D];            // [key tile][d]: that element of 16 keys
    alignas(64) float p[kMaxRows][kChunk];
  };

  static void load_q(Buffers& b, int r, const float* src) { std::memcpy(b.q[r], src, D * sizeof(float)); }

  static void load_k(Buffers& b, const float* const* rows) {
    for (int tile = 0; tile < kTiles; ++tile) {
      for (int h = 0; h < D / 16; ++h) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[16 * tile + j] + 16 * h);
        transpose16x16(r);
        for (int j = 0; j < 16; ++j) b.kt[tile][16 * h + j] = _mm512_castsi512_ps(r[j]);
      }
    }
  }

  static constexpr int kScoreSteps = D;

  template <int N, typename Tick>
  static void scores(const Buffers& b, int r0, __m512 (&acc)[N][kTiles], Tick&& tick) {
    for (int i = 0; i < N; ++i)
      for (int t = 0; t < kTiles; ++t) acc[i][t] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int d = 0; d < D; ++d) {
      tick();
      __m512 k[kTiles];
      for (int t = 0; t < kTiles; ++t) k[t] = b.kt[t][d];
      for (int i = 0; i < N; ++i) {
        const __m512 qv = _mm512_set1_ps(b.q[r0 + i][d]);
        for (int t = 0; t < kTiles; ++t) acc[i][t] = _mm512_fmadd_ps(k[t], qv, acc[i][t]);
      }
    }
  }

  static void store_p(Buffers& b, int r, const __m512 (&p)[kTiles]) {
    for (int t = 0; t < kTiles; ++t) _mm512_store_ps(b.p[r] + 16 * t, p[t]);
  }

  static void load_v(Buffers&, const float* const*, int) {}

  static constexpr int accumulate_steps(int n) { return n; }

  template <typename Tick>
  static void accumulate(const Buffers& b, const float* const* vrows, int n, int begin, int end, const float* alpha,
                         float (*acc)[D], Tick&& tick) {
    for_row_blocks<kPvRows>(begin, end, [&]<int N>(int r0) {
      __m512 a[N][kVecs];
      for (int i = 0; i < N; ++i) {
        const __m512 scale = _mm512_set1_ps(alpha[r0 + i]);
        for (int c = 0; c < kVecs; ++c) a[i][c] = _mm512_mul_ps(_mm512_load_ps(acc[r0 + i] + 16 * c), scale);
      }
      for (int j = 0; j < n; ++j) {
        tick();
        const float* v = vrows[j];
        for (int i = 0; i < N; ++i) {
          const __m512 pj = _mm512_set1_ps(b.p[r0 + i][j]);
          for (int c = 0; c < kVecs; ++c) a[i][c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 16 * c), a[i][c]);
        }
      }
      for (int i = 0; i < N; ++i)
        for (int c = 0; c < kVecs; ++c) _mm512_store_ps(acc[r0 + i] + 16 * c, a[i][c]);
    });
  }

  static void store_out(const float* acc, float inv_l, float* dst) {
    const __m512 scale = _mm512_set1_ps(inv_l);
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), scale));
  }
};

// Attention of one work item. Rows are grouped by kv head, then token, then query head:
// row r = (kv head kv_begin + r / per_head, token q_begin + (r % per_head) / group, query head
// group * kv head + r % group) with per_head = tokens * group.
template <typename T, int D>
struct ItemRunner {
  using O = Ops<T, D>;
  typename O::Buffers b;
  alignas(64) float acc[kMaxRows][D];
  alignas(64) __m512 l[kMaxRows];   // softmax denominators, summed lane-wise
  float m[kMaxRows + 4], alpha[kMaxRows + 4];  // m in base-2 score units; +4: whole-block loads
  int32_t qpos[kMaxRows];
  int64_t q_offset[kMaxRows], out_offset[kMaxRows];
  const T* kslots[kChunk];  // the chunk's cache slots at head kv_begin
  const T* vslots[kChunk];
  const T* krows[kChunk];   // the same, at the head being computed; zero rows past the chunk's end
  const T* vrows[kChunk];
  const float score_scale;  // softmax scale * log2(e): scores in base 2
#if SLUICE_HAVE_AMX
  static constexpr bool kAmxType = std::is_same_v<T, bf16>;  // the float32 cache stays on FMAs
#else
  static constexpr bool kAmxType = false;
#endif
  bool amx = false;  // this call's products on AMX tiles (set per run: the switch may change)

  explicit ItemRunner(float scale) : score_scale(scale * kLog2e) {}

  // Larger prompt tiles on AMX only (attention_common.h: the vector products gain nothing).
  static int tile_rows() {
#if SLUICE_HAVE_AMX
    if (kAmxType && sluice_amx::on()) return kMaxRows;
#endif
    return sluice_attention::kTileRows;
  }

  void run(const Problem& pb, const WorkItem& it, const T* q, const T* k_cache, const T* v_cache, T* out) {
    const int g = static_cast<int>(pb.group);
    const int per_head = (it.q_end - it.q_begin) * g;
    const int heads = it.kv_end - it.kv_begin;
    const int rows = heads * per_head;
    const int32_t first_token = pb.query_start[it.seq];
    const int32_t context = pb.seq_lens[it.seq] - (pb.query_start[it.seq + 1] - first_token);  // before the chunk
    for (int r = 0; r < rows; ++r) {
      const int token = it.q_begin + (r % per_head) / g;
      const int64_t head = static_cast<int64_t>(it.kv_begin + r / per_head) * g + r % g;
      q_offset[r] = (first_token + token) * pb.q_stride_t + head * pb.q_stride_h;
      out_offset[r] = (first_token + token) * pb.out_stride_t + head * D;
      O::load_q(b, r, q + q_offset[r]);
      qpos[r] = context + token;
      m[r] = kNegInf;
      l[r] = _mm512_setzero_ps();
    }
    std::memset(acc, 0, sizeof(float) * D * rows);
    std::fill(m + rows, m + kMaxRows + 4, kNegInf);

#if SLUICE_HAVE_AMX
    amx = kAmxType && sluice_amx::on();
    std::optional<sluice_amx::Tiles> tiles;
    if (amx) tiles.emplace(std::min(16, per_head));  // a kv head's rows: 3 for a decode of SmolLM2
#endif
    const int32_t* table = pb.block_tables + it.seq * pb.table_width;
    const int32_t num_keys = context + it.q_end;  // the last row's causal horizon
    const T* zero = reinterpret_cast<const T*>(kZeroRow);
    const bool whole_rows = heads == pb.num_kv_heads;
    // calls of prefetch_tick() per full chunk: scores() per 4-row block, accumulate() per PV block
    int ticks = heads * ((per_head + 3) / 4 * O::kScoreSteps +
                         (per_head + O::kPvRows - 1) / O::kPvRows * O::accumulate_steps(kChunk));
    if constexpr (kAmxType) {
#if SLUICE_HAVE_AMX
      if (amx) ticks = heads * ((per_head + 15) / 16 * (O::kAmxScoreTicks + O::kAmxPvTicks) + (per_head + 3) / 4);
#endif
    }
    for (int32_t start = 0; start < num_keys; start += kChunk) {
      const int n = std::min<int32_t>(kChunk, num_keys - start);
      if (whole_rows && start == 0) touch(pb, table, start, n, k_cache, v_cache);
      if (start + kChunk < num_keys)
        plan_prefetch(pb, table, start + kChunk, std::min<int32_t>(kChunk, num_keys - start - kChunk),
                      k_cache + it.kv_begin * D, v_cache + it.kv_begin * D, heads * D * sizeof(T), ticks);
      find_slots(pb, table, start, n, k_cache + it.kv_begin * D, v_cache + it.kv_begin * D);
      for (int j = n; j < kChunk; ++j) krows[j] = vrows[j] = zero;
      for (int hh = 0; hh < heads; ++hh) {
        for (int j = 0; j < n; ++j) {
          krows[j] = kslots[j] + hh * D;
          vrows[j] = vslots[j] + hh * D;
        }
        const int r0 = hh * per_head, r1 = r0 + per_head;
        O::load_k(b, krows);
        if constexpr (kAmxType) {
#if SLUICE_HAVE_AMX
          if (amx) {
            // The V pairs are rearranged (vector work) a few keys per tile product of the scores,
            // so that it runs while the tiles do instead of after them; the same values. A
            // verification step is compute-bound here, not memory-bound (q = 9: 1.6-1.8x the
            // K/V read's time; without the AMX products, or the softmax, or the V rearrangement it
            // ran 1.3-1.6x), and this overlap made q = 9 4-10% faster at 2 threads. Interleaving
            // the softmax of one row tile with the next tile's products as well did not help
            // (docs/measured/s48/attention-overlap.txt).
            const int score_ticks = (per_head + 15) / 16 * O::kAmxScoreTicks;
            const int keys_per_tick = 2 * (((n + 1) / 2 + score_ticks - 1) / score_ticks);
            int vj = 0;
            O::scores_amx(b, r0, r1, [&] {
              prefetch_tick();
              const int end = std::min(n, vj + keys_per_tick);
              O::load_v_pairs(b, vrows, vj, end);
              vj = end;
            });
            O::load_v_pairs(b, vrows, vj, n);
            O::zero_v_tail(b, n);
            for_row_blocks<4>(r0, r1, [&]<int N>(int rb) { scores_softmax<N>(rb, start, n); });
            O::accumulate_amx(b, r0, r1, alpha, acc, [this] { prefetch_tick(); });
            continue;
          }
#endif
        }
        for_row_blocks<4>(r0, r1, [&]<int N>(int rb) { scores_softmax<N>(rb, start, n); });
        O::load_v(b, vrows, n);
        O::accumulate(b, vrows, n, r0, r1, alpha, acc, [this] { prefetch_tick(); });
      }
      prefetch_rest();
    }
    for (int r = 0; r < rows; ++r) O::store_out(acc[r], 1.0f / _mm512_reduce_add_ps(l[r]), out + out_offset[r]);
  }

 private:
  // Reads the cache rows of keys [start, start + n) once, in address order, with plain loads. The
  // compute passes then find them in L1/L2. They read each head's slice of a row separately (a
  // strided pattern the hardware prefetchers serve poorly from memory). Used for an item's first
  // chunk only: later chunks were prefetched while the one before them was computed.
  static void touch(const Problem& pb, const int32_t* table, int32_t start, int n, const T* k_cache,
                    const T* v_cache) {
    const int64_t row_bytes = pb.cache_row * sizeof(T);
    __m512i x = _mm512_setzero_si512();
    for_block_runs(pb, table, start, n, [&](int, int run, int64_t slot) {
      const char* k = reinterpret_cast<const char*>(k_cache + slot * pb.cache_row);
      const char* v = reinterpret_cast<const char*>(v_cache + slot * pb.cache_row);
      for (int64_t o = 0; o < run * row_bytes; o += 64)
        x = _mm512_or_si512(x, _mm512_or_si512(_mm512_loadu_si512(k + o), _mm512_loadu_si512(v + o)));
    });
    asm volatile("" : : "v"(x));  // keep the loads
  }

  // The next chunk's cache lines, fetched into L2 a few at a time from the compute loops of this
  // chunk (prefetch_tick) so that memory is read while this chunk is computed; issued in one burst,
  // the prefetches stall on the core's limit of outstanding misses much as loads would. The plan
  // is a few contiguous byte ranges (a block run's rows, when the item covers whole rows; else
  // each key's slice), walked a line at a time: listing every line instead cost a hot decode ~40%
  // of its time (docs/benchmarks.md, session 51).
  struct Range {
    const char* p;
    int64_t bytes;
  };
  Range ranges[2 * kChunk];  // K and V alternately; at most a range each per key
  int num_ranges = 0, next_range = 0;
  int64_t next_offset = 0;
  int lines_per_tick = 1;

  // Plans the prefetch of keys [start, start + n): `bytes` of each slot from k_cache / v_cache (the
  // item's kv heads: the whole row when it covers them all), spread over `ticks` calls of prefetch_tick.
  void plan_prefetch(const Problem& pb, const int32_t* table, int32_t start, int n, const T* k_cache,
                     const T* v_cache, int64_t bytes, int ticks) {
    num_ranges = next_range = 0;
    next_offset = 0;
    const int64_t row_bytes = pb.cache_row * sizeof(T);
    const int64_t lines_per_key = (bytes + 63) / 64;
    for_block_runs(pb, table, start, n, [&](int, int run, int64_t slot) {
      const char* k = reinterpret_cast<const char*>(k_cache + slot * pb.cache_row);
      const char* v = reinterpret_cast<const char*>(v_cache + slot * pb.cache_row);
      if (bytes == row_bytes) {  // the run's rows are contiguous
        ranges[num_ranges++] = {k, run * row_bytes};
        ranges[num_ranges++] = {v, run * row_bytes};
        return;
      }
      for (int i = 0; i < run; ++i) {
        ranges[num_ranges++] = {k + i * row_bytes, bytes};
        ranges[num_ranges++] = {v + i * row_bytes, bytes};
      }
    });
    // About the ranges' lines (exactly, when a row is whole cache lines): it only paces the ticks,
    // and prefetch_rest issues whatever they leave.
    const int64_t lines = 2 * n * lines_per_key;
    lines_per_tick = static_cast<int>((lines + ticks - 1) / ticks);  // ticks >= kScoreSteps
  }

  bool prefetch_line() {
    if (next_range >= num_ranges) return false;
    const Range& r = ranges[next_range];
    _mm_prefetch(r.p + next_offset, _MM_HINT_T1);
    next_offset += 64;
    if (next_offset >= r.bytes) {
      ++next_range;
      next_offset = 0;
    }
    return true;
  }

  void prefetch_tick() {
    for (int i = 0; i < lines_per_tick && prefetch_line(); ++i) {
    }
  }

  void prefetch_rest() {
    while (prefetch_line()) {
    }
  }

  void find_slots(const Problem& pb, const int32_t* table, int32_t start, int n, const T* k_cache,
                  const T* v_cache) {
    for_block_runs(pb, table, start, n, [&](int j, int run, int64_t slot) {
      for (int i = 0; i < run; ++i) {
        kslots[j + i] = k_cache + (slot + i) * pb.cache_row;
        vslots[j + i] = v_cache + (slot + i) * pb.cache_row;
      }
    });
  }

  // Scores of rows [rb, rb + N) against the chunk's keys [start, start + n), and their online
  // softmax step: the rows' new maxima m, the factors alpha that rescale what they accumulated so
  // far, their denominators l, and the chunk's probabilities in the P buffer (0 where a key is past
  // the chunk's end or in the row's future).
  template <int N>
  void scores_softmax(int rb, int32_t start, int n) {
    __m512 a[N][kTiles];
    bool computed = false;
    if constexpr (kAmxType) {
      if (amx) {  // scores_amx has them
        for (int i = 0; i < N; ++i)
          for (int t = 0; t < kTiles; ++t) a[i][t] = _mm512_load_ps(&b.s[rb + i][16 * t]);
        prefetch_tick();
        computed = true;
      }
    }
    if (!computed) O::template scores<N>(b, rb, a, [this] { prefetch_tick(); });
    __mmask16 keep[N][kTiles];
    __m512 mx[4];
    for (int i = 0; i < N; ++i) {
      const int valid = std::min(n, qpos[rb + i] - start + 1);  // keys this row sees (may be <= 0)
      const uint64_t bits = valid >= kChunk ? ~0ull : valid <= 0 ? 0 : (1ull << valid) - 1;
      for (int t = 0; t < kTiles; ++t) {
        keep[i][t] = static_cast<__mmask16>(bits >> (16 * t));
        if (~bits) a[i][t] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), keep[i][t], a[i][t]);  // not all visible
      }
      mx[i] = _mm512_max_ps(_mm512_max_ps(a[i][0], a[i][1]), _mm512_max_ps(a[i][2], a[i][3]));
    }
    for (int i = N; i < 4; ++i) mx[i] = mx[0];
    // Lanes 4i .. 4i + 3 below belong to row rb + i.
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 c = _mm512_set1_ps(score_scale);
    const __m512 m_old = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(m + rb)));
    const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(max4x16(mx), c));
    // exp2(m_old - m_new); the first chunk's m_old is -inf: clamped, its alpha is ~0 (and scales zeros)
    const __m512 al = exp2_nonpositive<O::kExpDegree>(_mm512_max_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(-127.0f)), 0xFFFF);
    const __mmask8 rows_mask = static_cast<__mmask8>((1u << N) - 1);
    _mm_mask_storeu_ps(m + rb, rows_mask, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, m_new)));
    _mm_mask_storeu_ps(alpha + rb, rows_mask, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, al)));
    for (int i = 0; i < N; ++i) {
      const __m512i lane = _mm512_set1_epi32(4 * i);
      const __m512 mi = _mm512_permutexvar_ps(lane, m_new);
      __m512 p[kTiles];
      for (int t = 0; t < kTiles; ++t) p[t] = exp2_nonpositive<O::kExpDegree>(_mm512_fmsub_ps(a[i][t], c, mi), keep[i][t]);
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
      l[rb + i] = _mm512_fmadd_ps(l[rb + i], _mm512_permutexvar_ps(lane, al), sum);
      O::store_p(b, rb + i, p);
    }
  }
};

}  // namespace

SLUICE_DEFINE_PAGED_ATTENTION(ItemRunner)
