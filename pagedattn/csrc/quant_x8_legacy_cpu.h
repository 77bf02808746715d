// The legacy GGUF types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: blocks of 32 values)
// interleaved 8 rows at a time, as quant_x8_cpu.h does the K types, and the dispatch over every
// x8 type (every supported type).
//
// BlockQ8_0x8 is Q8_0's 32-value block of 8 rows: their 8 d (fp16) and their int8 values so
// that one 32-byte load holds 4 consecutive values of each row (row r at bytes 4r..4r+3); 272
// bytes per 8 rows, as stored (34 per row). The sign goes to the activation side
// (_mm256_sign_epi8, as the row-major kernel does), and one conversion, multiply and fma apply
// the 8 rows' scales: the row-major kernel converts and broadcasts one scale per row and block,
// and sums 8 lanes per row.
//
// BlockQ4_0x8 .. BlockQ5_1x8 hold the 4- and 5-bit types the same way, each as many bytes as
// its 8 rows stored: d (and m) per row, and the nibbles so that one 32-byte load (column c)
// holds bytes 4c..4c+3 of each row, whose low nibbles are values 4c..4c+3 and high nibbles
// values 16 + 4c..16 + 4c + 3. The fifth bits (Q5_x) are regrouped by value: byte 4r + k holds
// the fifth bits of row r's values 16h + 4c + k at bit 2c + h, so one shift and one mask move a
// column's bits under its nibbles (fifth_bits, as for Q5_K). The whole block's products add up before its float work:
// with VNNI in one int32 sum per row; without, low and high halves in int16 (4 maddubs each:
// 4 * 2 * 31 * 127 < 2^15), one madd apiece. The offset (Q4_0: -8, Q5_0: -16) or minimum m
// (Q4_1, Q5_1) is taken out with the activation block's sum (ActQ8_0::s), 8 rows per fma. The
// row-major kernel (quant_dot_cpu.h) instead sums 8 lanes for each row and adds the offset one
// row at a time.
#pragma once

#include "quant_x8_iq_cpu.h"

namespace pagedattn_quant {

#pragma pack(push, 1)
struct BlockQ8_0x8 {
  uint16_t d[8];
  int8_t qs[8][32];  // [4-byte column c][row r: bytes 4r..4r+3]: values 4c..4c+3
};
struct BlockQ4_0x8 {
  uint16_t d[8];
  uint8_t qs[4][32];  // [column c][row r: bytes 4r..4r+3]: values 4c.., 16 + 4c.. (high nibbles)
};
struct BlockQ4_1x8 {
  uint16_t d[8], m[8];
  uint8_t qs[4][32];
};
struct BlockQ5_0x8 {
  uint16_t d[8];
  uint8_t qh[32];  // byte 4r + k, bit 2c + h: the fifth bit of row r's value 16h + 4c + k
  uint8_t qs[4][32];
};
struct BlockQ5_1x8 {
  uint16_t d[8], m[8];
  uint8_t qh[32];
  uint8_t qs[4][32];
};
#pragma pack(pop)
static_assert(sizeof(BlockQ8_0x8) == 8 * sizeof(BlockQ8_0), "Q8_0 x8 block size");
static_assert(sizeof(BlockQ4_0x8) == 8 * sizeof(BlockQ4_0) && sizeof(BlockQ4_1x8) == 8 * sizeof(BlockQ4_1),
              "4-bit x8 block sizes");
static_assert(sizeof(BlockQ5_0x8) == 8 * sizeof(BlockQ5_0) && sizeof(BlockQ5_1x8) == 8 * sizeof(BlockQ5_1),
              "5-bit x8 block sizes");

template <int T>
struct LegacyX8;
template <>
struct LegacyX8<kQ4_0> { using type = BlockQ4_0x8; };
template <>
struct LegacyX8<kQ4_1> { using type = BlockQ4_1x8; };
template <>
struct LegacyX8<kQ5_0> { using type = BlockQ5_0x8; };
template <>
struct LegacyX8<kQ5_1> { using type = BlockQ5_1x8; };
template <>
struct LegacyX8<kIQ4_NL> { using type = BlockQ4_0x8; };  // the same bytes as Q4_0's
template <>
struct LegacyX8<kQ8_0> { using type = BlockQ8_0x8; };

template <int T>
constexpr bool legacy_has_qh() {
  return T == kQ5_0 || T == kQ5_1;
}

// Rows [8g, 8g + 8) of a row-major Q8_0 tensor (nb blocks of 32 per row) as nb x8 blocks.
inline void repack_q8_0_x8(const uint8_t* rows, int64_t nb, BlockQ8_0x8* out) {
  const BlockQ8_0* w = reinterpret_cast<const BlockQ8_0*>(rows);
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < 8; ++r) {
      const BlockQ8_0& blk = w[r * nb + b];
      out[b].d[r] = blk.d;
      for (int c = 0; c < 8; ++c) std::memcpy(&out[b].qs[c][4 * r], blk.qs + 4 * c, 4);
    }
  }
}

// Rows [8g, 8g + 8) of a row-major Q4_0, Q4_1, Q5_0 or Q5_1 tensor (T) as nb x8 blocks.
template <int T>
inline void repack_legacy_x8(const uint8_t* rows, int64_t nb, typename LegacyX8<T>::type* out) {
  using Block = typename LegacyBlock<T>::type;
  const Block* w = reinterpret_cast<const Block*>(rows);
  int q[32];
  for (int64_t b = 0; b < nb; ++b) {
    auto& o = out[b];
    std::memset(&o, 0, sizeof(o));
    for (int r = 0; r < 8; ++r) {
      const Block& blk = w[r * nb + b];
      o.d[r] = blk.d;
      if constexpr (legacy_has_min<T>()) o.m[r] = blk.m;
      unpack_legacy_scalar<T>(&blk, q);
      for (int c = 0; c < 4; ++c) {
        for (int k = 0; k < 4; ++k) {
          const int lo = q[4 * c + k], hi = q[16 + 4 * c + k];
          o.qs[c][4 * r + k] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
          if constexpr (legacy_has_qh<T>()) {
            o.qh[4 * r + k] |= static_cast<uint8_t>((((lo >> 4) & 1) << (2 * c)) | (((hi >> 4) & 1) << (2 * c + 1)));
          }
        }
      }
    }
  }
}

// Row r (0..7) of a group of nb x8 blocks, dequantised as dequant_row does the rows as stored
// (the same float operations: bit-identical values).
inline void dequant_q8_0_x8(const BlockQ8_0x8* grp, int64_t nb, int r, float* y) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half_to_float(grp[b].d[r]);
    for (int l = 0; l < 32; ++l) y[32 * b + l] = d * static_cast<float>(grp[b].qs[l / 4][4 * r + l % 4]);
  }
}

template <int T>
inline void dequant_legacy_x8(const typename LegacyX8<T>::type* grp, int64_t nb, int r, float* y) {
  for (int64_t b = 0; b < nb; ++b) {
    const auto& w = grp[b];
    const float d = half_to_float(w.d[r]);
    float c0 = -static_cast<float>(legacy_offset<T>()) * d;
    if constexpr (legacy_has_min<T>()) c0 = half_to_float(w.m[r]);
    for (int l = 0; l < 32; ++l) {
      const int h = l / 16, c = (l % 16) / 4, k = l % 4;
      int q = (w.qs[c][4 * r + k] >> (4 * h)) & 0xF;
      if constexpr (legacy_has_qh<T>()) q |= ((w.qh[4 * r + k] >> (2 * c + h)) & 1) << 4;
      if constexpr (T == kIQ4_NL) q = kIQ4Values[q];
      y[32 * b + l] = d * static_cast<float>(q) + c0;
    }
  }
}

// Value l (0..31) of row r of a Q8_0 or IQ4_NL (Q4_0's layout) x8 block.
template <int T>
inline int signed_x8_value(const typename LegacyX8<T>::type& w, int r, int l) {
  if constexpr (T == kQ8_0) {
    return w.qs[l / 4][4 * r + l % 4];
  } else {
    return kIQ4Values[(w.qs[(l % 16) / 4][4 * r + l % 4] >> (4 * (l / 16))) & 0xF];
  }
}

// As gemm_q45_k_x8, for the signed types (T): Q8_0, and IQ4_NL in Q4_0's x8 layout (a column's
// nibbles become values through iq4_table). With VNNI the weights go unsigned (Q8_0: q ^ 0x80,
// which is q + 128 as a byte; IQ4_NL: the table's values + 128) to meet the activations as they
// are, and 128 x the activation block's sum comes off after the block: one xor per column for
// all rows, where the sign trick costs one sign per row and column (AMD Zen 4, 2 threads, Q8_0
// [8192 x 2048], 512 rows: 341 GOP/s with the sign trick). The blocks are small (272 and 144
// bytes): it asks kRowPrefetchBytes ahead, as the row-major kernels do.
template <int T, int MB>
inline void gemm_signed_x8(const typename LegacyX8<T>::type* grp, int64_t nb, const ActQ8_0* const* act,
                           float* out, int64_t ldo, bool prefetch = true) {
#ifdef PAGEDATTN_QUANT_X86
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), lut = iq4_table();
  for (int64_t b = 0; b < nb; ++b) {
    const auto& w = grp[b];
    if (prefetch) prefetch_span(reinterpret_cast<const char*>(&w) + kRowPrefetchBytes, sizeof(w));
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    if constexpr (T == kQ8_0) {
      for (int c = 0; c < 8; ++c) {
        __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs[c]));
#ifdef PAGEDATTN_QUANT_VNNI
        q = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
        for (int m = 0; m < MB; ++m) isum[m] = signed_dot(isum[m], q, act[m][b].qs + 4 * c);
      }
    } else {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs[c]));
        const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, m4));
        const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
        for (int m = 0; m < MB; ++m) {
          isum[m] = signed_dot(signed_dot(isum[m], wl, act[m][b].qs + 4 * c), wh, act[m][b].qs + 16 + 4 * c);
        }
      }
    }
#ifdef PAGEDATTN_QUANT_VNNI
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_sub_epi32(isum[m], _mm256_set1_epi32(128 * act[m][b].sum));
#endif
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d)));
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, _mm256_set1_ps(act[m][b].d)), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
#else
  (void)prefetch;
  float acc[MB][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const auto& w = grp[b];
    for (int r = 0; r < 8; ++r) {
      int v[32];
      for (int l = 0; l < 32; ++l) v[l] = signed_x8_value<T>(w, r, l);
      for (int m = 0; m < MB; ++m) {
        int s = 0;
        for (int l = 0; l < 32; ++l) s += v[l] * act[m][b].qs[l];
        acc[m][r] += static_cast<float>(s) * (half_to_float(w.d[r]) * act[m][b].d);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < 8; ++r) out[m * ldo + r] = acc[m][r];
  }
#endif
}

// As gemm_signed_x8, for the 4- and 5-bit legacy types (T).
template <int T, int MB>
inline void gemm_legacy_x8(const typename LegacyX8<T>::type* grp, int64_t nb, const ActQ8_0* const* act,
                           float* out, int64_t ldo, bool prefetch = true) {
#ifdef PAGEDATTN_QUANT_X86
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256 offset = _mm256_set1_ps(-static_cast<float>(legacy_offset<T>()));
  for (int64_t b = 0; b < nb; ++b) {
    const auto& w = grp[b];
    if (prefetch) prefetch_span(reinterpret_cast<const char*>(&w) + kRowPrefetchBytes, sizeof(w));
    __m256i lo[MB], hi[MB];
    for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
    __m256i hb = _mm256_setzero_si256();
    if constexpr (legacy_has_qh<T>()) hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs[c]));
      __m256i ql = _mm256_and_si256(q, m4);
      __m256i qh = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (legacy_has_qh<T>()) {
        ql = _mm256_or_si256(ql, fifth_bits(hb, 2 * c));
        qh = _mm256_or_si256(qh, fifth_bits(hb, 2 * c + 1));
      }
      for (int m = 0; m < MB; ++m) {
        const int8_t* y = act[m][b].qs + 4 * c;
        lo[m] = SubBlockSum::add(lo[m], ql, broadcast4(y));
        hi[m] = SubBlockSum::add(hi[m], qh, broadcast4(y + 16));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d)));
    __m256 cw;
    if constexpr (legacy_has_min<T>()) {
      cw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m)));
    } else {
      cw = _mm256_mul_ps(offset, d);
    }
    for (int m = 0; m < MB; ++m) {
      const ActQ8_0& a = act[m][b];
#ifdef PAGEDATTN_QUANT_VNNI
      const __m256i isum = _mm256_add_epi32(lo[m], hi[m]);
#else
      const __m256i ones = _mm256_set1_epi16(1);
      const __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(lo[m], ones), _mm256_madd_epi16(hi[m], ones));
#endif
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(a.d)), acc[m]);
      acc[m] = _mm256_fmadd_ps(cw, _mm256_set1_ps(a.s), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
#else
  float acc[MB][8] = {};
  uint8_t wq[8][32];
  for (int64_t b = 0; b < nb; ++b) {
    const auto& w = grp[b];
    float dw[8], cw[8];
    for (int r = 0; r < 8; ++r) {
      dw[r] = half_to_float(w.d[r]);
      cw[r] = -static_cast<float>(legacy_offset<T>()) * dw[r];
      if constexpr (legacy_has_min<T>()) cw[r] = half_to_float(w.m[r]);
      for (int l = 0; l < 32; ++l) {
        const int h = l / 16, c = (l % 16) / 4, k = l % 4;
        int q = (w.qs[c][4 * r + k] >> (4 * h)) & 0xF;
        if constexpr (legacy_has_qh<T>()) q |= ((w.qh[4 * r + k] >> (2 * c + h)) & 1) << 4;
        wq[r][l] = static_cast<uint8_t>(q);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const ActQ8_0& a = act[m][b];
      for (int r = 0; r < 8; ++r) {
        int s = 0;
        for (int l = 0; l < 32; ++l) s += wq[r][l] * a.qs[l];
        acc[m][r] += static_cast<float>(s) * (dw[r] * a.d) + cw[r] * a.s;
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < 8; ++r) out[m * ldo + r] = acc[m][r];
  }
#endif
}

// ---- every x8 type ----

// Whether the AMX-INT8 tiles (quant_amx_cpu.h) have a kernel for this x8 type.
inline bool has_x8_amx(int type) { return type == kQ4_K || type == kQ6_K || type == kQ8_0; }

// The bytes of one x8 block of this type.
inline int64_t x8_block_bytes(int type) {
  switch (type) {
    case kQ4_K: return sizeof(BlockQ4_Kx8);
    case kQ5_K: return sizeof(BlockQ5_Kx8);
    case kQ6_K: return sizeof(BlockQ6_Kx8);
    case kQ2_K: return sizeof(BlockQ2_Kx8);
    case kQ3_K: return sizeof(BlockQ3_Kx8);
    case kIQ4_XS: return sizeof(BlockIQ4_XSx8);
    default: return 8 * block_bytes(type);  // the legacy types: as stored
  }
}

// Rows [8g, 8g + 8) of a row-major tensor of this type as nb x8 blocks at out.
inline void repack_x8(int type, const uint8_t* rows, int64_t nb, uint8_t* out) {
  switch (type) {
    case kQ4_K: return repack_q45_k_x8(rows, nb, reinterpret_cast<BlockQ4_Kx8*>(out));
    case kQ5_K: return repack_q45_k_x8(rows, nb, reinterpret_cast<BlockQ5_Kx8*>(out));
    case kQ6_K: return repack_q6_k_x8(rows, nb, reinterpret_cast<BlockQ6_Kx8*>(out));
    case kQ2_K: return repack_q23_k_x8(rows, nb, reinterpret_cast<BlockQ2_Kx8*>(out));
    case kQ3_K: return repack_q23_k_x8(rows, nb, reinterpret_cast<BlockQ3_Kx8*>(out));
    case kIQ4_XS: return repack_iq4_xs_x8(rows, nb, reinterpret_cast<BlockIQ4_XSx8*>(out));
    case kQ8_0: return repack_q8_0_x8(rows, nb, reinterpret_cast<BlockQ8_0x8*>(out));
    case kQ4_0:
    case kIQ4_NL: return repack_legacy_x8<kQ4_0>(rows, nb, reinterpret_cast<BlockQ4_0x8*>(out));
    case kQ4_1: return repack_legacy_x8<kQ4_1>(rows, nb, reinterpret_cast<BlockQ4_1x8*>(out));
    case kQ5_0: return repack_legacy_x8<kQ5_0>(rows, nb, reinterpret_cast<BlockQ5_0x8*>(out));
    case kQ5_1: return repack_legacy_x8<kQ5_1>(rows, nb, reinterpret_cast<BlockQ5_1x8*>(out));
  }
}

// Row r (0..7) of a group of nb x8 blocks of this type, dequantised.
inline void dequant_x8(int type, const uint8_t* grp, int64_t nb, int r, float* y) {
  switch (type) {
    case kQ4_K: return dequant_q45_k_x8(reinterpret_cast<const BlockQ4_Kx8*>(grp), nb, r, y);
    case kQ5_K: return dequant_q45_k_x8(reinterpret_cast<const BlockQ5_Kx8*>(grp), nb, r, y);
    case kQ6_K: return dequant_q6_k_x8(reinterpret_cast<const BlockQ6_Kx8*>(grp), nb, r, y);
    case kQ2_K: return dequant_q23_k_x8(reinterpret_cast<const BlockQ2_Kx8*>(grp), nb, r, y);
    case kQ3_K: return dequant_q23_k_x8(reinterpret_cast<const BlockQ3_Kx8*>(grp), nb, r, y);
    case kIQ4_XS: return dequant_iq4_xs_x8(reinterpret_cast<const BlockIQ4_XSx8*>(grp), nb, r, y);
    case kQ8_0: return dequant_q8_0_x8(reinterpret_cast<const BlockQ8_0x8*>(grp), nb, r, y);
    case kQ4_0: return dequant_legacy_x8<kQ4_0>(reinterpret_cast<const BlockQ4_0x8*>(grp), nb, r, y);
    case kQ4_1: return dequant_legacy_x8<kQ4_1>(reinterpret_cast<const BlockQ4_1x8*>(grp), nb, r, y);
    case kQ5_0: return dequant_legacy_x8<kQ5_0>(reinterpret_cast<const BlockQ5_0x8*>(grp), nb, r, y);
    case kQ5_1: return dequant_legacy_x8<kQ5_1>(reinterpret_cast<const BlockQ5_1x8*>(grp), nb, r, y);
    case kIQ4_NL: return dequant_legacy_x8<kIQ4_NL>(reinterpret_cast<const BlockQ4_0x8*>(grp), nb, r, y);
  }
}

// act[m]: activation row m's blocks (ActQ8_0 for the legacy types, ActQ8_K for the K types);
// out[m * 8 + r]: row r of the group . activation row m.
template <int MB>
inline void gemm_x8(int type, const uint8_t* grp, int64_t nb, const void* const* act, float* out,
                    bool prefetch) {
  const auto* a0 = reinterpret_cast<const ActQ8_0* const*>(act);
  const auto* ak = reinterpret_cast<const ActQ8_K* const*>(act);
  switch (type) {
    case kQ4_K: return gemm_q45_k_x8<MB>(reinterpret_cast<const BlockQ4_Kx8*>(grp), nb, ak, out, 8, prefetch);
    case kQ5_K: return gemm_q45_k_x8<MB>(reinterpret_cast<const BlockQ5_Kx8*>(grp), nb, ak, out, 8, prefetch);
    case kQ6_K: return gemm_q6_k_x8<MB>(reinterpret_cast<const BlockQ6_Kx8*>(grp), nb, ak, out, 8, prefetch);
    case kQ2_K: return gemm_q23_k_x8<MB>(reinterpret_cast<const BlockQ2_Kx8*>(grp), nb, ak, out, 8, prefetch);
    case kQ3_K: return gemm_q23_k_x8<MB>(reinterpret_cast<const BlockQ3_Kx8*>(grp), nb, ak, out, 8, prefetch);
    case kIQ4_XS: return gemm_iq4_xs_x8<MB>(reinterpret_cast<const BlockIQ4_XSx8*>(grp), nb, ak, out, 8, prefetch);
    case kQ8_0: return gemm_signed_x8<kQ8_0, MB>(reinterpret_cast<const BlockQ8_0x8*>(grp), nb, a0, out, 8, prefetch);
    case kQ4_0:
      return gemm_legacy_x8<kQ4_0, MB>(reinterpret_cast<const BlockQ4_0x8*>(grp), nb, a0, out, 8, prefetch);
    case kQ4_1:
      return gemm_legacy_x8<kQ4_1, MB>(reinterpret_cast<const BlockQ4_1x8*>(grp), nb, a0, out, 8, prefetch);
    case kQ5_0:
      return gemm_legacy_x8<kQ5_0, MB>(reinterpret_cast<const BlockQ5_0x8*>(grp), nb, a0, out, 8, prefetch);
    case kQ5_1:
      return gemm_legacy_x8<kQ5_1, MB>(reinterpret_cast<const BlockQ5_1x8*>(grp), nb, a0, out, 8, prefetch);
    case kIQ4_NL:
      return gemm_signed_x8<kIQ4_NL, MB>(reinterpret_cast<const BlockQ4_0x8*>(grp), nb, a0, out, 8, prefetch);
  }
}

// gemm_x8 for mb activation rows, 1 <= mb <= MB.
template <int MB = kX8Rows>
inline void gemm_x8_rows(int mb, int type, const uint8_t* grp, int64_t nb, const void* const* act,
                         float* out, bool prefetch) {
  if constexpr (MB > 1) {
    if (mb < MB) return gemm_x8_rows<MB - 1>(mb, type, grp, nb, act, out, prefetch);
  }
  gemm_x8<MB>(type, grp, nb, act, out, prefetch);
}

}  // namespace pagedattn_quant
