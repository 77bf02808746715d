// AMX tiles in software, for checking the tile kernels (pagedattn/csrc/quant_amx_cpu.h) on CPUs
// without AMX: include this first and build with -DPAGEDATTN_AMX_EMULATE. It replaces the tile
// intrinsics the kernels use with functions over 8 thread-local tiles, and checks what the
// hardware would refuse (#UD): an unconfigured tile, rows or bytes past the configuration, a
// product whose shapes do not meet (A's bytes per row = 4 x B's rows, C's = B's, C's rows = A's).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace amx_emulator {

struct Tile {
  int rows = 0, colsb = 0;
  alignas(64) uint8_t data[16][64];
};

inline Tile* tiles() {
  static thread_local Tile t[8];
  return t;
}

[[noreturn]] inline void refuse(const char* what, int t) {
  std::fprintf(stderr, "amx_emulator: %s (tile %d)\n", what, t);
  std::abort();
}

inline Tile& tile(int t) {
  if (t < 0 || t > 7) refuse("no such tile", t);
  Tile& x = tiles()[t];
  if (x.rows == 0 || x.colsb == 0) refuse("tile not configured", t);
  return x;
}

// Palette 1: byte 0 palette, bytes 16-47 bytes per row (uint16 each), bytes 48-63 rows.
inline void loadconfig(const void* cfg) {
  const uint8_t* p = static_cast<const uint8_t*>(cfg);
  if (p[0] != 1) refuse("palette is not 1", -1);
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, p + 16 + 2 * t, 2);
    const int rows = p[48 + t];
    if (rows > 16 || colsb > 64) refuse("configured past 16 rows of 64 bytes", t);
    tiles()[t].rows = rows;
    tiles()[t].colsb = colsb;
    std::memset(tiles()[t].data, 0, sizeof(tiles()[t].data));
  }
}

inline void loadd(int t, const void* base, int64_t stride) {
  Tile& x = tile(t);
  std::memset(x.data, 0, sizeof(x.data));
  for (int r = 0; r < x.rows; ++r) {
    std::memcpy(x.data[r], static_cast<const uint8_t*>(base) + r * stride, x.colsb);
  }
}

inline void stored(int t, void* base, int64_t stride) {
  Tile& x = tile(t);
  for (int r = 0; r < x.rows; ++r) {
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, x.data[r], x.colsb);
  }
}

inline void zero(int t) { std::memset(tile(t).data, 0, sizeof(tile(t).data)); }

// TDPBSSD: C[m][n] += sum over k, i < 4 of int8 A[m][4k + i] * int8 B[k][4n + i].
inline void dpbssd(int c, int a, int b) {
  Tile &C = tile(c), &A = tile(a), &B = tile(b);
  if (A.colsb != 4 * B.rows || C.colsb != B.colsb || C.rows != A.rows) {
    refuse("tile shapes do not meet", c);
  }
  for (int m = 0; m < C.rows; ++m) {
    for (int n = 0; n < C.colsb / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, C.data[m] + 4 * n, 4);
      for (int k = 0; k < B.rows; ++k) {
        for (int i = 0; i < 4; ++i) {
          acc += static_cast<int8_t>(A.data[m][4 * k + i]) * static_cast<int8_t>(B.data[k][4 * n + i]);
        }
      }
      std::memcpy(C.data[m] + 4 * n, &acc, 4);
    }
  }
}

}  // namespace amx_emulator

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#define _tile_loadconfig(cfg) amx_emulator::loadconfig(cfg)
#define _tile_loadd(t, base, stride) amx_emulator::loadd(t, base, stride)
#define _tile_stored(t, base, stride) amx_emulator::stored(t, base, stride)
#define _tile_zero(t) amx_emulator::zero(t)
#define _tile_dpbssd(c, a, b) amx_emulator::dpbssd(c, a, b)
