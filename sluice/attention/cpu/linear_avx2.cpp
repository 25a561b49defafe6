// bfloat16 linear layers for x86 CPUs with AVX2 + FMA but no AVX-512 BF16: the same ops and the
// same packed weight layout as linear.cpp (torch.ops.sluice.linear_bf16 and
// torch.ops.sluice.linear_bf16_silu_mul; packing in sluice/model/packed_linear.py), computed in
// float32 FMAs.
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 accumulation, one rounding to bfloat16.
//
// Why: without a bf16 dot-product instruction, torch's bfloat16 matmul runs at ~19 GFLOP/s on
// such a CPU (a 2-core Zen 3) against ~165 for float32; float32 weights would double the bytes a
// decode step streams. Here the weights stay bfloat16 and are widened in registers:
//
//   packed[group][k pair][column][2]: one 32-bit lane holds (W[n][k], W[n][k+1]); shifted left by
//   16 it is W[n][k] as a float32, masked to its high half it is W[n][k+1].
//
// x is widened to float32 once per call. A unit of work is 16 output columns (two vectors of 8)
// of one packed group, or, for the fused gate/up projection, 8 gate columns and their 8 up
// columns. One or two rows take spans of 4 column vectors instead (whole 64-byte weight lines:
// there a step is a stream of weights, see run_span). Per k pair a tile of up to 4 rows x 2
// vectors does 16 FMAs against 2 weight loads and 8 broadcasts. From 8 rows on, a unit's weights
// are first widened to float32 ([K][16], once per unit and row block) and tiles of 6 rows x 2
// vectors run on them: per k 12 FMAs against 2 loads and 6 broadcasts, no widening in the loop
// (~1.3-1.5x the throughput at 32-224 rows here). All paths sum each output in one chain over
// k = 0, 1, ..., so a row's bits do not depend on how many rows share the call. Rows are taken in
// blocks whose float32 copy stays in L2 while units pass over them; from 8 rows on, the threads
// take (row block, run of units) items from a shared counter.
//
// linear_bf16_silu_mul writes silu(gate) * up: [M, N / 2] (packed groups hold 32 gate columns then
// the 32 matching up columns; see pack_gate_up), with both halves rounded to bf16 first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <immintrin.h>

#include "linear_common.h"
#include "ops.h"
#include "simd_avx2.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#if !(defined(__AVX2__) && defined(__FMA__))
#error "sluice's AVX2 linear kernel needs AVX2 and FMA"
#endif

namespace {

using sluice_simd::bf16;
using sluice_simd::exp2_ps;
using sluice_simd::for_row_tiles;
using sluice_simd::round_bf16;
using sluice_simd::store8_bf16;

constexpr int kGroupCols = 64;  // output columns per packed group (as linear.cpp)
constexpr int kRowTile = 4;     // rows per micro-kernel call: 4 x 2 accumulators
constexpr int kRowBlock = 96;   // rows whose float32 copy a thread's units pass over together
constexpr int kWideRows = 6;     // rows per micro-kernel call on widened weights: 6 x 2 accumulators
constexpr int64_t kWideMinRows = 8;  // from this many rows a unit's weights are widened once per row block

// A packed k-pair vector (lane j: W[n_j][k], W[n_j][k + 1]) as two float32 vectors: k and k + 1.
inline void split_pair(__m256i v, __m256& even, __m256& odd) {
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// A unit's weights are one 64-byte line per k pair (its two column vectors; for the fused
// gate/up projection, two half lines), k pairs a group's width apart: a strided stream from
// memory that the hardware prefetchers follow only part of the way (the widening loop read at
// ~20 GB/s of the ~30-34 measured here). Software prefetches keep kAheadPairs k pairs in flight
// (a prefetch past the end of the weights does not fault).
constexpr int64_t kAheadPairs = 16;
inline void prefetch_ahead(const bf16* w0, const bf16* w1, int64_t p, int64_t stride) {
  _mm_prefetch(reinterpret_cast<const char*>(w0 + (p + kAheadPairs) * stride), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w1 + (p + kAheadPairs) * stride), _MM_HINT_T0);
}

// acc[r][c] = sum over k of x[r][k] * W[column vector voff[c]][k], for a group whose k pairs are
// `stride` bf16 apart (2 x its width).
template <int kRows>
inline void dot_tile(const float* x, int64_t ldx, const bf16* w, int64_t stride, int64_t k_pairs, const int (&voff)[2],
                     __m256 (&acc)[kRows][2]) {
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const bf16* w0 = w + 16 * voff[0];
  const bf16* w1 = w + 16 * voff[1];
  for (int64_t p = 0; p < k_pairs; ++p) {
    prefetch_ahead(w0, w1, p, stride);
    __m256 ae, ao, be, bo;
    split_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + p * stride)), ae, ao);
    split_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + p * stride)), be, bo);
    for (int r = 0; r < kRows; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * p);
      const __m256 xo = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
      acc[r][0] = _mm256_fmadd_ps(xe, ae, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xe, be, acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(xo, ao, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xo, bo, acc[r][1]);
    }
  }
}

// A unit's 16 columns widened to float32, [K][16]: row k holds W[col][k] of the unit's two column
// vectors. Written once per unit and row block, then read by every row tile of the block.
inline void widen_unit(const bf16* w, int64_t stride, int64_t k_pairs, const int (&voff)[2], float* wf) {
  const bf16* w0 = w + 16 * voff[0];
  const bf16* w1 = w + 16 * voff[1];
  for (int64_t p = 0; p < k_pairs; ++p) {
    prefetch_ahead(w0, w1, p, stride);
    __m256 ae, ao, be, bo;
    split_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + p * stride)), ae, ao);
    split_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + p * stride)), be, bo);
    float* row = wf + 32 * p;  // k = 2p: columns 0-7, 8-15; then k = 2p + 1
    _mm256_store_ps(row, ae);
    _mm256_store_ps(row + 8, be);
    _mm256_store_ps(row + 16, ao);
    _mm256_store_ps(row + 24, bo);
  }
}

// dot_tile on a widened unit: the same FMAs in the same order (one chain per output over k =
// 0, 1, ...), so the same bits, with the widening out of the loop and 6 rows of 2 accumulators.
// With kPrefetch, the tile also asks L2 for the next unit's weights (pf0, pf1: its two column
// vectors' k pair lines, pf_stride apart), one k pair every other k, so that unit's widening reads
// L2 while this unit's FMAs leave the memory bus idle.
template <int kRows, bool kPrefetch = false>
inline void dot_tile_wide(const float* x, int64_t ldx, const float* wf, int64_t k, __m256 (&acc)[kRows][2],
                          const bf16* pf0 = nullptr, const bf16* pf1 = nullptr, int64_t pf_stride = 0) {
  // Local accumulators: __m256 may alias float, so ones reached through `acc` would be stored
  // back to memory after every FMA.
  __m256 c0[kRows], c1[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; ++j) {
    if constexpr (kPrefetch) {
      if ((j & 1) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(pf0 + (j >> 1) * pf_stride), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(pf1 + (j >> 1) * pf_stride), _MM_HINT_T1);
      }
    }
    const __m256 a = _mm256_load_ps(wf + 16 * j), b = _mm256_load_ps(wf + 16 * j + 8);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + j);
      c0[r] = _mm256_fmadd_ps(xb, a, c0[r]);
      c1[r] = _mm256_fmadd_ps(xb, b, c1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = c0[r];
    acc[r][1] = c1[r];
  }
}

// silu(g) * u = g * u / (1 + exp(-g)), exp through exp2.
inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 e = exp2_ps(_mm256_mul_ps(g, _mm256_set1_ps(-1.4426950408889634f)));  // exp(-g)
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

struct Unit {
  int64_t col;     // first column of the group
  int vecs;        // the group's width in vectors of 8 columns
  int voff[2];     // the unit's two column vectors within the group
  int64_t out;     // first output column of the unit
};

// Rows [0, kRows) of one unit from their sums: plain projection (+ bias) or fused silu(gate) * up.
template <int kRows, bool kSiluMul>
inline void store_tile(__m256 (&acc)[kRows][2], const Unit& u, const float* bias, bf16* y, int64_t ldy) {
  for (int r = 0; r < kRows; ++r) {
    __m256 a = acc[r][0], b = acc[r][1];
    if (bias) {
      a = _mm256_add_ps(a, _mm256_loadu_ps(bias + u.col + 8 * u.voff[0]));
      b = _mm256_add_ps(b, _mm256_loadu_ps(bias + u.col + 8 * u.voff[1]));
    }
    if constexpr (kSiluMul) {
      store8_bf16(y + r * ldy + u.out, silu_mul(round_bf16(a), round_bf16(b)));
    } else {
      store8_bf16(y + r * ldy + u.out, a);
      store8_bf16(y + r * ldy + u.out + 8, b);
    }
  }
}

template <bool kSiluMul>
void run_unit(const float* x, int64_t m, int64_t ldx, const bf16* wg, int64_t k_pairs, const Unit& u,
              const float* bias, bf16* y, int64_t ldy) {
  for_row_tiles<kRowTile>(m, [&](int64_t r, auto rows) {
    constexpr int R = decltype(rows)::value;
    __m256 acc[R][2];
    dot_tile<R>(x + r * ldx, ldx, wg, 16 * u.vecs, k_pairs, u.voff, acc);
    store_tile<R, kSiluMul>(acc, u, bias, y + r * ldy, ldy);
  });
}

// run_unit with the unit's weights widened first (wf: K * 16 floats, 32-byte aligned).
template <bool kSiluMul>
void run_unit_wide(const float* x, int64_t m, int64_t ldx, const bf16* wg, int64_t k_pairs, const Unit& u,
                   const float* bias, bf16* y, int64_t ldy, float* wf, const bf16* next_wg, const Unit* next) {
  const int64_t k = 2 * k_pairs;
  widen_unit(wg, 16 * u.vecs, k_pairs, u.voff, wf);
  for_row_tiles<kWideRows>(m, [&](int64_t r, auto rows) {
    constexpr int R = decltype(rows)::value;
    __m256 acc[R][2];
    if (r == 0 && next != nullptr)
      dot_tile_wide<R, true>(x + r * ldx, ldx, wf, k, acc, next_wg + 16 * next->voff[0], next_wg + 16 * next->voff[1],
                             16 * next->vecs);
    else
      dot_tile_wide<R>(x + r * ldx, ldx, wf, k, acc);
    store_tile<R, kSiluMul>(acc, u, bias, y + r * ldy, ldy);
  });
}

// One or two rows (a lone decode, a short verification): here a step only streams the weights,
// and unit after unit of 64 bytes per k pair, a group's width (256 bytes) apart, read them at
// ~13 GB/s of the ~33 measured. A span instead takes 4 of a group's column vectors (plain: 4
// neighbours, two whole 64-byte lines per k pair; fused gate/up: 2 gate vectors and their 2 up
// vectors), so that the two spans of a group consume each of its lines whole, and the 4-8
// accumulators keep more FMA chains in flight. Each output is still one chain over k = 0, 1, ...
// (even then odd of each pair), as in dot_tile and dot_tile_wide: the same bits.
struct Span {
  int64_t col;     // first column of the group
  int vecs;        // the group's width in vectors of 8 columns
  int nv;          // vectors in the span: 4, or 2 at the end of a narrower last group
  int voff[4];     // the span's column vectors within the group (fused: gates, then their ups)
  int64_t out;     // first output column of the span
};

std::vector<Span> make_spans(int64_t n, bool silu_mul) {
  std::vector<Span> spans;
  for (int64_t col = 0; col < n; col += kGroupCols) {
    const int vecs = static_cast<int>(std::min<int64_t>(kGroupCols, n - col) / 8);
    if (silu_mul) {
      const int h = vecs / 2;
      for (int j = 0; j < h; j += 2) {
        if (j + 1 < h) spans.push_back({col, vecs, 4, {j, j + 1, j + h, j + h + 1}, col / 2 + 8 * j});
        else spans.push_back({col, vecs, 2, {j, j + h}, col / 2 + 8 * j});
      }
    } else {
      for (int j = 0; j < vecs; j += 4) {
        if (j + 3 < vecs) spans.push_back({col, vecs, 4, {j, j + 1, j + 2, j + 3}, col + 8 * j});
        else spans.push_back({col, vecs, 2, {j, j + 1}, col + 8 * j});
      }
    }
  }
  return spans;
}

template <int kRows, int kVecs, bool kSiluMul>
void run_span(const float* x, int64_t ldx, const bf16* wg, int64_t k_pairs, const Span& sp, const float* bias,
              bf16* y, int64_t ldy) {
  const int64_t stride = 16 * sp.vecs;
  const bf16* w[kVecs];
#pragma GCC unroll 4
  for (int v = 0; v < kVecs; ++v) w[v] = wg + 16 * sp.voff[v];
  __m256 acc[kRows][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k_pairs; ++p) {
    prefetch_ahead(w[0], w[kVecs - 1], p, stride);  // the span's two lines
    __m256 we[kVecs], wo[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v)
      split_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[v] + p * stride)), we[v], wo[v]);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * p);
      const __m256 xo = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_fmadd_ps(xe, we[v], acc[r][v]);
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_fmadd_ps(xo, wo[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v)
      if (bias) acc[r][v] = _mm256_add_ps(acc[r][v], _mm256_loadu_ps(bias + sp.col + 8 * sp.voff[v]));
    if constexpr (kSiluMul) {
#pragma GCC unroll 2
      for (int v = 0; v < kVecs / 2; ++v)
        store8_bf16(y + r * ldy + sp.out + 8 * v, silu_mul(round_bf16(acc[r][v]), round_bf16(acc[r][v + kVecs / 2])));
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) store8_bf16(y + r * ldy + sp.out + 8 * v, acc[r][v]);
    }
  }
}

template <int kRows, bool kSiluMul>
void run_spans(const float* x, int64_t ldx, const bf16* wp, int64_t k, const std::vector<Span>& spans,
               const float* bias, bf16* y, int64_t ldy) {
  // A span is 128 bytes of weight per k pair; split them evenly over the threads.
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 4, [&](int64_t s0, int64_t s1) {
    for (int64_t i = s0; i < s1; ++i) {
      const Span& sp = spans[i];
      const bf16* wg = wp + sp.col * k;
      if (sp.nv == 4) run_span<kRows, 4, kSiluMul>(x, ldx, wg, k / 2, sp, bias, y, ldy);
      else run_span<kRows, 2, kSiluMul>(x, ldx, wg, k / 2, sp, bias, y, ldy);
    }
  });
}

// The units of an N-column weight: plain, per group its vector pairs (0, 1), (2, 3), ...;
// fused, per group gate vector j with up vector j + vecs / 2.
std::vector<Unit> make_units(int64_t n, bool silu_mul) {
  std::vector<Unit> units;
  for (int64_t col = 0; col < n; col += kGroupCols) {
    const int vecs = static_cast<int>(std::min<int64_t>(kGroupCols, n - col) / 8);
    if (silu_mul) {
      for (int j = 0; j < vecs / 2; ++j) units.push_back({col, vecs, {j, j + vecs / 2}, col / 2 + 8 * j});
    } else {
      for (int j = 0; j < vecs; j += 2) units.push_back({col, vecs, {j, j + 1}, col + 8 * j});
    }
  }
  return units;
}

template <bool kSiluMul>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const float* bias, at::Tensor& y) {
  const int64_t m = x.size(0), ldx = x.stride(0), ldy = y.stride(0), k_pairs = k / 2;
  const bf16* xp = reinterpret_cast<const bf16*>(x.data_ptr<c10::BFloat16>());
  const bf16* wp = reinterpret_cast<const bf16*>(packed.data_ptr<c10::BFloat16>());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr<c10::BFloat16>());
  // x widened to float32 once: [M, K], rows contiguous, in the calling thread's buffer (kept
  // between calls: a fresh one per call would be mapped and page-faulted anew at prefill sizes).
  thread_local std::vector<float> xf;
  if (xf.size() < static_cast<size_t>(m * k)) xf.resize(static_cast<size_t>(m * k));
  float* xw = xf.data();  // the worker threads' lambdas must not name xf: each has its own
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* src = xp + r * ldx;
      float* dst = xw + r * k;
      int64_t j = 0;
      for (; j + 8 <= k; j += 8) _mm256_storeu_ps(dst + j, sluice_simd::load8_bf16(src + j));
      for (; j < k; ++j) dst[j] = c10::BFloat16(src[j], c10::BFloat16::from_bits());
    }
  });
  if (m <= 2) {
    const std::vector<Span> spans = make_spans(n, kSiluMul);
    if (m == 1) run_spans<1, kSiluMul>(xw, k, wp, k, spans, bias, yp, ldy);
    else run_spans<2, kSiluMul>(xw, k, wp, k, spans, bias, yp, ldy);
    return;
  }
  const std::vector<Unit> units = make_units(n, kSiluMul);
  const int64_t num_units = static_cast<int64_t>(units.size());
  if (m < kWideMinRows) {
    // A unit is K * 32 bytes of weight and 32 * M * K flops; for a tiny M let at::parallel_for
    // keep it on one thread rather than pay for the fork.
    const int64_t grain = m * k >= 4096 ? 1 : 8;
    at::parallel_for(0, num_units, grain, [&](int64_t u0, int64_t u1) {
      for (int64_t i = u0; i < u1; ++i) {
        const Unit& u = units[i];
        run_unit<kSiluMul>(xw, m, k, wp + u.col * k, k_pairs, u, bias, yp, ldy);
      }
    });
    return;
  }
  // Work items: a row block and a run of units, row blocks first, taken from a shared counter.
  // From a full row block on (prefill sizes) runs are an eighth of a thread's share, so that when
  // one core is slowed (the server's Python thread, a neighbour on the host) the other takes more
  // items instead of spinning at the join: with a third of one core taken by another process,
  // 336-row layers ran at ~108-113 GFLOP/s against ~82-94 with the units split in halves up front.
  // Below that (decodes, verification) a thread's share is one run, as before: there finer items
  // measured no better, and a long run keeps every unit's next-unit prefetch on its own thread.
  // Which thread computes an output does not change its bits.
  const int threads = std::max(1, at::get_num_threads());
  const int64_t run_len = m >= kRowBlock ? std::max<int64_t>(1, num_units / (8 * threads))
                                         : (num_units + threads - 1) / threads;
  const int64_t runs = (num_units + run_len - 1) / run_len;
  const int64_t items = (m + kRowBlock - 1) / kRowBlock * runs;
  std::atomic<int64_t> next_item{0};
  auto work = [&](int64_t, int64_t) {
    thread_local std::vector<float> wbuf;
    if (wbuf.size() < static_cast<size_t>(16 * k + 8)) wbuf.resize(static_cast<size_t>(16 * k + 8));
    float* wf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(wbuf.data()) + 31) & ~uintptr_t(31));
    for (int64_t it = next_item.fetch_add(1); it < items; it = next_item.fetch_add(1)) {
      const int64_t rb = it / runs * kRowBlock, rows = std::min<int64_t>(kRowBlock, m - rb);
      const int64_t u0 = it % runs * run_len, u1 = std::min(num_units, u0 + run_len);
      for (int64_t i = u0; i < u1; ++i) {
        const Unit& u = units[i];
        const Unit* next = i + 1 < num_units ? &units[i + 1] : nullptr;  // past the run: likely claimed next
        run_unit_wide<kSiluMul>(xw + rb * k, rows, k, wp + u.col * k, k_pairs, u, bias, yp + rb * ldy, ldy, wf,
                                next ? wp + next->col * k : nullptr, next);
      }
    }
  };
  const int64_t workers = std::min<int64_t>(threads, items);
  if (workers <= 1) work(0, 1);
  else at::parallel_for(0, workers, 1, work);
}

struct Avx2 {
  static constexpr bool kBlocks = false;  // GGUF blocks stay bf16 on this kernel set (packed_linear.py)
  static bool set_amx(bool) { return false; }  // AMX CPUs have AVX-512 BF16 and take that kernel set
  static bool amx_enabled() { return false; }
  template <bool kSiluMul>
  static void run(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const float* bias, at::Tensor& y) {
    ::run<kSiluMul>(x, packed, n, k, bias, y);
  }
};

}  // namespace

SLUICE_DEFINE_LINEAR_OPS(Avx2)
