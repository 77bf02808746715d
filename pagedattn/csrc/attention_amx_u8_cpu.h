// The u8 cache's AMX int8 tile kernel of paged decode attention (part of paged_attention_cpu.cpp's
// translation unit; compiled where the build targets AMX-INT8 and the u8 integer path exists).
#pragma once

#include "attention_amx_cpu.h"

#ifdef PAGEDATTN_HAS_AMX
namespace {

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

// The u8 tile kernel of one (row, partition) (walk_chunks' Kernel; tiles configured by
// configure_u8_attention_tiles).
class AmxU8Kernel {
 public:
  const uint8_t* key_cache;
  const uint8_t* value_cache;

  AmxU8Kernel(const Params& p, const uint8_t* key_cache, const uint8_t* value_cache,
              const bf16* q, Scratch& s, AmxU8Scratch& a)
      : key_cache(key_cache), value_cache(value_cache), p(p), s(s), a(a) {
    const int64_t D = p.head_size;
    for (int64_t g = 0; g < p.num_heads; ++g) {
      qsum[g] = u8_int_query(q + g * D, D, p.scale, s.qint.data() + g * D, s.qfactor[g]);
    }
    split_u8_queries(p, s.qint.data(), a.queries.data());
    rows = lane_multiples(2 * p.group);  // int32 offsets of a score tile column's rows
    trailers = lane_multiples(p.num_kv_heads * p.head_stride);  // byte offsets of a block's rows
  }

  bool first(const int32_t*, int64_t, int64_t, int64_t*) { return true; }

  bool locate(const int32_t* block_table, int64_t c0, int64_t count, const int64_t*) {
    const int64_t block_bytes = kAmxBlock * p.num_kv_heads * p.head_stride;
    return chunk_blocks(p, block_table, c0, count, key_cache, value_cache, block_bytes, kblocks,
                        vblocks);
  }

  // Per kv head, one per pair of blocks (score products), one per block and query head
  // (scores), one per query head (weights), one per two token quads (values) and one per value
  // product.
  // NOTE: spread over every phase, so that the lines are asked for at an even pace: with none
  // during the softmax, the kernel sat on its prefetch instructions (28% of its samples, out of
  // cache), the next burst waiting for fill buffers the last one still held.
  int64_t prefetch_steps(int64_t count) const {
    const int64_t G = p.group, nblocks = (count + kAmxBlock - 1) / kAmxBlock;
    const int64_t ksteps = p.head_size / kAmxU8K;
    return p.num_kv_heads * ((nblocks + 1) / 2 + nblocks * G + G + kChunk / 8 + 4 * ksteps);
  }

  void chunk(int64_t count, RowPrefetcher& pf) {
    const int64_t G = p.group, D = p.head_size, Hkv = p.num_kv_heads, hs = p.head_stride;
    const int64_t row_stride = Hkv * hs;
    const int64_t ksteps = D / kAmxU8K;
    const int64_t nblocks = (count + kAmxBlock - 1) / kAmxBlock;
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

 private:
  const Params& p;
  Scratch& s;
  AmxU8Scratch& a;
  float qsum[kU8MaxHeads];
  __m512i rows, trailers;
  float kscale[kChunk], kmin[kChunk], vscale[kChunk], vmin[kChunk];
  const uint8_t* kblocks[kChunk / kAmxBlock];
  const uint8_t* vblocks[kChunk / kAmxBlock];
  const uint8_t* vrows[kChunk];
};

// attend_partition for a u8 cache on the tiles.
bool attend_partition_amx_u8(const Params& p, const uint8_t* key_cache, const uint8_t* value_cache,
                             const int32_t* block_table, int64_t tok_begin, int64_t tok_end,
                             const bf16* q, const NextItem& next_item, Scratch& s,
                             AmxU8Scratch& a) {
  AmxU8Kernel kernel(p, key_cache, value_cache, q, s, a);
  return walk_chunks(p, kernel, block_table, tok_begin, tok_end, next_item, s);
}
#endif  // __AMX_INT8__ && PAGEDATTN_U8_INT

}  // namespace
#endif  // PAGEDATTN_HAS_AMX
