// What the CPU kernels of every instruction set share.
#pragma once

#include <cstdint>
#include <type_traits>

namespace sluice_simd {

using bf16 = uint16_t;  // raw bfloat16 bits

// tile(r, std::integral_constant<int, R>{}) over rows [0, m): tiles of kTile rows, then one of the
// R < kTile rows left, if any.
template <int R, class F>
inline void last_tile(int64_t r, int64_t left, F& tile) {
  if constexpr (R > 0) {
    if (left == R)
      tile(r, std::integral_constant<int, R>{});
    else
      last_tile<R - 1>(r, left, tile);
  }
}

template <int kTile, class F>
inline void for_row_tiles(int64_t m, F&& tile) {
  int64_t r = 0;
  for (; r + kTile <= m; r += kTile) tile(r, std::integral_constant<int, kTile>{});
  last_tile<kTile - 1>(r, m - r, tile);
}

}  // namespace sluice_simd
