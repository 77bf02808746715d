// Q4_K, Q5_K and Q6_K weights interleaved 8 rows at a time (llama.cpp's block_q4_Kx8 idea, our
// own layouts), and the helpers every x8 kernel shares (the legacy types' x8 blocks and the
// dispatch over all types: quant_x8_legacy_cpu.h). QuantLinear (quant_cpu.cpp) repacks a part
// whose row count is a multiple of 8 into this form once, at load, and multiplies it at every
// row count, so the layer is held once.
//
// One BlockQ4_Kx8 holds superblock b of 8 rows: their d and dmin (fp16), their 6-bit scales and
// mins unpacked to bytes, sub-block by sub-block, and their nibbles so that one 32-byte load
// holds 4 consecutive bytes of each row (row r at bytes 4r..4r+3). One maddubs meets that load
// with 4 activation bytes broadcast to all rows, and the int16 sums of a whole 32-value sub-block
// add up over 8 maddubs (8 * 2 * 15 * 127 < 2^15) before one madd applies the 8 rows' scales:
// the row-major kernel (quant_dot_cpu.h) follows every maddubs with a madd. 1,184 bytes per 8
// rows and superblock: 148 B per row against Q4_K's 144 (the scales held as bytes, +2.8%).
//
// BlockQ5_Kx8 is BlockQ4_Kx8 plus the fifth bits: row r's 32 qh bytes as stored, 4 to a column
// as the nibbles are (byte 4c + k holds the fifth bits of values 64i + 4c + k and 64i + 32 +
// 4c + k at bits 2i and 2i + 1), so one shift and one mask put a column's bits under its
// nibbles (fifth_bits). Its values reach 31: without VNNI 4 maddubs add in int16 before a madd
// (kQ5Columns). 1,440 bytes per 8 rows: 180 B per row against Q5_K's 176.
//
// BlockQ6_Kx8 is the same for 6-bit values (0..63, x = d * sc * (q - 32)): their low nibbles
// as above, their high bit pairs four to a byte (two 4-byte columns, low and high half), the
// 16 int8 scales per row and d; 1,680 bytes per 8 rows, as Q6_K's 210 per row. A maddubs of
// 6-bit values reaches 2 * 63 * 127, so two of them add in int16 before the scales' madd, and
// the -32 offset is taken out with the activation's 16-value sums (ActQ8_K::bsums).
//
// Standalone measurements: scripts/q4k_interleave_probe.cpp, scripts/x8_prefetch_probe.cpp.
// Elsewhere than x86 the same integer sums in plain C++.
#pragma once

#include <type_traits>

#include "quant_dot_cpu.h"

namespace pagedattn_quant {

#pragma pack(push, 1)
struct BlockQ4_Kx8 {
  uint16_t d[8];
  uint16_t dmin[8];
  uint8_t sc[8][8];  // [sub-block][row]
  uint8_t mn[8][8];  // [sub-block][row]
  uint8_t qs[4][8][32];  // [64-value chunk][4-byte column][row r: bytes 4r..4r+3]
};
struct BlockQ5_Kx8 {  // BlockQ4_Kx8 with the fifth bits
  uint16_t d[8];
  uint16_t dmin[8];
  uint8_t sc[8][8];
  uint8_t mn[8][8];
  uint8_t qh[8][32];  // [4-byte column c][row r: bytes 4r..4r+3]: row r's qh bytes 4c..4c+3
  uint8_t qs[4][8][32];
};
struct BlockQ6_Kx8 {
  uint16_t d[8];
  int8_t sc[16][8];       // [16-value group][row]
  uint8_t ql[4][8][32];   // as BlockQ4_Kx8::qs: low nibbles of values 64i + 4c + k, + 32
  uint8_t qh[4][4][32];   // [chunk][column pair]: 2-bit highs of (c lo, c hi, c+1 lo, c+1 hi)
};
#pragma pack(pop)
static_assert(sizeof(BlockQ4_Kx8) == 1184, "Q4_K x8 block size");
static_assert(sizeof(BlockQ5_Kx8) == 1440, "Q5_K x8 block size");
static_assert(sizeof(BlockQ6_Kx8) == 1680, "Q6_K x8 block size");

// Rows [8g, 8g + 8) of a row-major Q4_K or Q5_K tensor (nb superblocks per row) as nb x8 blocks
// (Block: BlockQ4_Kx8 or BlockQ5_Kx8).
template <typename Block>
inline void repack_q45_k_x8(const uint8_t* rows, int64_t nb, Block* out) {
  constexpr bool five = std::is_same_v<Block, BlockQ5_Kx8>;
  constexpr int64_t stride = five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  for (int64_t b = 0; b < nb; ++b) {
    Block& o = out[b];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = rows + (r * nb + b) * stride;
      const BlockQ4_K* head = reinterpret_cast<const BlockQ4_K*>(blk);  // d, dmin, scales first
      const uint8_t* qs = five ? reinterpret_cast<const BlockQ5_K*>(blk)->qs : head->qs;
      o.d[r] = head->d;
      o.dmin[r] = head->dmin;
      for (int j = 0; j < 8; ++j) scale_min_k4(j, head->scales, &o.sc[j][r], &o.mn[j][r]);
      for (int i = 0; i < 4; ++i) {
        for (int c = 0; c < 8; ++c) std::memcpy(&o.qs[i][c][4 * r], qs + 32 * i + 4 * c, 4);
      }
      if constexpr (five) {
        const uint8_t* qh = reinterpret_cast<const BlockQ5_K*>(blk)->qh;
        for (int c = 0; c < 8; ++c) std::memcpy(&o.qh[c][4 * r], qh + 4 * c, 4);
      }
    }
  }
}

// The 256 values (0..63, before the -32) of one Q6_K block in natural order.
inline void unpack_q6_k(const BlockQ6_K& blk, uint8_t* v) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = blk.ql + 64 * h;
    const uint8_t* qh = blk.qh + 32 * h;
    uint8_t* out = v + 128 * h;
    for (int l = 0; l < 32; ++l) {
      out[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
      out[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
      out[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      out[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
  }
}

// Rows [8g, 8g + 8) of a row-major Q6_K tensor as nb x8 blocks.
inline void repack_q6_k_x8(const uint8_t* rows, int64_t nb, BlockQ6_Kx8* out) {
  const BlockQ6_K* w = reinterpret_cast<const BlockQ6_K*>(rows);
  uint8_t v[256];
  for (int64_t b = 0; b < nb; ++b) {
    BlockQ6_Kx8& o = out[b];
    for (int r = 0; r < 8; ++r) {
      const BlockQ6_K& blk = w[r * nb + b];
      o.d[r] = blk.d;
      for (int g = 0; g < 16; ++g) o.sc[g][r] = blk.scales[g];
      unpack_q6_k(blk, v);
      for (int i = 0; i < 4; ++i) {
        for (int c = 0; c < 8; ++c) {
          for (int k = 0; k < 4; ++k) {
            const uint8_t lo = v[64 * i + 4 * c + k], hi = v[64 * i + 32 + 4 * c + k];
            o.ql[i][c][4 * r + k] = (lo & 0xF) | ((hi & 0xF) << 4);
            const int shift = 4 * (c % 2);
            uint8_t& h = o.qh[i][c / 2][4 * r + k];
            if (shift == 0) h = 0;
            h |= static_cast<uint8_t>((((lo >> 4) & 3) | (((hi >> 4) & 3) << 2)) << shift);
          }
        }
      }
    }
  }
}

// Row r (0..7) of a group of nb x8 blocks, dequantised as dequant_row does the rows as stored
// (the same float operations: bit-identical values).
template <typename Block>
inline void dequant_q45_k_x8(const Block* grp, int64_t nb, int r, float* y) {
  constexpr bool five = std::is_same_v<Block, BlockQ5_Kx8>;
  for (int64_t b = 0; b < nb; ++b) {
    const Block& w = grp[b];
    const float d = half_to_float(w.d[r]), dmin = half_to_float(w.dmin[r]);
    for (int j = 0; j < 8; ++j) {
      const float dj = d * w.sc[j][r], cj = dmin * w.mn[j][r];
      for (int l = 0; l < 32; ++l) {
        int q = (w.qs[j / 2][l / 4][4 * r + l % 4] >> (4 * (j % 2))) & 0xF;
        if constexpr (five) q |= ((w.qh[l / 4][4 * r + l % 4] >> j) & 1) << 4;
        y[256 * b + 32 * j + l] = dj * static_cast<float>(q) - cj;
      }
    }
  }
}

inline void dequant_q6_k_x8(const BlockQ6_Kx8* grp, int64_t nb, int r, float* y) {
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_Kx8& w = grp[b];
    const float d = half_to_float(w.d[r]);
    for (int n = 0; n < 256; ++n) {
      const int i = n / 64, l = n % 64, half = l / 32, c = (l % 32) / 4, k = l % 4;
      const int nib = (w.ql[i][c][4 * r + k] >> (4 * half)) & 0xF;
      const int hb = (w.qh[i][c / 2][4 * r + k] >> (4 * (c % 2) + 2 * half)) & 3;
      y[256 * b + n] = d * w.sc[n / 16][r] * static_cast<float>((nib | (hb << 4)) - 32);
    }
  }
}

// The first call on a group (its later activation rows find it in cache) starts each block by
// prefetching the x8 block kPrefetchBlocks ahead (into the next group past a group's end: a
// thread takes consecutive groups), all its cache lines at once: into L2 (T1), but Q6_K from 2
// rows non-temporal. Without it one activation row ran a Q6_K layer from DRAM at 10.5 GB/s (the
// kernel reads a block's ql and qh areas by turns and the hardware prefetcher fell behind),
// Q4_K at 15.8. AMD Zen 2, 2 threads, [8192 x 2048] layers cycled from DRAM, the kernels alone
// (scripts/x8_prefetch_probe.cpp), GB/s at 2 / 3 / 6 blocks ahead into L1 (T0): Q6_K 16.3 /
// 18.9 / 18.0, Q4_K 20.0 / 21.5 / 21.1; at 3 / 6 ahead NTA: Q6_K 19.5-22 / 19.5, Q4_K 24-27 /
// 26 (T1 not measured there). AMD Zen 4, QuantLinear, 12 such layers, 3 ahead, ms per layer,
// NTA against T1 (three alternating runs; Q6_K at 1 row: two builds minutes apart): 1 row Q6_K
// 0.82 against 0.36-0.44, Q4_K 0.26-0.29 against 0.24-0.26; 4 rows Q6_K 0.48-0.53 against
// 0.55, Q4_K 0.34-0.35 against 0.32-0.33.
#ifndef PAGEDATTN_X8_PREFETCH
#define PAGEDATTN_X8_PREFETCH 3
#endif
constexpr int kPrefetchBlocks = PAGEDATTN_X8_PREFETCH;
#ifdef PAGEDATTN_QUANT_X86
#ifndef PAGEDATTN_X8_HINT
#define PAGEDATTN_X8_HINT _MM_HINT_T1
#endif
template <typename Block, int Hint = PAGEDATTN_X8_HINT>
inline void prefetch_ahead(const Block* blk) {
  prefetch_span<Hint>(blk + kPrefetchBlocks, sizeof(Block));
}
#endif

#ifdef PAGEDATTN_QUANT_X86
// The fifth bits at bit `from` of each byte moved to bit 4 (the other bits cleared): a 16-bit
// shift carries no set bit across a byte into bit 4 for `from` in 0..7.
inline __m256i fifth_bits(__m256i hb, int from) {
  const __m256i at = from <= 4 ? _mm256_slli_epi16(hb, 4 - from) : _mm256_srli_epi16(hb, from - 4);
  return _mm256_and_si256(at, _mm256_set1_epi8(0x10));
}

// Two int8 values per row (a[r], b[r]) as int16 lanes 2r, 2r + 1: one madd meets them with a
// pair of activation sums.
inline __m256i pair_bytes(const void* a, const void* b) {
  const __m128i x = _mm_loadl_epi64(static_cast<const __m128i*>(a));
  const __m128i y = _mm_loadl_epi64(static_cast<const __m128i*>(b));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));
}

// pair_bytes of rows 2p and 2p + 1 of a [2P][8] table (a scale or minimum per sub-block or
// group and row), p < P.
template <int P>
inline void pairs_of(const void* table, __m256i* out) {
  const auto* t = static_cast<const int8_t*>(table);
  for (int p = 0; p < P; ++p) out[p] = pair_bytes(t + 16 * p, t + 16 * p + 8);
}

// Per row: the sum over p < P of pairs[p] . the activation's two int16 sums at s + 2p (one madd
// and one 32-bit load per pair).
template <int P>
inline __m256i pair_sums(const __m256i* pairs, const int16_t* s) {
  __m256i sum = _mm256_setzero_si256();
  for (int p = 0; p < P; ++p) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs[p], broadcast4(s + 2 * p)));
  return sum;
}

// How the K-type kernels add a sub-block's u8 x s8 products (32 values of 8 rows, 4 per
// lane) before its scale (8 int8 values, one per row; Q4_K's are 0..63, so signed reads them).
// With VNNI, dpbusd adds them straight into int32 lanes and one mullo scales each row's sum.
// Without, maddubs' int16 pairs add up and one madd applies the scale, held twice (lanes 2r and
// 2r + 1): 8 Q4_K columns reach 8 * 2 * 15 * 127 < 2^15, but two Q6_K columns already
// 2 * 2 * 63 * 127, so Q6_K scales every column pair there (kQ6Pairs). The integer sums are the
// same either way. AMD Zen 4, 1 thread, cached blocks, 8 activation rows: Q4_K 305 against 184
// GOP/s for the int16 form at 4 rows, Q6_K 221 against 170.
struct SubBlockSum {
#ifdef PAGEDATTN_QUANT_VNNI
  static constexpr int kQ6Pairs = 2;
  static constexpr int kQ5Columns = 8;
  static __m256i add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static __m256i scales(const int8_t* sc) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
  }
  static __m256i scale(__m256i isum, __m256i sub, __m256i sc) {
    return _mm256_add_epi32(isum, _mm256_mullo_epi32(sub, sc));
  }
#else
  static constexpr int kQ6Pairs = 1;
  static constexpr int kQ5Columns = 4;  // 4 * 2 * 31 * 127 < 2^15
  static __m256i add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
  }
  static __m256i scales(const int8_t* sc) { return pair_bytes(sc, sc); }
  static __m256i scale(__m256i isum, __m256i sub, __m256i sc) {
    return _mm256_add_epi32(isum, _mm256_madd_epi16(sub, sc));
  }
#endif
  static __m256i scales(const uint8_t* sc) { return scales(reinterpret_cast<const int8_t*>(sc)); }
};
#endif

// Activation rows one call of the x8 kernels meets: 8 where 32 vector registers hold their sums.
#if defined(PAGEDATTN_QUANT_X86) && defined(__AVX512VL__)
constexpr int kX8Rows = 8;
#else
constexpr int kX8Rows = 4;
#endif

// out[m * ldo + r] = row r of the group . activation row m, for MB activation rows (act[m]:
// its nb Q8_K blocks), Block: BlockQ4_Kx8 or BlockQ5_Kx8. Each row's sum does not depend on MB
// (bit-identical at any row count).
template <int MB, typename Block>
inline void gemm_q45_k_x8(const Block* grp, int64_t nb, const ActQ8_K* const* act, float* out,
                          int64_t ldo, bool prefetch = true) {
  constexpr bool five = std::is_same_v<Block, BlockQ5_Kx8>;
#ifdef PAGEDATTN_QUANT_X86
  constexpr int kSpan = five ? SubBlockSum::kQ5Columns : 8;  // columns summed before the scales
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const Block& w = grp[b];
    if (prefetch) prefetch_ahead(&w);
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      // sub-blocks 2i (low nibbles; Q5_K: fifth bits at bit 2i) and 2i + 1 (high, 2i + 1)
      for (int c0 = 0; c0 < 8; c0 += kSpan) {
        __m256i lo[MB], hi[MB];
        for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int cc = 0; cc < kSpan; ++cc) {  // NOTE: a constant trip count, fully unrolled
          const int c = c0 + cc;
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs[i][c]));
          __m256i ql = _mm256_and_si256(q, m4);
          __m256i qh = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          if constexpr (five) {
            const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh[c]));
            ql = _mm256_or_si256(ql, fifth_bits(hb, 2 * i));
            qh = _mm256_or_si256(qh, fifth_bits(hb, 2 * i + 1));
          }
          for (int m = 0; m < MB; ++m) {
            const int8_t* y = act[m][b].qs + 64 * i + 4 * c;
            lo[m] = SubBlockSum::add(lo[m], ql, broadcast4(y));
            hi[m] = SubBlockSum::add(hi[m], qh, broadcast4(y + 32));
          }
        }
        const __m256i s_lo = SubBlockSum::scales(w.sc[2 * i]);
        const __m256i s_hi = SubBlockSum::scales(w.sc[2 * i + 1]);
        for (int m = 0; m < MB; ++m) {
          isum[m] = SubBlockSum::scale(isum[m], lo[m], s_lo);
          isum[m] = SubBlockSum::scale(isum[m], hi[m], s_hi);
        }
      }
    }
    // The minimums: row r's mins of sub-blocks 2p, 2p + 1 in int16 lanes 2r, 2r + 1, met by one
    // madd with the two sub-blocks' activation sums (one 32-bit load of ActQ8_K::sums32).
    __m256i mins[4];
    pairs_of<4>(w.mn, mins);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dmin)));
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m256i msum = pair_sums<4>(mins, a.sums32);
      const __m256 ad = _mm256_set1_ps(a.d);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, ad), acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
#else
  float acc[MB][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const Block& w = grp[b];
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      for (int r = 0; r < 8; ++r) {
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
          const int i = j / 2, shift = 4 * (j % 2);
          int s = 0;
          for (int l = 0; l < 32; ++l) {
            int q = (w.qs[i][l / 4][4 * r + l % 4] >> shift) & 0xF;
            if constexpr (five) q |= ((w.qh[l / 4][4 * r + l % 4] >> j) & 1) << 4;
            s += q * a.qs[32 * j + l];
          }
          isum += w.sc[j][r] * s;
          msum += w.mn[j][r] * (a.bsums[2 * j] + a.bsums[2 * j + 1]);
        }
        acc[m][r] += half_to_float(w.d[r]) * a.d * static_cast<float>(isum) -
                     half_to_float(w.dmin[r]) * a.d * static_cast<float>(msum);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < 8; ++r) out[m * ldo + r] = acc[m][r];
  }
#endif
}

// As gemm_q45_k_x8, for BlockQ6_Kx8.
template <int MB>
inline void gemm_q6_k_x8(const BlockQ6_Kx8* grp, int64_t nb, const ActQ8_K* const* act,
                         float* out, int64_t ldo, bool prefetch = true) {
#ifdef PAGEDATTN_QUANT_X86
  constexpr int kSpan = SubBlockSum::kQ6Pairs;
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_Kx8& w = grp[b];
    if (prefetch) prefetch_ahead<BlockQ6_Kx8, MB == 1 ? PAGEDATTN_X8_HINT : PAGEDATTN_QUANT_HINT>(&w);
    __m256i isum[MB];  // sum over groups of sc * (q . y), q in 0..63
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      for (int cp0 = 0; cp0 < 4; cp0 += kSpan) {
        // column pairs cp0 .. cp0 + kSpan - 1: lo values in group 4i + cp0 / 2, hi values in
        // 4i + 2 + cp0 / 2; column 2cp's highs at bits 0-1 (lo) and 2-3 (hi), column 2cp + 1's
        // at 4-5 and 6-7, each moved to bits 4-5 by one constant shift and one mask.
        __m256i lo[MB], hi[MB];
        for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int cp = cp0; cp < cp0 + kSpan; ++cp) {
          const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh[i][cp]));
#pragma GCC unroll 2
          for (int e = 0; e < 2; ++e) {
            const int c = 2 * cp + e;
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.ql[i][c]));
            const __m256i h_lo = e == 0 ? _mm256_slli_epi16(hb, 4) : hb;
            const __m256i h_hi = e == 0 ? _mm256_slli_epi16(hb, 2) : _mm256_srli_epi16(hb, 2);
            const __m256i ql = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_and_si256(h_lo, m30));
            const __m256i qh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                                               _mm256_and_si256(h_hi, m30));
            for (int m = 0; m < MB; ++m) {
              const int8_t* y = act[m][b].qs + 64 * i + 4 * c;
              lo[m] = SubBlockSum::add(lo[m], ql, broadcast4(y));
              hi[m] = SubBlockSum::add(hi[m], qh, broadcast4(y + 32));
            }
          }
        }
        const __m256i s_lo = SubBlockSum::scales(w.sc[4 * i + cp0 / 2]);
        const __m256i s_hi = SubBlockSum::scales(w.sc[4 * i + 2 + cp0 / 2]);
        for (int m = 0; m < MB; ++m) {
          isum[m] = SubBlockSum::scale(isum[m], lo[m], s_lo);
          isum[m] = SubBlockSum::scale(isum[m], hi[m], s_hi);
        }
      }
    }
    // The -32 offset: 32 * sum over groups of sc * bsum, groups 2p and 2p + 1 in one madd (row
    // r's two scales in int16 lanes 2r, 2r + 1; the two sums in one 32-bit load of bsums).
    __m256i scp[8];
    pairs_of<8>(w.sc, scp);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d)));
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m256i total = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(pair_sums<8>(scp, a.bsums), 5));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(a.d)), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
#else
  float acc[MB][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_Kx8& w = grp[b];
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      for (int r = 0; r < 8; ++r) {
        int total = 0;
        for (int n = 0; n < 256; ++n) {
          const int i = n / 64, l = n % 64, half = l / 32, c = (l % 32) / 4, k = l % 4;
          const int nib = (w.ql[i][c][4 * r + k] >> (4 * half)) & 0xF;
          const int hb = (w.qh[i][c / 2][4 * r + k] >> (4 * (c % 2) + 2 * half)) & 3;
          total += w.sc[n / 16][r] * ((nib | (hb << 4)) - 32) * a.qs[n];
        }
        acc[m][r] += half_to_float(w.d[r]) * a.d * static_cast<float>(total);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < 8; ++r) out[m * ldo + r] = acc[m][r];
  }
#endif
}

}  // namespace pagedattn_quant
