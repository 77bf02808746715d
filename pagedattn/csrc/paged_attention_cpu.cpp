// Paged decode attention on CPU that reads K/V straight through the block tables (flash layout).
//
// key_cache / value_cache: [num_blocks, B, Hkv, D]; the key row of token t of a sequence is
// key_cache[block_table[t / B], t % B, h, :] (D contiguous elements), and a whole block is one
// contiguous B * Hkv * D run. One work item is (query row, partition of its tokens); it walks the
// partition in chunks of kChunk tokens, and for each chunk and kv head loads every K/V row once and
// uses it for the whole GQA group (G query heads), with an online softmax. All kv heads of a chunk
// are done back to back, so each block is streamed from memory once, in order. Rows split into
// several partitions write unnormalised partial results that a final pass merges with log-sum-exp.
// Work items (longest first) are handed out through an atomic counter inside at::parallel_for, so
// uneven context lengths still balance across threads.
//
// Everything but the AMX path is written on the vector layer of vec_cpu.h (at::vec, so AVX2,
// AVX-512 and NEON builds share one source); caches of any dtype accumulate in fp32. An FP8 cache
// (e4m3 / e5m2 bytes beside fp32 or bf16 queries) is widened as it is read; its k_scale (and the
// load's unit, kFp8Unit) is folded into the score scale and its v_scale into the final division,
// so the inner loops are those of bf16 with a different load; a chunk's key rows are widened once
// for the whole GQA group. On builds for AVX512-BF16 (the native build of
// such CPUs) bf16 scores use its dot products instead, and fp8 with bf16 queries runs on them
// end to end: the bytes become bf16 bits by two shifts and a mask, and values are summed two
// tokens per dot product (see accumulate_fp8_pairs). A u8 cache with bf16 queries runs integer
// arithmetic on x86 (AVX2 and AVX-512; see score_rows_u8, accumulate_u8_pairs): int16 queries
// against the bytes, and the chunk's weights as int16 against the value bytes, two tokens per
// 16-bit multiply-add; float32 queries keep the exact widening path.
//
// On a CPU with AMX, bf16 caches can run on the tiles instead (amx = true; the kernel tuner
// measures both): per kv head and block of 16 tokens, the scores are one tile product of the
// block's key rows (read in place: 16 rows, the cache's row stride) with the GQA group's queries,
// and after the same online-softmax update the probabilities, rounded to bf16, multiply the
// value rows, which are first interleaved in pairs of tokens (the layout the tiles read). The
// products sum in fp32; the probabilities' rounding makes results differ from the vector path
// at bf16 precision. It needs blocks of 16 tokens, D % 32 == 0, at most 16 query heads per kv
// head and no sliding window; anything else runs the vector path.
//
// A u8 cache with bf16 queries runs on the AMX int8 tiles where the CPU has them (amx = true):
// the vector integer path's int16 queries and weights, split into bytes, against the cache's
// bytes (attend_partition_amx_u8); its integer sums are exact. An fp8 cache with bf16 queries
// runs the fp8 pairs path's arithmetic on the AMX-BF16 tiles (attend_partition_amx_fp8).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include "ops_cpu.h"
#include "vec_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "amx_cpu.h"
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define PAGEDATTN_HAS_MXCSR 1
#endif

namespace {

constexpr int64_t kChunk = 64;      // tokens per online-softmax step
constexpr int kMaxHeadsPerPass = 4;  // query heads whose accumulators stay in registers
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Value rows per prefetch step (RowPrefetcher) in the value loops. NOTE: a step per row cost the
// u8 kernel a third of its in-cache speed at 32/8x128 (15.8 -> 22.5 ms, 32 x 4,096 tokens).
constexpr int64_t kValueStepTokens = 4;
constexpr int64_t kU8ScaleBytes = 8;  // a u8 row's trailer: float32 scale, float32 min
constexpr int64_t kU8MaxHeads = 1024;  // query heads of a u8 row's sum(q) scratch

using bf16 = c10::BFloat16;
using pagedattn_vec::fp8_e4m3;
using pagedattn_vec::fp8_e5m2;
using pagedattn_vec::fVec;
using pagedattn_vec::kWidth;
using pagedattn_vec::load;
using pagedattn_vec::store;

// x[i] = exp(x[i] - shift) for i < n; returns the sum.
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  const fVec vshift(shift);
  fVec vsum(0.0f);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const fVec e = pagedattn_vec::exp_nonpos(load(x + i) - vshift);
    store(x + i, e);
    vsum = vsum + e;
  }
  if (i < n) {
    const fVec e = pagedattn_vec::exp_nonpos(load(x + i, n - i) - vshift);
    store(x + i, e, n - i);
    vsum = vsum + fVec::set(fVec(0.0f), e, n - i);
  }
  return at::vec::vec_reduce_all([](const fVec& a, const fVec& b) { return a + b; }, vsum);
}

// The token rows (all kv heads, K and V) that the next chunk will read, asked for a few cache lines
// per step() from the inner loops of the current chunk.
// NOTE: asked for all at once, a chunk's hundreds of lines fill the core's miss buffers and the
// arithmetic queued behind those prefetches waits for them: memory time and compute time added
// up. Spread over the chunk, the reads overlap with the arithmetic. 32 rows x 4,096 tokens in
// shuffled blocks, out of cache, 2 threads, fastest of 3 rounds (AMX Xeon): bf16 9/3x64 9.9 ->
// 6.0 ms (its K/V read floor at the machine's 20.6 GB/s is 4.9 ms), 32/8x128 67 -> 36 ms; AMX
// 9.4 -> 5.9 and 42 -> 35 ms; u8 5.2 -> 4.9 and 31 -> 24 ms.
class RowPrefetcher {
 public:
  // Aim at the rows at element offsets offsets[0, count) of both caches (row_elems elements of
  // sizeof(C) each), paced over about `steps` calls of step(). offsets must stay valid until
  // finish(), which the caller runs before it overwrites them (and so before the next aim).
  template <typename C>
  void aim(const C* key_cache, const C* value_cache, const int64_t* offsets, int64_t count,
           int64_t row_elems, int64_t steps) {
    key_ = reinterpret_cast<const char*>(key_cache);
    value_ = reinterpret_cast<const char*>(value_cache);
    offsets_ = offsets;
    elem_bytes_ = sizeof(C);
    count_ = count;
    row_bytes_ = row_elems * elem_bytes_;
    t_ = byte_ = 0;
    const int64_t lines = count * ((row_bytes_ + 63) / 64);
    // NOTE: paced to be done about three quarters of the way through the chunk, so that the
    // last lines asked for still arrive before the next chunk reads them.
    per_step_ = std::max<int64_t>(1, (4 * lines + 3 * steps - 1) / (3 * std::max<int64_t>(1, steps)));
  }

  // Ask for the next per_step_ lines of K and of V.
  inline void step() {
    int64_t left = per_step_;
    while (left > 0 && t_ < count_) {
      const int64_t at = offsets_[t_] * elem_bytes_ + byte_;
      const int64_t n = std::min(left, (row_bytes_ - byte_ + 63) / 64);  // lines left in the row
      for (int64_t i = 0; i < n; ++i) {
        __builtin_prefetch(key_ + at + 64 * i, 0, 2);
        __builtin_prefetch(value_ + at + 64 * i, 0, 2);
      }
      left -= n;
      byte_ += 64 * n;
      if (byte_ >= row_bytes_) {
        byte_ = 0;
        ++t_;
      }
    }
  }

  void finish() {
    while (t_ < count_) step();
  }

 private:
  const char* key_ = nullptr;
  const char* value_ = nullptr;
  const int64_t* offsets_ = nullptr;
  int64_t elem_bytes_ = 1, count_ = 0, row_bytes_ = 0, t_ = 0, byte_ = 0, per_step_ = 1;
};

// acc[j] += q[i : i + kWidth] . row_j[i : i + kWidth] for kWidth rows.
template <typename T, typename C>
inline void dot_rows_step(fVec* acc, const T* q, const C* const* rows, int64_t i) {
  const fVec qv = load(q + i);
#pragma GCC unroll 16
  for (int j = 0; j < kWidth; ++j) acc[j] = at::vec::fmadd(qv, load(rows[j] + i), acc[j]);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// AVX512-BF16: 32 bf16 products per instruction (the 16-element tail zero-extended). The
// products are exact and summed in fp32, as the generic path does after widening. NOTE: kept
// because it measured faster: bf16, 32 rows x 1,024 tokens, 9/3 heads x 64, 2 threads on the
// AMX Xeon, the native build (this path) took 1.44-1.86 ms against 1.97-2.09 ms for the avx512
// build (the generic widen + FMA); at 512 tokens the two were within noise (0.75-0.99 ms and
// 0.87-0.90 ms; load average ~2).
inline void dot_rows_step_bf16(fVec* acc, const bf16* q, const bf16* const* rows, int64_t i,
                               bool half) {
  auto ld = [half](const bf16* ptr) {
    const auto* half_ptr = reinterpret_cast<const __m256i*>(ptr);
    return half ? _mm512_zextsi256_si512(_mm256_loadu_si256(half_ptr)) : _mm512_loadu_si512(ptr);
  };
  const __m512bh qv = (__m512bh)ld(q + i);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)ld(rows[j] + i));
  }
}
#endif

// scores[g * kChunk + t] = scale * dot(q[g], key row t) for num_heads heads: kWidth rows at a
// time per head, accumulators in registers, one hsum_rows per kWidth scores; the rows stay in L1
// across the heads of the GQA group, so each K row comes from memory once.
template <typename T, typename C>
void score_rows(const T* q, int64_t num_heads, int64_t head_size, const C* const* krows,
                int64_t count, float scale, float* scores, RowPrefetcher& pf) {
  const fVec vscale(scale);
  for (int64_t t0 = 0; t0 < count; t0 += kWidth) {
    const int64_t n = std::min<int64_t>(kWidth, count - t0);
    const C* rows[kWidth];
    for (int64_t j = 0; j < kWidth; ++j) rows[j] = krows[t0 + std::min(j, n - 1)];  // pad: repeat
    for (int64_t g = 0; g < num_heads; ++g) {
      pf.step();
      const T* qg = q + g * head_size;
      fVec acc[kWidth];
      for (int j = 0; j < kWidth; ++j) acc[j] = fVec(0.0f);
      int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>) {
        for (; i + 32 <= head_size; i += 32) dot_rows_step_bf16(acc, qg, rows, i, false);
        if (i < head_size) dot_rows_step_bf16(acc, qg, rows, i, true);  // a 16-element tail
        i = head_size;
      }
#endif
      for (; i < head_size; i += kWidth) dot_rows_step<T, C>(acc, qg, rows, i);
      store(scores + g * kChunk + t0, pagedattn_vec::hsum_rows(acc) * vscale, n);
    }
  }
}

// acc[g][i0 : i0 + kWidth * NS] += sum_t probs[g * kChunk + t] * row_t[...]: NG * NS independent
// accumulator chains, so the FMA latency is hidden.
template <typename T, int NG, int NS>
inline void accumulate_tile(const float* probs, const T* const* rows, int64_t count,
                            int64_t head_size, int64_t i0, float* acc, RowPrefetcher& pf) {
  fVec a[NG][NS];
  for (int g = 0; g < NG; ++g) {
    for (int s = 0; s < NS; ++s) a[g][s] = load(acc + g * head_size + i0 + kWidth * s);
  }
  for (int64_t t = 0; t < count; ++t) {
    if (t % kValueStepTokens == 0) pf.step();
    fVec v[NS];
    for (int s = 0; s < NS; ++s) v[s] = load(rows[t] + i0 + kWidth * s);
    for (int g = 0; g < NG; ++g) {
      const fVec pv(probs[g * kChunk + t]);
      for (int s = 0; s < NS; ++s) a[g][s] = at::vec::fmadd(pv, v[s], a[g][s]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int s = 0; s < NS; ++s) store(acc + g * head_size + i0 + kWidth * s, a[g][s]);
  }
}

// The widest tile (vectors per head, NS in 8, 4, 2, 1) whose NG * NS accumulators, NS value
// vectors and one broadcast fit in the vector registers.
template <int NG>
constexpr int widest_tile() {
  for (int ns : {8, 4, 2}) {
    if (NG * ns + ns + 1 <= pagedattn_vec::kNumRegs) return ns;
  }
  return 1;
}

// acc[g] += sum_t probs[g * kChunk + t] * value row t, for NG heads (acc: [NG, head_size] fp32).
template <typename T, int NG>
void accumulate_rows(const float* probs, const T* const* rows, int64_t count, int64_t head_size,
                     float* acc, RowPrefetcher& pf) {
  constexpr int kNs = widest_tile<NG>();
  int64_t i = 0;
  if constexpr (kNs >= 8) {
    for (; i + 8 * kWidth <= head_size; i += 8 * kWidth) {
      accumulate_tile<T, NG, 8>(probs, rows, count, head_size, i, acc, pf);
    }
  }
  if constexpr (kNs >= 4) {
    for (; i + 4 * kWidth <= head_size; i += 4 * kWidth) {
      accumulate_tile<T, NG, 4>(probs, rows, count, head_size, i, acc, pf);
    }
  }
  if constexpr (kNs >= 2) {
    for (; i + 2 * kWidth <= head_size; i += 2 * kWidth) {
      accumulate_tile<T, NG, 2>(probs, rows, count, head_size, i, acc, pf);
    }
  }
  for (; i < head_size; i += kWidth) {
    accumulate_tile<T, NG, 1>(probs, rows, count, head_size, i, acc, pf);
  }
}

// max(x[0..n)), n >= 1.
inline float max_of(const float* x, int64_t n) {
  fVec m(kNegInf);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) m = at::vec::maximum(m, load(x + i));
  float result = at::vec::vec_reduce_all(
      [](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, m);
  for (; i < n; ++i) result = std::max(result, x[i]);
  return result;
}

// Dispatch a templated NG to the runtime number of heads in this pass (1..kMaxHeadsPerPass).
template <typename Fn>
void with_heads(int ng, Fn&& fn) {
  switch (ng) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

// fn(g0, NG) for the query heads of kv head h (G of them) in passes of up to kMaxHeadsPerPass:
// g0 the pass's first head, NG its number of heads as a compile-time constant.
template <typename Fn>
void head_passes(int64_t h, int64_t G, Fn&& fn) {
  for (int64_t g0 = h * G; g0 < (h + 1) * G; g0 += kMaxHeadsPerPass) {
    const int ng = static_cast<int>(std::min<int64_t>(kMaxHeadsPerPass, (h + 1) * G - g0));
    with_heads(ng, [&](auto NG) { fn(g0, NG); });
  }
}

struct Params {
  int64_t num_rows, num_heads, num_kv_heads, group, head_size;
  int64_t num_blocks, block_size, max_blocks_per_seq;
  int64_t sliding_window;  // 0: none
  float scale, soft_cap;   // soft_cap 0: none
  float v_scale = 1.0f;    // output factor: an FP8 cache's v_scale * kFp8Unit, else 1
  // Cache elements per (token, kv head) row: D, or D + 8 bytes for u8 (its scale and min).
  int64_t head_stride = 0;
  int64_t partition_size;
  bool amx = false;  // bf16 on AMX tiles (set only where amx_attention_fits)
};

struct WorkItem {
  int64_t row, partition, tok_begin, tok_end;
};

// The work item a thread takes next, whose first chunk is prefetched during the current item's
// last chunk (none: block_table null).
struct NextItem {
  const int32_t* block_table = nullptr;
  int64_t tok_begin = 0, tok_end = 0;
};

// Per-thread scratch over all Hq query heads: scores/probs [Hq, kChunk], accumulators [Hq, D],
// running max and sum [Hq].
struct Scratch {
  std::vector<float> scores, acc, max, sum;
  std::vector<float> widened;  // a one-byte cache's key rows of one chunk and kv head, widened
  std::vector<bf16> lifted;    // fp8 pairs path: the row's queries times kQueryLift
  std::vector<uint32_t> pairs;  // pairs paths: [Hq, kChunk / 2] probability pairs
  std::vector<int16_t> qint;    // u8 integer path: the row's queries as int16, per head scaled
  std::vector<float> qfactor;   // u8 integer path: p.scale * the int16 queries' scale, per head
  Scratch(int64_t num_heads, int64_t head_size)
      : scores(num_heads * kChunk), acc(num_heads * head_size), max(num_heads), sum(num_heads),
        widened(kChunk * head_size), lifted(num_heads * head_size),
        pairs(num_heads * kChunk / 2), qint(num_heads * head_size), qfactor(num_heads) {}
};

// What a one-byte cache's (fp8, u8) key rows are widened to before the scores: bf16 where the
// build has AVX512-BF16 dot products and the queries are bf16 (every u8 and fp8 value is exact
// in bf16), else fp32. Widening a chunk's rows once serves the whole GQA group.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
template <typename T>
using WideKey = std::conditional_t<std::is_same_v<T, bf16>, bf16, float>;
#else
template <typename T>
using WideKey = float;
#endif

// out[t * D : (t + 1) * D] = the D elements of rows[t], widened (exactly) to W; wide[t] points there.
template <typename C, typename W>
void widen_rows(const C* const* rows, int64_t count, int64_t D, W* out, const W** wide,
                RowPrefetcher& pf) {
  for (int64_t t = 0; t < count; ++t) {
    pf.step();
    const C* r = rows[t];
    W* o = out + t * D;
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<W, bf16>) {
      for (; i + 32 <= D; i += 32) {
        const __m512bh pair = _mm512_cvtne2ps_pbh(load(r + i + 16), load(r + i));
        _mm512_storeu_si512(reinterpret_cast<void*>(o + i), (__m512i)pair);
      }
    }
#endif
    for (; i + kWidth <= D; i += kWidth) store(o + i, load(r + i));
    if (i < D) store(o + i, load(r + i, D - i), D - i);
    wide[t] = o;
  }
}

// sc[t] = soft_cap * tanh(sc[t] / soft_cap) for t < count (soft_cap 0: none).
inline void apply_soft_cap(float* sc, int64_t count, float soft_cap) {
  if (soft_cap > 0.0f) {
    for (int64_t t = 0; t < count; ++t) sc[t] = soft_cap * std::tanh(sc[t] / soft_cap);
  }
}

// The online softmax's running max of one head raised to include chunk_max, its sum and acc
// rescaled to the new max; returns it.
inline float raise_max(float chunk_max, float& max, float& sum, float* acc, int64_t head_size) {
  const float new_max = std::max(max, chunk_max);
  if (new_max > max && max != kNegInf) {
    const float alpha = std::exp(max - new_max);
    sum *= alpha;
    for (int64_t i = 0; i < head_size; ++i) acc[i] *= alpha;
  }
  max = new_max;
  return new_max;
}

// Online-softmax update of one head with a chunk of scores (turned into probabilities in place).
inline void softmax_update(float* sc, int64_t count, float soft_cap, float& max, float& sum,
                           float* acc, int64_t head_size) {
  apply_soft_cap(sc, count, soft_cap);
  const float new_max = raise_max(max_of(sc, count), max, sum, acc, head_size);
  sum += exp_shifted_sum(sc, count, new_max);
}

// Element offsets of the token rows of the chunk starting at c0 (up to kChunk tokens before
// tok_end); returns the number of tokens, or 0 on an out-of-range block id.
inline int64_t chunk_row_offsets(const Params& p, const int32_t* block_table, int64_t c0,
                                 int64_t tok_end, int64_t* offsets) {
  const int64_t count = std::min(kChunk, tok_end - c0);
  const int64_t row_stride = p.num_kv_heads * p.head_stride;
  int64_t table_idx = c0 / p.block_size, offset = c0 % p.block_size;
  int64_t block = block_table[table_idx];
  if (block < 0 || block >= p.num_blocks) return 0;
  for (int64_t t = 0; t < count; ++t) {
    if (offset == p.block_size) {
      offset = 0;
      block = block_table[++table_idx];
      if (block < 0 || block >= p.num_blocks) return 0;
    }
    offsets[t] = (block * p.block_size + offset) * row_stride;
    ++offset;
  }
  return count;
}

// Element offsets of the rows to prefetch while the chunk at c0 computes: the item's next chunk,
// or after its last chunk the first chunk of next_item (if any). Returns their number, or -1 on
// an out-of-range block id in this item; next_item's bad ids give 0 (that item reports them).
inline int64_t following_row_offsets(const Params& p, const int32_t* block_table, int64_t c0,
                                     int64_t tok_end, const NextItem& next_item,
                                     int64_t* offsets) {
  if (c0 + kChunk < tok_end) {
    const int64_t count = chunk_row_offsets(p, block_table, c0 + kChunk, tok_end, offsets);
    return count == 0 ? -1 : count;
  }
  if (next_item.block_table == nullptr) return 0;
  return chunk_row_offsets(p, next_item.block_table, next_item.tok_begin, next_item.tok_end,
                           offsets);
}

// Ask for a token row (all kv heads) in L2 ahead of use.
template <typename T>
inline void prefetch_row(const T* row, int64_t num_elems) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < num_elems * static_cast<int64_t>(sizeof(T)); b += 64) {
    __builtin_prefetch(bytes + b, 0, 2);
  }
}

// Prefetch the K and V token rows (all kv heads) at offsets[t0 .. t1).
template <typename T>
inline void prefetch_rows(const Params& p, const T* key_cache, const T* value_cache,
                          const int64_t* offsets, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_row(key_cache + offsets[t], p.num_kv_heads * p.head_stride);
    prefetch_row(value_cache + offsets[t], p.num_kv_heads * p.head_stride);
  }
}

// Prefetch the token rows of the chunk starting at c0.
template <typename T>
void prefetch_chunk(const Params& p, const T* key_cache, const T* value_cache,
                    const int32_t* block_table, int64_t c0, int64_t tok_end) {
  int64_t offsets[kChunk];
  const int64_t count = chunk_row_offsets(p, block_table, c0, tok_end, offsets);
  prefetch_rows(p, key_cache, value_cache, offsets, 0, count);
}

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

// Attention of one (row, partition) over every kv head: a chunk's blocks are read once, whole,
// in order, while the next chunk's (or, in the last chunk, the next item's first) are prefetched.
// Leaves unnormalised acc, max and sum in scratch; false on an out-of-range block id.
//
// A u8 cache (C = uint8_t) runs the same loops on the bytes q_t, with each row's scale s_t and
// min m_t applied around them: score = s_t * (q . k_bytes) + m_t * sum(q), and the value sum
// sum_t p_t (s_t v_bytes + m_t) = sum_t (p_t s_t) v_bytes + sum_t p_t m_t.
template <typename T, typename C>
bool attend_partition(const Params& p, const C* key_cache, const C* value_cache,
                      const int32_t* block_table, int64_t tok_begin, int64_t tok_end, const T* q,
                      const NextItem& next_item, Scratch& s) {
  const int64_t G = p.group, D = p.head_size;
  constexpr bool kU8 = std::is_same_v<C, uint8_t>;
  // u8: p.scale * sum(q[g]) per query head, and the chunk's per-row scales and mins.
  float qsum[kU8 ? kU8MaxHeads : 1];
  float kscale[kU8 ? kChunk : 1], kmin[kU8 ? kChunk : 1];
  float vscale[kU8 ? kChunk : 1], vmin[kU8 ? kChunk : 1];
#ifdef PAGEDATTN_U8_INT
  constexpr bool kU8Int = kU8 && std::is_same_v<T, bf16>;
  // NOTE: D <= 256 keeps a row's sum inside int32: 256 * 255 * 32767 < 2^31.
  const bool u8_int = kU8Int && D % kI16 == 0 && D <= 256;
#endif
  if constexpr (kU8) {
    for (int64_t g = 0; g < p.num_heads; ++g) {
      float sum = 0.0f;
#ifdef PAGEDATTN_U8_INT
      if (u8_int) {
        qsum[g] = u8_int_query(q + g * D, D, p.scale, s.qint.data() + g * D, s.qfactor[g]);
        continue;
      }
#endif
      for (int64_t i = 0; i < D; ++i) sum += static_cast<float>(q[g * D + i]);
      qsum[g] = p.scale * sum;
    }
  }
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  constexpr bool kFp8Pairs = !kU8 && sizeof(C) == 1 && std::is_same_v<T, bf16>;
  const bool pairs = kFp8Pairs && D % 32 == 0;
  if (pairs) lift_bf16(q, p.num_heads * D, kQueryLift, s.lifted.data());
#endif
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.max.begin(), s.max.end(), kNegInf);
  std::fill(s.sum.begin(), s.sum.end(), 0.0f);
  int64_t row_offsets[kChunk];
  const C* krows[kChunk];
  const C* vrows[kChunk];
  int64_t next_offsets[kChunk];
  if (!chunk_row_offsets(p, block_table, tok_begin, tok_end, next_offsets)) return false;
  // NOTE: the next chunk's blocks are scattered, which the hardware prefetcher cannot guess.
  RowPrefetcher pf;
  for (int64_t c0 = tok_begin; c0 < tok_end; c0 += kChunk) {
    const int64_t count = std::min(kChunk, tok_end - c0);
    pf.finish();  // before next_offsets is overwritten
    std::copy(next_offsets, next_offsets + count, row_offsets);
    const int64_t next_count =
        following_row_offsets(p, block_table, c0, tok_end, next_item, next_offsets);
    if (next_count < 0) return false;
    // The inner loops' step() calls per chunk: per kv head, a score step per kWidth rows and
    // query head, and a value step per kValueStepTokens rows and pass of query heads.
    const int64_t steps =
        p.num_kv_heads * (G * ((count + kWidth - 1) / kWidth) +
                          (count + kValueStepTokens - 1) / kValueStepTokens *
                              ((G + kMaxHeadsPerPass - 1) / kMaxHeadsPerPass));
    pf.aim(key_cache, value_cache, next_offsets, next_count, p.num_kv_heads * p.head_stride,
           steps);
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t t = 0; t < count; ++t) {
        krows[t] = key_cache + row_offsets[t] + h * p.head_stride;
        vrows[t] = value_cache + row_offsets[t] + h * p.head_stride;
      }
      if constexpr (sizeof(C) == 1 && !kU8) {
        // NOTE: fp8 only: widened once per chunk, 4,096 tokens took 7.1 ms against 9.4 (a u8
        // row's plain byte load is cheap enough that widening it measured slower, 10.6 vs 8.7).
        using W = WideKey<T>;
        const W* wide[kChunk];
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
        if constexpr (kFp8Pairs) {
          if (pairs) {
            fp8_rows_as_bf16(krows, count, D, reinterpret_cast<bf16*>(s.widened.data()), wide, pf);
            score_rows<bf16, bf16>(s.lifted.data() + h * G * D, G, D, wide, count,
                                   p.scale * kScoreUnlift, s.scores.data() + h * G * kChunk, pf);
          }
        }
        if (!pairs)
#endif
        {
          widen_rows(krows, count, D, reinterpret_cast<W*>(s.widened.data()), wide, pf);
          score_rows<T, W>(q + h * G * D, G, D, wide, count, p.scale,
                           s.scores.data() + h * G * kChunk, pf);
        }
      } else {
#ifdef PAGEDATTN_U8_INT
        if constexpr (kU8Int) {
          if (u8_int) {
            score_rows_u8(s.qint.data() + h * G * D, s.qfactor.data() + h * G, G, D, krows,
                          count, s.scores.data() + h * G * kChunk, pf);
          }
        }
        if (!u8_int)
#endif
          score_rows<T, C>(q + h * G * D, G, D, krows, count, p.scale,
                           s.scores.data() + h * G * kChunk, pf);
      }
      if constexpr (kU8) {
        for (int64_t t = 0; t < count; ++t) {
          u8_scale_min(krows[t], D, kscale[t], kmin[t]);
          u8_scale_min(vrows[t], D, vscale[t], vmin[t]);
        }
        for (int64_t g = h * G; g < (h + 1) * G; ++g) {
          u8_apply_key_scales(s.scores.data() + g * kChunk, count, kscale, kmin, qsum[g]);
        }
      }
      for (int64_t g = h * G; g < (h + 1) * G; ++g) {
        softmax_update(s.scores.data() + g * kChunk, count, p.soft_cap, s.max[g], s.sum[g],
                       s.acc.data() + g * D, D);
        if constexpr (kU8) {
          u8_apply_value_scales(s.scores.data() + g * kChunk, count, vscale, vmin,
                                s.acc.data() + g * D, D);
        }
      }
#ifdef PAGEDATTN_U8_INT
      if constexpr (kU8Int) {
        if (u8_int) {
          uint32_t* pp = s.pairs.data();
          float wscale[kU8MaxHeads];  // the GQA group's weight scales
          for (int64_t g = h * G; g < (h + 1) * G; ++g) {
            float* w = s.scores.data() + g * kChunk;
            if (count % 2) w[count] = 0.0f;
            wscale[g - h * G] = quantize_i16(w, count + count % 2,
                                             reinterpret_cast<int16_t*>(pp + g * (kChunk / 2)));
          }
          head_passes(h, G, [&](int64_t g0, auto NG) {
            accumulate_u8_pairs<decltype(NG)::value>(pp + g0 * (kChunk / 2), wscale + (g0 - h * G),
                                                     vrows, count, D, s.acc.data() + g0 * D, pf);
          });
          continue;
        }
      }
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      if constexpr (kFp8Pairs) {
        if (pairs) {
          uint32_t* pp = s.pairs.data();
          for (int64_t g = h * G; g < (h + 1) * G; ++g) {
            probability_pairs(s.scores.data() + g * kChunk, count, pp + g * (kChunk / 2));
          }
          head_passes(h, G, [&](int64_t g0, auto NG) {
            accumulate_fp8_pairs<C, decltype(NG)::value>(pp + g0 * (kChunk / 2), vrows, count, D,
                                                         s.acc.data() + g0 * D, pf);
          });
          continue;
        }
      }
#endif
      head_passes(h, G, [&](int64_t g0, auto NG) {
        accumulate_rows<C, decltype(NG)::value>(s.scores.data() + g0 * kChunk, vrows, count, D,
                                                s.acc.data() + g0 * D, pf);
      });
    }
  }
  return true;
}

#ifdef PAGEDATTN_HAS_AMX
constexpr int64_t kAmxBlock = 16;     // tokens per cache block (the tiles' 16 rows)
constexpr int64_t kAmxMaxGroup = 16;  // query heads per kv head (tile rows / columns)
constexpr int64_t kAmxK = 32;         // bf16 values per tile row

// {0, x, 2x, ..., 15x} as int32 lanes: the offsets of 16 rows x apart (a tile column's 16 rows,
// a block's 16 token rows).
inline __m512i lane_multiples(int64_t x) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(static_cast<int>(x)));
}

// The cache blocks of the chunk of count tokens at c0 (a multiple of kAmxBlock): kblocks[j] /
// vblocks[j] point at block j's first element (block_elems elements per block); false on an
// out-of-range block id.
template <typename C>
inline bool chunk_blocks(const Params& p, const int32_t* block_table, int64_t c0, int64_t count,
                         const C* key_cache, const C* value_cache, int64_t block_elems,
                         const C** kblocks, const C** vblocks) {
  for (int64_t j = 0; j * kAmxBlock < count; ++j) {
    const int64_t block = block_table[c0 / kAmxBlock + j];
    if (block < 0 || block >= p.num_blocks) return false;
    kblocks[j] = key_cache + block * block_elems;
    vblocks[j] = value_cache + block * block_elems;
  }
  return true;
}

// Tiles (palette 1): 0, 3 scores [16 tokens x G] fp32; 1, 7 key rows [16 tokens x 32 dims] bf16;
// 2 queries [16 dim pairs x G pairs]; 4 probabilities [G x 32 tokens] bf16; 5 values [16 token
// pairs x 16 dim pairs]; 6 output [G x 16 dims] fp32.
void configure_attention_tiles(int64_t G) {
  pagedattn_amx::TileConfig cfg;
  cfg.set(0, kAmxBlock, 4 * G);
  cfg.set(1, kAmxBlock, 64);
  cfg.set(2, kAmxK / 2, 4 * G);
  cfg.set(3, kAmxBlock, 4 * G);
  cfg.set(4, G, 64);
  cfg.set(5, kAmxK / 2, 64);
  cfg.set(6, G, 64);
  cfg.set(7, kAmxBlock, 64);
  cfg.load();
}

bool amx_attention_fits(const Params& p) {
  return p.block_size == kAmxBlock && p.head_size % kAmxK == 0 && p.group <= kAmxMaxGroup &&
         p.sliding_window == 0 && kChunk % kAmxK == 0 && linear_amx_available();
}

// Per-thread buffers of the AMX path.
struct AmxScratch {
  std::vector<bf16> queries;  // [Hkv][D / 32][16 dim pairs][G][2]: each kv head's B tiles
  std::vector<bf16> probs;    // [G][kChunk] (A tiles: 32 tokens per k step)
  std::vector<bf16> values;   // [kChunk / 32][D / 16][16 token pairs][16 dims][2]
  float tile[kAmxBlock * kAmxBlock];
  explicit AmxScratch(const Params& p)
      : queries(p.num_heads * p.head_size),
        probs(p.group * kChunk),
        values(kChunk * p.head_size) {}
};

// values[k step][dim block][pair r] = the rows of tokens 2r, 2r + 1 (zero past count) of a chunk,
// for one kv head, interleaved: (v[2r][d], v[2r + 1][d]) for each d.
void pair_value_rows(const Params& p, const bf16* const* blocks, int64_t count, int64_t head,
                     int64_t ksteps, bf16* out) {
  const int64_t D = p.head_size, row_stride = p.num_kv_heads * D, dim_blocks = D / 16;
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t ks = 0; ks < ksteps; ++ks) {
    for (int64_t r = 0; r < kAmxK / 2; ++r) {
      const int64_t t0 = ks * kAmxK + 2 * r, t1 = t0 + 1;
      const bf16* v0 = t0 < count ? blocks[t0 / kAmxBlock] + (t0 % kAmxBlock) * row_stride + head * D
                                  : nullptr;
      const bf16* v1 = t1 < count ? blocks[t1 / kAmxBlock] + (t1 % kAmxBlock) * row_stride + head * D
                                  : nullptr;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i a = v0 ? _mm512_loadu_si512(v0 + d) : _mm512_setzero_si512();
        const __m512i b = v1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
        bf16* dst = out + ((ks * dim_blocks + d / 16) * (kAmxK / 2) + r) * 32;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(dst + (kAmxK / 2) * 32, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }
}

// attend_partition on the tiles (the caller configured them with configure_attention_tiles).
// out = the queries q [Hq, D] as each kv head's B tiles: [Hkv][D / 32][16 dim pairs][G][2].
void pack_amx_queries(const Params& p, const bf16* q, bf16* out) {
  const int64_t G = p.group, D = p.head_size, qsteps = D / kAmxK;
  for (int64_t h = 0; h < p.num_kv_heads; ++h) {
    for (int64_t ks = 0; ks < qsteps; ++ks) {
      bf16* dst = out + (h * qsteps + ks) * (kAmxK / 2) * G * 2;
      for (int64_t r = 0; r < kAmxK / 2; ++r) {
        for (int64_t g = 0; g < G; ++g) {
          const bf16* src = q + (h * G + g) * D + ks * kAmxK + 2 * r;
          dst[(r * G + g) * 2] = src[0];
          dst[(r * G + g) * 2 + 1] = src[1];
        }
      }
    }
  }
}

bool attend_partition_amx(const Params& p, const bf16* key_cache, const bf16* value_cache,
                          const int32_t* block_table, int64_t tok_begin, int64_t tok_end,
                          const bf16* q, const NextItem& next_item, Scratch& s, AmxScratch& a) {
  const int64_t G = p.group, D = p.head_size, Hkv = p.num_kv_heads;
  const int64_t row_stride = Hkv * D, block_elems = kAmxBlock * row_stride;
  const int64_t qsteps = D / kAmxK, dim_blocks = D / 16;
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.max.begin(), s.max.end(), kNegInf);
  std::fill(s.sum.begin(), s.sum.end(), 0.0f);
  pack_amx_queries(p, q, a.queries.data());
  const __m512i rows = lane_multiples(G);  // element offsets of a tile column's 16 rows
  const bf16* kblocks[kChunk / kAmxBlock];
  const bf16* vblocks[kChunk / kAmxBlock];
  int64_t next_offsets[kChunk];
  RowPrefetcher pf;
  for (int64_t c0 = tok_begin; c0 < tok_end; c0 += kChunk) {
    const int64_t count = std::min(kChunk, tok_end - c0);
    const int64_t nblocks = (count + kAmxBlock - 1) / kAmxBlock;
    const int64_t ksteps = (count + kAmxK - 1) / kAmxK;
    if (!chunk_blocks(p, block_table, c0, count, key_cache, value_cache, block_elems, kblocks,
                      vblocks)) {
      return false;
    }
    // NOTE: the next chunk's blocks are scattered: ask for them while this one computes.
    pf.finish();  // before next_offsets is overwritten
    const int64_t next_count =
        following_row_offsets(p, block_table, c0, tok_end, next_item, next_offsets);
    if (next_count < 0) return false;
    // step() calls per chunk: per kv head, one per block and query head (scores), and one per
    // 16 dims (values).
    pf.aim(key_cache, value_cache, next_offsets, next_count, row_stride,
           Hkv * (nblocks * G + dim_blocks));
    for (int64_t h = 0; h < Hkv; ++h) {
      float* scores = s.scores.data() + h * G * kChunk;
      const bf16* queries = a.queries.data() + h * qsteps * (kAmxK / 2) * G * 2;
      // NOTE: two blocks per pass (accumulators 0 and 3, key rows 1 and 7) so that one block's
      // tile products run while the other's wait; the queries' tile is loaded once for both.
      for (int64_t j = 0; j < nblocks; j += 2) {
        const bool pair = j + 1 < nblocks;
        _tile_zero(0);
        if (pair) _tile_zero(3);
        for (int64_t ks = 0; ks < qsteps; ++ks) {
          _tile_loadd(2, queries + ks * (kAmxK / 2) * G * 2, 4 * G);
          _tile_loadd(1, kblocks[j] + h * D + ks * kAmxK, row_stride * sizeof(bf16));
          _tile_dpbf16ps(0, 1, 2);
          if (pair) {
            _tile_loadd(7, kblocks[j + 1] + h * D + ks * kAmxK, row_stride * sizeof(bf16));
            _tile_dpbf16ps(3, 7, 2);
          }
        }
        for (int64_t jj = j; jj < j + (pair ? 2 : 1); ++jj) {
          if (jj == j) {
            _tile_stored(0, a.tile, 4 * G);  // [16 tokens][G]
          } else {
            _tile_stored(3, a.tile, 4 * G);
          }
          // Transpose to scores[g][t] (16 tokens of head g are a stride-G gather), scaled.
          const __mmask16 mask = static_cast<__mmask16>(
              (1u << std::min(kAmxBlock, count - jj * kAmxBlock)) - 1);
          for (int64_t g = 0; g < G; ++g) {
            pf.step();
            const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(g)),
                                                 a.tile, 4);
            _mm512_mask_storeu_ps(scores + g * kChunk + jj * kAmxBlock, mask,
                                  _mm512_mul_ps(v, _mm512_set1_ps(p.scale)));
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores + g * kChunk;
        softmax_update(sc, count, p.soft_cap, s.max[h * G + g], s.sum[h * G + g],
                       s.acc.data() + (h * G + g) * D, D);
        bf16* pr = a.probs.data() + g * kChunk;
        for (int64_t t = 0; t < ksteps * kAmxK; t += 16) {
          const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, count - t));
          const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), sc + t);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + t),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
        }
      }
      pair_value_rows(p, vblocks, count, h, ksteps, a.values.data());
      for (int64_t db = 0; db < dim_blocks; ++db) {
        pf.step();
        _tile_zero(6);
        for (int64_t ks = 0; ks < ksteps; ++ks) {
          _tile_loadd(4, a.probs.data() + ks * kAmxK, kChunk * sizeof(bf16));
          _tile_loadd(5, a.values.data() + (ks * dim_blocks + db) * (kAmxK / 2) * 32, 64);
          _tile_dpbf16ps(6, 4, 5);
        }
        _tile_stored(6, a.tile, 64);  // [G][16 dims]
        for (int64_t g = 0; g < G; ++g) {
          float* acc = s.acc.data() + (h * G + g) * D + db * 16;
          _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), _mm512_loadu_ps(a.tile + g * 16)));
        }
      }
    }
  }
  return true;
}

// The tile paths' raise_max for one query head, with the chunk's scores sc already scaled and
// max_vec their max over count (recomputed here after a soft cap); returns the new max.
inline float tile_raise_max(float* sc, int64_t count, __m512 max_vec, float soft_cap, float& max,
                            float& sum, float* acc, int64_t D) {
  if (soft_cap > 0.0f) {
    apply_soft_cap(sc, count, soft_cap);
    return raise_max(max_of(sc, count), max, sum, acc, D);
  }
  return raise_max(_mm512_reduce_max_ps(max_vec), max, sum, acc, D);
}

#if defined(__AMX_INT8__) && defined(PAGEDATTN_U8_INT)
#define PAGEDATTN_HAS_AMX_U8 1
// The u8 cache on AMX int8 tiles (amx = true with bf16 queries): the same integers as the u8
// integer path, multiplied on the tiles. Each int16 query (kQueryLimit) is split into two int8
// halves, q = 256 * high + low, and one TDPBUSD per block and 64 dims multiplies the block's key
// bytes (read in place, 16 rows at the cache's row stride) with both halves of the GQA group's
// queries at once (2G tile columns); score = 256 * (k . high) + (k . low), exact in int32. The
// chunk's int16 weights p_t * s_t (>= 0) are split into high and low bytes as the 2G rows of the
// weights tile, and one TDPBUUD per 16 dims multiplies them with the chunk's value bytes,
// interleaved four tokens to a 32-bit lane (the layout the tiles read). The integer sums are
// exact, so the results equal the vector integer path's up to the float rounding of its score
// sums. Needs blocks of 16 tokens, D % 64 == 0, D <= 256 (as the integer path), at most 8 query
// heads per kv head and no sliding window; anything else runs the vector path.
constexpr int64_t kAmxU8K = 64;        // bytes per tile row: a key step's dims, a value step's tokens
constexpr int64_t kAmxU8MaxGroup = 8;  // query heads per kv head (2G tile columns / rows)
static_assert(kChunk == kAmxU8K, "one value tile product per chunk: kChunk tokens of weights");

// Tiles (palette 1): 0, 3 scores [16 tokens x 2G] int32; 1, 7 key bytes [16 tokens x 64 dims];
// 2 query halves [16 dim quads x 2G x 4]; 4 weight bytes [2G x 64 tokens]; 5 value bytes [16 token
// quads x 16 dims x 4]; 6 output [2G x 16 dims] int32.
void configure_u8_attention_tiles(int64_t G) {
  pagedattn_amx::TileConfig cfg;
  cfg.set(0, kAmxBlock, 8 * G);
  cfg.set(1, kAmxBlock, kAmxU8K);
  cfg.set(2, kAmxU8K / 4, 8 * G);
  cfg.set(3, kAmxBlock, 8 * G);
  cfg.set(4, 2 * G, kAmxU8K);
  cfg.set(5, kAmxU8K / 4, 64);
  cfg.set(6, 2 * G, 64);
  cfg.set(7, kAmxBlock, kAmxU8K);
  cfg.load();
}

bool amx_u8_attention_fits(const Params& p) {
  return p.block_size == kAmxBlock && p.head_size % kAmxU8K == 0 && p.head_size <= 256 &&
         p.group <= kAmxU8MaxGroup && p.sliding_window == 0 && linear_amx_available();
}

// Per-thread buffers of the u8 tile path.
struct AmxU8Scratch {
  std::vector<int8_t> queries;   // [Hkv][D / 64][16 dim quads][2G][4]: high halves, then low
  // Two of each (kv heads alternate; see attend_partition_amx_u8):
  std::vector<uint8_t> weights;  // [2G][kChunk]: the weights' high bytes, then their low bytes
  std::vector<uint8_t> values;   // [D / 16][16 token quads][16 dims][4 tokens]
  float wscale[2][kAmxU8MaxGroup];  // the weights' scales
  int32_t tile[kChunk / kAmxBlock][kAmxBlock * kAmxBlock];  // a chunk's score tiles
  int32_t out[4][kAmxU8MaxGroup * 2 * 16];  // the output tiles of one 64-dim step
  explicit AmxU8Scratch(const Params& p)
      : queries(2 * p.num_heads * p.head_size),
        weights(2 * 2 * p.group * kChunk),
        values(2 * kChunk * p.head_size) {}
};

// Split the item's int16 queries (s.qint) into the tiles' int8 halves, per kv head.
void split_u8_queries(const Params& p, const int16_t* qint, int8_t* out) {
  const int64_t G = p.group, D = p.head_size, ksteps = D / kAmxU8K;
  for (int64_t h = 0; h < p.num_kv_heads; ++h) {
    for (int64_t ks = 0; ks < ksteps; ++ks) {
      int8_t* dst = out + (h * ksteps + ks) * (kAmxU8K / 4) * 2 * G * 4;
      for (int64_t r = 0; r < kAmxU8K / 4; ++r) {
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t i = 0; i < 4; ++i) {
            const int32_t q = qint[(h * G + g) * D + ks * kAmxU8K + 4 * r + i];
            const int32_t low = static_cast<int8_t>(q & 0xFF);  // the signed low byte
            dst[(r * 2 * G + g) * 4 + i] = static_cast<int8_t>((q - low) / 256);
            dst[(r * 2 * G + G + g) * 4 + i] = static_cast<int8_t>(low);
          }
        }
      }
    }
  }
}

// values[d / 16 + s][r] = the value bytes of tokens 4r .. 4r + 3 (zero past count) of one kv head,
// four tokens to a 32-bit lane. The unpacks work within 128-bit lanes, so tile s of a 64-dim step
// holds dims {4s .. 4s + 3} + 16 * lane (unpermute_u8_output puts them back in order).
void interleave_u8_values(const uint8_t* const* vrows, int64_t count, int64_t D, uint8_t* out,
                          RowPrefetcher& pf) {
  for (int64_t r = 0; r < kChunk / 4; ++r) {
    if (r % 2 == 0) pf.step();
    const uint8_t* rows[4];
    for (int i = 0; i < 4; ++i) rows[i] = 4 * r + i < count ? vrows[4 * r + i] : nullptr;
    for (int64_t d0 = 0; d0 < D; d0 += kAmxU8K) {
      __m512i v[4];
      for (int i = 0; i < 4; ++i) {
        v[i] = rows[i] ? _mm512_loadu_si512(rows[i] + d0) : _mm512_setzero_si512();
      }
      const __m512i a = _mm512_unpacklo_epi8(v[0], v[1]), b = _mm512_unpackhi_epi8(v[0], v[1]);
      const __m512i c = _mm512_unpacklo_epi8(v[2], v[3]), d = _mm512_unpackhi_epi8(v[2], v[3]);
      uint8_t* dst = out + ((d0 / 16) * (kChunk / 4) + r) * 64;
      constexpr int64_t kTile = (kChunk / 4) * 64;  // bytes per value tile
      _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(a, c));
      _mm512_storeu_si512(dst + kTile, _mm512_unpackhi_epi16(a, c));
      _mm512_storeu_si512(dst + 2 * kTile, _mm512_unpacklo_epi16(b, d));
      _mm512_storeu_si512(dst + 3 * kTile, _mm512_unpackhi_epi16(b, d));
    }
  }
}

// The 64 dims of a step in order from its four output tiles' lanes x[s] (dims 4s + 16 * lane ..):
// a 4 x 4 transpose of 128-bit lanes.
inline void unpermute_u8_output(const __m512 x[4], __m512 out[4]) {
  const __m512 t0 = _mm512_shuffle_f32x4(x[0], x[1], 0x44), t1 = _mm512_shuffle_f32x4(x[2], x[3], 0x44);
  const __m512 t2 = _mm512_shuffle_f32x4(x[0], x[1], 0xEE), t3 = _mm512_shuffle_f32x4(x[2], x[3], 0xEE);
  out[0] = _mm512_shuffle_f32x4(t0, t1, 0x88);
  out[1] = _mm512_shuffle_f32x4(t0, t1, 0xDD);
  out[2] = _mm512_shuffle_f32x4(t2, t3, 0x88);
  out[3] = _mm512_shuffle_f32x4(t2, t3, 0xDD);
}

// The u8 tile path's softmax and weights for one query head and chunk, fused into two passes:
// the online-softmax update of softmax_update (running max and sum, acc rescaled) on the scores
// sc (max: their max over the count tokens), then u8_apply_value_scales, then the weights'
// int16 quantization of quantize_i16 written as high bytes (hi) and low bytes (lo) for the
// kChunk tokens (zero past count). Returns the weights' scale.
inline float u8_tile_weights(float* sc, int64_t count, __m512 max_vec, float soft_cap,
                             const float* vscale, const float* vmin, float& max, float& sum,
                             float* acc, int64_t D, uint8_t* hi, uint8_t* lo) {
  constexpr int64_t kVecs = kChunk / 16;
  const float new_max = tile_raise_max(sc, count, max_vec, soft_cap, max, sum, acc, D);
  const fVec shift(new_max);
  fVec esum(0.0f), bias(0.0f), wmax(0.0f);
  __m512 w[kVecs];
  for (int64_t v = 0; v < kVecs; ++v) {
    const int64_t t = 16 * v;
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, count - t));
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    // NOTE: lanes past count are 0, so they add nothing anywhere.
    const fVec e(_mm512_maskz_mov_ps(
        mask, pagedattn_vec::exp_nonpos(fVec(_mm512_maskz_loadu_ps(mask, sc + t)) - shift)));
    esum = esum + e;
    bias = bias + e * fVec(_mm512_maskz_loadu_ps(mask, vmin + t));
    w[v] = e * fVec(_mm512_maskz_loadu_ps(mask, vscale + t));
    wmax = at::vec::maximum(wmax, fVec(w[v]));
  }
  auto add = [](const fVec& a, const fVec& b) { return a + b; };
  sum += at::vec::vec_reduce_all(add, esum);
  const float b = at::vec::vec_reduce_all(add, bias);
  for (int64_t i = 0; i < D; ++i) acc[i] += b;
  const float m = _mm512_reduce_max_ps(wmax);
  const float inv = m == 0.0f ? 0.0f : 32767.0f / m;
  for (int64_t v = 0; v < kVecs; v += 2) {
    // NOTE: converted with the default rounding, to nearest, as quantize_i16.
    const __m512i lo32 = _mm512_cvtps_epi32(_mm512_mul_ps(w[v], _mm512_set1_ps(inv)));
    const __m512i hi32 = _mm512_cvtps_epi32(_mm512_mul_ps(w[v + 1], _mm512_set1_ps(inv)));
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo32)),
                                         _mm512_cvtepi32_epi16(hi32), 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + 16 * v),
                        _mm512_cvtepi16_epi8(_mm512_srli_epi16(q, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + 16 * v),
                        _mm512_cvtepi16_epi8(_mm512_and_si512(q, _mm512_set1_epi16(0xFF))));
  }
  return m == 0.0f ? 1.0f : m / 32767.0f;
}

// 256 * x[hi] + x[lo] for 16 int32 lanes, as float.
inline __m512 combine_halves(__m512i hi, __m512i lo) {
  return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
}

// attend_partition for a u8 cache on the tiles (configured by configure_u8_attention_tiles).
bool attend_partition_amx_u8(const Params& p, const uint8_t* key_cache, const uint8_t* value_cache,
                             const int32_t* block_table, int64_t tok_begin, int64_t tok_end,
                             const bf16* q, const NextItem& next_item, Scratch& s,
                             AmxU8Scratch& a) {
  const int64_t G = p.group, D = p.head_size, Hkv = p.num_kv_heads, hs = p.head_stride;
  const int64_t row_stride = Hkv * hs, block_bytes = kAmxBlock * row_stride;
  const int64_t ksteps = D / kAmxU8K;
  float qsum[kU8MaxHeads];
  for (int64_t g = 0; g < p.num_heads; ++g) {
    qsum[g] = u8_int_query(q + g * D, D, p.scale, s.qint.data() + g * D, s.qfactor[g]);
  }
  split_u8_queries(p, s.qint.data(), a.queries.data());
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.max.begin(), s.max.end(), kNegInf);
  std::fill(s.sum.begin(), s.sum.end(), 0.0f);
  const __m512i rows = lane_multiples(2 * G);  // int32 offsets of a score tile column's rows
  const __m512i trailers = lane_multiples(row_stride);  // byte offsets of a block's 16 rows
  float kscale[kChunk], kmin[kChunk], vscale[kChunk], vmin[kChunk];
  const uint8_t* kblocks[kChunk / kAmxBlock];
  const uint8_t* vblocks[kChunk / kAmxBlock];
  const uint8_t* vrows[kChunk];
  int64_t next_offsets[kChunk];
  RowPrefetcher pf;
  for (int64_t c0 = tok_begin; c0 < tok_end; c0 += kChunk) {
    const int64_t count = std::min(kChunk, tok_end - c0);
    const int64_t nblocks = (count + kAmxBlock - 1) / kAmxBlock;
    if (!chunk_blocks(p, block_table, c0, count, key_cache, value_cache, block_bytes, kblocks,
                      vblocks)) {
      return false;
    }
    pf.finish();  // before next_offsets is overwritten
    const int64_t next_count =
        following_row_offsets(p, block_table, c0, tok_end, next_item, next_offsets);
    if (next_count < 0) return false;
    // step() calls per chunk: per kv head, one per pair of blocks (score products), one per
    // block and query head (scores), one per query head (weights), one per two token quads
    // (values) and one per value product.
    // NOTE: spread over every phase, so that the lines are asked for at an even pace: with none
    // during the softmax, the kernel sat on its prefetch instructions (28% of its samples, out of
    // cache), the next burst waiting for fill buffers the last one still held.
    pf.aim(key_cache, value_cache, next_offsets, next_count, row_stride,
           Hkv * ((nblocks + 1) / 2 + nblocks * G + G + kChunk / 8 + 4 * ksteps));
    // acc[h's heads] += the weights times the value bytes of kv head h (its buffers: h % 2).
    auto value_products = [&](int64_t h) {
      const int64_t buf = h % 2;
      const uint8_t* values = a.values.data() + buf * kChunk * D;
      _tile_loadd(4, a.weights.data() + buf * 2 * G * kChunk, kChunk);
      for (int64_t ks = 0; ks < ksteps; ++ks) {
        for (int64_t sub = 0; sub < 4; ++sub) {
          pf.step();
          _tile_zero(6);
          _tile_loadd(5, values + (ks * 4 + sub) * (kChunk / 4) * 64, 64);
          _tile_dpbuud(6, 4, 5);
          _tile_stored(6, a.out[sub], 64);  // [2G][16]
        }
        for (int64_t g = 0; g < G; ++g) {
          __m512 x[4], ordered[4];
          for (int sub = 0; sub < 4; ++sub) {
            x[sub] = combine_halves(_mm512_loadu_si512(a.out[sub] + g * 16),
                                    _mm512_loadu_si512(a.out[sub] + (G + g) * 16));
          }
          unpermute_u8_output(x, ordered);
          float* acc = s.acc.data() + (h * G + g) * D + ks * kAmxU8K;
          const __m512 ws = _mm512_set1_ps(a.wscale[buf][g]);
          for (int k = 0; k < 4; ++k) {
            _mm512_storeu_ps(acc + 16 * k,
                             _mm512_fmadd_ps(ordered[k], ws, _mm512_loadu_ps(acc + 16 * k)));
          }
        }
      }
    };
    for (int64_t h = 0; h < Hkv; ++h) {
      float* scores = s.scores.data() + h * G * kChunk;
      const int8_t* queries = a.queries.data() + h * ksteps * (kAmxU8K / 4) * 2 * G * 4;
      // The rows' scales and mins, 16 tokens (a block) per gather.
      for (int64_t j = 0; j < nblocks; ++j) {
        const uint8_t* k = kblocks[j] + h * hs + D;
        const uint8_t* v = vblocks[j] + h * hs + D;
        _mm512_storeu_ps(kscale + j * kAmxBlock, _mm512_i32gather_ps(trailers, k, 1));
        _mm512_storeu_ps(kmin + j * kAmxBlock, _mm512_i32gather_ps(trailers, k + 4, 1));
        _mm512_storeu_ps(vscale + j * kAmxBlock, _mm512_i32gather_ps(trailers, v, 1));
        _mm512_storeu_ps(vmin + j * kAmxBlock, _mm512_i32gather_ps(trailers, v + 4, 1));
      }
      for (int64_t t = 0; t < count; ++t) {
        vrows[t] = vblocks[t / kAmxBlock] + (t % kAmxBlock) * row_stride + h * hs;
      }
      const int64_t buf = h % 2;
      interleave_u8_values(vrows, count, D, a.values.data() + buf * kChunk * D, pf);
      // NOTE: two blocks per pass (accumulators 0 and 3), as the bf16 tile path; the tiles are
      // stored as they finish and read back (transposed) only after the chunk's last product,
      // as reading a tile store at once waits for it.
      for (int64_t j = 0; j < nblocks; j += 2) {
        const bool pair = j + 1 < nblocks;
        pf.step();
        _tile_zero(0);
        if (pair) _tile_zero(3);
        for (int64_t ks = 0; ks < ksteps; ++ks) {
          _tile_loadd(2, queries + ks * (kAmxU8K / 4) * 2 * G * 4, 8 * G);
          _tile_loadd(1, kblocks[j] + h * hs + ks * kAmxU8K, row_stride);
          _tile_dpbusd(0, 1, 2);
          if (pair) {
            _tile_loadd(7, kblocks[j + 1] + h * hs + ks * kAmxU8K, row_stride);
            _tile_dpbusd(3, 7, 2);
          }
        }
        _tile_stored(0, a.tile[j], 8 * G);  // [16 tokens][2G]
        if (pair) _tile_stored(3, a.tile[j + 1], 8 * G);
      }
      // Scores with the rows' scales and mins (as u8_apply_key_scales), and each head's max.
      __m512 chunk_max[kAmxU8MaxGroup];
      for (int64_t g = 0; g < G; ++g) chunk_max[g] = _mm512_set1_ps(kNegInf);
      for (int64_t j = 0; j < nblocks; ++j) {
        const __mmask16 mask = static_cast<__mmask16>(
            (1u << std::min(kAmxBlock, count - j * kAmxBlock)) - 1);
        const __m512 ks = _mm512_loadu_ps(kscale + j * kAmxBlock);
        const __m512 km = _mm512_loadu_ps(kmin + j * kAmxBlock);
        for (int64_t g = 0; g < G; ++g) {
          pf.step();
          const __m512i hi =
              _mm512_i32gather_epi32(_mm512_add_epi32(rows, _mm512_set1_epi32(g)), a.tile[j], 4);
          const __m512i lo = _mm512_i32gather_epi32(
              _mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(G + g))), a.tile[j], 4);
          const __m512 raw =
              _mm512_mul_ps(combine_halves(hi, lo), _mm512_set1_ps(s.qfactor[h * G + g]));
          const __m512 sc = _mm512_add_ps(_mm512_mul_ps(raw, ks),
                                          _mm512_mul_ps(km, _mm512_set1_ps(qsum[h * G + g])));
          _mm512_mask_storeu_ps(scores + g * kChunk + j * kAmxBlock, mask, sc);
          chunk_max[g] = _mm512_mask_max_ps(chunk_max[g], mask, chunk_max[g], sc);
        }
      }
      uint8_t* weights = a.weights.data() + buf * 2 * G * kChunk;
      for (int64_t g = 0; g < G; ++g) {
        pf.step();
        float* sc = scores + g * kChunk;
        float* acc = s.acc.data() + (h * G + g) * D;
        a.wscale[buf][g] = u8_tile_weights(sc, count, chunk_max[g], p.soft_cap, vscale, vmin,
                                           s.max[h * G + g], s.sum[h * G + g], acc, D,
                                           weights + g * kChunk, weights + (G + g) * kChunk);
      }
      // NOTE: a kv head's value products run after the next head's scores: a tile load of bytes
      // that vector stores have just written waits for them (the first product of each head took
      // 18% of the kernel's samples, out of cache, when it followed its own weights at once).
      if (h > 0) value_products(h - 1);
    }
    value_products(Hkv - 1);
  }
  return true;
}
#endif  // __AMX_INT8__ && PAGEDATTN_U8_INT

// An fp8 cache with bf16 queries on the AMX-BF16 tiles (amx = true): the fp8 pairs path's
// arithmetic (bytes as bf16 bits, queries lifted by 2^96, probabilities by 2^112) on the bf16
// tile path's tiles. A kv head's key rows are widened into a scratch one head ahead of their
// tile products, and its value rows paired (two tokens to a 32-bit lane, the unpacks' dim order;
// see accumulate_fp8_pairs) before its scores, so that no tile load waits for the vector stores
// that wrote its bytes; a kv head's value products run after the next head's scores, as on the
// u8 tiles. Fits where amx_attention_fits does.
struct AmxFp8Scratch {
  std::vector<bf16> queries;  // as AmxScratch's, lifted
  // Two of each (kv heads alternate):
  std::vector<bf16> keys;     // [kChunk][D]: a head's key rows as bf16 bits
  std::vector<bf16> values;   // [kChunk / 32][D / 16][16 token pairs][16 dims][2], dims permuted
  std::vector<bf16> probs;    // [G][kChunk], lifted
  float tile[kChunk / kAmxBlock][kAmxBlock * kAmxBlock];
  float out[kAmxMaxGroup * 16];
  explicit AmxFp8Scratch(const Params& p)
      : queries(p.num_heads * p.head_size),
        keys(2 * kChunk * p.head_size),
        values(2 * kChunk * p.head_size),
        probs(2 * p.group * kChunk) {}
};

// The online-softmax update of one query head with a chunk's scores (as softmax_update; max_vec:
// their max over count) and its probabilities times kProbLift as bf16 in probs[0, kChunk) (zero
// past count).
inline void tile_probabilities(float* sc, int64_t count, __m512 max_vec, float soft_cap,
                               float& max, float& sum, float* acc, int64_t D, bf16* probs) {
  const float new_max = tile_raise_max(sc, count, max_vec, soft_cap, max, sum, acc, D);
  const fVec shift(new_max), lift(kProbLift);
  fVec esum(0.0f);
  for (int64_t t = 0; t < kChunk; t += 32) {
    __m512 e[2];
    for (int k = 0; k < 2; ++k) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, count - t - 16 * k));
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      e[k] = _mm512_maskz_mov_ps(
          mask, pagedattn_vec::exp_nonpos(fVec(_mm512_maskz_loadu_ps(mask, sc + t + 16 * k)) - shift));
      esum = esum + fVec(e[k]);
    }
    const __m512bh pair = _mm512_cvtne2ps_pbh(fVec(e[1]) * lift, fVec(e[0]) * lift);
    _mm512_storeu_si512(reinterpret_cast<void*>(probs + t), (__m512i)pair);
  }
  sum += at::vec::vec_reduce_all([](const fVec& a, const fVec& b) { return a + b; }, esum);
}

// attend_partition for an fp8 cache on the tiles (configured by configure_attention_tiles).
template <typename F>
bool attend_partition_amx_fp8(const Params& p, const F* key_cache, const F* value_cache,
                              const int32_t* block_table, int64_t tok_begin, int64_t tok_end,
                              const bf16* q, const NextItem& next_item, Scratch& s,
                              AmxFp8Scratch& a) {
  const int64_t G = p.group, D = p.head_size, Hkv = p.num_kv_heads;
  const int64_t row_stride = Hkv * D, block_elems = kAmxBlock * row_stride;
  const int64_t qsteps = D / kAmxK, dim_blocks = D / 16;
  lift_bf16(q, p.num_heads * D, kQueryLift, s.lifted.data());
  pack_amx_queries(p, s.lifted.data(), a.queries.data());
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.max.begin(), s.max.end(), kNegInf);
  std::fill(s.sum.begin(), s.sum.end(), 0.0f);
  const __m512i rows = lane_multiples(G);  // element offsets of a tile column's 16 rows
  const float score_scale = p.scale * kScoreUnlift;
  const F* kblocks[kChunk / kAmxBlock];
  const F* vblocks[kChunk / kAmxBlock];
  int64_t next_offsets[kChunk];
  RowPrefetcher pf;
  for (int64_t c0 = tok_begin; c0 < tok_end; c0 += kChunk) {
    const int64_t count = std::min(kChunk, tok_end - c0);
    const int64_t nblocks = (count + kAmxBlock - 1) / kAmxBlock;
    if (!chunk_blocks(p, block_table, c0, count, key_cache, value_cache, block_elems, kblocks,
                      vblocks)) {
      return false;
    }
    pf.finish();  // before next_offsets is overwritten
    const int64_t next_count =
        following_row_offsets(p, block_table, c0, tok_end, next_item, next_offsets);
    if (next_count < 0) return false;
    // step() calls per chunk: per kv head, one per 16 key rows widened, one per 2 value pairs
    // of 32 tokens, one per pair of blocks (score products), one per block and query head
    // (scores), one per query head (probabilities) and one per 16 dims (value products).
    pf.aim(key_cache, value_cache, next_offsets, next_count, row_stride,
           Hkv * (nblocks + 8 * ((count + 31) / 32) + (nblocks + 1) / 2 + nblocks * G + G +
                  dim_blocks));
    auto row = [&](const F* const* blocks, int64_t t, int64_t h) {
      return blocks[t / kAmxBlock] + (t % kAmxBlock) * row_stride + h * D;
    };
    // keys[h % 2] = kv head h's key rows as bf16 bits (rows past count left as they are: their
    // scores are never stored).
    auto widen_keys = [&](int64_t h) {
      bf16* dst = a.keys.data() + (h % 2) * kChunk * D;
      for (int64_t t = 0; t < count; ++t) {
        if (t % kAmxBlock == 0) pf.step();
        for (int64_t d = 0; d < D; d += 32) {
          _mm512_storeu_si512(dst + t * D + d, fp8_bf16_bits(row(kblocks, t, h) + d));
        }
      }
    };
    // acc[h's heads] += the probabilities times kv head h's value rows (its buffers: h % 2).
    auto value_products = [&](int64_t h) {
      const bf16* values = a.values.data() + (h % 2) * kChunk * D;
      const bf16* probs = a.probs.data() + (h % 2) * G * kChunk;
      const int64_t ksteps = (count + kAmxK - 1) / kAmxK;
      for (int64_t db = 0; db < dim_blocks; db += 2) {
        fVec lohi[2][kAmxMaxGroup];
        for (int64_t half = 0; half < 2; ++half) {
          pf.step();
          _tile_zero(6);
          for (int64_t ks = 0; ks < ksteps; ++ks) {
            _tile_loadd(4, probs + ks * kAmxK, kChunk * sizeof(bf16));
            _tile_loadd(5, values + ((ks * dim_blocks + db + half) * (kAmxK / 2)) * 32, 64);
            _tile_dpbf16ps(6, 4, 5);
          }
          _tile_stored(6, a.out, 64);  // [G][16 dims]
          for (int64_t g = 0; g < G; ++g) lohi[half][g] = fVec(_mm512_loadu_ps(a.out + g * 16));
        }
        for (int64_t g = 0; g < G; ++g) {
          fVec x0, x1;
          unpermute(lohi[0][g], lohi[1][g], x0, x1);
          float* acc = s.acc.data() + (h * G + g) * D + db * 16;
          store(acc, load(acc) + x0);
          store(acc + 16, load(acc + 16) + x1);
        }
      }
    };
    widen_keys(0);
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t buf = h % 2;
      if (h + 1 < Hkv) widen_keys(h + 1);
      // values[buf][k step][dim block][pair r]: tokens 2r, 2r + 1 of the k step (zero past count).
      bf16* values = a.values.data() + buf * kChunk * D;
      for (int64_t ks = 0; ks * kAmxK < count; ++ks) {
        for (int64_t r = 0; r < kAmxK / 2; ++r) {
          if (r % 2 == 0) pf.step();
          const int64_t t0 = ks * kAmxK + 2 * r, t1 = t0 + 1;
          for (int64_t d = 0; d < D; d += 32) {
            const __m512i v0 = t0 < count ? fp8_bf16_bits(row(vblocks, t0, h) + d) : _mm512_setzero_si512();
            const __m512i v1 = t1 < count ? fp8_bf16_bits(row(vblocks, t1, h) + d) : _mm512_setzero_si512();
            bf16* dst = values + ((ks * dim_blocks + d / 16) * (kAmxK / 2) + r) * 32;
            _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(v0, v1));
            _mm512_storeu_si512(dst + (kAmxK / 2) * 32, _mm512_unpackhi_epi16(v0, v1));
          }
        }
      }
      const bf16* keys = a.keys.data() + buf * kChunk * D;
      const bf16* queries = a.queries.data() + h * qsteps * (kAmxK / 2) * G * 2;
      for (int64_t j = 0; j < nblocks; j += 2) {
        const bool pair = j + 1 < nblocks;
        pf.step();
        _tile_zero(0);
        if (pair) _tile_zero(3);
        for (int64_t ks = 0; ks < qsteps; ++ks) {
          _tile_loadd(2, queries + ks * (kAmxK / 2) * G * 2, 4 * G);
          _tile_loadd(1, keys + j * kAmxBlock * D + ks * kAmxK, D * sizeof(bf16));
          _tile_dpbf16ps(0, 1, 2);
          if (pair) {
            _tile_loadd(7, keys + (j + 1) * kAmxBlock * D + ks * kAmxK, D * sizeof(bf16));
            _tile_dpbf16ps(3, 7, 2);
          }
        }
        _tile_stored(0, a.tile[j], 4 * G);  // [16 tokens][G]
        if (pair) _tile_stored(3, a.tile[j + 1], 4 * G);
      }
      float* scores = s.scores.data() + h * G * kChunk;
      __m512 chunk_max[kAmxMaxGroup];
      for (int64_t g = 0; g < G; ++g) chunk_max[g] = _mm512_set1_ps(kNegInf);
      for (int64_t j = 0; j < nblocks; ++j) {
        const __mmask16 mask = static_cast<__mmask16>(
            (1u << std::min(kAmxBlock, count - j * kAmxBlock)) - 1);
        for (int64_t g = 0; g < G; ++g) {
          pf.step();
          const __m512 sc = _mm512_mul_ps(
              _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(g)), a.tile[j], 4),
              _mm512_set1_ps(score_scale));
          _mm512_mask_storeu_ps(scores + g * kChunk + j * kAmxBlock, mask, sc);
          chunk_max[g] = _mm512_mask_max_ps(chunk_max[g], mask, chunk_max[g], sc);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        pf.step();
        tile_probabilities(scores + g * kChunk, count, chunk_max[g], p.soft_cap, s.max[h * G + g],
                           s.sum[h * G + g], s.acc.data() + (h * G + g) * D, D,
                           a.probs.data() + buf * G * kChunk + g * kChunk);
      }
      if (h > 0) value_products(h - 1);
    }
    value_products(Hkv - 1);
  }
  return true;
}
#endif  // PAGEDATTN_HAS_AMX

// Partition size: the requested one, halved (down to 2 chunks) until there are enough work items
// to keep every thread busy.
int64_t choose_partition_size(const Params& p, const int32_t* seq_lens, int64_t num_threads) {
  int64_t size = p.partition_size;
  while (size > 2 * kChunk) {
    int64_t num_items = 0;
    for (int64_t r = 0; r < p.num_rows; ++r) num_items += (seq_lens[r] + size - 1) / size;
    if (num_items >= 4 * num_threads) break;
    size /= 2;
  }
  return size;
}

template <typename T, typename C>
void paged_decode_impl(const Params& p, const T* query, const C* key_cache, const C* value_cache,
                       const int32_t* block_tables, const int32_t* seq_lens, T* out) {
  const int64_t Hq = p.num_heads, D = p.head_size;
  const int64_t num_threads = at::get_num_threads();
  const int64_t part_size = choose_partition_size(p, seq_lens, num_threads);
  // Work items per row: the visible token range [begin, seq_len) split into partitions.
  std::vector<WorkItem> items;
  std::vector<int64_t> num_partitions(p.num_rows), first_partition(p.num_rows);
  int64_t num_partials = 0;
  for (int64_t r = 0; r < p.num_rows; ++r) {
    const int64_t seq_len = seq_lens[r];
    TORCH_CHECK(seq_len > 0 && seq_len <= p.max_blocks_per_seq * p.block_size, "row ", r,
                " has seq_len ", seq_len, " outside (0, ", p.max_blocks_per_seq * p.block_size,
                "]: the block table is too short or the length is wrong");
    const int64_t begin =
        p.sliding_window > 0 ? std::max<int64_t>(0, seq_len - p.sliding_window) : 0;
    const int64_t n = (seq_len - begin + part_size - 1) / part_size;
    num_partitions[r] = n;
    first_partition[r] = num_partials;
    if (n > 1) num_partials += n;
    for (int64_t i = 0; i < n; ++i) {
      items.push_back(
          {r, i, begin + i * part_size, std::min(seq_len, begin + (i + 1) * part_size)});
    }
  }
  // NOTE: longest items first, so that the dynamic queue ends with short ones.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
    return a.tok_end - a.tok_begin > b.tok_end - b.tok_begin;
  });
  // Partial results of multi-partition rows: acc [partial, Hq, D], max/sum [partial, Hq].
  std::vector<float> part_acc(num_partials * Hq * D), part_max(num_partials * Hq),
      part_sum(num_partials * Hq);
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad_block{false};
  at::parallel_for(0, std::min(num_threads, num_items), 1, [&](int64_t, int64_t) {
    Scratch s(Hq, D);
#ifdef PAGEDATTN_HAS_AMX
    // NOTE: the tile configuration is per thread; p.amx is only set for bf16 and u8 caches (with
    // bf16 queries) and shapes that fit.
    std::unique_ptr<AmxScratch> amx;
    std::unique_ptr<AmxFp8Scratch> amx_fp8;
#ifdef PAGEDATTN_HAS_AMX_U8
    std::unique_ptr<AmxU8Scratch> amx_u8;
#endif
    if (p.amx) {
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>) {
        configure_attention_tiles(p.group);
        amx = std::make_unique<AmxScratch>(p);
      }
      if constexpr (std::is_same_v<T, bf16> && (std::is_same_v<C, fp8_e4m3> ||
                                                std::is_same_v<C, fp8_e5m2>)) {
        configure_attention_tiles(p.group);
        amx_fp8 = std::make_unique<AmxFp8Scratch>(p);
      }
#ifdef PAGEDATTN_HAS_AMX_U8
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, uint8_t>) {
        configure_u8_attention_tiles(p.group);
        amx_u8 = std::make_unique<AmxU8Scratch>(p);
      }
#endif
    }
#endif
    // NOTE: each thread claims its next item one ahead, and the current item's last chunk
    // prefetches that item's first chunk; otherwise the first chunk of every row (all of a short
    // row) is read with cold misses, one token row at a time. Only a thread's first item is asked
    // for in one burst, with nothing to overlap it yet.
    // NOTE: with fewer than two items per thread, claiming one ahead let the first thread to
    // start take the items the others would run: at batch 1 a row's two partitions both ran on
    // the calling thread while the worker waited. 9/3x64 bf16, 256 tokens, 2 threads, AMX Xeon,
    // after a 64 MB read: 21.5 -> 17.3 us (vector), 25.9 -> 18.3 us (AMX).
    const bool claim_ahead = num_items >= 2 * num_threads;
    int64_t w = next.fetch_add(1), w_ahead = num_items;
    if (w < num_items) {
      const WorkItem& first = items[w];
      prefetch_chunk(p, key_cache, value_cache, block_tables + first.row * p.max_blocks_per_seq,
                     first.tok_begin, first.tok_end);
    }
    for (; w < num_items; w = claim_ahead ? w_ahead : next.fetch_add(1)) {
      if (claim_ahead) w_ahead = next.fetch_add(1);
      NextItem ahead;
      if (w_ahead < num_items) {
        const WorkItem& n = items[w_ahead];
        ahead = {block_tables + n.row * p.max_blocks_per_seq, n.tok_begin, n.tok_end};
      }
      const WorkItem& item = items[w];
      const int32_t* table = block_tables + item.row * p.max_blocks_per_seq;
      const T* q = query + item.row * Hq * D;
      bool ok;
#ifdef PAGEDATTN_HAS_AMX
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>) {
        ok = amx ? attend_partition_amx(p, key_cache, value_cache, table, item.tok_begin,
                                        item.tok_end, q, ahead, s, *amx)
                 : attend_partition<T, C>(p, key_cache, value_cache, table, item.tok_begin,
                                          item.tok_end, q, ahead, s);
      } else if constexpr (std::is_same_v<T, bf16> && (std::is_same_v<C, fp8_e4m3> ||
                                                       std::is_same_v<C, fp8_e5m2>)) {
        ok = amx_fp8 ? attend_partition_amx_fp8<C>(p, key_cache, value_cache, table,
                                                   item.tok_begin, item.tok_end, q, ahead, s,
                                                   *amx_fp8)
                     : attend_partition<T, C>(p, key_cache, value_cache, table, item.tok_begin,
                                              item.tok_end, q, ahead, s);
#ifdef PAGEDATTN_HAS_AMX_U8
      } else if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, uint8_t>) {
        ok = amx_u8 ? attend_partition_amx_u8(p, key_cache, value_cache, table, item.tok_begin,
                                              item.tok_end, q, ahead, s, *amx_u8)
                    : attend_partition<T, C>(p, key_cache, value_cache, table, item.tok_begin,
                                             item.tok_end, q, ahead, s);
#endif
      } else {
        ok = attend_partition<T, C>(p, key_cache, value_cache, table, item.tok_begin,
                                    item.tok_end, q, ahead, s);
      }
#else
      ok = attend_partition<T, C>(p, key_cache, value_cache, table, item.tok_begin, item.tok_end,
                                  q, ahead, s);
#endif
      if (!ok) {
        bad_block = true;
        continue;
      }
      if (num_partitions[item.row] == 1) {
        T* o = out + item.row * Hq * D;
        for (int64_t g = 0; g < Hq; ++g) {
          const float inv = p.v_scale / s.sum[g];
          for (int64_t i = 0; i < D; ++i) o[g * D + i] = static_cast<T>(s.acc[g * D + i] * inv);
        }
      } else {
        const int64_t base = first_partition[item.row] + item.partition;
        std::copy(s.acc.begin(), s.acc.end(), part_acc.begin() + base * Hq * D);
        std::copy(s.max.begin(), s.max.end(), part_max.begin() + base * Hq);
        std::copy(s.sum.begin(), s.sum.end(), part_sum.begin() + base * Hq);
      }
    }
#ifdef PAGEDATTN_HAS_AMX
    if (p.amx) _tile_release();
#endif
  });
  TORCH_CHECK(!bad_block, "a block table entry read by paged_decode is outside [0, ",
              p.num_blocks, "): the block tables do not match the KV cache");
  // Merge the partitions of each (row, query head) with log-sum-exp weights.
  std::vector<float> merged(D);
  for (int64_t r = 0; r < p.num_rows; ++r) {
    if (num_partitions[r] == 1) continue;
    for (int64_t g = 0; g < Hq; ++g) {
      auto at = [&](int64_t i) { return (first_partition[r] + i) * Hq + g; };
      float global_max = kNegInf;
      for (int64_t i = 0; i < num_partitions[r]; ++i) {
        global_max = std::max(global_max, part_max[at(i)]);
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t i = 0; i < num_partitions[r]; ++i) {
        const float w = std::exp(part_max[at(i)] - global_max);
        total += w * part_sum[at(i)];
        const float* a = part_acc.data() + at(i) * D;
        for (int64_t d = 0; d < D; ++d) merged[d] += w * a[d];
      }
      T* o = out + (r * Hq + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(merged[d] * p.v_scale / total);
    }
  }
}

}  // namespace

// out/query: [N, Hq, D]; key/value_cache: [num_blocks, B, Hkv, D]; block_tables: [N, max_blocks]
// int32; seq_lens: [N] int32 (keys visible to row n: its last seq_lens[n] positions' window).
// amx: run bf16 on AMX tiles where the CPU, the build and the shapes allow it (else ignored).
void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                  torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                  double scale, int64_t sliding_window, double soft_cap, int64_t partition_size,
                  bool amx, double k_scale, double v_scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query must be [N, Hq, D] and the caches "
              "[num_blocks, B, Hkv, D] (flash layout)");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn ||
                   key_cache.scalar_type() == at::kFloat8_e5m2;
  const bool u8 = key_cache.scalar_type() == at::kByte;
  TORCH_CHECK((fp8 || u8 || query.dtype() == key_cache.dtype()) &&
                  value_cache.dtype() == key_cache.dtype() && out.dtype() == query.dtype(),
              "query, caches and output must share one dtype (or the caches be fp8 or u8)");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  out.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode needs contiguous tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  Params p;
  p.num_rows = query.size(0);
  p.num_heads = query.size(1);
  p.head_size = query.size(2);
  p.num_blocks = key_cache.size(0);
  p.block_size = key_cache.size(1);
  p.num_kv_heads = key_cache.size(2);
  // NOTE: a u8 row is D bytes, then its float32 scale and min.
  p.head_stride = key_cache.size(3);
  const int64_t cache_head_size = u8 ? p.head_stride - kU8ScaleBytes : p.head_stride;
  TORCH_CHECK(cache_head_size == p.head_size, "cache head_size ", cache_head_size,
              " != query head_size ", p.head_size);
  TORCH_CHECK(p.head_size % 16 == 0, "head_size must be a multiple of 16, got ", p.head_size);
  TORCH_CHECK(p.num_heads % p.num_kv_heads == 0, "num_heads ", p.num_heads,
              " is not a multiple of num_kv_heads ", p.num_kv_heads);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == p.num_rows &&
                  seq_lens.numel() == p.num_rows && out.sizes() == query.sizes(),
              "block_tables [N, max_blocks], seq_lens [N] and out [N, Hq, D] must match query");
  TORCH_CHECK(partition_size > 0, "partition_size must be positive");
  p.group = p.num_heads / p.num_kv_heads;
  p.max_blocks_per_seq = block_tables.size(1);
  p.sliding_window = sliding_window;
  p.scale = static_cast<float>(scale);
  p.soft_cap = static_cast<float>(soft_cap);
  p.partition_size = partition_size;
#ifdef PAGEDATTN_HAS_AMX
  p.amx = amx && query.scalar_type() == at::kBFloat16 && amx_attention_fits(p);
#endif
  if (p.num_rows == 0) return;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  if (u8) {
#ifdef PAGEDATTN_HAS_AMX_U8
    p.amx = amx && query.scalar_type() == at::kBFloat16 && amx_u8_attention_fits(p);
#else
    p.amx = false;
#endif
    TORCH_CHECK(p.num_heads <= kU8MaxHeads, "a u8 cache supports at most ", kU8MaxHeads,
                " query heads, got ", p.num_heads);
    const uint8_t* k = key_cache.data_ptr<uint8_t>();
    const uint8_t* v = value_cache.data_ptr<uint8_t>();
    if (query.scalar_type() == at::kFloat) {
      paged_decode_impl(p, query.data_ptr<float>(), k, v, tables, lens, out.data_ptr<float>());
    } else {
      TORCH_CHECK(query.scalar_type() == at::kBFloat16,
                  "a u8 cache needs float32 or bfloat16 queries, got ", query.dtype());
      paged_decode_impl(p, reinterpret_cast<const bf16*>(query.data_ptr<at::BFloat16>()), k, v,
                        tables, lens, reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()));
    }
    return;
  }
  if (fp8) {
#ifdef PAGEDATTN_HAS_AMX
    p.amx = amx && query.scalar_type() == at::kBFloat16 && amx_attention_fits(p);
#endif
    TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
                "an fp8 cache needs float32 or bfloat16 queries, got ", query.dtype());
    const bool e4m3 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
    const float unit = e4m3 ? pagedattn_vec::kFp8Unit<fp8_e4m3> : 1.0f;
    p.scale = static_cast<float>(scale * k_scale * unit);
    p.v_scale = static_cast<float>(v_scale * unit);
    auto run = [&](auto* q, auto* o) {
      const void* k = key_cache.data_ptr();
      const void* v = value_cache.data_ptr();
      if (e4m3) {
        paged_decode_impl(p, q, static_cast<const fp8_e4m3*>(k), static_cast<const fp8_e4m3*>(v),
                          tables, lens, o);
      } else {
        paged_decode_impl(p, q, static_cast<const fp8_e5m2*>(k), static_cast<const fp8_e5m2*>(v),
                          tables, lens, o);
      }
    };
    if (query.scalar_type() == at::kFloat) {
      run(query.data_ptr<float>(), out.data_ptr<float>());
    } else {
      run(reinterpret_cast<const bf16*>(query.data_ptr<at::BFloat16>()),
          reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()));
    }
    return;
  }
  if (query.scalar_type() == at::kFloat) {
    paged_decode_impl<float, float>(p, query.data_ptr<float>(), key_cache.data_ptr<float>(),
                             value_cache.data_ptr<float>(), tables, lens, out.data_ptr<float>());
  } else if (query.scalar_type() == at::kBFloat16) {
    auto ptr = [](torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>()); };
    paged_decode_impl<bf16, bf16>(p, ptr(query), ptr(key_cache), ptr(value_cache), tables, lens,
                            ptr(out));
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16, got ", query.dtype());
  }
}

// Denormal floats make every CPU kernel 5-10x slower. The flush-to-zero state is per thread (MXCSR
// FTZ/DAZ on x86, FPCR.FZ on aarch64) and torch's set_flush_denormal only sets the calling
// thread, so set it in every worker of the pool. Returns the number of pool threads set.
inline void set_flush_denormal_this_thread(bool on) {
#if defined(PAGEDATTN_HAS_MXCSR)
  constexpr unsigned int kFtzDaz = 0x8040;
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | kFtzDaz) : (csr & ~kFtzDaz));
#elif defined(__aarch64__)
  constexpr uint64_t kFz = uint64_t{1} << 24;
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  fpcr = on ? (fpcr | kFz) : (fpcr & ~kFz);
  asm volatile("msr fpcr, %0" : : "r"(fpcr));
#else
  (void)on;
#endif
}

int64_t set_flush_denormal_all_threads(bool on) {
#if !defined(PAGEDATTN_HAS_MXCSR) && !defined(__aarch64__)
  return 0;
#else
  const int64_t num_threads = at::get_num_threads();
  std::atomic<int64_t> num_set{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    set_flush_denormal_this_thread(on);
    num_set += end - begin;
  });
  set_flush_denormal_this_thread(on);
  return num_set.load();
#endif
}

void bind_quant(pybind11::module_& m);  // quant_cpu.cpp: kernels on GGUF weight blocks

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &pagedattn_vec::isa_name,
        "The vector ISA this build was compiled for: avx512, avx2, neon, sve or scalar");
  m.def("vector_width", [] { return static_cast<int64_t>(pagedattn_vec::kWidth); },
        "fp32 lanes of the build's vectors (16 AVX-512, 8 AVX2, 4 NEON)");
  m.def("linear_packed", &linear_packed, "y = x @ W^T (+ bias) over 32-column weight panels");
  m.def("linear_packed_vectorized", &linear_packed_vectorized,
        "Whether linear_packed runs on vector instructions (AVX2, AVX-512, NEON)");
  m.def("linear_amx", &linear_amx, "y = x @ W^T (+ bias) in bf16 on AMX tiles (decode rows)",
        py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("bias"),
        py::arg("scale") = py::none());
  m.def("linear_amx_available", &linear_amx_available,
        "Whether this build and CPU run linear_amx (AMX-BF16, tile state granted by the OS)");
  m.def("cache_write", &cache_write,
        "Write K/V rows into a flash-layout paged cache by slot (an fp8 cache: x / scale)",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("gather_dequant_fp8", &gather_dequant_fp8,
        "Whole blocks of an fp8 cache through a block list, dequantized (x * scale) into out",
        py::arg("out"), py::arg("cache"), py::arg("block_ids"), py::arg("scale"));
  m.def("gather_dequant_u8", &gather_dequant_u8,
        "Whole blocks of a u8 cache through a block list, dequantized (q * scale + min) into out",
        py::arg("out"), py::arg("cache"), py::arg("block_ids"));
  m.def("rotary_inplace", &rotary_inplace, "Neox rotary embedding of [T, H, D] in place");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H], optionally adding a residual in place first");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU of a fused [T, 2I] gate/up projection");
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma RMSNorm (scale 1 + w, one rounding) of [..., H]");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "GeGLU (tanh gelu) of a fused [T, 2I] gate/up");
  m.def("argmax_last_dim", &argmax_last_dim, "First index of each row's maximum");
  m.def("paged_decode", &paged_decode, "Paged decode attention over a flash-layout KV cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("soft_cap"), py::arg("partition_size"), py::arg("amx"), py::arg("k_scale") = 1.0,
        py::arg("v_scale") = 1.0);
  m.def("set_flush_denormal_all_threads", &set_flush_denormal_all_threads,
        "Flush denormals to zero (FTZ/DAZ) in the calling thread and every intra-op thread");
  m.def("lora_apply", &lora_apply,
        "y += (x @ A_slot) @ B_slot per row of slot >= 0 (LoRALinear's stacked slots)",
        py::arg("y"), py::arg("x"), py::arg("slots"), py::arg("a"), py::arg("b"),
        py::arg("max_loras"), py::arg("max_rank"));
  register_decode_stack(m);
  register_shm_collectives(m);
  bind_quant(m);
}
