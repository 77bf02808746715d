// The x8 kernels (quant_x8_cpu.h, quant_x8_low_cpu.h, quant_x8_iq_cpu.h, quant_x8_legacy_cpu.h)
// on 512-bit vectors: two groups of 8 rows at once, group g in the low half of every vector and
// group g + 1 in the high half, so one broadcast activation value meets 16 rows. Same blocks (no
// other layout is held), same integer sums and the same float operations per row: bit-identical
// to the 8-row kernels at every row count (the legacy types' VNNI forms: Q8_0 and IQ4_NL as
// values + 128).
//
// Why: with 8 rows per 256-bit vector, every vpdpbusd needs its own broadcast activation load
// and the column's unpacking is shared by only 8 rows, so the core issues ~5 instructions per
// cycle to keep its two multiply-add pipes busy. Here half as many broadcasts and unpacking
// instructions do the same multiply-adds. With few rows it loses (measured, not profiled):
// QuantLinear pairs groups from kX8PairRows activation rows. AMD Zen 4,
// 2 threads, run_x8's loop over 12 random layers, groups one at a time against pairs
// (scripts/x8_pair_probe.cpp, interleaved), ms per layer:
//   Q4_K [8192 x 2048]:  8 rows 1.00x, 16 1.04x, 32 1.10x, 64 1.17x, 512 1.19x (553 -> 656 GOP/s)
//   Q5_K:                8 rows 0.97x, 16 0.95x, 32 1.02x, 64 1.06x, 512 1.10x
//   Q6_K [2048 x 8192]:  1 row 0.89x, 4 0.61x, 8 0.92x, 32 1.02x, 64 1.07x, 512 1.22x (420 -> 513)
//   Q2_K [8192 x 2048]:  8 rows 0.90x, 32 1.12x, 64 1.24x, 512 1.25x (414 -> 519)
//   Q3_K:                8 rows 0.77-0.88x, 32 1.01-1.23x, 64 1.13x, 512 1.09-1.27x (~375 -> 420-460)
//   IQ4_XS:              8 rows 0.97x, 32 1.13x, 64 1.08x, 512 1.18x (534 -> 629)
//   Q8_0:                1 row 0.87x, 4 0.98x, 32 1.23x, 64 1.20x, 512 1.21x (517 -> 624)
//   Q4_0 / Q4_1:         8 rows 0.96x / 1.13x, 32 1.06x / 1.11x, 512 1.10x / 1.13x
//   Q5_0 / Q5_1:         32 rows 1.09x / 1.10x, 512 1.10x / 1.13x
//   IQ4_NL:              8 rows 1.05x, 32 1.23x, 64 1.27x, 512 1.27x (507 -> 644)
//
// Built where the compiler has AVX512-BW and VNNI (the native build of such a CPU); elsewhere
// has_x8_pair() is false and QuantLinear runs one group at a time.
#pragma once

#include "quant_x8_legacy_cpu.h"

#if defined(PAGEDATTN_QUANT_VNNI) && defined(__AVX512BW__)
#define PAGEDATTN_X8_PAIRS 1
#endif

namespace pagedattn_quant {

constexpr int64_t kX8PairRows = 32;  // activation rows from which groups run in pairs

#ifdef PAGEDATTN_X8_PAIRS
namespace zmm {

// 32 bytes at a (low half) and 32 at b (high half).
inline __m512i load2(const void* a, const void* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(static_cast<const __m256i*>(b)), 1);
}
// 8 bytes at a and 8 at b as 16 int32 lanes (Signed: int8, else uint8).
template <bool Signed>
inline __m512i bytes16(const void* a, const void* b) {
  const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64(static_cast<const __m128i*>(a)),
                                       _mm_loadl_epi64(static_cast<const __m128i*>(b)));
  return Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}
inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
// The 8 fp16 values at a and the 8 at b as 16 floats.
inline __m512 halves16(const uint16_t* a, const uint16_t* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}
inline __m512i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512i fifth_bits(__m512i hb, int from) {  // as quant_x8_cpu.h's fifth_bits
  const __m512i at = from <= 4 ? _mm512_slli_epi16(hb, 4 - from) : _mm512_srli_epi16(hb, from - 4);
  return _mm512_and_si512(at, _mm512_set1_epi8(0x10));
}
inline __m512i third_bits(__m512i hb, int from) {  // as quant_x8_low_cpu.h's third_bits
  const __m512i at = from <= 2 ? _mm512_slli_epi16(hb, 2 - from) : _mm512_srli_epi16(hb, from - 2);
  return _mm512_and_si512(at, _mm512_set1_epi8(0x04));
}
// pairs_of (quant_x8_cpu.h) for groups g0 (t0: the low halves) and g1 (t1: the high halves).
template <int P>
inline void pairs_of(const void* t0, const void* t1, __m512i* out) {
  const auto* a = static_cast<const int8_t*>(t0);
  const auto* b = static_cast<const int8_t*>(t1);
  for (int p = 0; p < P; ++p) out[p] = join(pair_bytes(a + 16 * p, a + 16 * p + 8), pair_bytes(b + 16 * p, b + 16 * p + 8));
}
// pair_sums (quant_x8_cpu.h) on 512-bit vectors.
template <int P>
inline __m512i pair_sums(const __m512i* pairs, const int16_t* s) {
  __m512i sum = _mm512_setzero_si512();
  for (int p = 0; p < P; ++p) sum = _mm512_add_epi32(sum, _mm512_madd_epi16(pairs[p], broadcast4(s + 2 * p)));
  return sum;
}
// isum[m] += lo[m] * s_lo + hi[m] * s_hi: two sub-blocks' sums times their rows' scales.
template <int MB>
inline void add_scaled(__m512i* isum, const __m512i* lo, const __m512i* hi, __m512i s_lo, __m512i s_hi) {
  for (int m = 0; m < MB; ++m) {
    isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(lo[m], s_lo));
    isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(hi[m], s_hi));
  }
}
// Row r of the low group to out0[m * ldo + r], of the high group to out1[m * ldo + r].
template <int MB>
inline void store(const __m512* acc, float* out0, float* out1, int64_t ldo) {
  for (int m = 0; m < MB; ++m) {
    _mm256_storeu_ps(out0 + m * ldo, _mm512_castps512_ps256(acc[m]));
    _mm256_storeu_ps(out1 + m * ldo, _mm512_extractf32x8_ps(acc[m], 1));
  }
}

}  // namespace zmm

// gemm_q45_k_x8 over groups g0 and g1 at once.
template <int MB, typename Block>
inline void gemm_q45_k_x8_pair(const Block* g0, const Block* g1, int64_t nb, const ActQ8_K* const* act,
                               float* out0, float* out1, int64_t ldo, bool prefetch) {
  constexpr bool five = std::is_same_v<Block, BlockQ5_Kx8>;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const Block& w0 = g0[b];
    const Block& w1 = g1[b];
    if (prefetch) {
      prefetch_ahead(&w0);
      prefetch_ahead(&w1);
    }
    __m512i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      __m512i lo[MB], hi[MB];
      for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i q = zmm::load2(w0.qs[i][c], w1.qs[i][c]);
        __m512i ql = _mm512_and_si512(q, m4);
        __m512i qh = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        if constexpr (five) {
          const __m512i hb = zmm::load2(w0.qh[c], w1.qh[c]);
          ql = _mm512_or_si512(ql, zmm::fifth_bits(hb, 2 * i));
          qh = _mm512_or_si512(qh, zmm::fifth_bits(hb, 2 * i + 1));
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* y = act[m][b].qs + 64 * i + 4 * c;
          lo[m] = _mm512_dpbusd_epi32(lo[m], ql, zmm::broadcast4(y));
          hi[m] = _mm512_dpbusd_epi32(hi[m], qh, zmm::broadcast4(y + 32));
        }
      }
      const __m512i s_lo = zmm::bytes16<true>(w0.sc[2 * i], w1.sc[2 * i]);  // 0..63: as SubBlockSum::scales
      const __m512i s_hi = zmm::bytes16<true>(w0.sc[2 * i + 1], w1.sc[2 * i + 1]);
      zmm::add_scaled<MB>(isum, lo, hi, s_lo, s_hi);
    }
    __m512i mins[4];
    zmm::pairs_of<4>(w0.mn, w1.mn, mins);
    const __m512 d = zmm::halves16(w0.d, w1.d), dmin = zmm::halves16(w0.dmin, w1.dmin);
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m512i msum = zmm::pair_sums<4>(mins, a.sums32);
      const __m512 ad = _mm512_set1_ps(a.d);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, ad), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, ad), acc[m]);
    }
  }
  zmm::store<MB>(acc, out0, out1, ldo);
}

// gemm_q6_k_x8 over groups g0 and g1 at once.
template <int MB>
inline void gemm_q6_k_x8_pair(const BlockQ6_Kx8* g0, const BlockQ6_Kx8* g1, int64_t nb, const ActQ8_K* const* act,
                              float* out0, float* out1, int64_t ldo, bool prefetch) {
  constexpr int kHint = MB == 1 ? PAGEDATTN_X8_HINT : PAGEDATTN_QUANT_HINT;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_Kx8& w0 = g0[b];
    const BlockQ6_Kx8& w1 = g1[b];
    if (prefetch) {
      prefetch_ahead<BlockQ6_Kx8, kHint>(&w0);
      prefetch_ahead<BlockQ6_Kx8, kHint>(&w1);
    }
    __m512i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      for (int cp0 = 0; cp0 < 4; cp0 += SubBlockSum::kQ6Pairs) {
        __m512i lo[MB], hi[MB];
        for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int cp = cp0; cp < cp0 + SubBlockSum::kQ6Pairs; ++cp) {
          const __m512i hb = zmm::load2(w0.qh[i][cp], w1.qh[i][cp]);
#pragma GCC unroll 2
          for (int e = 0; e < 2; ++e) {  // the highs moved to bits 4-5 as gemm_q6_k_x8 does
            const int c = 2 * cp + e;
            const __m512i q = zmm::load2(w0.ql[i][c], w1.ql[i][c]);
            const __m512i h_lo = e == 0 ? _mm512_slli_epi16(hb, 4) : hb;
            const __m512i h_hi = e == 0 ? _mm512_slli_epi16(hb, 2) : _mm512_srli_epi16(hb, 2);
            const __m512i ql = _mm512_or_si512(_mm512_and_si512(q, m4), _mm512_and_si512(h_lo, m30));
            const __m512i qh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                                               _mm512_and_si512(h_hi, m30));
            for (int m = 0; m < MB; ++m) {
              const int8_t* y = act[m][b].qs + 64 * i + 4 * c;
              lo[m] = _mm512_dpbusd_epi32(lo[m], ql, zmm::broadcast4(y));
              hi[m] = _mm512_dpbusd_epi32(hi[m], qh, zmm::broadcast4(y + 32));
            }
          }
        }
        const __m512i s_lo = zmm::bytes16<true>(w0.sc[4 * i + cp0 / 2], w1.sc[4 * i + cp0 / 2]);
        const __m512i s_hi = zmm::bytes16<true>(w0.sc[4 * i + 2 + cp0 / 2], w1.sc[4 * i + 2 + cp0 / 2]);
        zmm::add_scaled<MB>(isum, lo, hi, s_lo, s_hi);
      }
    }
    __m512i scp[8];
    zmm::pairs_of<8>(w0.sc, w1.sc, scp);
    const __m512 d = zmm::halves16(w0.d, w1.d);
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m512i total = _mm512_sub_epi32(isum[m], _mm512_slli_epi32(zmm::pair_sums<8>(scp, a.bsums), 5));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(a.d)), acc[m]);
    }
  }
  zmm::store<MB>(acc, out0, out1, ldo);
}

// gemm_q23_k_x8 over groups g0 and g1 at once.
template <int MB, typename Block>
inline void gemm_q23_k_x8_pair(const Block* g0, const Block* g1, int64_t nb, const ActQ8_K* const* act,
                               float* out0, float* out1, int64_t ldo, bool prefetch) {
  constexpr bool three = std::is_same_v<Block, BlockQ3_Kx8>;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi16(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const Block& w0 = g0[b];
    const Block& w1 = g1[b];
    if (prefetch) {
      prefetch_ahead(&w0);
      prefetch_ahead(&w1);
    }
    // row r's scales and offsets (Q3_K: both the scale) or minimums (Q2_K: the packed bytes'
    // low and high nibbles) of groups 2p and 2p + 1 in int16 lanes 2r, 2r + 1
    __m512i scp[8], mnp[8];
    zmm::pairs_of<8>(w0.sc, w1.sc, scp);
    for (int p = 0; p < 8; ++p) {
      mnp[p] = three ? scp[p] : _mm512_and_si512(_mm512_srli_epi16(scp[p], 4), m4);
      scp[p] = three ? scp[p] : _mm512_and_si512(scp[p], m4);
    }
    __m512i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[MB], hi[MB];
        for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          __m512i ql = _mm512_and_si512(_mm512_srli_epi16(zmm::load2(w0.qs[h][c], w1.qs[h][c]), 2 * j), m3);
          __m512i qh = _mm512_and_si512(_mm512_srli_epi16(zmm::load2(w0.qs[h][c + 4], w1.qs[h][c + 4]), 2 * j), m3);
          if constexpr (three) {
            ql = _mm512_or_si512(ql, zmm::third_bits(zmm::load2(w0.hm[c], w1.hm[c]), 4 * h + j));
            qh = _mm512_or_si512(qh, zmm::third_bits(zmm::load2(w0.hm[c + 4], w1.hm[c + 4]), 4 * h + j));
          }
          for (int m = 0; m < MB; ++m) {
            const int8_t* y = act[m][b].qs + 128 * h + 32 * j + 4 * c;
            lo[m] = _mm512_dpbusd_epi32(lo[m], ql, zmm::broadcast4(y));
            hi[m] = _mm512_dpbusd_epi32(hi[m], qh, zmm::broadcast4(y + 16));
          }
        }
        // a row's two group sums fit in int16 (16 x 7 x 128 < 2^15): lanes 2r and 2r + 1 meet
        // groups 8h + 2j and 8h + 2j + 1's scales in one vpdpwssd
        for (int m = 0; m < MB; ++m) {
          const __m512i pair = _mm512_mask_blend_epi16(0xAAAAAAAA, lo[m], _mm512_slli_epi32(hi[m], 16));
          isum[m] = _mm512_dpwssd_epi32(isum[m], pair, scp[4 * h + j]);
        }
      }
    }
    const __m512 d = zmm::halves16(w0.d, w1.d);
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m512i msum = zmm::pair_sums<8>(mnp, a.bsums);
      const __m512 ad = _mm512_set1_ps(a.d);
      if constexpr (three) {
        const __m512i total = _mm512_sub_epi32(isum[m], _mm512_slli_epi32(msum, 2));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, ad), acc[m]);
      } else {
        const __m512 dmin = zmm::halves16(w0.dmin, w1.dmin);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, ad), acc[m]);
        acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, ad), acc[m]);
      }
    }
  }
  zmm::store<MB>(acc, out0, out1, ldo);
}

// gemm_iq4_xs_x8 over groups g0 and g1 at once (VNNI's form: values + 128).
template <int MB>
inline void gemm_iq4_xs_x8_pair(const BlockIQ4_XSx8* g0, const BlockIQ4_XSx8* g1, int64_t nb,
                                const ActQ8_K* const* act, float* out0, float* out1, int64_t ldo, bool prefetch) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i lut = _mm512_broadcast_i64x4(iq4_table());  // vpshufb looks up within 128-bit lanes
  for (int64_t b = 0; b < nb; ++b) {
    const BlockIQ4_XSx8& w0 = g0[b];
    const BlockIQ4_XSx8& w1 = g1[b];
    if (prefetch) {
      prefetch_ahead(&w0);
      prefetch_ahead(&w1);
    }
    __m512i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm512_setzero_si512();
    for (int i = 0; i < 8; i += 2) {
      __m512i sub[2][MB];  // sub-blocks i and i + 1
      for (int m = 0; m < MB; ++m) sub[0][m] = sub[1][m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const int e = k / 4, c = k % 4;
        const __m512i q = zmm::load2(w0.qs[i + e][c], w1.qs[i + e][c]);
        const __m512i wl = _mm512_shuffle_epi8(lut, _mm512_and_si512(q, m4));
        const __m512i wh = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
        for (int m = 0; m < MB; ++m) {
          const int8_t* y = act[m][b].qs + 32 * (i + e) + 4 * c;
          sub[e][m] = _mm512_dpbusd_epi32(sub[e][m], wl, zmm::broadcast4(y));
          sub[e][m] = _mm512_dpbusd_epi32(sub[e][m], wh, zmm::broadcast4(y + 16));
        }
      }
      zmm::add_scaled<MB>(isum, sub[0], sub[1], zmm::bytes16<true>(w0.sc[i], w1.sc[i]),
                          zmm::bytes16<true>(w0.sc[i + 1], w1.sc[i + 1]));
    }
    // the +128, as gemm_iq4_xs_x8 takes it off
    __m512i scp[4];
    zmm::pairs_of<4>(w0.sc, w1.sc, scp);
    const __m512 d = zmm::halves16(w0.d, w1.d);
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m512i total = _mm512_sub_epi32(isum[m], _mm512_slli_epi32(zmm::pair_sums<4>(scp, a.sums32), 7));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(a.d)), acc[m]);
    }
  }
  zmm::store<MB>(acc, out0, out1, ldo);
}

// gemm_signed_x8 (VNNI's form) and gemm_legacy_x8 over groups g0 and g1 at once.
template <int T, int MB>
inline void gemm_legacy_x8_pair(const typename LegacyX8<T>::type* g0, const typename LegacyX8<T>::type* g1,
                                int64_t nb, const ActQ8_0* const* act, float* out0, float* out1, int64_t ldo,
                                bool prefetch) {
  constexpr bool unsigned_sum = T == kQ8_0 || T == kIQ4_NL;  // values + 128: 128 x sum comes off
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i lut = _mm512_broadcast_i64x4(iq4_table());
  const __m512 offset = _mm512_set1_ps(-static_cast<float>(legacy_offset<T>()));
  for (int64_t b = 0; b < nb; ++b) {
    const auto& w0 = g0[b];
    const auto& w1 = g1[b];
    if (prefetch) {
      prefetch_span(reinterpret_cast<const char*>(&w0) + kRowPrefetchBytes, sizeof(w0));
      prefetch_span(reinterpret_cast<const char*>(&w1) + kRowPrefetchBytes, sizeof(w1));
    }
    __m512i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm512_setzero_si512();
    if constexpr (T == kQ8_0) {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i qu = _mm512_xor_si512(zmm::load2(w0.qs[c], w1.qs[c]), flip);
        for (int m = 0; m < MB; ++m) isum[m] = _mm512_dpbusd_epi32(isum[m], qu, zmm::broadcast4(act[m][b].qs + 4 * c));
      }
    } else {
      __m512i hb = _mm512_setzero_si512();
      if constexpr (legacy_has_qh<T>()) hb = zmm::load2(w0.qh, w1.qh);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i q = zmm::load2(w0.qs[c], w1.qs[c]);
        __m512i ql = _mm512_and_si512(q, m4);
        __m512i qh = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        if constexpr (legacy_has_qh<T>()) {
          ql = _mm512_or_si512(ql, zmm::fifth_bits(hb, 2 * c));
          qh = _mm512_or_si512(qh, zmm::fifth_bits(hb, 2 * c + 1));
        }
        if constexpr (T == kIQ4_NL) {
          ql = _mm512_shuffle_epi8(lut, ql);
          qh = _mm512_shuffle_epi8(lut, qh);
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* y = act[m][b].qs + 4 * c;
          isum[m] = _mm512_dpbusd_epi32(isum[m], ql, zmm::broadcast4(y));
          isum[m] = _mm512_dpbusd_epi32(isum[m], qh, zmm::broadcast4(y + 16));
        }
      }
    }
    const __m512 d = zmm::halves16(w0.d, w1.d);
    __m512 cw = _mm512_setzero_ps();
    if constexpr (legacy_has_min<T>()) {
      cw = zmm::halves16(w0.m, w1.m);
    } else {
      cw = _mm512_mul_ps(offset, d);
    }
    for (int m = 0; m < MB; ++m) {
      const ActQ8_0& a = act[m][b];
      if constexpr (unsigned_sum) isum[m] = _mm512_sub_epi32(isum[m], _mm512_set1_epi32(128 * a.sum));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, _mm512_set1_ps(a.d)), acc[m]);
      if constexpr (!unsigned_sum) acc[m] = _mm512_fmadd_ps(cw, _mm512_set1_ps(a.s), acc[m]);
    }
  }
  zmm::store<MB>(acc, out0, out1, ldo);
}
#endif

// Whether groups of this type run two at a time here, for M activation rows.
inline bool has_x8_pair(int type, int64_t M) {
#ifdef PAGEDATTN_X8_PAIRS
  return M >= kX8PairRows && is_supported(type);
#else
  (void)type, (void)M;
  return false;
#endif
}

#ifdef PAGEDATTN_X8_PAIRS
// Groups grp and grp + group_bytes of a type that has_x8_pair(), mb activation rows (1 <= mb <=
// MB): out[m * 16 + r], rows r < 8 of the first group, 8..15 of the second.
template <int MB = kX8Rows>
inline void gemm_x8_pair_rows(int mb, int type, const uint8_t* grp, int64_t group_bytes, int64_t nb,
                              const void* const* act, float* out, bool prefetch) {
  if constexpr (MB > 1) {
    if (mb < MB) return gemm_x8_pair_rows<MB - 1>(mb, type, grp, group_bytes, nb, act, out, prefetch);
  }
  const auto* ak = reinterpret_cast<const ActQ8_K* const*>(act);
  const auto* a0 = reinterpret_cast<const ActQ8_0* const*>(act);
  const uint8_t* next = grp + group_bytes;
  auto legacy = [&](auto t) {
    constexpr int T = decltype(t)::value;
    using Block = typename LegacyX8<T>::type;
    gemm_legacy_x8_pair<T, MB>(reinterpret_cast<const Block*>(grp), reinterpret_cast<const Block*>(next), nb, a0,
                               out, out + 8, 16, prefetch);
  };
  switch (type) {
    case kQ8_0: return legacy(std::integral_constant<int, kQ8_0>());
    case kQ4_0: return legacy(std::integral_constant<int, kQ4_0>());
    case kQ4_1: return legacy(std::integral_constant<int, kQ4_1>());
    case kQ5_0: return legacy(std::integral_constant<int, kQ5_0>());
    case kQ5_1: return legacy(std::integral_constant<int, kQ5_1>());
    case kIQ4_NL: return legacy(std::integral_constant<int, kIQ4_NL>());
    case kQ4_K:
      return gemm_q45_k_x8_pair<MB>(reinterpret_cast<const BlockQ4_Kx8*>(grp), reinterpret_cast<const BlockQ4_Kx8*>(next),
                                    nb, ak, out, out + 8, 16, prefetch);
    case kQ5_K:
      return gemm_q45_k_x8_pair<MB>(reinterpret_cast<const BlockQ5_Kx8*>(grp), reinterpret_cast<const BlockQ5_Kx8*>(next),
                                    nb, ak, out, out + 8, 16, prefetch);
    case kQ6_K:
      return gemm_q6_k_x8_pair<MB>(reinterpret_cast<const BlockQ6_Kx8*>(grp), reinterpret_cast<const BlockQ6_Kx8*>(next),
                                   nb, ak, out, out + 8, 16, prefetch);
    case kQ2_K:
      return gemm_q23_k_x8_pair<MB>(reinterpret_cast<const BlockQ2_Kx8*>(grp), reinterpret_cast<const BlockQ2_Kx8*>(next),
                                    nb, ak, out, out + 8, 16, prefetch);
    case kQ3_K:
      return gemm_q23_k_x8_pair<MB>(reinterpret_cast<const BlockQ3_Kx8*>(grp), reinterpret_cast<const BlockQ3_Kx8*>(next),
                                    nb, ak, out, out + 8, 16, prefetch);
    case kIQ4_XS:
      return gemm_iq4_xs_x8_pair<MB>(reinterpret_cast<const BlockIQ4_XSx8*>(grp),
                                     reinterpret_cast<const BlockIQ4_XSx8*>(next), nb, ak, out, out + 8, 16, prefetch);
  }
}
#endif

}  // namespace pagedattn_quant
