// bfloat16 linear layers for few rows (decode steps), registered as torch.ops.sluice.linear_bf16
// and torch.ops.sluice.linear_bf16_silu_mul.
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 accumulation, one rounding to bfloat16.
//
// Why: at 1-64 rows oneDNN reaches 28-350 GFLOP/s on this model's shapes, far from what the
// weights' bandwidth (1 row) or the cores' `vdpbf16ps` peak (8+ rows) allow. Here the weight is
// packed once, at load time, so that one step streams it exactly once, in address order:
//
//   packed[group][k pair][column][2]: groups of up to 64 output columns (4 vectors of 16); for
//   each k pair (k, k+1) the group's columns' (W[n][k], W[n][k+1]) bf16 pairs, one 32-bit lane
//   each, which is the operand layout of `vdpbf16ps`.
//
// A group's slice (K * 128 bytes) stays in L2 while every tile of up to 6 rows passes over it:
// per k pair, 4 vector loads and 6 broadcasts feed 24 independent `vdpbf16ps` accumulators.
// Groups (halves of groups where that evens the split) are split between the threads; prefill-sized
// inputs are split in row blocks too (see run).
//
// linear_bf16_silu_mul takes a gate/up projection whose packed groups hold 32 gate columns then
// the 32 matching up columns (see pack_gate_up), and writes silu(gate) * up: [M, N / 2], so the
// [M, N] intermediate of an MLP never reaches memory.
//
// On CPUs with AMX (Sapphire Rapids and later, built with -march=native there) the same packed
// layout feeds `tdpbf16ps`: a group's k pairs are the rows of a B tile (16 k pairs x 16 columns x
// 2, 256-byte stride in a 64-wide group), x's rows are A tiles. AMX sums in another order than
// `vdpbf16ps` (not the same bits), so where it is on it computes every row count of a layer, from
// one row up: a row's bits never depend on the rows beside it (speculative verification relies on
// that). Layers whose K is not a multiple of 32 stay on the AVX-512 path. The switch is amx.h's.
//
// Weights in a GGUF's blocks (Q4_1 and Q8_0, kept as the file has them: linear_common.h's packed
// layout) are dequantized into the bf16 layout above as the products need them, a B tile's block at
// a time on AMX up to two row tiles, else a group at a time into the thread's buffer, and the same
// code computes from there: the bits are those of the bf16 weights the file dequantizes to, while
// a step reads 0.625 (Q4_1) or 1.0625 (Q8_0) bytes a weight from memory instead of 2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <immintrin.h>

#include "linear_common.h"
#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx.h"

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__))
#error "sluice's CPU linear kernel needs AVX-512 F, BW, VL and BF16"
#endif

namespace {

using sluice_simd::bf16;
using sluice_simd::exp2_ps;
using sluice_simd::round_bf16;
constexpr int kGroupCols = 64;  // output columns per packed group
constexpr int kRowTile = 6;     // rows per micro-kernel call: 6 x 4 accumulators

inline __m512bh broadcast_pair(const bf16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

// acc[r][j] = sum over k of x[r][k] * W[16 vi[j] + lane][k] for the group at w, whose k pairs are
// ldw elements apart (32 per 16-column vector of the group): kVecs of its vectors, vi[j] the j-th.
template <int kRows, int kVecs>
inline void dot_tile(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, const int (&vi)[kVecs], int64_t k_pairs,
                     __m512 (&acc)[kRows][kVecs]) {
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kVecs; ++j) acc[r][j] = _mm512_setzero_ps();
  const bf16* wj[kVecs];
  for (int j = 0; j < kVecs; ++j) wj[j] = w + 32 * vi[j];
  for (int64_t p = 0; p < k_pairs; ++p) {
    __m512bh wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wj[j] + p * ldw);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh a = broadcast_pair(x + r * ldx + 2 * p);
      for (int j = 0; j < kVecs; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, wv[j]);
    }
  }
}

inline void store_bf16(bf16* dst, __m512 v) { sluice_simd::store_bf16(dst, v); }

// silu(g) * u = g * u / (1 + exp(-g)), exp through exp2.
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 e = exp2_ps(_mm512_mul_ps(g, _mm512_set1_ps(-1.4426950408889634f)));  // exp(-g)
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}


// The epilogue both paths share: one output vector of 16 columns from float32 sums, bias added,
// rounded once; fused, gate and up rounded to bf16 before silu(gate) * up.
inline void store_plain(bf16* dst, __m512 v, const float* bias) {
  if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  store_bf16(dst, v);
}

inline void store_silu_mul(bf16* dst, __m512 g, __m512 u, const float* gate_bias, const float* up_bias) {
  if (gate_bias) {
    g = _mm512_add_ps(g, _mm512_loadu_ps(gate_bias));
    u = _mm512_add_ps(u, _mm512_loadu_ps(up_bias));
  }
  store_bf16(dst, silu_mul(round_bf16(g), round_bf16(u)));
}

// Rows [r0, r0 + kRows) of kVecs vectors vi of one group (ldw as for dot_tile): plain projection
// (+ bias), output vector vi[j], or fused, output vector vi[j] = silu(gate vi[j]) * up vi[j + kVecs / 2]
// for j < kVecs / 2. y and bias are the group's.
template <int kRows, int kVecs, bool kSiluMul>
inline void group_tile(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, const int (&vi)[kVecs],
                       int64_t k_pairs, const float* bias, bf16* y, int64_t ldy) {
  __m512 acc[kRows][kVecs];
  dot_tile<kRows, kVecs>(x, ldx, w, ldw, vi, k_pairs, acc);
  for (int r = 0; r < kRows; ++r) {
    if constexpr (kSiluMul) {
      static_assert(kVecs % 2 == 0);
      for (int j = 0; j < kVecs / 2; ++j) {
        const int g = vi[j], u = vi[j + kVecs / 2];
        store_silu_mul(y + r * ldy + 16 * g, acc[r][j], acc[r][j + kVecs / 2], bias ? bias + 16 * g : nullptr,
                       bias ? bias + 16 * u : nullptr);
      }
    } else {
      for (int j = 0; j < kVecs; ++j)
        store_plain(y + r * ldy + 16 * vi[j], acc[r][j], bias ? bias + 16 * vi[j] : nullptr);
    }
  }
}

template <int kVecs, bool kSiluMul>
void run_group(const bf16* x, int64_t m, int64_t ldx, const bf16* w, int64_t ldw, const int (&vi)[kVecs],
               int64_t k_pairs, const float* bias, bf16* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + kRowTile <= m; r += kRowTile)
    group_tile<kRowTile, kVecs, kSiluMul>(x + r * ldx, ldx, w, ldw, vi, k_pairs, bias, y + r * ldy, ldy);
  const bf16* xr = x + r * ldx;
  bf16* yr = y + r * ldy;
  switch (m - r) {
    case 0: break;
    case 1: group_tile<1, kVecs, kSiluMul>(xr, ldx, w, ldw, vi, k_pairs, bias, yr, ldy); break;
    case 2: group_tile<2, kVecs, kSiluMul>(xr, ldx, w, ldw, vi, k_pairs, bias, yr, ldy); break;
    case 3: group_tile<3, kVecs, kSiluMul>(xr, ldx, w, ldw, vi, k_pairs, bias, yr, ldy); break;
    case 4: group_tile<4, kVecs, kSiluMul>(xr, ldx, w, ldw, vi, k_pairs, bias, yr, ldy); break;
    default: group_tile<5, kVecs, kSiluMul>(xr, ldx, w, ldw, vi, k_pairs, bias, yr, ldy); break;
  }
}

// A group's passes, as the decode-sized split deals them (both paths): pairs of 16-column vectors
// (fused: a gate vector with its up vector), at most 2 in a 64-column group.
inline int group_passes(int64_t gw, bool silu_mul) {
  const int vecs = static_cast<int>(gw / 16);
  return silu_mul ? vecs / 2 : (vecs + 1) / 2;
}

// The 16-column vectors of pass p of a group of `vecs` vectors: plain (2p, 2p + 1), or 2p alone
// (v[1] = -1) at a narrower group's end; fused, gate vector p and its up vector p + vecs / 2,
// whose silu(gate) * up is output vector p.
inline void pass_vectors(int vecs, bool silu_mul, int p, int (&v)[2]) {
  if (silu_mul) v[0] = p, v[1] = p + vecs / 2;
  else v[0] = 2 * p, v[1] = 2 * p + 1 < vecs ? 2 * p + 1 : -1;
}

// Rows [0, m) of passes [p0, p1) of a group of `vecs` vectors on the AVX-512 path: a whole
// 64-column group in one sweep (4 weight vectors per k pair against each row's broadcast), else
// pass by pass. The sums are the same either way.
template <bool kSiluMul>
void vector_group(const bf16* x, int64_t m, int64_t ldx, const bf16* w, int vecs, int p0, int p1, int64_t k_pairs,
                  const float* bias, bf16* y, int64_t ldy) {
  const int64_t ldw = 32 * vecs;
  if (vecs == 4 && p0 == 0 && p1 >= 2) {
    constexpr int vi[4] = {0, 1, 2, 3};
    run_group<4, kSiluMul>(x, m, ldx, w, ldw, vi, k_pairs, bias, y, ldy);
    return;
  }
  for (int p = p0; p < std::min(p1, group_passes(16 * vecs, kSiluMul)); ++p) {
    int v[2];
    pass_vectors(vecs, kSiluMul, p, v);
    if (v[1] >= 0) {
      const int vi[2] = {v[0], v[1]};
      run_group<2, kSiluMul>(x, m, ldx, w, ldw, vi, k_pairs, bias, y, ldy);
    } else if constexpr (!kSiluMul) {
      const int vi[1] = {v[0]};
      run_group<1, false>(x, m, ldx, w, ldw, vi, k_pairs, bias, y, ldy);
    }
  }
}


// ---- GGUF blocks: Q4_1, Q8_0 -------------------------------------------------------------------

// One vector block (linear_common.h: 16 columns x 32 k) into the bf16 packed layout at dst (its
// first k pair; k pairs ldw elements apart): each weight computed as gguf's dequantization computes
// it in float32, then rounded to bf16 to nearest even, as torch's conversion does: the bf16 weight
// the file dequantizes to. The d * q products are exact (an 11-bit significand times 4 or 8 bits),
// so Q4_1's fused d * q + m rounds once, as gguf's two operations do.
//
// Lanes of a k pair's vector: (column i / 2, k parity i % 2), columns 0-7 (lo), then 8-15 (hi).
struct BlockScales {
  __m512 lo, hi;
  explicit BlockScales(const uint8_t* fp16x16) {
    const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(fp16x16)));
    lo = _mm512_permutexvar_ps(lo_cols, v);
    hi = _mm512_permutexvar_ps(_mm512_add_epi32(lo_cols, _mm512_set1_epi32(8)), v);
  }
};

// Q4_1: d * q + m, q 4-bit.
inline void dequant_q4_1_block(const uint8_t* blk, bf16* dst, int64_t ldw) {
  const BlockScales d(blk), m(blk + 32);
  // q as float32 by table: vpermps reads only an index's low 4 bits, which are a byte's low nibble,
  // and, shifted, its high one (one shuffle each instead of a mask and a conversion).
  const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const uint8_t* q = blk + 64;
  for (int p = 0; p < 16; ++p) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * p)));
    const __m512 lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, values), d.lo, m.lo);
    const __m512 hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values), d.hi, m.hi);
    _mm512_storeu_si512(dst + p * ldw, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Q8_0: d * q, q 8-bit signed.
inline void dequant_q8_0_block(const uint8_t* blk, bf16* dst, int64_t ldw) {
  const BlockScales d(blk);
  const uint8_t* q = blk + 32;
  for (int p = 0; p < 16; ++p) {
    const __m128i* qp = reinterpret_cast<const __m128i*>(q + 32 * p);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp))), d.lo);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp + 1))), d.hi);
    _mm512_storeu_si512(dst + p * ldw, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// A weight packed in GGUF blocks (linear_common.h): Q4_1 (uint8) or Q8_0 (int8).
struct Blocks {
  const uint8_t* data = nullptr;
  bool q8 = false;
  int64_t block_bytes = 0, k_blocks = 0;

  Blocks(const at::Tensor& packed, int64_t k) {
    q8 = packed.scalar_type() == at::kChar;
    data = static_cast<const uint8_t*>(packed.data_ptr());
    block_bytes = q8 ? sluice_linear::kQ8VectorBlock : sluice_linear::kQ4VectorBlock;
    k_blocks = k / sluice_linear::kBlockK;
  }
  // The blocks of 16-column vector v (columns 16 v ..), one after the other.
  const uint8_t* vector(int64_t v) const { return data + v * k_blocks * block_bytes; }
  void dequant(const uint8_t* blk, bf16* dst, int64_t ldw) const {
    if (q8) dequant_q8_0_block(blk, dst, ldw);
    else dequant_q4_1_block(blk, dst, ldw);
  }
  // The block `ahead` blocks past blk, into L1.
  void prefetch(const uint8_t* blk, int ahead) const {
    const char* p = reinterpret_cast<const char*>(blk) + ahead * block_bytes;
    for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  }
};

// The 16-column vectors vi (-1: none) of the group whose first vector is first_vector (vecs
// vectors) into buf, the group's bf16 packed layout (ldw = 32 vecs elements a k pair).
inline void dequant_vectors(const Blocks& q, int64_t first_vector, int vecs, const int* vi, int count, bf16* buf) {
  const int64_t ldw = 32 * vecs;
  for (int j = 0; j < count; ++j) {
    if (vi[j] < 0) continue;
    const uint8_t* src = q.vector(first_vector + vi[j]);
    for (int64_t b = 0; b < q.k_blocks; ++b) {
      const uint8_t* blk = src + b * q.block_bytes;
      q.prefetch(blk, 4);
      q.dequant(blk, buf + b * 16 * ldw + 32 * vi[j], ldw);
    }
  }
}

// The thread's buffer for a dequantized group (k x 64 bf16 at most), kept between calls.
inline bf16* dequant_buffer(int64_t k) {
  static thread_local std::vector<bf16> buffer;
  if (static_cast<int64_t>(buffer.size()) < k * kGroupCols) buffer.resize(k * kGroupCols);
  return buffer.data();
}

// ---- AMX ---------------------------------------------------------------------------------------

#if SLUICE_HAVE_AMX
constexpr int kTileRows = 16;  // rows of x per A tile, k pairs per B tile
constexpr int kTileK = 32;     // bf16 of K per A tile row (64 bytes)
using AmxTiles = sluice_amx::Tiles;  // tiles 0-3: C; 4-5: A (x rows); 6-7: B (packed weight)

// Cache lines to prefetch into L2 (the next group's weights), per_step of them at each k step.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  void step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// c[16 r + i][16 v + j] (ld 32 floats) = sum over K of a_r[i][:] * column (16 ct[v] + j) of the
// group at w (gw columns wide), for kR row tiles and kV column tiles; tick() runs once per k step
// (vector work that overlaps the tiles': prefetches, the previous block's epilogue).
//
// With q (a weight in GGUF blocks, linear_common.h; the group's first vector first_vector; w
// unused) each k step's B tiles are dequantized first, one block each, into a 1 KiB buffer the
// tile loads then read from L1.
template <int kR, int kV, class Tick>
inline void amx_block(const bf16* const (&a)[2], const int64_t (&lda_bytes)[2], const bf16* w, int64_t gw, int64_t k,
                      const int (&ct)[2], float* c, Tick& tick, const Blocks* q = nullptr, int64_t first_vector = 0) {
  alignas(64) bf16 bq[2][16 * 32];
  _tile_zero(0);
  if constexpr (kV > 1) _tile_zero(1);
  if constexpr (kR > 1) {
    _tile_zero(2);
    if constexpr (kV > 1) _tile_zero(3);
  }
  const int64_t ldb_bytes = gw * 4;
  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    _tile_loadd(4, a[0] + k0, lda_bytes[0]);
    if (q) {
      for (int v = 0; v < kV; ++v) {
        const uint8_t* blk = q->vector(first_vector + ct[v]) + k0 / sluice_linear::kBlockK * q->block_bytes;
        q->prefetch(blk, 8);
        q->dequant(blk, bq[v], 32);
      }
      _tile_loadd(6, bq[0], 64);
      if constexpr (kV > 1) _tile_loadd(7, bq[1], 64);
    } else {
      const bf16* wk = w + k0 * gw;  // k pair k0 / 2: (k0 / 2) * gw * 2 elements
      _tile_loadd(6, wk + 32 * ct[0], ldb_bytes);
      if constexpr (kV > 1) _tile_loadd(7, wk + 32 * ct[1], ldb_bytes);
    }
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kV > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kR > 1) {
      _tile_loadd(5, a[1] + k0, lda_bytes[1]);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kV > 1) _tile_dpbf16ps(3, 5, 7);
    }
    tick();
  }
  _tile_stored(0, c, 128);
  if constexpr (kV > 1) _tile_stored(1, c + 16, 128);
  if constexpr (kR > 1) {
    _tile_stored(2, c + 16 * 32, 128);
    if constexpr (kV > 1) _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// x's rows as A tiles: row tile t starts at x + 16 t rows, except a last partial tile, which reads
// a copy of its rows (made once per call, into the calling thread's buffer) so that no tile load
// runs past x. The copy's other rows hold whatever the buffer held: each output row depends on its
// own A row only, and the rows past m are dropped.
struct AmxRows {
  const bf16* x;
  int64_t ldx, m, k;
  const bf16* pad = nullptr;  // 16 x k

  AmxRows(const bf16* x_, int64_t ldx_, int64_t m_, int64_t k_) : x(x_), ldx(ldx_), m(m_), k(k_) {
    const int64_t rem = m % kTileRows;
    if (rem) {
      static thread_local std::vector<bf16> buffer;  // kept between calls: no allocation per layer
      if (static_cast<int64_t>(buffer.size()) < kTileRows * k) buffer.resize(kTileRows * k);
      for (int64_t r = 0; r < rem; ++r) std::memcpy(&buffer[r * k], x + (m - rem + r) * ldx, k * sizeof(bf16));
      pad = buffer.data();
    }
  }
  bool padded(int64_t t) const { return (t + 1) * kTileRows > m; }
  const bf16* tile(int64_t t) const { return padded(t) ? pad : x + t * kTileRows * ldx; }
  int64_t ld_bytes(int64_t t) const { return (padded(t) ? k : ldx) * static_cast<int64_t>(sizeof(bf16)); }
};

// Rows [r0, r0 + rows) (r0 a multiple of 16) of the group at w, gw columns wide; meanwhile the
// next_bytes that follow the group's weights (the next group this thread computes; 0: none) are
// prefetched into L2, spread over the group's k steps (the hardware prefetchers, left to
// themselves, streamed a decode step's weights at ~2/3 of the read bandwidth).
template <bool kSiluMul>
void amx_group(const AmxRows& xs, int64_t r0, int64_t rows, const bf16* w, int64_t gw, int64_t k, const float* bias,
               bf16* y, int64_t ldy, int64_t next_bytes, int p_begin = 0, int p_end = 2, const Blocks* q = nullptr,
               int64_t first_vector = 0) {
  alignas(64) float c[2][32 * 32];
  const int tiles = static_cast<int>(gw / 16);
  // Column-tile passes as pass_vectors gives them (a 16-column tile is a vector's columns).
  const int npass = group_passes(gw, kSiluMul);
  // Passes [p_begin, p_end) of the group's: a decode-sized call splits the passes of all its
  // groups between the threads.
  p_end = std::min(p_end, npass);
  if (p_begin >= p_end) return;
  const int64_t t_end = (r0 + rows + kTileRows - 1) / kTileRows;
  Prefetch pf;
  if (next_bytes > 0) {
    const int64_t steps = (p_end - p_begin) * ((t_end - r0 / kTileRows + 1) / 2) * (k / kTileK);
    pf.next = reinterpret_cast<const char*>(w + gw * k);
    pf.end = pf.next + next_bytes;
    pf.per_step = (next_bytes / 64 + steps - 1) / steps;
  }
  // A block's epilogue (its C tiles rounded to bf16, or silu(gate) * up) runs during the next
  // block's k steps, a few rows per step, so that the vector work overlaps the tiles' instead of
  // following it (the tiles idle through an epilogue otherwise); the C tiles alternate between
  // two buffers. The same arithmetic on the same sums: the same bits.
  struct Pending {
    const float* c = nullptr;
    int64_t row0 = 0, nrows = 0, done = 0, per_tick = 0;
    int ct[2] = {0, -1};
  } pending;
  auto epilogue_rows = [&](int64_t until) {
    const int64_t end = std::min(until, pending.nrows);
    for (int64_t i = pending.done; i < end; ++i) {
      const float* ci = pending.c + i * 32;
      bf16* yi = y + (pending.row0 - r0 + i) * ldy;
      const int* ct = pending.ct;
      if constexpr (kSiluMul) {
        store_silu_mul(yi + 16 * ct[0], _mm512_load_ps(ci), _mm512_load_ps(ci + 16),
                       bias ? bias + 16 * ct[0] : nullptr, bias ? bias + 16 * ct[1] : nullptr);
      } else {
        for (int v = 0; v < (ct[1] >= 0 ? 2 : 1); ++v)
          store_plain(yi + 16 * ct[v], _mm512_load_ps(ci + 16 * v), bias ? bias + 16 * ct[v] : nullptr);
      }
    }
    pending.done = end;
  };
  auto tick = [&] {
    pf.step();
    epilogue_rows(pending.done + pending.per_tick);
  };
  const int64_t k_steps = k / kTileK;
  int buffer = 0;
  for (int p = p_begin; p < p_end; ++p) {
    int ct[2];
    pass_vectors(tiles, kSiluMul, p, ct);
    const bool two_cols = ct[1] >= 0;
    for (int64_t t = r0 / kTileRows; t < t_end; t += 2) {
      const bool two_rows = t + 1 < t_end;
      const bf16* a[2] = {xs.tile(t), two_rows ? xs.tile(t + 1) : nullptr};
      const int64_t lda[2] = {xs.ld_bytes(t), two_rows ? xs.ld_bytes(t + 1) : 0};
      float* cb = c[buffer];
      if (two_rows) {
        if (two_cols) amx_block<2, 2>(a, lda, w, gw, k, ct, cb, tick, q, first_vector);
        else amx_block<2, 1>(a, lda, w, gw, k, ct, cb, tick, q, first_vector);
      } else {
        if (two_cols) amx_block<1, 2>(a, lda, w, gw, k, ct, cb, tick, q, first_vector);
        else amx_block<1, 1>(a, lda, w, gw, k, ct, cb, tick, q, first_vector);
      }
      epilogue_rows(pending.nrows);  // whatever the block's k steps left of the previous one
      const int64_t row0 = t * kTileRows;
      pending.c = cb;
      pending.row0 = row0;
      pending.nrows = std::min<int64_t>(two_rows ? 32 : 16, r0 + rows - row0);
      pending.done = 0;
      pending.per_tick = (pending.nrows + k_steps - 1) / k_steps;
      pending.ct[0] = ct[0];
      pending.ct[1] = ct[1];
      buffer ^= 1;
    }
  }
  epilogue_rows(pending.nrows);
}

#endif  // SLUICE_HAVE_AMX

// Columns [g * 64, ...) of the group g; the last group may be 16, 32 or 48 wide.
//
// Below two row blocks (decodes, verification, short prompts) the groups' half-group passes are
// split between the threads up front: there a step is mostly the weights' pass through the cores,
// and each thread streams its own contiguous half. From two row blocks on (prefill chunks) the
// work items are a block of rows times a run of groups, row blocks first, dealt from a shared
// counter (the AVX2 kernel's scheme, linear_avx2.cpp): when one core is slowed by something else
// (the server's Python thread, a benchmark client, a neighbour on the host) the other takes more
// items instead of waiting at the join. A group's weight slice is then read once per row block
// instead of once, from L3 at these sizes. Which item computes an output does not change its
// bits: every row tile runs the same sums in the same order.
constexpr int64_t kRowBlock = 96;  // 16 row tiles; x's block (<= 96 x 1536 bf16) stays in L2
// Measured (docs/measured/s36/gemm-ab.txt: 30 layers' projections, 2 threads): with one core 30%
// busy elsewhere, 200 / 336 / 512 rows ran 0-13% faster dealt than split up front; on idle cores
// the same (the 9- and 15-group projections' 5 / 4 and 8 / 7 split costs nothing measurable), but
// dealt from 96 rows was 4% slower at 96.
constexpr int64_t kDealMinRows = 2 * kRowBlock;

template <bool kSiluMul>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const float* bias, at::Tensor& y) {
  const int64_t m = x.size(0), ldx = x.stride(0), ldy = y.stride(0), k_pairs = k / 2;
  const int64_t groups = (n + kGroupCols - 1) / kGroupCols;
  const bf16* xp = reinterpret_cast<const bf16*>(x.data_ptr<c10::BFloat16>());
  // bf16 packed weights, or GGUF blocks (Q4_1: uint8, Q8_0: int8).
  std::optional<Blocks> blocks;
  if (packed.scalar_type() != at::kBFloat16) blocks.emplace(packed, k);
  const bf16* wp = blocks ? nullptr : reinterpret_cast<const bf16*>(packed.data_ptr<c10::BFloat16>());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr<c10::BFloat16>());
#if SLUICE_HAVE_AMX
  const bool amx = k % kTileK == 0 && sluice_amx::on();
  std::optional<AmxRows> amx_rows;
  if (amx) amx_rows.emplace(xp, ldx, m, k);
#endif
  // Rows [r0, r0 + rows) of group g, its passes [p0, p1) (group_passes); the thread's next group
  // is g + 1 if g + 1 < g_end.
  auto group = [&](int64_t g, int64_t r0, int64_t rows, int64_t g_end, int p0 = 0, int p1 = 2) {
    const int64_t col = g * kGroupCols;
    const int vecs = static_cast<int>(std::min<int64_t>(kGroupCols, n - col) / 16);
    const bf16* wg = blocks ? nullptr : wp + col * k;
    const float* bg = bias ? bias + col : nullptr;
#if SLUICE_HAVE_AMX
    // Up to two row tiles on AMX: each k step's B tiles dequantized as the tiles need them.
    const bool per_step = blocks && amx && rows <= 2 * kTileRows;
#else
    const bool per_step = false;
#endif
    if (blocks && !per_step) {  // the vectors of passes [p0, p1) into the thread's buffer, computed from there
      bf16* buf = dequant_buffer(k);
      for (int p = p0; p < std::min(p1, group_passes(16 * vecs, kSiluMul)); ++p) {
        int v[2];
        pass_vectors(vecs, kSiluMul, p, v);
        dequant_vectors(*blocks, col / 16, vecs, v, 2, buf);
      }
      wg = buf;
    }
#if SLUICE_HAVE_AMX
    if (amx) {
      const int64_t next_bytes = !blocks && g + 1 < g_end ? std::min<int64_t>(kGroupCols, n - col - kGroupCols) * k * 2 : 0;
      amx_group<kSiluMul>(*amx_rows, r0, rows, wg, 16 * vecs, k, bg, yp + r0 * ldy + (kSiluMul ? col / 2 : col), ldy,
                          next_bytes, p0, p1, per_step ? &*blocks : nullptr, col / 16);
      return;
    }
#endif
    vector_group<kSiluMul>(xp + r0 * ldx, rows, ldx, wg, vecs, p0, p1, k_pairs, bg,
                           yp + r0 * ldy + (kSiluMul ? col / 2 : col), ldy);
  };
  if (m < kDealMinRows) {
    // One group is ~K * 128 bytes of weight and 2 * M * K * 64 flops; below ~2 groups per thread
    // of work for a tiny M the fork costs more than it saves, so let at::parallel_for decide.
    const int64_t grain = m * k >= 4096 ? 1 : 4;
    // Split by the groups' passes (half a 64-column group each) rather than by groups: the
    // projections of 9 and 15 groups (576 and 960 columns) split 5 / 4 and 8 / 7 by groups, and
    // the thread with one group less waited at the join for a fifth and an eighth of the call
    // (docs/measured/s47/gemm-split.txt, on AMX: 30 layers' projections 2-8% faster split by
    // passes; s48 the vector path). Every group but the last has 2 passes; a thread's whole
    // groups still run in one sweep each, so only a group the split cuts runs pass by pass.
    // Which thread computes a column does not change its bits.
    const int64_t last_w = n - (groups - 1) * kGroupCols;
    const int64_t units = 2 * (groups - 1) + group_passes(std::min<int64_t>(kGroupCols, last_w), kSiluMul);
    at::parallel_for(0, units, 2 * grain, [&](int64_t u0, int64_t u1) {
#if SLUICE_HAVE_AMX
      std::optional<AmxTiles> tiles;
      if (amx) tiles.emplace();
#endif
      const int64_t g_last = (u1 - 1) / 2;  // every unit of a group g is 2 g or 2 g + 1
      for (int64_t g = u0 / 2; g <= g_last; ++g) {
        const int p0 = static_cast<int>(std::max<int64_t>(u0 - 2 * g, 0));
        const int p1 = static_cast<int>(std::min<int64_t>(u1 - 2 * g, 2));
        group(g, 0, m, g_last + 1, p0, p1);
      }
    });
    return;
  }
  const int threads = std::max(1, at::get_num_threads());
  const int64_t run_len = std::max<int64_t>(1, groups / (8 * threads));
  const int64_t runs = (groups + run_len - 1) / run_len;
  int64_t row_block = kRowBlock;
#if SLUICE_HAVE_AMX
  // On AMX a group's weights are the slower operand to fetch (a 96-row block's products take
  // ~10 us): deal runs of groups over all rows, each weight read once (docs/measured/s44/:
  // 512 rows, 30 layers' projections 81 -> 72 ms; as fast as splitting the groups up front).
  if (amx) row_block = m;
#endif
  const int64_t items = (m + row_block - 1) / row_block * runs;
  std::atomic<int64_t> next_item{0};
  auto work = [&](int64_t, int64_t) {
#if SLUICE_HAVE_AMX
    std::optional<AmxTiles> tiles;
    if (amx) tiles.emplace();
#endif
    for (int64_t it = next_item.fetch_add(1); it < items; it = next_item.fetch_add(1)) {
      const int64_t r0 = it / runs * row_block, rows = std::min<int64_t>(row_block, m - r0);
      const int64_t g0 = it % runs * run_len, g1 = std::min(groups, g0 + run_len);
      for (int64_t g = g0; g < g1; ++g) group(g, r0, rows, g1);
    }
  };
  const int64_t workers = std::min<int64_t>(threads, items);
  if (workers <= 1) work(0, 1);
  else at::parallel_for(0, workers, 1, work);
}

struct Avx512 {
  static constexpr bool kBlocks = true;
  static void unpack(const at::Tensor& packed, int64_t n, int64_t k, c10::BFloat16* out) {
    const Blocks q(packed, k);
    const int64_t groups = (n + kGroupCols - 1) / kGroupCols;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t col = g * kGroupCols;
        const int vecs = static_cast<int>(std::min<int64_t>(kGroupCols, n - col) / 16);
        const int vi[4] = {0, 1, 2, 3};
        dequant_vectors(q, col / 16, vecs, vi, vecs, reinterpret_cast<bf16*>(out) + col * k);
      }
    });
  }
  static bool set_amx(bool enable) { return sluice_amx::set(enable); }
  static bool amx_enabled() { return sluice_amx::on(); }
  template <bool kSiluMul>
  static void run(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, const float* bias, at::Tensor& y) {
    ::run<kSiluMul>(x, packed, n, k, bias, y);
  }
};

}  // namespace

SLUICE_DEFINE_LINEAR_OPS(Avx512)
