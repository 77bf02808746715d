// The one-byte caches' arithmetic for paged decode attention (part of paged_attention_cpu.cpp's
// translation unit): the u8 integer path (int16 queries and weights against the bytes, x86), the
// fp8 pairs path (AVX512-BF16 builds) and a u8 row's scale and min.
#pragma once

#include "attention_common_cpu.h"

namespace {

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define PAGEDATTN_U8_INT 1
// The u8 cache with bf16 queries on x86 ("u8 integer path"): the bytes meet int16 queries (each
// head scaled to +-32767, finer than bf16's 8 bits) in 16-bit multiply-adds, 32-bit sums, and the
// values meet the chunk's weights p_t * s_t as int16 (scaled to the chunk's largest) two tokens
// per multiply-add. Products are exact; the only roundings are the two int16 scalings.
#if defined(CPU_CAPABILITY_AVX512)
using iVec = __m512i;
constexpr int64_t kI16 = 32;  // int16 lanes
inline iVec zext_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline iVec load_i16(const int16_t* p) { return _mm512_loadu_si512(p); }
inline iVec zero_i() { return _mm512_setzero_si512(); }
inline iVec broadcast_i32(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline iVec unpack_lo(iVec a, iVec b) { return _mm512_unpacklo_epi16(a, b); }
inline iVec unpack_hi(iVec a, iVec b) { return _mm512_unpackhi_epi16(a, b); }
inline fVec to_float(iVec v) { return _mm512_cvtepi32_ps(v); }
inline iVec madd_i16(iVec acc, iVec a, iVec b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
// The natural order of 32 dims from the unpacks' lo {0-3, 8-11, 16-19, 24-27} and hi {4-7, ...}.
inline void unpermute(const fVec& lo, const fVec& hi, fVec& a, fVec& b) {
  const __m512i ia = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i ib = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  a = _mm512_permutex2var_ps(lo, ia, hi);
  b = _mm512_permutex2var_ps(lo, ib, hi);
}
#else
using iVec = __m256i;
constexpr int64_t kI16 = 16;
inline iVec zext_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline iVec load_i16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline iVec zero_i() { return _mm256_setzero_si256(); }
inline iVec broadcast_i32(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline iVec unpack_lo(iVec a, iVec b) { return _mm256_unpacklo_epi16(a, b); }
inline iVec unpack_hi(iVec a, iVec b) { return _mm256_unpackhi_epi16(a, b); }
inline fVec to_float(iVec v) { return _mm256_cvtepi32_ps(v); }
inline iVec madd_i16(iVec acc, iVec a, iVec b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
// 16 dims: lo holds {0-3, 8-11}, hi {4-7, 12-15}.
inline void unpermute(const fVec& lo, const fVec& hi, fVec& a, fVec& b) {
  a = _mm256_permute2f128_ps(lo, hi, 0x20);
  b = _mm256_permute2f128_ps(lo, hi, 0x31);
}
#endif

// The largest int16 query: 127 * 256 + 127, so that every query splits into two int8 halves,
// q = 256 * high + low with low its signed low byte (the AMX int8 path; the vector path uses the
// same queries, so the two compute the same integer scores).
constexpr int kQueryLimit = 32639;

// out = round(x * limit / max|x|) for n values; returns max|x| / limit (1 if x is all zero).
template <typename T>
inline float quantize_i16(const T* x, int64_t n, int16_t* out, int limit = 32767) {
  fVec vm(0.0f);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) vm = at::vec::maximum(vm, load(x + i).abs());
  float m = at::vec::vec_reduce_all(
      [](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, vm);
  for (; i < n; ++i) m = std::max(m, std::abs(static_cast<float>(x[i])));
  if (m == 0.0f) {
    std::fill(out, out + n, int16_t{0});
    return 1.0f;
  }
  const float inv = static_cast<float>(limit) / m;
  const fVec vinv(inv);
  for (i = 0; i + kWidth <= n; i += kWidth) {
    const fVec v = load(x + i) * vinv;  // NOTE: converted with the default rounding, to nearest
#if defined(CPU_CAPABILITY_AVX512)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
#else
    const __m256i w = _mm256_cvtps_epi32(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
#endif
  }
  for (; i < n; ++i) out[i] = static_cast<int16_t>(std::lrintf(static_cast<float>(x[i]) * inv));
  return m / static_cast<float>(limit);
}

// scores[g * kChunk + t] = factor[g] * (qint[g] . the D bytes of row t) for G heads (D % kI16 == 0).
void score_rows_u8(const int16_t* qint, const float* factor, int64_t G, int64_t D,
                   const uint8_t* const* krows, int64_t count, float* scores, RowPrefetcher& pf) {
  for (int64_t t0 = 0; t0 < count; t0 += kWidth) {
    const int64_t n = std::min<int64_t>(kWidth, count - t0);
    const uint8_t* rows[kWidth];
    for (int64_t j = 0; j < kWidth; ++j) rows[j] = krows[t0 + std::min(j, n - 1)];  // pad: repeat
    for (int64_t g = 0; g < G; ++g) {
      pf.step();
      iVec acc[kWidth];
      for (int j = 0; j < kWidth; ++j) acc[j] = zero_i();
      for (int64_t i = 0; i < D; i += kI16) {
        const iVec qv = load_i16(qint + g * D + i);
#pragma GCC unroll 16
        for (int j = 0; j < kWidth; ++j) acc[j] = madd_i16(acc[j], zext_bytes(rows[j] + i), qv);
      }
      fVec f[kWidth];
      for (int j = 0; j < kWidth; ++j) f[j] = to_float(acc[j]);
      store(scores + g * kChunk + t0, pagedattn_vec::hsum_rows(f) * fVec(factor[g]), n);
    }
  }
}

// acc[g] += wscale[g] * sum_t w_t[g] * bytes of value row t for NG heads, with w as int16 pairs
// (pairs[g * kChunk / 2 + t / 2]): two tokens per multiply-add, the odd tail's partner weight 0.
template <int NG>
void accumulate_u8_pairs(const uint32_t* pairs, const float* wscale, const uint8_t* const* rows,
                         int64_t count, int64_t D, float* acc, RowPrefetcher& pf) {
  constexpr int64_t kPairs = kChunk / 2;
  for (int64_t d0 = 0; d0 < D; d0 += kI16) {
    iVec lo[NG], hi[NG];
    for (int g = 0; g < NG; ++g) lo[g] = hi[g] = zero_i();
    for (int64_t t = 0; t < count; t += 2) {
      if (t % kValueStepTokens == 0) pf.step();
      const iVec r0 = zext_bytes(rows[t] + d0);
      const iVec r1 = zext_bytes(rows[t + 1 < count ? t + 1 : t] + d0);
      const iVec vlo = unpack_lo(r0, r1), vhi = unpack_hi(r0, r1);
      for (int g = 0; g < NG; ++g) {
        const iVec w = broadcast_i32(pairs[g * kPairs + t / 2]);
        lo[g] = madd_i16(lo[g], vlo, w);
        hi[g] = madd_i16(hi[g], vhi, w);
      }
    }
    for (int g = 0; g < NG; ++g) {
      fVec a, b;
      unpermute(to_float(lo[g]), to_float(hi[g]), a, b);
      float* out = acc + g * D + d0;
      const fVec ws(wscale[g]);
      store(out, at::vec::fmadd(a, ws, load(out)));
      store(out + kWidth, at::vec::fmadd(b, ws, load(out + kWidth)));
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// fp8 with bf16 queries on AVX512-BF16 builds ("fp8 pairs"): an fp8 byte's sign, exponent and
// mantissa moved into a bf16's bits read as its value times 2^-120 (e4m3) or 2^-112 (e5m2),
// subnormals included; 3 instructions per 32 values. Queries are lifted by 2^96 and
// probabilities by 2^112 (exact, powers of two) so that the products are the fp16 path's
// (value / kFp8Unit) and stay normal: the dot products treat subnormal inputs and outputs as 0,
// so an fp8 subnormal (below 2^-6, or 2^-14 for e5m2, in the cache's units) counts as 0 here.
constexpr float kQueryLift = 0x1p96f;
constexpr float kScoreUnlift = 0x1p16f;  // scores of lifted queries: times 2^(112 - 96)
constexpr float kProbLift = 0x1p112f;

template <typename F>
inline __m512i fp8_bf16_bits(const F* p) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  if constexpr (std::is_same_v<F, fp8_e4m3>) {
    return _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(static_cast<int16_t>(0x87F0)));
  } else {
    return _mm512_and_si512(_mm512_slli_epi16(w, 5), _mm512_set1_epi16(static_cast<int16_t>(0x8FE0)));
  }
}

// out[t * D : (t + 1) * D] = fp8 row t as bf16 bits (D % 32 == 0); wide[t] points there.
template <typename F>
void fp8_rows_as_bf16(const F* const* rows, int64_t count, int64_t D, bf16* out,
                      const bf16** wide, RowPrefetcher& pf) {
  for (int64_t t = 0; t < count; ++t) {
    pf.step();
    bf16* o = out + t * D;
    for (int64_t i = 0; i < D; i += 32) {
      _mm512_storeu_si512(reinterpret_cast<void*>(o + i), fp8_bf16_bits(rows[t] + i));
    }
    wide[t] = o;
  }
}

// out[0 : n] = bf16(x * lift) (n % 32 == 0; exact for powers of two short of overflow).
template <typename X>
inline void lift_bf16(const X* x, int64_t n, float lift, bf16* out) {
  const fVec l(lift);
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(load(x + i + 16) * l, load(x + i) * l);
    _mm512_storeu_si512(reinterpret_cast<void*>(out + i), (__m512i)v);
  }
}

// pairs[t / 2] = (bf16(probs[t] * kProbLift), bf16(probs[t + 1] * kProbLift)) for t < count,
// the odd tail's partner 0 (probs has kChunk slots; those past count are zeroed here).
inline void probability_pairs(float* probs, int64_t count, uint32_t* pairs) {
  const int64_t padded = (count + 31) / 32 * 32;
  std::fill(probs + count, probs + padded, 0.0f);
  lift_bf16(probs, padded, kProbLift, reinterpret_cast<bf16*>(pairs));
}

// acc[g] += sum_t p_t[g] * value row t for NG heads, two tokens per AVX512-BF16 dot product: the
// pair's value rows interleaved (unpack lo / hi of their bf16 bits) against the probability pair.
// The unpacks leave the dims of 32 in the order lo {0-3, 8-11, 16-19, 24-27}, hi {4-7, ...}, so
// the fp32 accumulators are permuted into that order and back (unpermute) around the token loop.
template <typename F, int NG>
void accumulate_fp8_pairs(const uint32_t* pairs, const F* const* rows, int64_t count,
                          int64_t head_size, float* acc, RowPrefetcher& pf) {
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  constexpr int64_t kPairs = kChunk / 2;
  for (int64_t d0 = 0; d0 < head_size; d0 += 32) {
    __m512 lo[NG], hi[NG];
    for (int g = 0; g < NG; ++g) {
      const __m512 a = _mm512_loadu_ps(acc + g * head_size + d0);
      const __m512 b = _mm512_loadu_ps(acc + g * head_size + d0 + 16);
      lo[g] = _mm512_permutex2var_ps(a, to_lo, b);
      hi[g] = _mm512_permutex2var_ps(a, to_hi, b);
    }
    for (int64_t t = 0; t < count; t += 2) {
      if (t % kValueStepTokens == 0) pf.step();
      const __m512i r0 = fp8_bf16_bits(rows[t] + d0);
      const __m512i r1 = fp8_bf16_bits(rows[t + 1 < count ? t + 1 : t] + d0);  // p 0 if padded
      const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
      const __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
      for (int g = 0; g < NG; ++g) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g * kPairs + t / 2]));
        lo[g] = _mm512_dpbf16_ps(lo[g], vlo, pv);
        hi[g] = _mm512_dpbf16_ps(hi[g], vhi, pv);
      }
    }
    for (int g = 0; g < NG; ++g) {
      fVec a, b;
      unpermute(lo[g], hi[g], a, b);
      store(acc + g * head_size + d0, a);
      store(acc + g * head_size + d0 + 16, b);
    }
  }
}
#endif

// A u8 row's scale and min (the float32 pair after its D bytes).
inline void u8_scale_min(const uint8_t* row, int64_t D, float& scale, float& min) {
  std::memcpy(&scale, row + D, sizeof(float));
  std::memcpy(&min, row + D + sizeof(float), sizeof(float));
}

// sc[t] = sc[t] * kscale[t] + kmin[t] * qsum for a u8 chunk's scores of one query head
// (qsum: p.scale * sum(q)), the key rows' scales and mins applied.
inline void u8_apply_key_scales(float* sc, int64_t count, const float* kscale, const float* kmin,
                                float qsum) {
  const fVec qs(qsum);
  int64_t t = 0;
  for (; t + kWidth <= count; t += kWidth) {
    store(sc + t, load(sc + t) * load(kscale + t) + load(kmin + t) * qs);
  }
  for (; t < count; ++t) sc[t] = sc[t] * kscale[t] + kmin[t] * qsum;
}

// A u8 chunk's probabilities pr of one query head become the value bytes' weights p_t * s_t, and
// sum_t p_t * m_t (the mins' share) is added to every element of the head's acc.
inline void u8_apply_value_scales(float* pr, int64_t count, const float* vscale, const float* vmin,
                                  float* acc, int64_t D) {
  // NOTE: vectorized by hand: the compiler keeps a float sum's order, one add at a time.
  fVec vbias(0.0f);
  int64_t t = 0;
  for (; t + kWidth <= count; t += kWidth) {
    const fVec pv = load(pr + t);
    vbias = vbias + pv * load(vmin + t);
    store(pr + t, pv * load(vscale + t));
  }
  float bias =
      at::vec::vec_reduce_all([](const fVec& a, const fVec& b) { return a + b; }, vbias);
  for (; t < count; ++t) {
    bias += pr[t] * vmin[t];
    pr[t] *= vscale[t];
  }
  for (int64_t i = 0; i < D; ++i) acc[i] += bias;
}

#ifdef PAGEDATTN_U8_INT
// One query head for the u8 integer paths: qint = the int16 query (kQueryLimit), factor =
// p.scale times its scale; returns factor * sum(qint) (the min's term, from the same integers as
// the bytes' term).
template <typename T>
inline float u8_int_query(const T* q, int64_t D, float scale, int16_t* qint, float& factor) {
  factor = scale * quantize_i16(q, D, qint, kQueryLimit);
  int32_t isum = 0;
  for (int64_t i = 0; i < D; ++i) isum += qint[i];
  return factor * static_cast<float>(isum);
}
#endif

}  // namespace
