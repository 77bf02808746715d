// The building blocks of paged decode attention on CPU (paged_attention_cpu.cpp, which includes
// this and the kernels' headers into one translation unit): the constants, the row prefetcher,
// the vector dot products and value sums, the per-call parameters and per-thread scratch, the
// online softmax, the chunks' row offsets, and the chunk walk every kernel shares (walk_chunks).
#pragma once

#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include "vec_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

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

// The chunk walk of one (row, partition), written once for every kernel below: the online
// softmax's state zeroed, then chunk by chunk (kChunk tokens) the chunk's rows found, the
// prefetcher aimed at the rows that follow (the item's next chunk or, in its last chunk, the next
// item's first) and the chunk computed. Leaves unnormalised acc, max and sum in scratch; false on
// an out-of-range block id. A Kernel (one per cache dtype and path) has
//   key_cache, value_cache                   the caches it reads (of its cache element type);
//   first(block_table, begin, end, offsets)  before the walk, with the first chunk's row offsets
//                                            for a kernel that reads rows by offset (false: a bad
//                                            block id);
//   locate(block_table, c0, count, offsets)  the chunk's rows (offsets: its row offsets, valid
//                                            until the prefetcher's finish()); false: a bad id;
//   prefetch_steps(count)                    its step() calls per chunk (the prefetcher's pace);
//   chunk(count, pf)                         scores, softmax and value sums of every kv head.
template <typename Kernel>
bool walk_chunks(const Params& p, Kernel& kernel, const int32_t* block_table, int64_t tok_begin,
                 int64_t tok_end, const NextItem& next_item, Scratch& s) {
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.max.begin(), s.max.end(), kNegInf);
  std::fill(s.sum.begin(), s.sum.end(), 0.0f);
  int64_t next_offsets[kChunk];
  if (!kernel.first(block_table, tok_begin, tok_end, next_offsets)) return false;
  // NOTE: the next chunk's blocks are scattered, which the hardware prefetcher cannot guess.
  RowPrefetcher pf;
  for (int64_t c0 = tok_begin; c0 < tok_end; c0 += kChunk) {
    const int64_t count = std::min(kChunk, tok_end - c0);
    if (!kernel.locate(block_table, c0, count, next_offsets)) return false;
    pf.finish();  // before next_offsets is overwritten
    const int64_t next_count =
        following_row_offsets(p, block_table, c0, tok_end, next_item, next_offsets);
    if (next_count < 0) return false;
    pf.aim(kernel.key_cache, kernel.value_cache, next_offsets, next_count,
           p.num_kv_heads * p.head_stride, kernel.prefetch_steps(count));
    kernel.chunk(count, pf);
  }
  return true;
}

}  // namespace
