// The vector kernel of paged decode attention (part of paged_attention_cpu.cpp's translation
// unit): every cache dtype on at::vec, with the one-byte caches' paths of attention_quant_cpu.h.
#pragma once

#include "attention_common_cpu.h"
#include "attention_quant_cpu.h"

namespace {

// Attention of one (row, partition) over every kv head on the vector layer (walk_chunks' Kernel):
// a chunk's blocks are read once, whole, in order, through the rows' offsets.
//
// A u8 cache (C = uint8_t) runs the same loops on the bytes q_t, with each row's scale s_t and
// min m_t applied around them: score = s_t * (q . k_bytes) + m_t * sum(q), and the value sum
// sum_t p_t (s_t v_bytes + m_t) = sum_t (p_t s_t) v_bytes + sum_t p_t m_t.
template <typename T, typename C>
class VectorKernel {
 public:
  static constexpr bool kU8 = std::is_same_v<C, uint8_t>;
#ifdef PAGEDATTN_U8_INT
  static constexpr bool kU8Int = kU8 && std::is_same_v<T, bf16>;
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  static constexpr bool kFp8Pairs = !kU8 && sizeof(C) == 1 && std::is_same_v<T, bf16>;
#endif

  const C* key_cache;
  const C* value_cache;

  VectorKernel(const Params& p, const C* key_cache, const C* value_cache, const T* q, Scratch& s)
      : key_cache(key_cache), value_cache(value_cache), p(p), q(q), s(s) {
    const int64_t D = p.head_size;
#ifdef PAGEDATTN_U8_INT
    // NOTE: D <= 256 keeps a row's sum inside int32: 256 * 255 * 32767 < 2^31.
    u8_int = kU8Int && D % kI16 == 0 && D <= 256;
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
    pairs = kFp8Pairs && D % 32 == 0;
    if (pairs) lift_bf16(q, p.num_heads * D, kQueryLift, s.lifted.data());
#endif
  }

  bool first(const int32_t* block_table, int64_t tok_begin, int64_t tok_end, int64_t* offsets) {
    return chunk_row_offsets(p, block_table, tok_begin, tok_end, offsets) != 0;
  }

  // The chunk's row offsets are those walk_chunks found for it one chunk earlier.
  bool locate(const int32_t*, int64_t, int64_t count, const int64_t* offsets) {
    std::copy(offsets, offsets + count, row_offsets);
    return true;
  }

  // Per kv head, a score step per kWidth rows and query head, and a value step per
  // kValueStepTokens rows and pass of query heads.
  int64_t prefetch_steps(int64_t count) const {
    const int64_t G = p.group;
    return p.num_kv_heads * (G * ((count + kWidth - 1) / kWidth) +
                             (count + kValueStepTokens - 1) / kValueStepTokens *
                                 ((G + kMaxHeadsPerPass - 1) / kMaxHeadsPerPass));
  }

  void chunk(int64_t count, RowPrefetcher& pf) {
    const int64_t G = p.group, D = p.head_size;
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

 private:
  const Params& p;
  const T* q;
  Scratch& s;
  // u8: p.scale * sum(q[g]) per query head, and the chunk's per-row scales and mins.
  float qsum[kU8 ? kU8MaxHeads : 1];
  float kscale[kU8 ? kChunk : 1], kmin[kU8 ? kChunk : 1];
  float vscale[kU8 ? kChunk : 1], vmin[kU8 ? kChunk : 1];
  int64_t row_offsets[kChunk];
  const C* krows[kChunk];
  const C* vrows[kChunk];
#ifdef PAGEDATTN_U8_INT
  bool u8_int = false;
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  bool pairs = false;
#endif
};

// Attention of one (row, partition) on the vector layer.
template <typename T, typename C>
bool attend_partition(const Params& p, const C* key_cache, const C* value_cache,
                      const int32_t* block_table, int64_t tok_begin, int64_t tok_end, const T* q,
                      const NextItem& next_item, Scratch& s) {
  VectorKernel<T, C> kernel(p, key_cache, value_cache, q, s);
  return walk_chunks(p, kernel, block_table, tok_begin, tok_end, next_item, s);
}

}  // namespace
