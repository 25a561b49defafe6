// AMX tiles for the AVX-512 kernel set (linear.cpp, paged_attention.cpp) on CPUs that have them
// (Sapphire Rapids and later; the kernels are built with -march=native, which defines __AMX_BF16__
// there). One switch for all of them: on by default where Linux grants the tile state,
// `SLUICE_CPU_AMX=0` at first use or torch.ops.sluice.linear_set_amx(False) turns it off.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SLUICE_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SLUICE_HAVE_AMX 0
#endif

namespace sluice_amx {

inline std::atomic<int> g_amx{-1};  // -1: not decided yet; 0 off; 1 on

// Linux hands out the 8 KiB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), once per
// process; every thread of the process may then use the tiles.
inline bool permitted() {
#if SLUICE_HAVE_AMX
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

inline bool on() {
  int v = g_amx.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("SLUICE_CPU_AMX");
    v = permitted() && !(env && std::strcmp(env, "0") == 0) ? 1 : 0;
    g_amx.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

inline bool set(bool enable) {
  const bool v = enable && permitted();
  g_amx.store(v ? 1 : 0, std::memory_order_relaxed);
  return v;
}

#if SLUICE_HAVE_AMX
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles as 16 rows of 64 bytes: C (16 x 16 float32), A (16 rows x 32 bf16) and B
// (16 bf16 pairs x 16 columns) alike. Configures the calling thread's tiles for a scope and
// releases them after it (so that a context switch need not save them).
//
// `rows` < 16 shortens tiles 0-5 (C and A) to that many rows, for work on fewer rows than a tile
// (attention's decodes: 3 query heads per kv head): their products and stores cost less.
struct Tiles {
  explicit Tiles(int rows = 16) {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
      c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};
#endif

}  // namespace sluice_amx
