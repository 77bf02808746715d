// bf16 GEMM on AMX tiles, decode and prefill row counts: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
// W is bf16, or int8 with a per-column scale (--quantization int8): each int8 tile is widened
// to bf16 in L1 just before its tile product (exact), and the scale applied to the fp32 sums.
//
// At 32 rows a decode step's matmuls read each weight once and do 32 multiply-adds with it, so
// they are bound by streaming the weights, not by the tiles' arithmetic. The general-purpose
// library GEMMs (oneDNN, F.linear) ran at 300-500 GFLOP/s there on the AMX machine, about half
// of what streaming the weights allows. This kernel keeps the weights in the tiles' own layout
// (packed once at load) and streams each of them exactly once per call:
//
// - W is packed as [N / 16][K / 32] tiles of 16 k-pairs x 16 columns x 2 (the VNNI layout
//   TDPBF16PS reads: row r of a tile holds W[n0 + c][k0 + 2r] and W[n0 + c][k0 + 2r + 1] for
//   c = 0..15), so the tiles of one 16-column block are one contiguous run.
// - A work item is a pair of 16-column blocks over one row block (all rows at decode sizes).
//   For every chunk of 32 rows it keeps 2 x 2 fp32 accumulator tiles (rows 0-15 and 16-31,
//   both blocks), and for each 32-wide k step loads two activation tiles and two weight tiles:
//   four TDPBF16PS per 2 KB of weights.
// - Threads claim the items a few at a time (claims_cpu.h), row block by row block: a row
//   block's activations (about 512 KB; a few tens of KB at decode) stay in L2 while every block
//   pair reads them.
// - At 1 or 2 rows (batch-1 decode, a draft model's steps) the tiles' arithmetic is idle and
//   only the streaming counts, so the same packing is read by AVX-512 instead: each tile row is
//   one 64-byte vector of 16 columns x 2 k values, which VDPBF16PS multiplies with the row's k
//   pair broadcast. A work item there is up to 8 consecutive 16-column blocks read side by side
//   (8 streams), each prefetched 512 bytes ahead.
// - The sum over k runs in fp32 on the tiles; bias is added in fp32 and the result rounded to
//   bf16 once (round to nearest even), as oneDNN does. The order of the k sum differs from other
//   kernels', so results agree with theirs to bf16 rounding, not bit for bit.
//
// Compiled only where the compiler targets AMX (-march=native on an AMX CPU); elsewhere
// linear_amx_available() is false and pagedattn.model.packed_linear never offers the kernel.
// Linux hands a process the tiles' state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <cstdint>

#include "amx_cpu.h"
#include "claims_cpu.h"
#include "ops_cpu.h"

#ifdef PAGEDATTN_HAS_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileRows = 16;  // rows of an activation/accumulator tile
constexpr int64_t kTileCols = 16;  // output columns per block (16 fp32 = 64 bytes)
constexpr int64_t kTileK = 32;     // bf16 k values per tile row (64 bytes)
constexpr int64_t kRowChunk = 2 * kTileRows;
// Weight tiles fetched ahead of use in each of a pair's two streams. The first loads of a block
// pair otherwise wait on memory: 2 ahead made the SmolLM2 matmul pass 15-25% faster (1 and 32
// rows) on the AMX Xeon; 4-16 ahead were no better.
constexpr int64_t kPrefetchTiles = 2;
// Block pairs a thread claims at a time, at most.
// NOTE: split into equal halves up front, the two threads of the AMX Xeon (a VM) often streamed
// at different speeds: at 32 rows, SmolLM2 bf16, one thread waited for the other 29-35% of a
// decode step, a third of that time for the other to finish here. Claimed 8 at a time (the LM
// head's 1,536 pairs), the wait fell to 21%.
constexpr int64_t kPairsPerClaim = 8;
// Activation bytes of one row block: a work item is one block pair over one row block, and the
// items run row block by row block, so a block's rows stay in L2 while every pair reads them.
// NOTE: with all rows in one block, prefill-sized calls read the activations from L3 once per
// block pair (2,048 x 576 bf16 is 2.4 MB): one thread ran 0.8 TFLOP/s at 2,048 rows against 1.2
// at 256 (SmolLM2's MLP up-projection, AMX Xeon).
constexpr int64_t kRowBlockBytes = 512 << 10;

// At most this many rows are multiplied with AVX-512 dot products instead of the tiles.
// NOTE: SmolLM2's 30 layers + LM head (256 MiB bf16) at 1 row, 2 threads, AMX Xeon: the tiles
// streamed 26-27 GB/s, dot products over 8 blocks at a time 30 GB/s (a read-only loop tops out at
// 30 GB/s there). At 4 rows the dot products were slower than the tiles (22 against 26 GB/s).
constexpr int64_t kDotRows = 2;
// 16-column blocks one dot-product work item reads side by side, and how far ahead it prefetches
// in each (bytes). 2 and 4 streams per thread streamed 25-28 GB/s, 8 streams 30.
constexpr int kDotBlocks = 8;
constexpr int kDotPrefetchBytes = 512;

// Rows per row block for activations of K bf16 values: a multiple of kRowChunk, at least one.
inline int64_t row_block(int64_t K) {
  const int64_t rows = kRowBlockBytes / (K * static_cast<int64_t>(sizeof(c10::BFloat16)));
  return std::max(kRowChunk, rows / kRowChunk * kRowChunk);
}

#ifdef PAGEDATTN_HAS_AMX
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Ask Linux once for the AMX tile state; false if the kernel refuses (old kernel, no AMX).
bool request_amx() {
  static const bool granted =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// The tile configuration for a chunk with rows0 and rows1 rows in its two row tiles (rows1 may
// be 0). Tiles: 0-3 accumulators (row tile i, block j -> 2i + j), 4-5 activations, 6-7 weights.
void load_tile_config(int64_t rows0, int64_t rows1) {
  pagedattn_amx::TileConfig cfg;
  const int64_t rows[2] = {rows0, rows1};
  for (int i = 0; i < 2; ++i) {
    if (rows[i] == 0) continue;
    for (int j = 0; j < 2; ++j) cfg.set(2 * i + j, rows[i], kTileCols * sizeof(float));
    cfg.set(4 + i, rows[i], kTileK * sizeof(c10::BFloat16));
  }
  for (int t = 6; t < 8; ++t) cfg.set(t, kTileK / 2, kTileCols * 2 * sizeof(c10::BFloat16));
  cfg.load();
}

// The row split a thread's tiles are configured for, kept across the block pairs of one call.
// NOTE: configured once per block pair, ldtilecfg took 1.9% of a SmolLM2 bf16 decode step at 32
// rows (the LM head alone is 1,536 pairs).
struct TileRows {
  int64_t rows0 = -1, rows1 = -1;
  void configure(int64_t r0, int64_t r1) {
    if (r0 == rows0 && r1 == rows1) return;
    load_tile_config(r0, r1);
    rows0 = r0;
    rows1 = r1;
  }
};

// fp32 accumulators [rows, 16] (* scale, + bias) -> bf16 output row segments.
inline void store_rows(const float* acc, int64_t rows, const float* scale, const float* bias,
                       c10::BFloat16* y, int64_t ldy) {
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 s = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(acc + r * kTileCols), s, b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

// One int8 weight tile (512 values) -> the same tile in bf16 (exact: |q| <= 127 < 2^8).
inline const c10::BFloat16* widen_tile(const int8_t* q, c10::BFloat16* out) {
  for (int i = 0; i < kTileK * kTileCols; i += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i + 16))));
    _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
  // NOTE: GCC does not see that tileloadd reads this buffer (as with ldtilecfg): without the
  // clobber it dropped the stores above as dead.
  asm volatile("" : : "r"(out) : "memory");
  return out;
}

// The tile to multiply with: a bf16 weight's own, or an int8 weight's widened into scratch.
inline const c10::BFloat16* weight_tile(const c10::BFloat16* w, c10::BFloat16*) { return w; }
inline const c10::BFloat16* weight_tile(const int8_t* w, c10::BFloat16* scratch) {
  return widen_tile(w, scratch);
}

// One or two 16-column blocks (nb0, nb0 + 1 when two) over rows [m_begin, M). W is bf16, or int8
// with a per-column scale applied to the fp32 sums (scale null for bf16).
template <bool kTwoBlocks, typename W>
void block_pair(const c10::BFloat16* x, const W* packed, const float* scale, const float* bias,
                c10::BFloat16* y, int64_t m_begin, int64_t M, int64_t N, int64_t K, int64_t nb0,
                TileRows& tiles) {
  const int64_t kb_count = K / kTileK;
  const int64_t tile_elems = kTileK * kTileCols;  // weight values per tile
  const W* w0 = packed + nb0 * kb_count * tile_elems;
  const W* w1 = w0 + kb_count * tile_elems;
  alignas(64) float acc[kTileRows * kTileCols];
  alignas(64) c10::BFloat16 widened[2][kTileK * kTileCols];  // int8 weights only
  const int64_t ldx = K * sizeof(c10::BFloat16);
  for (int64_t m0 = m_begin; m0 < M; m0 += kRowChunk) {
    const int64_t rows0 = std::min(kTileRows, M - m0);
    const int64_t rows1 = std::min(kTileRows, std::max<int64_t>(0, M - m0 - kTileRows));
    tiles.configure(rows0, rows1);
    const c10::BFloat16* x0 = x + m0 * K;
    const c10::BFloat16* x1 = x0 + kTileRows * K;
    _tile_zero(0);
    if (kTwoBlocks) _tile_zero(1);
    if (rows1) {
      _tile_zero(2);
      if (kTwoBlocks) _tile_zero(3);
    }
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      if (m0 == m_begin) {
        // NOTE: past the pair's last tile this runs into the next pair's, which is next in
        // memory (and harmless past the end of the weight: prefetches never fault).
        const char* p0 = reinterpret_cast<const char*>(w0 + (kb + kPrefetchTiles) * tile_elems);
        const char* p1 = reinterpret_cast<const char*>(w1 + (kb + kPrefetchTiles) * tile_elems);
        for (int l = 0; l < static_cast<int>(tile_elems * sizeof(W)); l += 64) {
          _mm_prefetch(p0 + l, _MM_HINT_T0);
          if (kTwoBlocks) _mm_prefetch(p1 + l, _MM_HINT_T0);
        }
      }
      _tile_loadd(4, x0 + kb * kTileK, ldx);
      _tile_loadd(6, weight_tile(w0 + kb * tile_elems, widened[0]), 64);
      _tile_dpbf16ps(0, 4, 6);
      if (kTwoBlocks) {
        _tile_loadd(7, weight_tile(w1 + kb * tile_elems, widened[1]), 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (rows1) {
        _tile_loadd(5, x1 + kb * kTileK, ldx);
        _tile_dpbf16ps(2, 5, 6);
        if (kTwoBlocks) _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t n0 = nb0 * kTileCols;
    const float* b0 = bias ? bias + n0 : nullptr;
    const float* b1 = bias ? bias + n0 + kTileCols : nullptr;
    const float* s0 = scale ? scale + n0 : nullptr;
    const float* s1 = scale ? scale + n0 + kTileCols : nullptr;
    c10::BFloat16* y0 = y + m0 * N + n0;
    c10::BFloat16* y1 = y0 + kTileRows * N;
    _tile_stored(0, acc, kTileCols * sizeof(float));
    store_rows(acc, rows0, s0, b0, y0, N);
    if (kTwoBlocks) {
      _tile_stored(1, acc, kTileCols * sizeof(float));
      store_rows(acc, rows0, s1, b1, y0 + kTileCols, N);
    }
    if (rows1) {
      _tile_stored(2, acc, kTileCols * sizeof(float));
      store_rows(acc, rows1, s0, b0, y1, N);
      if (kTwoBlocks) {
        _tile_stored(3, acc, kTileCols * sizeof(float));
        store_rows(acc, rows1, s1, b1, y1 + kTileCols, N);
      }
    }
  }
}

// kBlocks consecutive 16-column blocks from nb0, over kRows (1 or 2) rows, with AVX-512 dot
// products on the tiles' packing: for each tile row r (16 columns x the k pair 2r, 2r + 1), the
// rows' k pairs broadcast to all 16 lanes. bf16 weights only.
template <int kBlocks, int kRows>
void dot_blocks(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias,
                c10::BFloat16* y, int64_t N, int64_t K, int64_t nb0) {
  const int64_t kb_count = K / kTileK;
  const int64_t tile_elems = kTileK * kTileCols;
  const char* w[kBlocks];
  __m512 acc[kRows][kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    w[b] = reinterpret_cast<const char*>(packed + (nb0 + b) * kb_count * tile_elems);
    for (int i = 0; i < kRows; ++i) acc[i][b] = _mm512_setzero_ps();
  }
  const auto* pairs = reinterpret_cast<const int32_t*>(x);  // a row's k pairs, 2 bf16 each
  const int64_t pairs_per_row = K / 2;
  constexpr int64_t kTileRowBytes = kTileCols * 2 * sizeof(c10::BFloat16);  // 64
  for (int64_t p = 0; p < pairs_per_row; ++p) {
    __m512bh xv[kRows];
    for (int i = 0; i < kRows; ++i) {
      xv[i] = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairs[i * pairs_per_row + p]));
    }
    const int64_t offset = p * kTileRowBytes;  // tile row p % 16 of tile p / 16
    for (int b = 0; b < kBlocks; ++b) {
      // NOTE: past a block's end this runs into the next block's tiles (the next stream of
      // this item, or the next item's), and past the weight's end prefetches never fault.
      _mm_prefetch(w[b] + offset + kDotPrefetchBytes, _MM_HINT_T0);
      const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w[b] + offset));
      for (int i = 0; i < kRows; ++i) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], wv, xv[i]);
    }
  }
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t n0 = (nb0 + b) * kTileCols;
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < kRows; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * N + n0),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][b], bv))));
    }
  }
}

// Blocks [nb0, nb0 + count) (count <= kDotBlocks) over kRows rows: the widest item first.
template <int kRows>
void dot_item(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias,
              c10::BFloat16* y, int64_t N, int64_t K, int64_t nb0, int64_t count) {
  if (count == kDotBlocks) return dot_blocks<kDotBlocks, kRows>(x, packed, bias, y, N, K, nb0);
  for (int64_t done = 0; done < count;) {  // a tail of 1-7 blocks: 4, 2, 1 at a time
    const int64_t left = count - done;
    if (left >= 4) {
      dot_blocks<4, kRows>(x, packed, bias, y, N, K, nb0 + done);
      done += 4;
    } else if (left >= 2) {
      dot_blocks<2, kRows>(x, packed, bias, y, N, K, nb0 + done);
      done += 2;
    } else {
      dot_blocks<1, kRows>(x, packed, bias, y, N, K, nb0 + done);
      done += 1;
    }
  }
}

// y = x @ W^T (+ bias) for M <= kDotRows rows of bf16 weights, items claimed a few at a time.
// With warm (items [0, warm->taken()) already fetched by helper threads, see DotWarmup), each
// thread slot first runs the items its helper thread warmed, and the claims start after them.
void dot_rows(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias,
              c10::BFloat16* y, int64_t M, int64_t N, int64_t K, const DotWarmup* warm) {
  const int64_t num_blocks = N / kTileCols;
  const int64_t num_items = (num_blocks + kDotBlocks - 1) / kDotBlocks;
  const int64_t taken = warm ? warm->taken() : 0;
  auto run_item = [&](int64_t item) {
    const int64_t nb0 = item * kDotBlocks;
    const int64_t count = std::min<int64_t>(kDotBlocks, num_blocks - nb0);
    if (M == 1) {
      dot_item<1>(x, packed, bias, y, N, K, nb0, count);
    } else {
      dot_item<2>(x, packed, bias, y, N, K, nb0, count);
    }
  };
  pagedattn_claims::Claims items(num_items, 2, taken);
  items.run_slots([&](pagedattn_claims::Claims& claims, int64_t slot_begin, int64_t slot_end) {
    for (int64_t item = 0; item < taken; ++item) {
      // NOTE: a helper thread's number may exceed this call's slots (fewer items than threads).
      const int64_t slot = warm->owner[item] % claims.threads();
      if (slot_begin <= slot && slot < slot_end) run_item(item);
    }
    int64_t begin, end;
    while (claims.next(begin, end)) {
      for (int64_t item = begin; item < end; ++item) run_item(item);
    }
  });
}
#endif  // PAGEDATTN_HAS_AMX

}  // namespace

void DotWarmup::aim(const torch::Tensor& packed_weight, int64_t n, int64_t k, int64_t threads) {
  packed = packed_weight.data_ptr();
  N = n;
  K = k;
  const int64_t items = (N / kTileCols + kDotBlocks - 1) / kDotBlocks;
  // NOTE: the caller's thread takes its share of the items too, so the helpers warm at most
  // theirs: (threads - 1) / threads of them.
  limit = items * (threads - 1) / std::max<int64_t>(1, threads);
  owner.assign(static_cast<size_t>(limit), 0);
  next.store(0, std::memory_order_relaxed);
}

void DotWarmup::warm(int thread, const std::atomic<bool>& busy) {
#ifdef PAGEDATTN_HAS_AMX
  const char* base = static_cast<const char*>(packed);
  const int64_t num_blocks = N / kTileCols;
  const int64_t block_bytes = K * kTileCols * static_cast<int64_t>(sizeof(c10::BFloat16));
  const int64_t tile_rows = K / 2;  // 64-byte tile rows per block: one per k pair
  while (busy.load(std::memory_order_relaxed)) {
    const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
    if (item >= limit) return;
    owner[static_cast<size_t>(item)] = thread;
    const int64_t nb0 = item * kDotBlocks;
    const int64_t count = std::min<int64_t>(kDotBlocks, num_blocks - nb0);
    const char* w = base + nb0 * block_bytes;
    // In the order dot_blocks reads them: tile row r of every block of the item, r = 0, 1, ...
    for (int64_t r = 0; r < tile_rows; ++r) {
      if (r % 8 == 0 && !busy.load(std::memory_order_relaxed)) return;
      for (int64_t b = 0; b < count; ++b) _mm_prefetch(w + b * block_bytes + 64 * r, _MM_HINT_T1);
    }
  }
#else
  (void)thread;
  (void)busy;
#endif
}

bool linear_amx_dot_rows(int64_t rows) {
#ifdef PAGEDATTN_HAS_AMX
  return rows >= 1 && rows <= kDotRows && linear_amx_available();
#else
  (void)rows;
  return false;
#endif
}

bool linear_amx_available() {
#ifdef PAGEDATTN_HAS_AMX
  return request_amx();
#else
  return false;
#endif
}

// packed: bf16 tiles, or int8 tiles with scale = the per-column float32 scales.
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, int64_t N,
                         c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> scale) {
  return linear_amx_warmed(x, packed, N, bias, scale, nullptr);
}

// linear_amx with the items that helper threads warmed (DotWarmup::aim on this packing; the
// dot-product path only, else warmup is ignored).
torch::Tensor linear_amx_warmed(torch::Tensor x, torch::Tensor packed, int64_t N,
                                c10::optional<torch::Tensor> bias,
                                c10::optional<torch::Tensor> scale, DotWarmup* warmup) {
  TORCH_CHECK(linear_amx_available(), "linear_amx needs a CPU with AMX-BF16 (and a build for it)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_amx runs on CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16,
              "x must be a contiguous bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kTileK == 0 && N % kTileCols == 0, "linear_amx needs K % 32 == 0 and ",
              "N % 16 == 0, got K=", K, " N=", N);
  const bool int8 = packed.scalar_type() == torch::kInt8;
  TORCH_CHECK((packed.scalar_type() == torch::kBFloat16 || int8) && packed.is_contiguous() &&
                  packed.numel() == N * K,
              "packed must be the contiguous bf16 or int8 AMX packing of a [", N, ", ", K,
              "] weight");
  TORCH_CHECK(int8 == scale.has_value(), "int8 tiles need their per-column scales (only they)");
  const float* scale_ptr = nullptr;
  if (int8) {
    TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() &&
                    scale->numel() == N,
                "scale must be a contiguous float32 [N]");
    scale_ptr = scale->data_ptr<float>();
  }
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == N,
                "bias must be a contiguous float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef PAGEDATTN_HAS_AMX
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>());
  if (warmup != nullptr && warmup->packed != packed.data_ptr()) warmup = nullptr;
  if (!int8 && M <= kDotRows) {
    dot_rows(xp, reinterpret_cast<const c10::BFloat16*>(packed.data_ptr<at::BFloat16>()),
             bias_ptr, yp, M, N, K, warmup);
    return y;
  }
  const int64_t num_blocks = N / kTileCols;
  const int64_t num_pairs = (num_blocks + 1) / 2;
  const int64_t block_rows = row_block(K);
  const int64_t num_row_blocks = (M + block_rows - 1) / block_rows;
  auto run = [&](const auto* wp) {
    pagedattn_claims::Claims items(num_row_blocks * num_pairs, kPairsPerClaim);
    items.run([&](pagedattn_claims::Claims& claims) {
      TileRows tiles;
      int64_t begin, end;
      while (claims.next(begin, end)) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t m_begin = item / num_pairs * block_rows;
          const int64_t m_end = std::min(M, m_begin + block_rows);
          const int64_t nb0 = 2 * (item % num_pairs);
          if (nb0 + 1 < num_blocks) {
            block_pair<true>(xp, wp, scale_ptr, bias_ptr, yp, m_begin, m_end, N, K, nb0, tiles);
          } else {
            block_pair<false>(xp, wp, scale_ptr, bias_ptr, yp, m_begin, m_end, N, K, nb0, tiles);
          }
        }
      }
      _tile_release();
    });
  };
  if (int8) {
    run(packed.data_ptr<int8_t>());
  } else {
    run(reinterpret_cast<const c10::BFloat16*>(packed.data_ptr<at::BFloat16>()));
  }
#endif
  return y;
}
