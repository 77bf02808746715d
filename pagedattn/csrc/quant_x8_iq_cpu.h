// IQ4_XS, the non-linear 4-bit K type (IQ4_XS files): rows as stored (dequantised, and met with
// activations in plain C++ for a part whose row count is not a multiple of 8) and the x8 layout
// and GEMM, as quant_x8_cpu.h's for Q4_K; the table lookup and the signed products the Q8_0 and
// IQ4_NL x8 kernel shares (quant_x8_legacy_cpu.h).
//
//   IQ4_XS  d, 8 6-bit scales (2 high bits each in a uint16, 4 low bits in 4 bytes), 128 B of
//           nibbles: x = d * (sc - 32) * kIQ4Values[nibble]                    136 B / 256
//
// Sub-block i (32 values) keeps value l < 16 in the low nibble of qs byte 16i + l and value
// 16 + l in its high nibble (the legacy types' order). The x8 block keeps d per row, the scales
// as int8 (sc - 32) per sub-block and row, and the nibbles four bytes of each of 8 rows to a
// 32-byte column (138 B per row and superblock against 136). A nibble becomes its value by one
// vpshufb through the 16-entry table. With VNNI the table holds value + 128 (1..241, unsigned)
// for vpdpbusd, and 128 x the scaled sub-block sums of the activation come off after the block
// (ActQ8_K::sums32); without it maddubs would saturate on such values, so the weights keep their
// sign and the activations take it (llama.cpp's AVX2 form): |w| x sign(a, w) pairs, widened to
// int32 by madd. Same integer sums either way.
#pragma once

#include "quant_x8_low_cpu.h"

namespace pagedattn_quant {

#pragma pack(push, 1)
struct BlockIQ4_XSx8 {
  uint16_t d[8];
  int8_t sc[8][8];        // [sub-block][row]: scale - 32
  uint8_t qs[8][4][32];   // [sub-block][4-byte column c][row r: bytes 4r..4r+3]
};
#pragma pack(pop)
static_assert(sizeof(BlockIQ4_XSx8) == 1104, "IQ4_XS x8 block size");

#ifdef PAGEDATTN_QUANT_X86
// The 16-entry table one vpshufb turns nibbles into values with: kIQ4Values (+ 128 with VNNI).
inline __m256i iq4_table() {
  const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
#ifdef PAGEDATTN_QUANT_VNNI
  return _mm256_broadcastsi128_si256(_mm_add_epi8(values, _mm_set1_epi8(static_cast<char>(0x80))));
#else
  return _mm256_broadcastsi128_si256(values);
#endif
}

// acc + one column's weights (4 bytes of each of 8 rows: signed, or with VNNI + 128, whose 128 x
// the activation sums come off later) . the 4 activation bytes at y, per row.
inline __m256i signed_dot(__m256i acc, __m256i w, const int8_t* y) {
#ifdef PAGEDATTN_QUANT_VNNI
  return _mm256_dpbusd_epi32(acc, w, broadcast4(y));
#else
  return dot_u8s8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(broadcast4(y), w));  // -128: 128 unsigned
#endif
}
#endif

// The 8 scales of an IQ4_XS block, minus 32.
inline void iq4_xs_scales(const BlockIQ4_XS& w, int* sc) {
  for (int i = 0; i < 8; ++i) {
    const int lo = (w.scales_l[i / 2] >> (4 * (i % 2))) & 0xF, hi = (w.scales_h >> (2 * i)) & 3;
    sc[i] = (lo | hi << 4) - 32;
  }
}

// The 256 values (kIQ4Values) of a block from its qs.
inline void unpack_iq4_xs(const uint8_t* qs, int8_t* v) {
  for (int n = 0; n < 256; ++n) {
    const int i = n / 32, l = n % 32;
    v[n] = kIQ4Values[(qs[16 * i + l % 16] >> (4 * (l / 16))) & 0xF];
  }
}

inline void dequant_iq4_xs(const uint8_t* row, int64_t K, float* y) {
  const auto* w = reinterpret_cast<const BlockIQ4_XS*>(row);
  int8_t v[256];
  int sc[8];
  for (int64_t b = 0; b < K / kBlockK; ++b) {
    iq4_xs_scales(w[b], sc);
    unpack_iq4_xs(w[b].qs, v);
    const float d = half_to_float(w[b].d);
    for (int n = 0; n < 256; ++n) y[256 * b + n] = d * static_cast<float>(sc[n / 32]) * static_cast<float>(v[n]);
  }
}

// The integer sum of one block: sub-block sums times their scales.
inline int iq4_xs_block_sum(const int8_t* v, const int* sc, const ActQ8_K& a) {
  int isum = 0;
  for (int i = 0; i < 8; ++i) {
    int s = 0;
    for (int l = 0; l < 32; ++l) s += v[32 * i + l] * a.qs[32 * i + l];
    isum += sc[i] * s;
  }
  return isum;
}

template <int MB>
inline void dot_iq4_xs(const uint8_t* row, int64_t nb, const ActQ8_K* const* act, float* sums) {
  const auto* w = reinterpret_cast<const BlockIQ4_XS*>(row);
  float acc[MB] = {};
  int8_t v[256];
  int sc[8];
  for (int64_t b = 0; b < nb; ++b) {
    iq4_xs_scales(w[b], sc);
    unpack_iq4_xs(w[b].qs, v);
    const float d = half_to_float(w[b].d);
    for (int m = 0; m < MB; ++m) {
      acc[m] += static_cast<float>(iq4_xs_block_sum(v, sc, act[m][b])) * (d * act[m][b].d);
    }
  }
  for (int m = 0; m < MB; ++m) sums[m] = acc[m];
}

// Rows [8g, 8g + 8) of a row-major IQ4_XS tensor as nb x8 blocks.
inline void repack_iq4_xs_x8(const uint8_t* rows, int64_t nb, BlockIQ4_XSx8* out) {
  const auto* w = reinterpret_cast<const BlockIQ4_XS*>(rows);
  int sc[8];
  for (int64_t b = 0; b < nb; ++b) {
    BlockIQ4_XSx8& o = out[b];
    for (int r = 0; r < 8; ++r) {
      const BlockIQ4_XS& blk = w[r * nb + b];
      o.d[r] = blk.d;
      iq4_xs_scales(blk, sc);
      for (int i = 0; i < 8; ++i) {
        o.sc[i][r] = static_cast<int8_t>(sc[i]);
        for (int c = 0; c < 4; ++c) std::memcpy(&o.qs[i][c][4 * r], blk.qs + 16 * i + 4 * c, 4);
      }
    }
  }
}

// Row r of an x8 block: its values and scales.
inline void unpack_iq4_xs_x8(const BlockIQ4_XSx8& w, int r, int8_t* v, int* sc) {
  uint8_t qs[128];
  for (int i = 0; i < 8; ++i) {
    sc[i] = w.sc[i][r];
    for (int c = 0; c < 4; ++c) std::memcpy(qs + 16 * i + 4 * c, &w.qs[i][c][4 * r], 4);
  }
  unpack_iq4_xs(qs, v);
}

inline void dequant_iq4_xs_x8(const BlockIQ4_XSx8* grp, int64_t nb, int r, float* y) {
  int8_t v[256];
  int sc[8];
  for (int64_t b = 0; b < nb; ++b) {
    unpack_iq4_xs_x8(grp[b], r, v, sc);
    const float d = half_to_float(grp[b].d[r]);
    for (int n = 0; n < 256; ++n) y[256 * b + n] = d * static_cast<float>(sc[n / 32]) * static_cast<float>(v[n]);
  }
}

// out[m * ldo + r] = row r of the group . activation row m, for MB activation rows.
template <int MB>
inline void gemm_iq4_xs_x8(const BlockIQ4_XSx8* grp, int64_t nb, const ActQ8_K* const* act,
                           float* out, int64_t ldo, bool prefetch = true) {
#ifdef PAGEDATTN_QUANT_X86
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i lut = iq4_table();
  for (int64_t b = 0; b < nb; ++b) {
    const BlockIQ4_XSx8& w = grp[b];
    if (prefetch) prefetch_ahead(&w);
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      __m256i sub[MB];
      for (int m = 0; m < MB; ++m) sub[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs[i][c]));
        const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, m4));
        const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
        for (int m = 0; m < MB; ++m) {
          const int8_t* y = act[m][b].qs + 32 * i + 4 * c;
          sub[m] = signed_dot(signed_dot(sub[m], wl, y), wh, y + 16);
        }
      }
      const __m256i s = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc[i])));
      for (int m = 0; m < MB; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(sub[m], s));
    }
#ifdef PAGEDATTN_QUANT_VNNI
    // the +128: 128 x sum over sub-blocks of sc x the activation's sub-block sum, sub-blocks 2p
    // and 2p + 1 in one madd (row r's scales in int16 lanes 2r, 2r + 1)
    __m256i scp[4];
    pairs_of<4>(w.sc, scp);
#endif
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d)));
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      __m256i total = isum[m];
#ifdef PAGEDATTN_QUANT_VNNI
      total = _mm256_sub_epi32(total, _mm256_slli_epi32(pair_sums<4>(scp, a.sums32), 7));
#endif
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(a.d)), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
#else
  (void)prefetch;
  float acc[MB][8] = {};
  int8_t v[256];
  int sc[8];
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < 8; ++r) {
      unpack_iq4_xs_x8(grp[b], r, v, sc);
      const float d = half_to_float(grp[b].d[r]);
      for (int m = 0; m < MB; ++m) {
        acc[m][r] += static_cast<float>(iq4_xs_block_sum(v, sc, act[m][b])) * (d * act[m][b].d);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < 8; ++r) out[m * ldo + r] = acc[m][r];
  }
#endif
}

}  // namespace pagedattn_quant
