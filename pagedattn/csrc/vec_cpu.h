// The vector layer every CPU kernel is written on: ATen's at::vec::Vectorized<float> (AVX2,
// AVX-512, NEON or SVE, picked by the build's CPU_CAPABILITY_* define, see
// pagedattn/cpu/extension.py), plus the few operations it lacks, each written once per ISA:
//
// - load/store of kWidth fp32 lanes from/to float or bf16 (bf16 widens exactly; stores round to
//   nearest even, as torch's float -> bfloat16 does);
// - exp_nonpos(x): exp for softmax arguments (x <= 0), the Cephes polynomial the AVX-512 kernels
//   used before, so results on AVX-512 are the same bits as before and AVX2/NEON match them;
// - hsum_rows(v): lane i = sum of the lanes of v[i] (a transpose-and-add tree on x86);
// - widen_bf16_pairs: the two fp32 vectors of a run of bf16 pairs (the panel GEMM's layout);
// - load from fp8 (e4m3 / e5m2 bytes, the FP8 KV cache): the bytes become fp16 bits by shifts and
//   the hardware's fp16 -> fp32 conversion widens them (F16C; exact, subnormals included, and
//   unaffected by DAZ). e5m2 is an fp16's top byte; e4m3 lands at 2^-8 times its value, so its
//   callers multiply by kFp8Unit (folded into the layer's k/v scale);
// - load from u8 (the u8 KV cache's bytes): zero-extended to int32 and converted (exact).
//
// kWidth is 16 on AVX-512, 8 on AVX2 (and the scalar build's generic vectors), 4 on NEON.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace pagedattn_vec {

using bf16 = c10::BFloat16;
using fVec = at::vec::Vectorized<float>;

constexpr int kWidth = fVec::size();
// Architectural vector registers, for sizing register-blocked accumulators.
#if defined(CPU_CAPABILITY_AVX512) || defined(__aarch64__)
constexpr int kNumRegs = 32;
#else
constexpr int kNumRegs = 16;
#endif

// The level this file was compiled for (pagedattn's ISA level names, "neon"/"sve" on ARM).
inline const char* isa_name() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#elif defined(CPU_CAPABILITY_SVE256) || defined(CPU_CAPABILITY_SVE)
  return "sve";
#elif defined(__aarch64__)
  return "neon";
#else
  return "scalar";
#endif
}

// kWidth fp32 lanes from p (n lanes, the rest zero, for the partial forms).
inline fVec load(const float* p) { return fVec::loadu(p); }
inline fVec load(const float* p, int64_t n) { return fVec::loadu(p, n); }
inline fVec load(const bf16* p) {
  fVec out;
  at::vec::load_to_float<bf16>(p, out);
  return out;
}
inline fVec load(const bf16* p, int64_t n) {
  __at_align__ bf16 tmp[kWidth] = {};
  std::memcpy(tmp, p, n * sizeof(bf16));
  return load(tmp);
}

// FP8 KV cache elements (one byte; the types only select the load).
struct fp8_e4m3 {
  uint8_t x;
};
struct fp8_e5m2 {
  uint8_t x;
};
// What a load from T must be multiplied by to give the stored value (1 but for e4m3).
template <typename T>
constexpr float kFp8Unit = 1.0f;
template <>
constexpr float kFp8Unit<fp8_e4m3> = 256.0f;

// fp16 bits of fp8 byte b (as the vector paths make them).
inline uint16_t fp8_half_bits(uint8_t b, const fp8_e4m3*) {
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}
inline uint16_t fp8_half_bits(uint8_t b, const fp8_e5m2*) { return static_cast<uint16_t>(b << 8); }

template <typename F>
inline fVec load_fp8(const F* p) {
#if defined(CPU_CAPABILITY_AVX512)
  // Sign-extended to 16 bits, << 7 puts the sign at bit 15 and e4m3's bits 6..0 at 13..7; the
  // sign's copy at bit 14 is cleared. e5m2: zero-extended, << 8.
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i h;
  if constexpr (std::is_same_v<F, fp8_e4m3>) {
    h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                         _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  } else {
    h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
  }
  return _mm512_cvtph_ps(h);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m128i h;
  if constexpr (std::is_same_v<F, fp8_e4m3>) {
    h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7),
                      _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  } else {
    h = _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
  }
  return _mm256_cvtph_ps(h);
#else
  __at_align__ float out[kWidth];
  for (int i = 0; i < kWidth; ++i) {
    out[i] = static_cast<float>(c10::Half(fp8_half_bits(p[i].x, p), c10::Half::from_bits()));
  }
  return fVec::loadu(out);
#endif
}
inline fVec load(const fp8_e4m3* p) { return load_fp8(p); }
inline fVec load(const fp8_e5m2* p) { return load_fp8(p); }
template <typename F>
inline fVec load_fp8(const F* p, int64_t n) {
  __at_align__ F tmp[kWidth] = {};
  std::memcpy(tmp, p, n);
  return load_fp8(tmp);
}
inline fVec load(const fp8_e4m3* p, int64_t n) { return load_fp8(p, n); }
inline fVec load(const fp8_e5m2* p, int64_t n) { return load_fp8(p, n); }

// u8 KV cache bytes (attention/u8.py): kWidth bytes zero-extended to int32 and converted, exact.
inline fVec load(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  __at_align__ float out[kWidth];
  for (int i = 0; i < kWidth; ++i) out[i] = static_cast<float>(p[i]);
  return fVec::loadu(out);
#endif
}
inline fVec load(const uint8_t* p, int64_t n) {
  __at_align__ uint8_t tmp[kWidth] = {};
  std::memcpy(tmp, p, n);
  return load(tmp);
}

inline void store(float* p, const fVec& v) { v.store(p); }
inline void store(float* p, const fVec& v, int64_t n) { v.store(p, static_cast<int>(n)); }
// NOTE: at::vec's convert_from_float<bf16> rounds two fp32 vectors into one bf16 vector; with
// one vector (v, v) it rounded every lane twice. The one-vector conversion below is the same
// rounding (nearest even, NaN -> 0xffff) done once: SmolLM2's RMSNorm took 19 us at 32 bf16 rows
// of 576 against 6 us in fp32 (AMX Xeon), most of it in these roundings.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
using fRegister = __m512;
using bf16Bits = __m256i;  // kWidth bf16 values
#else
using fRegister = __m256;
using bf16Bits = __m128i;
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// AVX512-BF16 rounds 16 lanes to nearest even in one instruction, where at::vec spends eight
// (it differs only for NaN bits and fp32 denormals, which the engine flushes to zero anyway).
// NOTE: SmolLM2 at 32 bf16 rows, one thread, AMX Xeon: SwiGLU 37.4 -> 30.9 us, RMSNorm with the
// residual 11.1 -> 8.5 us.
inline bf16Bits to_bf16_bits(const fVec& v) {
  return reinterpret_cast<bf16Bits>(_mm512_cvtneps_pbh(fRegister(v)));
}
#else
inline bf16Bits to_bf16_bits(const fVec& v) { return at::vec::cvtfp32_bf16(fRegister(v)); }
#endif
inline fVec from_bf16_bits(const bf16Bits& b) {
  fRegister out;
  at::vec::cvtbf16_fp32(b, out);
  return out;
}
inline void store_bf16_bits(bf16* p, const bf16Bits& b) { std::memcpy(p, &b, sizeof(b)); }
#endif

inline void store(bf16* p, const fVec& v, int64_t n = kWidth) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (n == kWidth) {
    store_bf16_bits(p, to_bf16_bits(v));
    return;
  }
#endif
  at::vec::convert_from_float<bf16>(v, v).store(p, static_cast<int>(n));
}

// v rounded to T and widened back (a no-op for fp32): the rounding points of a bf16 kernel.
inline fVec round_as(const fVec& v, const float*) { return v; }
inline fVec round_as(const fVec& v, const bf16*) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return from_bf16_bits(to_bf16_bits(v));
#else
  return std::get<0>(at::vec::convert_to_float<bf16>(at::vec::convert_from_float<bf16>(v, v)));
#endif
}

// 2^n for integer-valued n in [-126, 127].
inline fVec pow2n(const fVec& n) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
#else
  using iVec = at::vec::Vectorized<int32_t>;
  const iVec e = at::vec::convert_to_int_of_same_size(n) + iVec(127);
  return at::vec::cast<float>(e * iVec(1 << 23));  // (n + 127) << 23, never overflows
#endif
}

// exp(x) for x <= 0 (softmax arguments; x < -87 gives exp(-87)): Cephes-style range reduction
// and a degree-6 polynomial, about 1 ulp.
inline fVec exp_nonpos(fVec x) {
  x = at::vec::maximum(x, fVec(-87.0f));
  const fVec n = (x * fVec(1.44269504088896341f)).round();
  const fVec neg_n = fVec(0.0f) - n;
  fVec r = at::vec::fmadd(neg_n, fVec(0.693359375f), x);
  r = at::vec::fmadd(neg_n, fVec(-2.12194440e-4f), r);
  fVec p(1.9875691500e-4f);
  p = at::vec::fmadd(p, r, fVec(1.3981999507e-3f));
  p = at::vec::fmadd(p, r, fVec(8.3334519073e-3f));
  p = at::vec::fmadd(p, r, fVec(4.1665795894e-2f));
  p = at::vec::fmadd(p, r, fVec(1.6666665459e-1f));
  p = at::vec::fmadd(p, r, fVec(5.0000001201e-1f));
  p = at::vec::fmadd(p, r * r, r + fVec(1.0f));
  return p * pow2n(n);
}

// Lane i of the result = sum of the lanes of v[i], i < kWidth.
inline fVec hsum_rows(const fVec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  // A transpose-and-add tree: 45 ops for 16 sums.
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(s1[2 * i]), b = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88),
                       _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
#elif defined(CPU_CAPABILITY_AVX2)
  // Horizontal adds pairwise, then the two 128-bit halves: 9 ops for 8 sums.
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 t0 = _mm256_hadd_ps(s01, s23), t1 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
#else
  __at_align__ float sums[kWidth];
  for (int i = 0; i < kWidth; ++i) {
    sums[i] = at::vec::vec_reduce_all([](const fVec& a, const fVec& b) { return a + b; }, v[i]);
  }
  return fVec::loadu(sums);
#endif
}

// kWidth 32-bit lanes of bf16 pairs (2 * kWidth values from p): lo = the even values, hi = the
// odd ones, both widened to fp32.
inline void widen_bf16_pairs(const bf16* p, fVec& lo, fVec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  uint32_t raw[kWidth], even[kWidth], odd[kWidth];
  std::memcpy(raw, p, sizeof(raw));
  for (int i = 0; i < kWidth; ++i) {
    even[i] = raw[i] << 16;
    odd[i] = raw[i] & 0xFFFF0000u;
  }
  lo = fVec::loadu(even);
  hi = fVec::loadu(odd);
#endif
}

}  // namespace pagedattn_vec
