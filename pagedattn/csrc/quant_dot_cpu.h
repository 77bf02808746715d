// Dot products of GGUF weight blocks with int8 activation blocks (quant_blocks_cpu.h), for
// 1..kMaxRows activation rows at a time: each weight block is unpacked once per call and met
// with every row, so a decode step with a few rows streams its weights once.
//
// x86 (the AVX2 and AVX-512 builds): the weight's values are unpacked to unsigned bytes (0..15,
// 0..31 or 0..63; Q8_0 keeps its sign on the activation side) and multiplied with the activation
// bytes by _mm256_maddubs_epi16 (pairs summed to int16: 63 * 127 * 2 < 2^15, no saturation),
// then _mm256_madd_epi16 sums pairs again to int32 (times the sub-block scale for K types); with
// AVX512-VNNI (a -march that has it) _mm256_dpbusd_epi32 does both steps for the legacy types.
// The offset of unsigned values (-8, -16, -32) and the minimum of Q4_1/Q5_1/Q4_K/Q5_K are taken
// out with the activation block's sum (ActQ8_0::s, ActQ8_K::bsums), as llama.cpp does. Each
// block's int32 sums become float once per block (times d_weight * d_activation).
//
// Elsewhere (the scalar and ARM builds) the same sums in plain C++.
#pragma once

#include "quant_blocks_cpu.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PAGEDATTN_QUANT_X86 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDATTN_QUANT_VNNI 1  // u8 x s8 dot products straight into int32 (vpdpbusd)
#endif
#endif

namespace pagedattn_quant {

constexpr int kMaxRows = 8;  // activation rows met with one unpacked weight block

// The offset each legacy type's unsigned values carry (x = d * (q - offset)); 0: a minimum m.
template <int T>
constexpr int legacy_offset() {
  return T == kQ4_0 ? 8 : (T == kQ5_0 ? 16 : 0);
}
template <int T>
constexpr bool legacy_has_min() {
  return T == kQ4_1 || T == kQ5_1;
}
// The types whose values are signed (Q8_0, IQ4_NL through kIQ4Values): the sign goes to the
// activation side of maddubs.
template <int T>
constexpr bool legacy_signed() {
  return T == kQ8_0 || T == kIQ4_NL;
}

template <int T>
struct LegacyBlock;
template <>
struct LegacyBlock<kQ4_0> { using type = BlockQ4_0; };
template <>
struct LegacyBlock<kQ4_1> { using type = BlockQ4_1; };
template <>
struct LegacyBlock<kQ5_0> { using type = BlockQ5_0; };
template <>
struct LegacyBlock<kQ5_1> { using type = BlockQ5_1; };
template <>
struct LegacyBlock<kQ8_0> { using type = BlockQ8_0; };
template <>
struct LegacyBlock<kIQ4_NL> { using type = BlockIQ4_NL; };

// The 32 values of a legacy block as integers (unsigned before the offset; Q8_0 and IQ4_NL
// signed).
template <int T>
inline void unpack_legacy_scalar(const typename LegacyBlock<T>::type* b, int* q) {
  if constexpr (T == kQ8_0) {
    for (int j = 0; j < 32; ++j) q[j] = b->qs[j];
  } else if constexpr (T == kIQ4_NL) {
    for (int j = 0; j < 16; ++j) {
      q[j] = kIQ4Values[b->qs[j] & 0xF];
      q[j + 16] = kIQ4Values[b->qs[j] >> 4];
    }
  } else {
    uint32_t qh = 0;
    if constexpr (T == kQ5_0 || T == kQ5_1) std::memcpy(&qh, b->qh, 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = b->qs[j] & 0xF;
      q[j + 16] = b->qs[j] >> 4;
      if constexpr (T == kQ5_0 || T == kQ5_1) {
        q[j] |= ((qh >> j) & 1) << 4;
        q[j + 16] |= ((qh >> (j + 16)) & 1) << 4;
      }
    }
  }
}

// Weight blocks stream from memory at every decode step: the kernels ask for the bytes they
// will read next, every cache line of [p, p + bytes) at once, non-temporal (quant_x8_cpu.h and
// QuantLinear::decode measure why).
#ifndef PAGEDATTN_QUANT_HINT
#define PAGEDATTN_QUANT_HINT _MM_HINT_NTA
#endif
#ifdef PAGEDATTN_QUANT_X86
template <int Hint = PAGEDATTN_QUANT_HINT>
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(c + l, 0, Hint & 3);  // _mm_prefetch's mapping
}
#else
template <int Hint = 0>
inline void prefetch_span(const void*, int64_t) {}
#endif

// How far ahead the kernels that stream rows' blocks in order ask (the row-major ones and the
// interleaved Q8_0, whose blocks are small): [8192 x 2048] layers cycled from DRAM, 2 threads,
// AMD Zen 2, one row, row-major, GB/s without / 2 / 4 / 8 KiB ahead: Q8_0 15.7-16.1 / 19.6 /
// 17.8 / 17.2, Q4_1 12.4-14.6 / 17.8 / 17.5 / 17.7, Q4_0 14.4 / 16.5 / 16.5 / 16.5; 4 rows:
// Q8_0 1.64 -> 1.46 ms.
#ifndef PAGEDATTN_ROW_PREFETCH_BYTES
#define PAGEDATTN_ROW_PREFETCH_BYTES 2048
#endif
constexpr int64_t kRowPrefetchBytes = PAGEDATTN_ROW_PREFETCH_BYTES;

#ifdef PAGEDATTN_QUANT_X86
// 4 bytes (4 int8 activations, or two int16 sums) in every 32-bit lane.
inline __m256i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#ifdef PAGEDATTN_QUANT_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// The _mm256_shuffle_epi8 control that fills every int16 lane of the low 128-bit lane with its
// int16 lane `low`, and of the high 128-bit lane with its lane `high` (a scale per sub-block).
inline __m256i int16_lanes(int low, int high) {
  auto lane = [](int i) { return _mm_set1_epi16(static_cast<short>(((2 * i + 1) << 8) | (2 * i))); };
  return _mm256_set_m128i(lane(high), lane(low));
}

// 32 bits -> 32 bytes, 0xFF where the bit is set (byte j from bit j).
inline __m256i bits_to_bytes(const uint8_t* bits) {
  uint32_t x;
  std::memcpy(&x, bits, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// The 32 values of a legacy block in bytes: elements 0..15 in the low lane, 16..31 high.
template <int T>
inline __m256i unpack_legacy(const typename LegacyBlock<T>::type* b) {
  if constexpr (T == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
    __m256i q = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
    if constexpr (T == kIQ4_NL) {
      const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
      q = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(values), q);
    }
    if constexpr (T == kQ5_0 || T == kQ5_1) {
      q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(b->qh), _mm256_set1_epi8(0x10)));
    }
    return q;
  }
}
#endif

// sums[m] = dot(weight row, activation row m) for m < MB; a row of nb blocks of type T.
template <int T, int MB>
inline void dot_legacy(const uint8_t* row, int64_t nb, const ActQ8_0* const* act, float* sums) {
  using Block = typename LegacyBlock<T>::type;
  const Block* blocks = reinterpret_cast<const Block*>(row);
  float off[MB] = {};
#ifdef PAGEDATTN_QUANT_X86
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Block* blk = blocks + b;
    const float dw = half_to_float(blk->d);
    float cw = -static_cast<float>(legacy_offset<T>()) * dw;
    if constexpr (legacy_has_min<T>()) cw = half_to_float(blk->m);
    __m256i w = unpack_legacy<T>(blk);
    __m256i wabs = w;
    if constexpr (legacy_signed<T>()) wabs = _mm256_sign_epi8(w, w);
    for (int m = 0; m < MB; ++m) {
      const ActQ8_0& a = act[m][b];
      __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs));
      if constexpr (legacy_signed<T>()) y = _mm256_sign_epi8(y, w);
      const __m256i p = dot_u8s8(_mm256_setzero_si256(), wabs, y);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a.d), acc[m]);
      if constexpr (!legacy_signed<T>()) off[m] += cw * a.s;
    }
  }
  for (int m = 0; m < MB; ++m) sums[m] = hsum_ps(acc[m]) + off[m];
#else
  float acc[MB] = {};
  int q[32];
  for (int64_t b = 0; b < nb; ++b) {
    const Block* blk = blocks + b;
    const float dw = half_to_float(blk->d);
    float cw = -static_cast<float>(legacy_offset<T>()) * dw;
    if constexpr (legacy_has_min<T>()) cw = half_to_float(blk->m);
    unpack_legacy_scalar<T>(blk, q);
    for (int m = 0; m < MB; ++m) {
      const ActQ8_0& a = act[m][b];
      int s = 0;
      for (int j = 0; j < 32; ++j) s += q[j] * a.qs[j];
      acc[m] += static_cast<float>(s) * (dw * a.d);
      if constexpr (!legacy_signed<T>()) off[m] += cw * a.s;
    }
  }
  for (int m = 0; m < MB; ++m) sums[m] = acc[m] + off[m];
#endif
}

// Q4_K and Q5_K (T): 8 sub-blocks of 32, each with a 6-bit scale and min.
template <int T, int MB>
inline void dot_q45_k(const uint8_t* row, int64_t nb, const ActQ8_K* const* act, float* sums) {
  constexpr bool five = T == kQ5_K;
  constexpr int64_t stride = five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  float off[MB] = {};
#ifdef PAGEDATTN_QUANT_X86
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
#else
  float acc[MB] = {};
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * stride;
    // Q4_K and Q5_K share d, dmin and the scales at the front; qh (Q5_K) then qs follow.
    const BlockQ4_K* head = reinterpret_cast<const BlockQ4_K*>(blk);
    const uint8_t* qh = five ? reinterpret_cast<const BlockQ5_K*>(blk)->qh : nullptr;
    const uint8_t* qs = five ? reinterpret_cast<const BlockQ5_K*>(blk)->qs : head->qs;
    const float d = half_to_float(head->d), dmin = half_to_float(head->dmin);
#ifdef PAGEDATTN_QUANT_X86
    // The 8 six-bit scales and mins unpacked with four 32-bit masks (llama.cpp's way), not 8
    // scale_min_k4 calls: at one activation row this per-block work is not shared.
    uint32_t u[4];
    std::memcpy(u, head->scales, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t u1 = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = u1;
    u[0] &= 0x3f3f3f3fu;
    // bytes 0..7: the scales, 8..15: the minimums
    const __m128i packed = _mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]),
                                         static_cast<int>(u[1]), static_cast<int>(u[0]));
    const __m128i sc16 = _mm_cvtepu8_epi16(packed);
    const __m256i scales = _mm256_set_m128i(sc16, sc16);
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i hbits = _mm256_setzero_si256();
    if constexpr (five) hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(q, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (five) {
        const __m256i one = _mm256_set1_epi8(1);
        const __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one);
        const __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
      }
      // scale 2j (2j + 1) in every lane
      const __m256i s_lo = _mm256_shuffle_epi8(scales, int16_lanes(2 * j, 2 * j));
      const __m256i s_hi = _mm256_shuffle_epi8(scales, int16_lanes(2 * j + 1, 2 * j + 1));
      for (int m = 0; m < MB; ++m) {
        const int8_t* y = act[m][b].qs + 64 * j;
        const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
        const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 32));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), s_lo));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), s_hi));
      }
    }
    // The minimums: mn[j] against the sums of sub-block j's two 16-value activation groups,
    // 16 int16 products summed in pairs by one madd per row (each min stands at 2j and 2j + 1).
    const __m128i mn8 = _mm_unpackhi_epi64(packed, packed);
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * a.d), acc[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins)),
                               _mm256_set1_ps(-dmin * a.d), acc[m]);
    }
#else
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(j, head->scales, &sc[j], &mn[j]);
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      int mins = 0;
      for (int j = 0; j < 8; ++j) mins += mn[j] * (a.bsums[2 * j] + a.bsums[2 * j + 1]);
      off[m] -= dmin * a.d * static_cast<float>(mins);
      int total = 0;
      for (int j = 0; j < 4; ++j) {
        int s_lo = 0, s_hi = 0;
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
          if constexpr (five) {
            lo |= ((qh[l] >> (2 * j)) & 1) << 4;
            hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
          }
          s_lo += lo * a.qs[64 * j + l];
          s_hi += hi * a.qs[64 * j + 32 + l];
        }
        total += sc[2 * j] * s_lo + sc[2 * j + 1] * s_hi;
      }
      acc[m] += static_cast<float>(total) * (d * a.d);
    }
#endif
  }
#ifdef PAGEDATTN_QUANT_X86
  for (int m = 0; m < MB; ++m) sums[m] = hsum_ps(acc[m]) + off[m];
#else
  for (int m = 0; m < MB; ++m) sums[m] = acc[m] + off[m];
#endif
}

// Q6_K: 16 sub-blocks of 16 with int8 scales; values 0..63 less 32.
template <int MB>
inline void dot_q6_k(const uint8_t* row, int64_t nb, const ActQ8_K* const* act, float* sums) {
  const BlockQ6_K* blocks = reinterpret_cast<const BlockQ6_K*>(row);
  float off[MB] = {};
#ifdef PAGEDATTN_QUANT_X86
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
#else
  float acc[MB] = {};
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_K* blk = blocks + b;
    const float d = half_to_float(blk->d);
#ifdef PAGEDATTN_QUANT_X86
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = blk->ql + 64 * h;
      // This half's 8 scales as int16, in both 128-bit lanes (shuffled out per group below).
      const __m128i sc16 =
          _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk->scales + 8 * h)));
      const __m256i sc_h = _mm256_set_m128i(sc16, sc16);
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i qhv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->qh + 32 * h));
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(qa, m4),
                             _mm256_slli_epi16(_mm256_and_si256(qhv, _mm256_set1_epi8(0x03)), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(qb, m4),
                             _mm256_slli_epi16(_mm256_and_si256(qhv, _mm256_set1_epi8(0x0C)), 2));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4),
                             _mm256_and_si256(qhv, _mm256_set1_epi8(0x30)));
      q[3] = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
          _mm256_srli_epi16(_mm256_and_si256(qhv, _mm256_set1_epi8(static_cast<char>(0xC0))), 2));
      for (int t = 0; t < 4; ++t) {
        // low lane: scale 2t; high lane: scale 2t + 1
        const __m256i s = _mm256_shuffle_epi8(sc_h, int16_lanes(2 * t, 2 * t + 1));
        for (int m = 0; m < MB; ++m) {
          const int8_t* y = act[m][b].qs + 128 * h + 32 * t;
          const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], yv), s));
        }
      }
    }
    // The offset 32: the 16 scales against the 16 group sums, one madd per row.
    const __m256i scales =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk->scales)));
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * a.d), acc[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, scales)),
                               _mm256_set1_ps(-32.0f * d * a.d), acc[m]);
    }
#else
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      int bias = 0;
      for (int g = 0; g < 16; ++g) bias += blk->scales[g] * a.bsums[g];
      off[m] -= 32.0f * d * a.d * static_cast<float>(bias);
      int total = 0;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = blk->ql + 64 * h;
        const uint8_t* qh = blk->qh + 32 * h;
        const int8_t* sc = blk->scales + 8 * h;
        const int8_t* y = a.qs + 128 * h;
        for (int l = 0; l < 32; ++l) {
          const int g = l / 16;
          const int q1 = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
          const int q2 = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
          const int q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
          const int q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
          total += sc[g] * q1 * y[l] + sc[g + 2] * q2 * y[l + 32] + sc[g + 4] * q3 * y[l + 64] +
                   sc[g + 6] * q4 * y[l + 96];
        }
      }
      acc[m] += static_cast<float>(total) * (d * a.d);
    }
#endif
  }
#ifdef PAGEDATTN_QUANT_X86
  for (int m = 0; m < MB; ++m) sums[m] = hsum_ps(acc[m]) + off[m];
#else
  for (int m = 0; m < MB; ++m) sums[m] = acc[m] + off[m];
#endif
}

// ---- rows as stored, dequantised to float (quant_cpu.cpp's dequant_row picks by type) ----

template <int T>
inline void dequant_legacy(const uint8_t* row, int64_t K, float* y) {
  using Block = typename LegacyBlock<T>::type;
  const Block* blocks = reinterpret_cast<const Block*>(row);
  int q[32];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const Block* blk = blocks + b;
    const float d = half_to_float(blk->d);
    float c = -static_cast<float>(legacy_offset<T>()) * d;
    if constexpr (legacy_has_min<T>()) c = half_to_float(blk->m);
    unpack_legacy_scalar<T>(blk, q);
    for (int j = 0; j < 32; ++j) y[b * kBlock + j] = d * static_cast<float>(q[j]) + c;
  }
}

template <bool five>
inline void dequant_q45_k(const uint8_t* row, int64_t K, float* y) {
  constexpr int64_t stride = five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  for (int64_t b = 0; b < K / kBlockK; ++b) {
    const uint8_t* blk = row + b * stride;
    const BlockQ4_K* head = reinterpret_cast<const BlockQ4_K*>(blk);
    const uint8_t* qh = five ? reinterpret_cast<const BlockQ5_K*>(blk)->qh : nullptr;
    const uint8_t* qs = five ? reinterpret_cast<const BlockQ5_K*>(blk)->qs : head->qs;
    const float d = half_to_float(head->d), dmin = half_to_float(head->dmin);
    float* out = y + b * kBlockK;
    for (int j = 0; j < 4; ++j) {
      uint8_t sc0, m0, sc1, m1;
      scale_min_k4(2 * j, head->scales, &sc0, &m0);
      scale_min_k4(2 * j + 1, head->scales, &sc1, &m1);
      const float d0 = d * sc0, c0 = dmin * m0, d1 = d * sc1, c1 = dmin * m1;
      for (int l = 0; l < 32; ++l) {
        int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
        if constexpr (five) {
          lo |= ((qh[l] >> (2 * j)) & 1) << 4;
          hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
        }
        out[64 * j + l] = d0 * static_cast<float>(lo) - c0;
        out[64 * j + 32 + l] = d1 * static_cast<float>(hi) - c1;
      }
    }
  }
}

inline void dequant_q6_k(const uint8_t* row, int64_t K, float* y) {
  const BlockQ6_K* blocks = reinterpret_cast<const BlockQ6_K*>(row);
  for (int64_t b = 0; b < K / kBlockK; ++b) {
    const BlockQ6_K* blk = blocks + b;
    const float d = half_to_float(blk->d);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = blk->ql + 64 * h;
      const uint8_t* qh = blk->qh + 32 * h;
      const int8_t* sc = blk->scales + 8 * h;
      float* out = y + b * kBlockK + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int g = l / 16;
        out[l] = d * sc[g] * static_cast<float>(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
        out[l + 32] =
            d * sc[g + 2] * static_cast<float>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        out[l + 64] = d * sc[g + 4] * static_cast<float>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        out[l + 96] =
            d * sc[g + 6] * static_cast<float>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

}  // namespace pagedattn_quant
