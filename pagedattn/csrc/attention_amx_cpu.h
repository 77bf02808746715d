// The AMX tile kernels of paged decode attention for bf16 and fp8 caches (part of
// paged_attention_cpu.cpp's translation unit; compiled only where amx_cpu.h defines
// PAGEDATTN_HAS_AMX). The u8 cache's tile kernel is in attention_amx_u8_cpu.h.
// The paths are described at the top of paged_attention_cpu.cpp.
#pragma once

#include "amx_cpu.h"
#include "attention_common_cpu.h"
#include "attention_quant_cpu.h"

#ifdef PAGEDATTN_HAS_AMX
namespace {

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

// The bf16 tile kernel of one (row, partition) (walk_chunks' Kernel; the caller configured the
// tiles with configure_attention_tiles): per kv head and block of 16 tokens, the scores are one
// tile product of the block's key rows (read in place) with the GQA group's queries; the
// probabilities, rounded to bf16, multiply the value rows interleaved in pairs of tokens.
class AmxBf16Kernel {
 public:
  const bf16* key_cache;
  const bf16* value_cache;

  AmxBf16Kernel(const Params& p, const bf16* key_cache, const bf16* value_cache, const bf16* q,
                Scratch& s, AmxScratch& a)
      : key_cache(key_cache), value_cache(value_cache), p(p), s(s), a(a) {
    pack_amx_queries(p, q, a.queries.data());
    rows = lane_multiples(p.group);  // element offsets of a tile column's 16 rows
  }

  bool first(const int32_t*, int64_t, int64_t, int64_t*) { return true; }

  bool locate(const int32_t* block_table, int64_t c0, int64_t count, const int64_t*) {
    const int64_t block_elems = kAmxBlock * p.num_kv_heads * p.head_size;
    return chunk_blocks(p, block_table, c0, count, key_cache, value_cache, block_elems, kblocks,
                        vblocks);
  }

  // Per kv head, one per block and query head (scores), and one per 16 dims (values).
  int64_t prefetch_steps(int64_t count) const {
    const int64_t nblocks = (count + kAmxBlock - 1) / kAmxBlock;
    return p.num_kv_heads * (nblocks * p.group + p.head_size / 16);
  }

  void chunk(int64_t count, RowPrefetcher& pf) {
    const int64_t G = p.group, D = p.head_size, Hkv = p.num_kv_heads;
    const int64_t row_stride = Hkv * D;
    const int64_t qsteps = D / kAmxK, dim_blocks = D / 16;
    const int64_t nblocks = (count + kAmxBlock - 1) / kAmxBlock;
    const int64_t ksteps = (count + kAmxK - 1) / kAmxK;
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

 private:
  const Params& p;
  Scratch& s;
  AmxScratch& a;
  __m512i rows;
  const bf16* kblocks[kChunk / kAmxBlock];
  const bf16* vblocks[kChunk / kAmxBlock];
};

// attend_partition on the bf16 tiles.
bool attend_partition_amx(const Params& p, const bf16* key_cache, const bf16* value_cache,
                          const int32_t* block_table, int64_t tok_begin, int64_t tok_end,
                          const bf16* q, const NextItem& next_item, Scratch& s, AmxScratch& a) {
  AmxBf16Kernel kernel(p, key_cache, value_cache, q, s, a);
  return walk_chunks(p, kernel, block_table, tok_begin, tok_end, next_item, s);
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

// The fp8 tile kernel of one (row, partition) (walk_chunks' Kernel; tiles configured by
// configure_attention_tiles).
template <typename F>
class AmxFp8Kernel {
 public:
  const F* key_cache;
  const F* value_cache;

  AmxFp8Kernel(const Params& p, const F* key_cache, const F* value_cache, const bf16* q,
               Scratch& s, AmxFp8Scratch& a)
      : key_cache(key_cache), value_cache(value_cache), p(p), s(s), a(a) {
    lift_bf16(q, p.num_heads * p.head_size, kQueryLift, s.lifted.data());
    pack_amx_queries(p, s.lifted.data(), a.queries.data());
    rows = lane_multiples(p.group);  // element offsets of a tile column's 16 rows
  }

  bool first(const int32_t*, int64_t, int64_t, int64_t*) { return true; }

  bool locate(const int32_t* block_table, int64_t c0, int64_t count, const int64_t*) {
    const int64_t block_elems = kAmxBlock * p.num_kv_heads * p.head_size;
    return chunk_blocks(p, block_table, c0, count, key_cache, value_cache, block_elems, kblocks,
                        vblocks);
  }

  // Per kv head, one per 16 key rows widened, one per 2 value pairs of 32 tokens, one per pair
  // of blocks (score products), one per block and query head (scores), one per query head
  // (probabilities) and one per 16 dims (value products).
  int64_t prefetch_steps(int64_t count) const {
    const int64_t G = p.group, nblocks = (count + kAmxBlock - 1) / kAmxBlock;
    return p.num_kv_heads * (nblocks + 8 * ((count + 31) / 32) + (nblocks + 1) / 2 +
                             nblocks * G + G + p.head_size / 16);
  }

  void chunk(int64_t count, RowPrefetcher& pf) {
    const int64_t G = p.group, D = p.head_size, Hkv = p.num_kv_heads;
    const int64_t row_stride = Hkv * D;
    const int64_t qsteps = D / kAmxK, dim_blocks = D / 16;
    const float score_scale = p.scale * kScoreUnlift;
    const int64_t nblocks = (count + kAmxBlock - 1) / kAmxBlock;
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

 private:
  const Params& p;
  Scratch& s;
  AmxFp8Scratch& a;
  __m512i rows;
  const F* kblocks[kChunk / kAmxBlock];
  const F* vblocks[kChunk / kAmxBlock];
};

// attend_partition for an fp8 cache on the tiles.
template <typename F>
bool attend_partition_amx_fp8(const Params& p, const F* key_cache, const F* value_cache,
                              const int32_t* block_table, int64_t tok_begin, int64_t tok_end,
                              const bf16* q, const NextItem& next_item, Scratch& s,
                              AmxFp8Scratch& a) {
  AmxFp8Kernel<F> kernel(p, key_cache, value_cache, q, s, a);
  return walk_chunks(p, kernel, block_table, tok_begin, tok_end, next_item, s);
}

}  // namespace
#endif  // PAGEDATTN_HAS_AMX
