// AMX helpers shared by the tile kernels (linear_amx_cpu.cpp, paged_attention_cpu.cpp,
// quant_amx_cpu.h). PAGEDATTN_HAS_AMX is defined where the compiler targets AMX-BF16
// (-march=native on an AMX CPU) on Linux; elsewhere the tile code is not compiled and
// linear_amx_available() is false. PAGEDATTN_AMX_EMULATE: the tile instructions come from
// tests/cpu/amx_emulator.h (a test build on a CPU without AMX).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define PAGEDATTN_HAS_AMX 1
#endif

#if defined(PAGEDATTN_HAS_AMX) || defined(PAGEDATTN_AMX_EMULATE)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pagedattn_amx {

// A tile configuration (palette 1): set(tile, rows, bytes per row) for each tile used, then
// load() it into the calling thread (the configuration is per thread).
class TileConfig {
 public:
  TileConfig() {
    std::memset(&cfg_, 0, sizeof(cfg_));
    cfg_.palette_id = 1;
  }

  void set(int tile, int64_t rows, int64_t colsb) {
    cfg_.rows[tile] = static_cast<uint8_t>(rows);
    cfg_.colsb[tile] = static_cast<uint16_t>(colsb);
  }

  void load() const {
    // NOTE: GCC 12 does not see that ldtilecfg reads the configuration and drops the stores
    // that filled it; the empty asm with a memory clobber keeps them.
    asm volatile("" : : "r"(&cfg_) : "memory");
    _tile_loadconfig(&cfg_);
  }

 private:
  struct alignas(64) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg_;
};

}  // namespace pagedattn_amx
#endif  // PAGEDATTN_HAS_AMX || PAGEDATTN_AMX_EMULATE
