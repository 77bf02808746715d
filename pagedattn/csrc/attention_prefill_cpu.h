// Paged prefill attention on CPU: q_len queries (the last q_len positions of a sequence of
// seq_len tokens) over the sequence's key and value rows read through its block table, causal,
// with an optional sliding window and soft cap. Flash-style: an online softmax over chunks of
// kKeys keys, so no [q_len, seq_len] score matrix exists and no gathered copy of the cache.
//
// One work item is (kv head, tile of query positions): its rows are the tile's positions times
// the G query heads of that kv head (about kTileRows of them), so every key and value row read
// from the cache serves them all. The rows are the vector lanes: queries transposed to [D][rows]
// once per item, then per chunk of kKeys keys the scores [kKeys][rows] are a register-blocked
// product (a broadcast key element times the query vectors), the online softmax runs down the
// lanes (max, exp and sum are vertical: no horizontal reductions), and the value sums [D][rows]
// are the same product with value elements broadcast against the probability vectors. Masks
// (causal, window, padding lanes) are applied only in the chunks where some lane needs them.
// Everything sums in fp32 on the vector layer of vec_cpu.h (AVX2, AVX-512 and NEON builds share
// the source); with AVX512-BF16 bf16 queries over a bf16 or fp8 cache run both products as bf16
// pairs (see kRunsPairs). Otherwise an fp8 or u8 cache's rows are widened to fp32 per chunk (the
// u8 rows by their own scale and min).
// Items run longest first (the causal tiles near the end), handed out by an atomic counter.
//
// Measured against the gather + SDPA path it replaces (Zen 4, 2 threads, bf16, 512-token
// prompt): 9/3 heads x 64 1.24 against 5.09 ms, 32/8 x 64 4.56 against 16.4 ms (2,048 tokens:
// 64 against 162 ms); float32 7.5 against 16.0 ms at 32/8, 512 tokens.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>

#include "attention_common_cpu.h"

namespace {
namespace prefill {

constexpr int64_t kKeys = 64;    // keys per online-softmax step
constexpr int64_t kTileRows = 96;  // query rows (positions x heads of a kv head) per work item
// The register block of bcast_gemm: kBlockB broadcast rows by up to kBlockV vectors.
constexpr int kBlockB = pagedattn_vec::kNumRegs >= 32 ? 8 : 4;
constexpr int kBlockV = pagedattn_vec::kNumRegs >= 32 ? 3 : 2;
static_assert(kBlockB * kBlockV + kBlockV + 1 <= pagedattn_vec::kNumRegs, "bcast_gemm spills");
static_assert(kKeys % kBlockB == 0 && 16 % kBlockB == 0, "blocks must tile keys and head_size");

struct Params {
  int64_t q_len, seq_len, num_heads, num_kv_heads, head_size, block_size, num_blocks;
  int64_t head_stride;     // cache elements per (token, kv head) row: D, or D + 8 for u8
  int64_t sliding_window;  // 0: none
  float scale, soft_cap;   // soft_cap 0: none
  float v_scale = 1.0f;    // what the value sums are multiplied by (an fp8 cache's v_scale)
};

// c[i][j] = c[i][j] * init[j] (init null: 0) + sum_k a[i * a_i + k * a_k] * b[k][j] for kBlockB
// rows i and NV vectors j; b and c rows are ld floats apart.
template <int NV>
inline void bcast_block(const float* a, int64_t a_i, int64_t a_k, const float* b, int64_t K,
                        int64_t ld, const fVec* init, float* c) {
  fVec acc[kBlockB][NV];
  for (int i = 0; i < kBlockB; ++i) {
    for (int j = 0; j < NV; ++j) {
      acc[i][j] = init ? load(c + i * ld + j * kWidth) * init[j] : fVec(0.0f);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    fVec v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load(b + k * ld + j * kWidth);
    for (int i = 0; i < kBlockB; ++i) {
      const fVec x(a[i * a_i + k * a_k]);
      for (int j = 0; j < NV; ++j) acc[i][j] = at::vec::fmadd(x, v[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kBlockB; ++i) {
    for (int j = 0; j < NV; ++j) store(c + i * ld + j * kWidth, acc[i][j]);
  }
}

// c [M][vecs * kWidth] (+)= a [M x K] (element (i, k) at a[i * a_i + k * a_k]) times b
// [K][vecs * kWidth]; rows of b and c are ld floats apart; M % kBlockB == 0. init[j]: the
// factor c's old vector j is kept at (null: c is overwritten).
inline void bcast_gemm(const float* a, int64_t a_i, int64_t a_k, const float* b, int64_t M,
                       int64_t K, int64_t vecs, int64_t ld, const fVec* init, float* c) {
  for (int64_t i = 0; i < M; i += kBlockB) {
    for (int64_t j = 0; j < vecs;) {
      const fVec* in = init ? init + j : nullptr;
      const float* bj = b + j * kWidth;
      float* cij = c + i * ld + j * kWidth;
      const float* ai = a + i * a_i;
      if (vecs - j >= kBlockV) {
        bcast_block<kBlockV>(ai, a_i, a_k, bj, K, ld, in, cij);
        j += kBlockV;
      } else if (vecs - j >= 2) {
        bcast_block<2>(ai, a_i, a_k, bj, K, ld, in, cij);
        j += 2;
      } else {
        bcast_block<1>(ai, a_i, a_k, bj, K, ld, in, cij);
        j += 1;
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// AVX512-BF16: bf16 caches and queries run their dot products two products per fp32 lane
// (vdpbf16ps): the scores from the cache's key rows as stored (pairs of dimensions, exact
// products, fp32 sums, as the fp32 path), the value sums from probabilities rounded to bf16
// (pairs of keys), as the AMX decode path rounds them.
constexpr bool kPairs = true;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// c[i][j] = c[i][j] * init[j] (init null: 0) + sum_k dot2(a[i][k * a_k], b[k][j]) for kBlockB
// rows i (a[i]: their bf16 pairs) and NV vectors j of 16 pairs; rows of b and c are ld apart.
template <int NV>
inline void pair_block(const uint32_t* const* a, int64_t a_k, const uint32_t* b, int64_t K,
                       int64_t ld, const fVec* init, float* c) {
  __m512 acc[kBlockB][NV];
  for (int i = 0; i < kBlockB; ++i) {
    for (int j = 0; j < NV; ++j) {
      acc[i][j] = init ? _mm512_mul_ps(_mm512_loadu_ps(c + i * ld + j * 16), init[j])
                       : _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512bh v[NV];
    for (int j = 0; j < NV; ++j) v[j] = as_bh(_mm512_loadu_si512(b + k * ld + j * 16));
    for (int i = 0; i < kBlockB; ++i) {
      const __m512bh x = as_bh(_mm512_set1_epi32(static_cast<int>(a[i][k * a_k])));
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], v[j], x);
    }
  }
  for (int i = 0; i < kBlockB; ++i) {
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + i * ld + j * 16, acc[i][j]);
  }
}

// c [M][vecs * 16] (+)= rows a[0 .. M) (bf16 pairs, k * a_k apart) dotted with b [K][vecs * 16]
// pairs; M % kBlockB == 0; init as in bcast_gemm.
inline void pair_gemm(const uint32_t* const* a, int64_t a_k, const uint32_t* b, int64_t M,
                      int64_t K, int64_t vecs, int64_t ld, const fVec* init, float* c) {
  for (int64_t i = 0; i < M; i += kBlockB) {
    for (int64_t j = 0; j < vecs;) {
      const fVec* in = init ? init + j : nullptr;
      const uint32_t* bj = b + j * 16;
      float* cij = c + i * ld + j * 16;
      if (vecs - j >= kBlockV) {
        pair_block<kBlockV>(a + i, a_k, bj, K, ld, in, cij);
        j += kBlockV;
      } else if (vecs - j >= 2) {
        pair_block<2>(a + i, a_k, bj, K, ld, in, cij);
        j += 2;
      } else {
        pair_block<1>(a + i, a_k, bj, K, ld, in, cij);
        j += 1;
      }
    }
  }
}

// p2[u][lanes] = the bf16 pair (st[2u][lane], st[2u + 1][lane]), rounded to nearest even.
inline void pack_probability_pairs(const float* st, int64_t lanes, uint32_t* p2) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                              9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                              17, 1, 16, 0);
  for (int64_t u = 0; u < kKeys / 2; ++u) {
    for (int64_t l = 0; l < lanes; l += 16) {
      const __m512bh two = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(st + (2 * u + 1) * lanes + l),
                                               _mm512_loadu_ps(st + 2 * u * lanes + l));
      const __m512i pairs =
          _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i&>(two));
      _mm512_storeu_si512(p2 + u * lanes + l, pairs);
    }
  }
}

// v2[u][d] = the bf16 pair (value row 2u [d], value row 2u + 1 [d]) of the chunk's rows.
inline void pack_value_pairs(const uint32_t* const* rows, int64_t D, uint32_t* v2) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t u = 0; u < kKeys / 2; ++u) {
    const bf16* a = reinterpret_cast<const bf16*>(rows[2 * u]);
    const bf16* b = reinterpret_cast<const bf16*>(rows[2 * u + 1]);
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 m = D - d >= 32 ? ~__mmask32{0} : __mmask32{0xFFFF};  // D % 16 == 0
      const __m512i x = _mm512_maskz_loadu_epi16(m, a + d), y = _mm512_maskz_loadu_epi16(m, b + d);
      _mm512_storeu_si512(v2 + u * D + d, _mm512_permutex2var_epi16(x, lo, y));
      if (d + 16 < D) _mm512_storeu_si512(v2 + u * D + d + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}
#else
constexpr bool kPairs = false;
#endif

template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, fp8_e4m3> || std::is_same_v<C, fp8_e5m2>;
// Whether queries T over a cache of C run the bf16 pairs: a bf16 cache as stored, an fp8 one
// widened to bf16 per chunk (exact: every fp8 value, as load() widens it, is a bf16 value).
template <typename T, typename C>
constexpr bool kRunsPairs = kPairs && std::is_same_v<T, bf16> && (std::is_same_v<C, bf16> || kIsFp8<C>);

// Per-thread scratch of one work item. Rows (query position x head) are vector lanes:
// qt [D][rows] (scaled queries), st [kKeys][rows] (scores, then probabilities), ot [D][rows]
// (value sums); kw / vw the chunk's key and value rows in fp32 [kKeys][D]. For the bf16 pairs:
// q2 [D / 2][rows] (query pairs), p2 [kKeys / 2][rows] (probability pairs), v2 [kKeys / 2][D]
// (value pairs of two keys), kb / vb an fp8 chunk's rows widened to bf16 [kKeys][D]. Then the
// running max and sum, the row positions and the window's first key per lane.
struct Scratch {
  std::vector<float> qt, st, ot, kw, vw;
  std::vector<uint32_t> q2, p2, v2, zero;
  std::vector<bf16> kb, vb;
  std::vector<fVec> max, sum, pos, low, alpha;
  Scratch(int64_t rows, int64_t D, bool pairs)
      : qt(pairs ? 0 : D * rows), st(kKeys * rows), ot(D * rows), kw(pairs ? 0 : kKeys * D),
        vw(pairs ? 0 : kKeys * D), q2(pairs ? D / 2 * rows : 0), p2(pairs ? kKeys / 2 * rows : 0),
        v2(pairs ? kKeys / 2 * D : 0), zero(D, 0), kb(pairs ? kKeys * D : 0),
        vb(pairs ? kKeys * D : 0), max(rows / kWidth), sum(rows / kWidth), pos(rows / kWidth),
        low(rows / kWidth), alpha(rows / kWidth) {}
};

// The chunk's count rows widened into dst [kKeys][D] fp32; rows past count are zero. A u8 row
// reads as q * scale + min (its trailer's two floats); an fp8 row as stored (times kFp8Unit).
template <typename C>
void widen_chunk(const C* cache, const int64_t* offsets, int64_t count, int64_t D, float* dst) {
  for (int64_t t = 0; t < count; ++t) {
    const C* row = cache + offsets[t];
    if constexpr (std::is_same_v<C, uint8_t>) {
      float trailer[2];
      std::memcpy(trailer, row + D, sizeof(trailer));
      const fVec scale(trailer[0]), min(trailer[1]);
      for (int64_t d = 0; d < D; d += kWidth) {
        store(dst + t * D + d, at::vec::fmadd(load(row + d), scale, min));
      }
    } else {
      for (int64_t d = 0; d < D; d += kWidth) store(dst + t * D + d, load(row + d));
    }
  }
  std::memset(dst + count * D, 0, (kKeys - count) * D * sizeof(float));
}

// Online-softmax update of the chunk's dot products st [kKeys][rows] (keys c0 .. c0 + count),
// times scale (and soft-capped), into
// probabilities: masked where `edge` (a key after a row's position or before its window, and
// padding lanes), the running max and sum updated, alpha = the factor the old sums keep.
inline void softmax_chunk(Scratch& sc, int64_t vecs, int64_t rows, int64_t c0, int64_t count,
                          bool edge, float scale, float soft_cap) {
  float* st = sc.st.data();
  const fVec neg_inf(kNegInf), zero(0.0f);
  for (int64_t j = 0; j < vecs; ++j) {
    fVec m = neg_inf;
    for (int64_t t = 0; t < count; ++t) {
      float* s = st + t * rows + j * kWidth;
      fVec v = load(s) * fVec(scale);
      if (soft_cap > 0.0f) {
        __at_align__ float x[kWidth];
        v.store(x);
        for (int l = 0; l < kWidth; ++l) x[l] = soft_cap * std::tanh(x[l] / soft_cap);
        v = fVec::loadu(x);
      }
      if (edge) {
        const fVec key(static_cast<float>(c0 + t));
        v = fVec::blendv(neg_inf, v, (key <= sc.pos[j]) & (key >= sc.low[j]));
      }
      store(s, v);
      m = at::vec::maximum(m, v);
    }
    const fVec new_max = at::vec::maximum(sc.max[j], m);
    // A lane that has seen no key yet keeps -inf; it shifts by 0 so that nothing is NaN.
    const fVec shift = fVec::blendv(new_max, zero, new_max == neg_inf);
    const fVec alpha = pagedattn_vec::exp_nonpos(sc.max[j] - shift);
    fVec total = zero;
    for (int64_t t = 0; t < count; ++t) {
      float* s = st + t * rows + j * kWidth;
      const fVec v = load(s);
      fVec e = pagedattn_vec::exp_nonpos(v - shift);
      if (edge) e = fVec::blendv(zero, e, v != neg_inf);
      store(s, e);
      total = total + e;
    }
    sc.max[j] = new_max;
    sc.sum[j] = sc.sum[j] * alpha + total;
    sc.alpha[j] = alpha;
  }
  std::memset(st + count * rows, 0, (kKeys - count) * rows * sizeof(float));
}

// One work item: kv head h, query positions [i0, i1) of the span (absolute pos = first + i).
template <typename T, typename C>
void run_item(const Params& p, const T* query, const C* key_cache, const C* value_cache,
              const int32_t* table, int64_t h, int64_t i0, int64_t i1, Scratch& sc, T* out) {
  constexpr bool pairs = kRunsPairs<T, C>;
  const int64_t D = p.head_size, G = p.num_heads / p.num_kv_heads, Hq = p.num_heads;
  const int64_t first = p.seq_len - p.q_len;  // position of query 0
  const int64_t rows = (i1 - i0) * G;
  const int64_t vecs = (rows + kWidth - 1) / kWidth, lanes = vecs * kWidth;
  const int64_t W = p.sliding_window;
  for (int64_t r = 0; r < lanes; ++r) {
    const T* src = r < rows ? query + ((i0 + r / G) * Hq + h * G + r % G) * D : nullptr;
    if constexpr (pairs) {
      const uint32_t* q = src ? reinterpret_cast<const uint32_t*>(src) : sc.zero.data();
      for (int64_t u = 0; u < D / 2; ++u) sc.q2[u * lanes + r] = q[u];
    } else {
      for (int64_t d = 0; d < D; ++d) sc.qt[d * lanes + r] = src ? static_cast<float>(src[d]) : 0.0f;
    }
  }
  for (int64_t j = 0; j < vecs; ++j) {
    __at_align__ float pos[kWidth], low[kWidth];
    for (int l = 0; l < kWidth; ++l) {
      const int64_t r = j * kWidth + l;
      const int64_t at = first + i0 + r / G;
      pos[l] = r < rows ? static_cast<float>(at) : -1.0f;  // padding lanes see no key
      low[l] = W > 0 ? static_cast<float>(at - W + 1) : kNegInf;
    }
    sc.pos[j] = fVec::loadu(pos);
    sc.low[j] = fVec::loadu(low);
    sc.max[j] = fVec(kNegInf);
    sc.sum[j] = fVec(0.0f);
  }
  std::fill(sc.ot.begin(), sc.ot.begin() + D * lanes, 0.0f);
  const int64_t key_end = first + i1;  // exclusive: the last position's own key
  const int64_t key_begin = W > 0 ? std::max<int64_t>(0, first + i0 - W + 1) : 0;
  const int64_t row_stride = p.num_kv_heads * p.head_stride;
  int64_t offsets[kKeys];
  const uint32_t* krows[kKeys];
  const uint32_t* vrows[kKeys];
  for (int64_t c0 = key_begin; c0 < key_end; c0 += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, key_end - c0);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t at = c0 + t;
      offsets[t] = (table[at / p.block_size] * p.block_size + at % p.block_size) * row_stride +
                   h * p.head_stride;
    }
    if constexpr (pairs) {
      for (int64_t t = 0; t < kKeys; ++t) {
        if (t >= count) {
          krows[t] = vrows[t] = sc.zero.data();
        } else if constexpr (kIsFp8<C>) {
          bf16* k = sc.kb.data() + t * D;
          bf16* v = sc.vb.data() + t * D;
          for (int64_t d = 0; d < D; d += kWidth) {
            store(k + d, load(key_cache + offsets[t] + d));
            store(v + d, load(value_cache + offsets[t] + d));
          }
          krows[t] = reinterpret_cast<const uint32_t*>(k);
          vrows[t] = reinterpret_cast<const uint32_t*>(v);
        } else {
          krows[t] = reinterpret_cast<const uint32_t*>(key_cache + offsets[t]);
          vrows[t] = reinterpret_cast<const uint32_t*>(value_cache + offsets[t]);
        }
      }
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      // st [kKeys][lanes] = key rows (D / 2 pairs each) . q2 [D / 2][lanes]
      pair_gemm(krows, 1, sc.q2.data(), kKeys, D / 2, vecs, lanes, nullptr, sc.st.data());
#endif
    } else {
      widen_chunk(key_cache, offsets, count, D, sc.kw.data());
      widen_chunk(value_cache, offsets, count, D, sc.vw.data());
      // st [kKeys][lanes] = kw [kKeys][D] . qt [D][lanes]
      bcast_gemm(sc.kw.data(), D, 1, sc.qt.data(), kKeys, D, vecs, lanes, nullptr, sc.st.data());
    }
    // Masks where a key may be hidden from some lane: after the first row's position, or before
    // the last row's window.
    const bool edge = c0 + count - 1 > first + i0 || (W > 0 && c0 < first + i1 - W) || rows < lanes;
    softmax_chunk(sc, vecs, lanes, c0, count, edge, p.scale, p.soft_cap);
    if constexpr (pairs) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      // ot [D][lanes] = ot * alpha + v2^T [D][kKeys / 2] . p2 [kKeys / 2][lanes]
      pack_probability_pairs(sc.st.data(), lanes, sc.p2.data());
      pack_value_pairs(vrows, D, sc.v2.data());
      for (int64_t d0 = 0; d0 < D; d0 += kKeys) {
        const uint32_t* vt[kKeys];
        for (int64_t d = 0; d < std::min<int64_t>(kKeys, D - d0); ++d) vt[d] = sc.v2.data() + d0 + d;
        pair_gemm(vt, D, sc.p2.data(), std::min<int64_t>(kKeys, D - d0), kKeys / 2, vecs, lanes,
                  sc.alpha.data(), sc.ot.data() + d0 * lanes);
      }
#endif
    } else {
      // ot [D][lanes] = ot * alpha + vw^T [D][kKeys] . st [kKeys][lanes]
      bcast_gemm(sc.vw.data(), 1, D, sc.st.data(), D, kKeys, vecs, lanes, sc.alpha.data(), sc.ot.data());
    }
  }
  __at_align__ float inv[kWidth];
  for (int64_t j = 0; j < vecs; ++j) {
    const fVec s = sc.sum[j];
    s.store(inv);
    for (int l = 0; l < kWidth; ++l) {
      const int64_t r = j * kWidth + l;
      if (r >= rows) break;
      T* dst = out + ((i0 + r / G) * Hq + h * G + r % G) * D;
      const float f = inv[l] > 0.0f ? p.v_scale / inv[l] : 0.0f;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(sc.ot[d * lanes + r] * f);
    }
  }
}

// Every item of a call on the pool's threads, the heaviest (latest tiles) first.
template <typename T, typename C>
void run(const Params& p, const T* query, const C* key_cache, const C* value_cache,
         const int32_t* table, T* out) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t tile = std::max<int64_t>(1, kTileRows / G);  // query positions per item
  const int64_t tiles = (p.q_len + tile - 1) / tile;
  const int64_t items = tiles * p.num_kv_heads;
  const int64_t lanes = (tile * G + kWidth - 1) / kWidth * kWidth;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch sc(lanes, p.head_size, kRunsPairs<T, C>);
    for (int64_t j = next++; j < items; j = next++) {
      const int64_t t = tiles - 1 - j / p.num_kv_heads, h = j % p.num_kv_heads;
      const int64_t i0 = t * tile, i1 = std::min(p.q_len, i0 + tile);
      run_item(p, query, key_cache, value_cache, table, h, i0, i1, sc, out);
    }
  });
}

}  // namespace prefill
}  // namespace
