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
//
// Files: attention_common_cpu.h (the prefetcher, the vector dot products and value sums, the
// online softmax and walk_chunks, the chunk walk every kernel shares), attention_quant_cpu.h (the
// u8 integer and fp8 pairs arithmetic), attention_vector_cpu.h (the vector kernel),
// attention_amx_cpu.h and attention_amx_u8_cpu.h (the tile kernels); this file plans the work
// items, runs them on the threads and merges the partitions. attention_prefill_cpu.h is the
// prefill kernel (paged_prefill: a span of a sequence's queries, causal, flash-style). The extension's Python bindings are
// in bindings_cpu.cpp.

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

#include "attention_common_cpu.h"
#include "attention_quant_cpu.h"
#include "attention_vector_cpu.h"
#include "attention_amx_cpu.h"
#include "attention_amx_u8_cpu.h"
#include "attention_prefill_cpu.h"

namespace {

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

// The work items of a call and where their results go: a row of one partition is normalised
// straight into out; the partitions of a longer row keep unnormalised partial results (acc, max,
// sum) that merge_partitions combines by log-sum-exp.
struct WorkPlan {
  std::vector<WorkItem> items;  // longest first
  std::vector<int64_t> num_partitions, first_partition;  // per row
  std::vector<float> part_acc, part_max, part_sum;  // [partial, Hq, D], [partial, Hq]
};

// Each row's visible token range [begin, seq_len) split into partitions of part_size tokens.
WorkPlan plan_work(const Params& p, const int32_t* seq_lens, int64_t part_size) {
  const int64_t Hq = p.num_heads, D = p.head_size;
  WorkPlan plan;
  plan.num_partitions.resize(p.num_rows);
  plan.first_partition.resize(p.num_rows);
  int64_t num_partials = 0;
  for (int64_t r = 0; r < p.num_rows; ++r) {
    const int64_t seq_len = seq_lens[r];
    TORCH_CHECK(seq_len > 0 && seq_len <= p.max_blocks_per_seq * p.block_size, "row ", r,
                " has seq_len ", seq_len, " outside (0, ", p.max_blocks_per_seq * p.block_size,
                "]: the block table is too short or the length is wrong");
    const int64_t begin =
        p.sliding_window > 0 ? std::max<int64_t>(0, seq_len - p.sliding_window) : 0;
    const int64_t n = (seq_len - begin + part_size - 1) / part_size;
    plan.num_partitions[r] = n;
    plan.first_partition[r] = num_partials;
    if (n > 1) num_partials += n;
    for (int64_t i = 0; i < n; ++i) {
      plan.items.push_back(
          {r, i, begin + i * part_size, std::min(seq_len, begin + (i + 1) * part_size)});
    }
  }
  // NOTE: longest items first, so that the dynamic queue ends with short ones.
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const WorkItem& a, const WorkItem& b) {
    return a.tok_end - a.tok_begin > b.tok_end - b.tok_begin;
  });
  plan.part_acc.resize(num_partials * Hq * D);
  plan.part_max.resize(num_partials * Hq);
  plan.part_sum.resize(num_partials * Hq);
  return plan;
}

// An item's result from the thread's scratch: normalised into out, or kept as a partial.
template <typename T>
void store_result(const Params& p, const WorkItem& item, const Scratch& s, WorkPlan& plan,
                  T* out) {
  const int64_t Hq = p.num_heads, D = p.head_size;
  if (plan.num_partitions[item.row] == 1) {
    T* o = out + item.row * Hq * D;
    for (int64_t g = 0; g < Hq; ++g) {
      const float inv = p.v_scale / s.sum[g];
      for (int64_t i = 0; i < D; ++i) o[g * D + i] = static_cast<T>(s.acc[g * D + i] * inv);
    }
  } else {
    const int64_t base = plan.first_partition[item.row] + item.partition;
    std::copy(s.acc.begin(), s.acc.end(), plan.part_acc.begin() + base * Hq * D);
    std::copy(s.max.begin(), s.max.end(), plan.part_max.begin() + base * Hq);
    std::copy(s.sum.begin(), s.sum.end(), plan.part_sum.begin() + base * Hq);
  }
}

// Merge the partitions of each (row, query head) with log-sum-exp weights.
template <typename T>
void merge_partitions(const Params& p, const WorkPlan& plan, T* out) {
  const int64_t Hq = p.num_heads, D = p.head_size;
  std::vector<float> merged(D);
  for (int64_t r = 0; r < p.num_rows; ++r) {
    if (plan.num_partitions[r] == 1) continue;
    for (int64_t g = 0; g < Hq; ++g) {
      auto at = [&](int64_t i) { return (plan.first_partition[r] + i) * Hq + g; };
      float global_max = kNegInf;
      for (int64_t i = 0; i < plan.num_partitions[r]; ++i) {
        global_max = std::max(global_max, plan.part_max[at(i)]);
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t i = 0; i < plan.num_partitions[r]; ++i) {
        const float w = std::exp(plan.part_max[at(i)] - global_max);
        total += w * plan.part_sum[at(i)];
        const float* a = plan.part_acc.data() + at(i) * D;
        for (int64_t d = 0; d < D; ++d) merged[d] += w * a[d];
      }
      T* o = out + (r * Hq + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(merged[d] * p.v_scale / total);
    }
  }
}

// One thread's kernel for the items of a call: a tile kernel where p.amx chose the tiles for
// this query and cache dtype (the thread's tiles configured and their scratch made here, the
// tiles released at the end), else the vector kernel.
template <typename T, typename C>
class ThreadAttention {
 public:
  explicit ThreadAttention(const Params& p) : p_(p) {
#ifdef PAGEDATTN_HAS_AMX
    // NOTE: the tile configuration is per thread; p.amx is only set for bf16, fp8 and u8 caches
    // (with bf16 queries) and shapes that fit.
    if (p.amx) {
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>) {
        configure_attention_tiles(p.group);
        amx_ = std::make_unique<AmxScratch>(p);
      }
      if constexpr (std::is_same_v<T, bf16> && (std::is_same_v<C, fp8_e4m3> ||
                                                std::is_same_v<C, fp8_e5m2>)) {
        configure_attention_tiles(p.group);
        amx_fp8_ = std::make_unique<AmxFp8Scratch>(p);
      }
#ifdef PAGEDATTN_HAS_AMX_U8
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, uint8_t>) {
        configure_u8_attention_tiles(p.group);
        amx_u8_ = std::make_unique<AmxU8Scratch>(p);
      }
#endif
    }
#endif
  }

  ~ThreadAttention() {
#ifdef PAGEDATTN_HAS_AMX
    if (p_.amx) _tile_release();
#endif
  }

  // Attention of one item (unnormalised, in s); false on an out-of-range block id.
  bool attend(const C* key_cache, const C* value_cache, const int32_t* table,
              const WorkItem& item, const T* q, const NextItem& ahead, Scratch& s) {
    const Params& p = p_;
#ifdef PAGEDATTN_HAS_AMX
    if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>) {
      if (amx_) {
        return attend_partition_amx(p, key_cache, value_cache, table, item.tok_begin,
                                    item.tok_end, q, ahead, s, *amx_);
      }
    } else if constexpr (std::is_same_v<T, bf16> && (std::is_same_v<C, fp8_e4m3> ||
                                                     std::is_same_v<C, fp8_e5m2>)) {
      if (amx_fp8_) {
        return attend_partition_amx_fp8<C>(p, key_cache, value_cache, table, item.tok_begin,
                                           item.tok_end, q, ahead, s, *amx_fp8_);
      }
#ifdef PAGEDATTN_HAS_AMX_U8
    } else if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, uint8_t>) {
      if (amx_u8_) {
        return attend_partition_amx_u8(p, key_cache, value_cache, table, item.tok_begin,
                                       item.tok_end, q, ahead, s, *amx_u8_);
      }
#endif
    }
#endif
    return attend_partition<T, C>(p, key_cache, value_cache, table, item.tok_begin, item.tok_end,
                                  q, ahead, s);
  }

 private:
  const Params& p_;
#ifdef PAGEDATTN_HAS_AMX
  std::unique_ptr<AmxScratch> amx_;
  std::unique_ptr<AmxFp8Scratch> amx_fp8_;
#ifdef PAGEDATTN_HAS_AMX_U8
  std::unique_ptr<AmxU8Scratch> amx_u8_;
#endif
#endif
};

template <typename T, typename C>
void paged_decode_impl(const Params& p, const T* query, const C* key_cache, const C* value_cache,
                       const int32_t* block_tables, const int32_t* seq_lens, T* out) {
  const int64_t Hq = p.num_heads, D = p.head_size;
  const int64_t num_threads = at::get_num_threads();
  WorkPlan plan = plan_work(p, seq_lens, choose_partition_size(p, seq_lens, num_threads));
  const std::vector<WorkItem>& items = plan.items;
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad_block{false};
  at::parallel_for(0, std::min(num_threads, num_items), 1, [&](int64_t, int64_t) {
    Scratch s(Hq, D);
    ThreadAttention<T, C> attention(p);
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
      if (!attention.attend(key_cache, value_cache, table, item, query + item.row * Hq * D, ahead,
                            s)) {
        bad_block = true;
        continue;
      }
      store_result(p, item, s, plan, out);
    }
  });
  TORCH_CHECK(!bad_block, "a block table entry read by paged_decode is outside [0, ",
              p.num_blocks, "): the block tables do not match the KV cache");
  merge_partitions(p, plan, out);
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

// out/query: [q_len, Hq, D], the last q_len positions of a sequence of seq_len tokens;
// key/value_cache: [num_blocks, B, Hkv, D] in the query's dtype (float32 or bfloat16), fp8
// (read times k_scale / v_scale) or u8 ([.., D + 8], each row with its scale and min);
// block_table: [>= ceil(seq_len / B)] int32. Causal, over the window (0: none), soft cap (0: none).
void paged_prefill(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                   torch::Tensor value_cache, torch::Tensor block_table, int64_t seq_len,
                   double scale, int64_t sliding_window, double soft_cap, double k_scale,
                   double v_scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "query must be [q_len, Hq, D] and the caches [num_blocks, B, Hkv, D] (flash layout)");
  const bool e4m3 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool fp8 = e4m3 || key_cache.scalar_type() == at::kFloat8_e5m2;
  const bool u8 = key_cache.scalar_type() == at::kByte;
  TORCH_CHECK((fp8 || u8 || query.dtype() == key_cache.dtype()) &&
                  value_cache.dtype() == key_cache.dtype() && out.dtype() == query.dtype() &&
                  out.sizes() == query.sizes(),
              "query, caches and output must share one dtype (or the caches be fp8 or u8) and "
              "out the query's shape");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  out.is_contiguous() && block_table.is_contiguous() && block_table.dim() == 1 &&
                  block_table.scalar_type() == at::kInt,
              "paged_prefill needs contiguous tensors and an int32 block table");
  prefill::Params p;
  p.q_len = query.size(0);
  p.seq_len = seq_len;
  p.num_heads = query.size(1);
  p.head_size = query.size(2);
  p.num_blocks = key_cache.size(0);
  p.block_size = key_cache.size(1);
  p.num_kv_heads = key_cache.size(2);
  p.head_stride = key_cache.size(3);
  p.sliding_window = sliding_window;
  p.scale = static_cast<float>(scale);
  p.soft_cap = static_cast<float>(soft_cap);
  if (fp8) {
    const float unit = e4m3 ? pagedattn_vec::kFp8Unit<fp8_e4m3> : 1.0f;
    p.scale = static_cast<float>(scale * k_scale * unit);
    p.v_scale = static_cast<float>(v_scale * unit);
  }
  TORCH_CHECK(p.head_stride - (u8 ? kU8ScaleBytes : 0) == p.head_size && p.head_size % 16 == 0,
              "head_size must match the cache's and be a multiple of 16, got ", p.head_size);
  TORCH_CHECK(p.num_heads % p.num_kv_heads == 0, "num_heads ", p.num_heads,
              " is not a multiple of num_kv_heads ", p.num_kv_heads);
  TORCH_CHECK(p.q_len <= seq_len, "q_len ", p.q_len, " exceeds seq_len ", seq_len);
  const int64_t blocks = (seq_len + p.block_size - 1) / p.block_size;
  TORCH_CHECK(block_table.numel() >= blocks, "the block table holds ", block_table.numel(),
              " blocks, seq_len ", seq_len, " needs ", blocks);
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < blocks; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < p.num_blocks, "block id ", table[b],
                " is outside the KV cache (", p.num_blocks, " blocks)");
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_prefill supports float32 and bfloat16 queries, got ", query.dtype());
  if (p.q_len == 0) return;
  auto run = [&](auto* q, auto* o) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(q)>>;
    const void* k = key_cache.data_ptr();
    const void* v = value_cache.data_ptr();
    if (u8) {
      prefill::run(p, q, static_cast<const uint8_t*>(k), static_cast<const uint8_t*>(v), table, o);
    } else if (e4m3) {
      prefill::run(p, q, static_cast<const fp8_e4m3*>(k), static_cast<const fp8_e4m3*>(v), table, o);
    } else if (fp8) {
      prefill::run(p, q, static_cast<const fp8_e5m2*>(k), static_cast<const fp8_e5m2*>(v), table, o);
    } else {
      prefill::run(p, q, static_cast<const T*>(k), static_cast<const T*>(v), table, o);
    }
  };
  if (query.scalar_type() == at::kFloat) {
    run(query.data_ptr<float>(), out.data_ptr<float>());
  } else {
    run(reinterpret_cast<const bf16*>(query.data_ptr<at::BFloat16>()),
        reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()));
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
