// The interleaved Q4_K, Q6_K and Q8_0 layers (quant_x8_cpu.h) on AMX-INT8 tiles, for calls with
// many activation rows: two x8 groups (16 weight rows) against 16 or 32 activation rows at a time.
//
// The AVX-512 VNNI kernels add 64 int8 products per instruction; one TDPBSSD adds 16 x 16 x 32.
// The weights' scales change every 32 values (Q4_K sub-blocks, Q8_0 blocks) or 16 (Q6_K
// groups), so each tile product covers one of them, as llama.cpp's AMX kernels do:
//
// - Weights (B, 16 columns): a sub-block of the two groups unpacked to int8 in the tiles' VNNI
//   layout. The x8 layout already holds 4 consecutive values of each row side by side, so tile
//   row c is the group's 32-byte column c next to the other group's: Q4_K nibbles as they are
//   (0..15), Q6_K values with the 32 taken off (-32..31), Q8_0 values as stored.
// - Activations (A, 16 rows): the Q8_K / Q8_0 blocks as quantised, read in place (a tile load
//   with the activation row's stride), so rows must come in sixteens (QuantLinear pads them).
// - Each product's int32 tile is stored and its rows scaled into float sums with the sub-block's
//   16 integer scales (float products of integers below 2^24 are exact), then each superblock
//   ends as the VNNI kernel's does: d, dmin, the mins (Q4_K). The sums are the VNNI kernels'
//   integer sums, so the outputs are the same bit for bit while every partial sum of a
//   superblock stays below 2^24 in magnitude (one Q6_K group's product can reach 2^23 only with
//   every activation at +-127 and every value at its extreme), and a token's output does not
//   depend on whether its step ran the tiles.
//
// Compiled where the compiler targets AMX-INT8 (-march=native on an AMX CPU, PAGEDATTN_HAS_AMX
// in amx_cpu.h); tests/cpu/amx_emulator.h runs the same code with the tile instructions done in
// software on CPUs without AMX (PAGEDATTN_AMX_EMULATE). Untimed on AMX hardware as written:
// the tuner (tune_quant_amx_rows) decides from how many rows it runs, never by default.
#pragma once

#include "amx_cpu.h"
#include "quant_x8_legacy_cpu.h"

#if (defined(PAGEDATTN_HAS_AMX) && defined(__AMX_INT8__) || defined(PAGEDATTN_AMX_EMULATE)) && \
    defined(PAGEDATTN_QUANT_VNNI) && defined(__AVX512BW__)
#define PAGEDATTN_QUANT_AMX 1
#endif

#ifdef PAGEDATTN_QUANT_AMX
namespace pagedattn_quant {
namespace x8_amx {

constexpr int kRows = 16;  // activation rows per A tile, weight rows (two x8 groups) per B tile

// The tiles for sub-blocks of `values` values (32: Q4_K, Q8_0; 16: Q6_K), in this thread:
// 0-1 the weights of two sub-blocks, 2-3 the activations of the same two, 4-5 their products.
// (GCC's tile intrinsics paste the tile number into the instruction: literals below.)
inline void configure(int values) {
  pagedattn_amx::TileConfig cfg;
  for (int t : {0, 1}) cfg.set(t, values / 4, 64);
  for (int t : {2, 3}) cfg.set(t, kRows, values);
  for (int t : {4, 5}) cfg.set(t, kRows, 64);
  cfg.load();
}

// Group 0's 32 bytes at a, group 1's at b: one 64-byte tile row (16 weight rows x 4 values).
inline __m512i join(const void* a, const void* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(static_cast<const __m256i*>(b)), 1);
}
// 8 fp16 values of each group as 16 floats.
inline __m512 halves(const uint16_t* a, const uint16_t* b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(x), y, 1));
}
// 8 scale bytes of each group as 16 floats.
inline __m128i bytes16(const void* a, const void* b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(static_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(static_cast<const __m128i*>(b)));
}
inline __m512 unsigned_scales(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(a, b)));
}
inline __m512 signed_scales(const int8_t* a, const int8_t* b) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(a, b)));
}

// Two tile products of one row tile: C0 = A(a0) . B0, C1 = A(a1) . B1, stored as int32 [16][16].
inline void products(const int8_t* w0, const int8_t* w1, const int8_t* a0, const int8_t* a1,
                     int64_t stride, int32_t (*c)[kRows][16]) {
  // NOTE: GCC's tileloadd does not say it reads memory: without the clobber the stores that
  // unpacked the weights could be dropped as dead (linear_amx_cpu.cpp's widen_tile does the same).
  asm volatile("" : : "r"(w0), "r"(w1) : "memory");
  _tile_loadd(0, w0, 64);
  _tile_loadd(1, w1, 64);
  _tile_loadd(2, a0, stride);
  _tile_loadd(3, a1, stride);
  _tile_zero(4);
  _tile_zero(5);
  _tile_dpbssd(4, 2, 0);
  _tile_dpbssd(5, 3, 1);
  _tile_stored(4, c[0], 64);
  _tile_stored(5, c[1], 64);
}

// sum[m] += C0[m] * s0 + C1[m] * s1 (float; exact while the sums stay below 2^24).
inline void scale_into(__m512* sum, const int32_t (*c)[kRows][16], __m512 s0, __m512 s1) {
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) {
    sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[0][m])), s0, sum[m]);
    sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[1][m])), s1, sum[m]);
  }
}

// sum[m] = the sum over a superblock's Subs sub-blocks (of Values values) s of the products of
// activation row m's sub-block s (rows at a + m * stride) with the weights' (wt[s]), * sc[s].
template <int Subs, int Values>
inline void superblock_sums(const int8_t (*wt)[Values / 4][64], const int8_t* a, int64_t stride,
                            const __m512* sc, __m512* sum) {
  alignas(64) int32_t c[2][kRows][16];
  for (int m = 0; m < kRows; ++m) sum[m] = _mm512_setzero_ps();
  for (int s = 0; s < Subs; s += 2) {
    products(wt[s][0], wt[s + 1][0], a + Values * s, a + Values * (s + 1), stride, c);
    scale_into(sum, c, sc[s], sc[s + 1]);
  }
}

// out[m * 16 + n] = row n of the groups (g0: rows 0-7, g1: 8-15) . activation row m, for
// rows16 activation rows (a multiple of 16; row m's nb blocks at act + m * nb). Per type:
inline void q4_k(const BlockQ4_Kx8* g0, const BlockQ4_Kx8* g1, int64_t nb, const ActQ8_K* act,
                 int64_t rows16, float* out) {
  alignas(64) int8_t wt[8][8][64];  // [sub-block][tile row]
  const int64_t stride = nb * static_cast<int64_t>(sizeof(ActQ8_K));
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  std::memset(out, 0, sizeof(float) * 16 * rows16);
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ4_Kx8 &w0 = g0[b], &w1 = g1[b];
    prefetch_ahead(&w0);
    prefetch_ahead(&w1);
    for (int i = 0; i < 4; ++i) {
      for (int r = 0; r < 8; ++r) {
        const __m512i q = join(w0.qs[i][r], w1.qs[i][r]);
        _mm512_store_si512(wt[2 * i][r], _mm512_and_si512(q, m4));
        _mm512_store_si512(wt[2 * i + 1][r], _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
      }
    }
    __m512 sc[8];
    for (int j = 0; j < 8; ++j) sc[j] = unsigned_scales(w0.sc[j], w1.sc[j]);
    __m512i mins[4];  // as gemm_q4_k_x8's, 16 rows
    for (int p = 0; p < 4; ++p) {
      mins[p] = _mm512_inserti64x4(_mm512_castsi256_si512(pair_bytes(w0.mn[2 * p], w0.mn[2 * p + 1])),
                                   pair_bytes(w1.mn[2 * p], w1.mn[2 * p + 1]), 1);
    }
    const __m512 d = halves(w0.d, w1.d), dmin = halves(w0.dmin, w1.dmin);
    for (int64_t m0 = 0; m0 < rows16; m0 += kRows) {
      const ActQ8_K* a = act + m0 * nb + b;
      __m512 sum[kRows];
      superblock_sums<8, 32>(wt, a->qs, stride, sc, sum);
      for (int m = 0; m < kRows; ++m) {
        const ActQ8_K& am = a[m * nb];
        __m512i msum = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) {
          int32_t s;
          std::memcpy(&s, am.sums32 + 2 * p, 4);
          msum = _mm512_add_epi32(msum, _mm512_madd_epi16(mins[p], _mm512_set1_epi32(s)));
        }
        const __m512 ad = _mm512_set1_ps(am.d);
        float* o = out + (m0 + m) * 16;
        __m512 acc = _mm512_loadu_ps(o);
        acc = _mm512_fmadd_ps(sum[m], _mm512_mul_ps(d, ad), acc);
        acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, ad), acc);
        _mm512_storeu_ps(o, acc);
      }
    }
  }
}

inline void q6_k(const BlockQ6_Kx8* g0, const BlockQ6_Kx8* g1, int64_t nb, const ActQ8_K* act,
                 int64_t rows16, float* out) {
  alignas(64) int8_t wt[16][4][64];  // [16-value group][tile row]
  const int64_t stride = nb * static_cast<int64_t>(sizeof(ActQ8_K));
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
  std::memset(out, 0, sizeof(float) * 16 * rows16);
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_Kx8 &w0 = g0[b], &w1 = g1[b];
    prefetch_ahead<BlockQ6_Kx8, PAGEDATTN_QUANT_HINT>(&w0);
    prefetch_ahead<BlockQ6_Kx8, PAGEDATTN_QUANT_HINT>(&w1);
    // Column c of chunk i holds values 64i + 4c + k (low nibbles: group 4i + c / 4, tile row
    // c % 4) and 64i + 32 + 4c + k (high nibbles: group 4i + 2 + c / 4); highs as gemm_q6_k_x8.
    for (int i = 0; i < 4; ++i) {
      for (int cp = 0; cp < 4; ++cp) {
        const __m512i hb = join(w0.qh[i][cp], w1.qh[i][cp]);
        for (int e = 0; e < 2; ++e) {
          const int col = 2 * cp + e;
          const __m512i q = join(w0.ql[i][col], w1.ql[i][col]);
          const __m512i h_lo = e == 0 ? _mm512_slli_epi16(hb, 4) : hb;
          const __m512i h_hi = e == 0 ? _mm512_slli_epi16(hb, 2) : _mm512_srli_epi16(hb, 2);
          const __m512i lo = _mm512_or_si512(_mm512_and_si512(q, m4), _mm512_and_si512(h_lo, m30));
          const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                                             _mm512_and_si512(h_hi, m30));
          _mm512_store_si512(wt[4 * i + col / 4][col % 4], _mm512_sub_epi8(lo, k32));
          _mm512_store_si512(wt[4 * i + 2 + col / 4][col % 4], _mm512_sub_epi8(hi, k32));
        }
      }
    }
    __m512 sc[16];
    for (int g = 0; g < 16; ++g) sc[g] = signed_scales(w0.sc[g], w1.sc[g]);
    const __m512 d = halves(w0.d, w1.d);
    for (int64_t m0 = 0; m0 < rows16; m0 += kRows) {
      const ActQ8_K* a = act + m0 * nb + b;
      __m512 sum[kRows];
      superblock_sums<16, 16>(wt, a->qs, stride, sc, sum);
      for (int m = 0; m < kRows; ++m) {
        float* o = out + (m0 + m) * 16;
        const __m512 ad = _mm512_set1_ps(a[m * nb].d);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(sum[m], _mm512_mul_ps(d, ad), _mm512_loadu_ps(o)));
      }
    }
  }
}

inline void q8_0(const BlockQ8_0x8* g0, const BlockQ8_0x8* g1, int64_t nb, const ActQ8_0* act,
                 int64_t rows16, float* out) {
  alignas(64) int8_t wt[2][8][64];  // two blocks
  alignas(64) int32_t c[2][kRows][16];
  const int64_t stride = nb * static_cast<int64_t>(sizeof(ActQ8_0));
  std::memset(out, 0, sizeof(float) * 16 * rows16);
  for (int64_t b = 0; b < nb; b += 2) {
    // Two blocks per pair of products; an odd count's last block pairs with zero weights.
    const bool two = b + 1 < nb;
    const int64_t b1 = two ? b + 1 : b;
    for (int k = 0; k < (two ? 2 : 1); ++k) {
      const BlockQ8_0x8 &w0 = g0[b + k], &w1 = g1[b + k];
      prefetch_span(reinterpret_cast<const char*>(&w0) + kRowPrefetchBytes, sizeof(w0));
      prefetch_span(reinterpret_cast<const char*>(&w1) + kRowPrefetchBytes, sizeof(w1));
      for (int r = 0; r < 8; ++r) _mm512_store_si512(wt[k][r], join(w0.qs[r], w1.qs[r]));
    }
    if (!two) std::memset(wt[1], 0, sizeof(wt[1]));
    const __m512 d0 = halves(g0[b].d, g1[b].d), d1 = halves(g0[b1].d, g1[b1].d);
    for (int64_t m0 = 0; m0 < rows16; m0 += kRows) {
      const ActQ8_0* a = act + m0 * nb;
      products(wt[0][0], wt[1][0], a[b].qs, a[b1].qs, stride, c);
      for (int m = 0; m < kRows; ++m) {
        const ActQ8_0* am = a + m * nb;
        float* o = out + (m0 + m) * 16;
        __m512 acc = _mm512_loadu_ps(o);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[0][m])),
                              _mm512_mul_ps(d0, _mm512_set1_ps(am[b].d)), acc);
        if (two) {
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[1][m])),
                                _mm512_mul_ps(d1, _mm512_set1_ps(am[b1].d)), acc);
        }
        _mm512_storeu_ps(o, acc);
      }
    }
  }
}

// The kernel of `type` (Q4_K, Q6_K or Q8_0) on two x8 groups: see q4_k. act: ActQ8_K blocks
// for the K types, ActQ8_0 for Q8_0. The tiles must be configured for the type (values()).
inline void gemm_pair(int type, const uint8_t* g0, const uint8_t* g1, int64_t nb, const void* act,
                      int64_t rows16, float* out) {
  if (type == kQ4_K) {
    q4_k(reinterpret_cast<const BlockQ4_Kx8*>(g0), reinterpret_cast<const BlockQ4_Kx8*>(g1), nb,
         static_cast<const ActQ8_K*>(act), rows16, out);
  } else if (type == kQ6_K) {
    q6_k(reinterpret_cast<const BlockQ6_Kx8*>(g0), reinterpret_cast<const BlockQ6_Kx8*>(g1), nb,
         static_cast<const ActQ8_K*>(act), rows16, out);
  } else {
    q8_0(reinterpret_cast<const BlockQ8_0x8*>(g0), reinterpret_cast<const BlockQ8_0x8*>(g1), nb,
         static_cast<const ActQ8_0*>(act), rows16, out);
  }
}

// The values per tile product (configure's argument) of `type`.
inline int values(int type) { return type == kQ6_K ? 16 : 32; }

}  // namespace x8_amx
}  // namespace pagedattn_quant
#endif  // PAGEDATTN_QUANT_AMX
