// Q2_K and Q3_K, the 2- and 3-bit K types (most tensors of Q2_K and Q3_K_S/M/L files): their
// rows as stored (dequantised, and met with activations in plain C++ for a part whose row count
// is not a multiple of 8) and their x8 layout and GEMM, as quant_x8_cpu.h's for Q4_K.
//
//   Q2_K  16 B scales (low nibble: scale, high: min), 64 B of 2-bit values q, d, dmin:
//         x = d * sc * q - dmin * m                                               84 B / 256
//   Q3_K  32 B of high bits, 64 B of 2-bit lows, 12 B of 6-bit scales, d:
//         x = d * (sc - 32) * (q - 4), q = low | high << 2                        110 B / 256
//
// Both keep value 128h + 32j + l (h < 2, j < 4, l < 32) at bits 2j..2j+1 of qs byte 32h + l
// (Q3_K: its high bit at bit 4h + j of hmask byte l); each 16 values have their own scale.
//
// The x8 blocks keep qs four bytes of each of 8 rows to a 32-byte column (one load holds one
// column's values for 4 groups: a shift by 2j and a mask take group j's), Q3_K's hmask the same
// way, d (and dmin) per row, and the scales per group and row: Q2_K's packed bytes as stored
// (84 B per row and superblock), Q3_K's as int8 (sc - 32; 114 B against 110: the 6-bit packing
// would cost the kernel a scalar unpack per block). Values are unsigned (Q3_K: 0..7, its -4
// taken out with the activation's 16-value sums, Q2_K's minimums likewise), so the group sums
// are SubBlockSum's, as for the other K types; with VNNI a row's two group sums fit in int16
// and one vpdpwssd applies both scales where the others take two vpmulld (1.04-1.10x at 8-32
// activation rows, AMD Zen 4, 2 threads, in one process). Two groups at once on 512-bit
// vectors: quant_x8_zmm_cpu.h. Each row's sum does not depend on how many activation rows meet
// it.
#pragma once

#include "quant_x8_cpu.h"

namespace pagedattn_quant {

#pragma pack(push, 1)
struct BlockQ2_Kx8 {
  uint16_t d[8];
  uint16_t dmin[8];
  uint8_t sc[16][8];     // [16-value group][row]: scale | min << 4, as stored
  uint8_t qs[2][8][32];  // [128-value half][4-byte column c][row r: bytes 4r..4r+3]
};
struct BlockQ3_Kx8 {
  uint16_t d[8];
  int8_t sc[16][8];      // [16-value group][row]: scale - 32
  uint8_t qs[2][8][32];  // as BlockQ2_Kx8::qs
  uint8_t hm[8][32];     // [4-byte column c][row r: bytes 4r..4r+3]: row r's hmask bytes 4c..
};
#pragma pack(pop)
static_assert(sizeof(BlockQ2_Kx8) == 8 * sizeof(BlockQ2_K), "Q2_K x8 block size");
static_assert(sizeof(BlockQ3_Kx8) == 912, "Q3_K x8 block size");

// The 16 scales of a Q3_K block, minus 32 (llama.cpp's 6-bit packing).
inline void q3_k_scales(const uint8_t* s, int8_t* sc) {
  for (int k = 0; k < 16; ++k) {
    const int lo = (s[k % 8] >> (4 * (k / 8))) & 0xF, hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
    sc[k] = static_cast<int8_t>((lo | hi << 4) - 32);
  }
}

// The 256 values of a Q2_K (0..3) or Q3_K (0..7, before the -4) block from its qs and hmask.
template <int T>
inline void unpack_q23_k(const uint8_t* qs, const uint8_t* hmask, uint8_t* v) {
  for (int n = 0; n < 256; ++n) {
    const int h = n / 128, j = n % 128 / 32, l = n % 32;
    int q = (qs[32 * h + l] >> (2 * j)) & 3;
    if constexpr (T == kQ3_K) q |= ((hmask[l] >> (4 * h + j)) & 1) << 2;
    v[n] = static_cast<uint8_t>(q);
  }
}

// Block b of a row as stored: values, the scale (Q3_K: -32 applied) and minimum of each group.
template <int T>
inline void unpack_q23_k_block(const uint8_t* blk, uint8_t* v, int* sc, int* mn, float* d,
                               float* dmin) {
  if constexpr (T == kQ3_K) {
    const auto& w = *reinterpret_cast<const BlockQ3_K*>(blk);
    int8_t s[16];
    q3_k_scales(w.scales, s);
    for (int g = 0; g < 16; ++g) sc[g] = s[g], mn[g] = 4 * s[g];
    unpack_q23_k<T>(w.qs, w.hmask, v);
    *d = half_to_float(w.d), *dmin = *d;
  } else {
    const auto& w = *reinterpret_cast<const BlockQ2_K*>(blk);
    for (int g = 0; g < 16; ++g) sc[g] = w.scales[g] & 0xF, mn[g] = w.scales[g] >> 4;
    unpack_q23_k<T>(w.qs, nullptr, v);
    *d = half_to_float(w.d), *dmin = half_to_float(w.dmin);
  }
}

// x = d * sc * q - dmin * mn per group (Q3_K: d * sc * q - d * 4 * sc; gguf's float operations
// are d * sc, times q - 4: the Q3_K branch keeps them, bit-identical).
template <int T>
inline float q23_k_value(float d, float dmin, int sc, int mn, int q) {
  if constexpr (T == kQ3_K) {
    (void)dmin, (void)mn;
    return d * static_cast<float>(sc) * static_cast<float>(q - 4);
  } else {
    return d * static_cast<float>(sc) * static_cast<float>(q) - dmin * static_cast<float>(mn);
  }
}

template <int T>
inline void dequant_q23_k(const uint8_t* row, int64_t K, float* y) {
  uint8_t v[256];
  int sc[16], mn[16];
  float d, dmin;
  for (int64_t b = 0; b < K / kBlockK; ++b) {
    unpack_q23_k_block<T>(row + b * block_bytes(T), v, sc, mn, &d, &dmin);
    for (int n = 0; n < 256; ++n) y[256 * b + n] = q23_k_value<T>(d, dmin, sc[n / 16], mn[n / 16], v[n]);
  }
}

// One block of a row (its values, group scales and minimums) . one activation block: each
// group's integer sum times its scale, less the minimums (Q3_K: 4 * scale) times the group's
// activation sum, then d * d_activation.
template <int T>
inline float q23_k_block_dot(const uint8_t* v, const int* sc, const int* mn, float d, float dmin,
                             const ActQ8_K& a) {
  int isum = 0, msum = 0;
  for (int g = 0; g < 16; ++g) {
    int s = 0;
    for (int l = 0; l < 16; ++l) s += v[16 * g + l] * a.qs[16 * g + l];
    isum += sc[g] * s;
    msum += mn[g] * a.bsums[g];
  }
  if constexpr (T == kQ3_K) {
    (void)dmin;
    return static_cast<float>(isum - msum) * (d * a.d);
  } else {
    return static_cast<float>(isum) * (d * a.d) - static_cast<float>(msum) * (dmin * a.d);
  }
}

// sums[m] = the row . activation row m.
template <int T, int MB>
inline void dot_q23_k(const uint8_t* row, int64_t nb, const ActQ8_K* const* act, float* sums) {
  float acc[MB] = {};
  uint8_t v[256];
  int sc[16], mn[16];
  float d, dmin;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_q23_k_block<T>(row + b * block_bytes(T), v, sc, mn, &d, &dmin);
    for (int m = 0; m < MB; ++m) acc[m] += q23_k_block_dot<T>(v, sc, mn, d, dmin, act[m][b]);
  }
  for (int m = 0; m < MB; ++m) sums[m] = acc[m];
}

// Rows [8g, 8g + 8) of a row-major Q2_K or Q3_K tensor as nb x8 blocks.
template <typename Block>
inline void repack_q23_k_x8(const uint8_t* rows, int64_t nb, Block* out) {
  constexpr bool three = std::is_same_v<Block, BlockQ3_Kx8>;
  constexpr int64_t stride = three ? sizeof(BlockQ3_K) : sizeof(BlockQ2_K);
  for (int64_t b = 0; b < nb; ++b) {
    Block& o = out[b];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = rows + (r * nb + b) * stride;
      const uint8_t* qs;
      if constexpr (three) {
        const auto& w = *reinterpret_cast<const BlockQ3_K*>(blk);
        int8_t s[16];
        q3_k_scales(w.scales, s);
        for (int g = 0; g < 16; ++g) o.sc[g][r] = s[g];
        for (int c = 0; c < 8; ++c) std::memcpy(&o.hm[c][4 * r], w.hmask + 4 * c, 4);
        o.d[r] = w.d;
        qs = w.qs;
      } else {
        const auto& w = *reinterpret_cast<const BlockQ2_K*>(blk);
        for (int g = 0; g < 16; ++g) o.sc[g][r] = w.scales[g];
        o.d[r] = w.d, o.dmin[r] = w.dmin;
        qs = w.qs;
      }
      for (int h = 0; h < 2; ++h) {
        for (int c = 0; c < 8; ++c) std::memcpy(&o.qs[h][c][4 * r], qs + 32 * h + 4 * c, 4);
      }
    }
  }
}

// Row r of an x8 block: its values (as unpack_q23_k), group scales and minimums, d and dmin.
template <typename Block>
inline void unpack_q23_k_x8(const Block& w, int r, uint8_t* v, int* sc, int* mn, float* d, float* dmin) {
  constexpr bool three = std::is_same_v<Block, BlockQ3_Kx8>;
  uint8_t qs[64], hm[32];
  for (int h = 0; h < 2; ++h) {
    for (int c = 0; c < 8; ++c) std::memcpy(qs + 32 * h + 4 * c, &w.qs[h][c][4 * r], 4);
  }
  if constexpr (three) {
    for (int c = 0; c < 8; ++c) std::memcpy(hm + 4 * c, &w.hm[c][4 * r], 4);
    for (int g = 0; g < 16; ++g) sc[g] = w.sc[g][r], mn[g] = 4 * w.sc[g][r];
    *d = half_to_float(w.d[r]), *dmin = *d;
    unpack_q23_k<kQ3_K>(qs, hm, v);
  } else {
    for (int g = 0; g < 16; ++g) sc[g] = w.sc[g][r] & 0xF, mn[g] = w.sc[g][r] >> 4;
    *d = half_to_float(w.d[r]), *dmin = half_to_float(w.dmin[r]);
    unpack_q23_k<kQ2_K>(qs, hm, v);
  }
}

// Row r (0..7) of a group of nb x8 blocks, dequantised as dequant_q23_k does the rows as stored.
template <typename Block>
inline void dequant_q23_k_x8(const Block* grp, int64_t nb, int r, float* y) {
  constexpr int T = std::is_same_v<Block, BlockQ3_Kx8> ? kQ3_K : kQ2_K;
  uint8_t v[256];
  int sc[16], mn[16];
  float d, dmin;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_q23_k_x8(grp[b], r, v, sc, mn, &d, &dmin);
    for (int n = 0; n < 256; ++n) y[256 * b + n] = q23_k_value<T>(d, dmin, sc[n / 16], mn[n / 16], v[n]);
  }
}

#ifdef PAGEDATTN_QUANT_X86
// Group j's high bits (bit `from` of each hmask byte) at bit 2, the other bits cleared.
inline __m256i third_bits(__m256i hb, int from) {
  const __m256i at = from <= 2 ? _mm256_slli_epi16(hb, 2 - from) : _mm256_srli_epi16(hb, from - 2);
  return _mm256_and_si256(at, _mm256_set1_epi8(0x04));
}
#endif

// out[m * ldo + r] = row r of the group . activation row m, for MB activation rows, Block:
// BlockQ2_Kx8 or BlockQ3_Kx8.
template <int MB, typename Block>
inline void gemm_q23_k_x8(const Block* grp, int64_t nb, const ActQ8_K* const* act, float* out,
                          int64_t ldo, bool prefetch = true) {
  constexpr bool three = std::is_same_v<Block, BlockQ3_Kx8>;
#ifdef PAGEDATTN_QUANT_X86
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const Block& w = grp[b];
    if (prefetch) prefetch_ahead(&w);
    // Q2_K: the packed bytes' scales and minimums apart (two vector ops per 32 bytes)
    alignas(32) uint8_t unpacked[2][16][8];
    const int8_t* sc = reinterpret_cast<const int8_t*>(w.sc);
    if constexpr (!three) {
      for (int k = 0; k < 4; ++k) {
        const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.sc[4 * k]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked[0][4 * k]), _mm256_and_si256(s, m4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked[1][4 * k]),
                           _mm256_and_si256(_mm256_srli_epi16(s, 4), m4));
      }
      sc = reinterpret_cast<const int8_t*>(unpacked[0]);
    }
    // row r's scales and offsets (Q3_K: 4 x its scale) or minimums of groups 2p and 2p + 1 in
    // int16 lanes 2r, 2r + 1 (one madd with two activation group sums; with VNNI one vpdpwssd)
    __m256i scp[8], mins[8];
    pairs_of<8>(sc, scp);
    if constexpr (!three) pairs_of<8>(unpacked[1], mins);
    const __m256i* mnp = three ? scp : mins;
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 4; ++j) {
        // groups 8h + 2j (columns 0..3) and 8h + 2j + 1 (columns 4..7)
        __m256i lo[MB], hi[MB];
        for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const auto* col = reinterpret_cast<const __m256i*>(w.qs[h][c]);
          __m256i ql = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(col), 2 * j), m3);
          __m256i qh = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(col + 4), 2 * j), m3);
          if constexpr (three) {
            const auto* hb = reinterpret_cast<const __m256i*>(w.hm[c]);
            ql = _mm256_or_si256(ql, third_bits(_mm256_loadu_si256(hb), 4 * h + j));
            qh = _mm256_or_si256(qh, third_bits(_mm256_loadu_si256(hb + 4), 4 * h + j));
          }
          for (int m = 0; m < MB; ++m) {
            const int8_t* y = act[m][b].qs + 128 * h + 32 * j + 4 * c;
            lo[m] = SubBlockSum::add(lo[m], ql, broadcast4(y));
            hi[m] = SubBlockSum::add(hi[m], qh, broadcast4(y + 16));
          }
        }
#ifdef PAGEDATTN_QUANT_VNNI
        // a row's two group sums fit in int16 (16 x 7 x 128 < 2^15): lanes 2r and 2r + 1 meet
        // the two scales in one vpdpwssd (two vpmulld otherwise)
        for (int m = 0; m < MB; ++m) {
          const __m256i pair = _mm256_blend_epi16(lo[m], _mm256_slli_epi32(hi[m], 16), 0xAA);
          isum[m] = _mm256_dpwssd_epi32(isum[m], pair, scp[4 * h + j]);
        }
#else
        const int8_t* s_lo = sc + 8 * (8 * h + 2 * j);
        for (int m = 0; m < MB; ++m) {
          isum[m] = SubBlockSum::scale(isum[m], lo[m], SubBlockSum::scales(s_lo));
          isum[m] = SubBlockSum::scale(isum[m], hi[m], SubBlockSum::scales(s_lo + 8));
        }
#endif
      }
    }
    // The offset (Q3_K: 4 * sc) or minimum times each group's activation sum (one 32-bit load
    // of ActQ8_K::bsums per pair of groups).
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d)));
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m256i msum = pair_sums<8>(mnp, a.bsums);
      const __m256 ad = _mm256_set1_ps(a.d);
      if constexpr (three) {
        const __m256i total = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(msum, 2));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, ad), acc[m]);
      } else {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dmin)));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, ad), acc[m]);
        acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
#else
  (void)prefetch;
  float acc[MB][8] = {};
  uint8_t v[256];
  int sc[16], mn[16];
  float d, dmin;
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < 8; ++r) {
      unpack_q23_k_x8(grp[b], r, v, sc, mn, &d, &dmin);
      for (int m = 0; m < MB; ++m) acc[m][r] += q23_k_block_dot<three ? kQ3_K : kQ2_K>(v, sc, mn, d, dmin, act[m][b]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < 8; ++r) out[m * ldo + r] = acc[m][r];
  }
#endif
}

}  // namespace pagedattn_quant
