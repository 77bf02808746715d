// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for bf16 x and W on AVX512-BF16's dot product
// (VDPBF16PS), for CPUs that have it and no AMX (AMD Zen 4 and 5; Intel Cooper Lake).
//
// W is packed once at load into panels of 32 output columns by k pairs: panel p, pair j holds
// W[32p + c, 2j] and W[32p + c, 2j + 1] side by side for c = 0..31, so one 64-byte load is 16
// columns' pair, the layout VDPBF16PS multiplies a broadcast pair of activations with (each fp32
// lane adds two products). The same panel and claim scheme as linear_cpu.cpp's fp32-FMA panels:
// an MR x 32 block of y in 2 * MR accumulators, threads claim panels a few at a time, every
// thread runs all rows of a chunk through its panels (the weights stream once per decode step),
// one row runs two panels at once (two weight streams per thread). Against those panels this
// kernel multiplies two products per lane and instruction and keeps activations in bf16 (no fp32
// copy of x); the sums differ from them in rounding (two products added per instruction, as
// oneDNN's and the AMX kernels' bf16 sums do).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "claims_cpu.h"
#include "ops_cpu.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDATTN_DPBF16 1
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kPanelColumns = 32;  // output columns per panel
static_assert(kPanelColumns == 32, "panel_linear_bias (ops_cpu.h) counts panels of 32 columns");
}  // namespace

#ifdef PAGEDATTN_DPBF16
namespace {

using bf16 = c10::BFloat16;

constexpr int64_t kPanel = kPanelColumns;
constexpr int kMaxRows = 12;        // rows per micro-kernel call: 24 accumulators of 32
constexpr int64_t kPairElems = 64;  // bf16 elements per k pair of a panel (32 columns x 2)
constexpr int64_t kPanelsPerClaim = 8;
constexpr int64_t kMinRowChunk = 128;
// bf16 activations per chunk, at most (they stay in L2 while every panel runs over them).
// NOTE: 256 KiB, 512 KiB and 1 MiB took the same time at 16-2,048 rows (Zen 4, [8192 x 2048]).
constexpr int64_t kChunkBytes = 1 << 20;
// Row blocks from which each block fetches a slice of the thread's next panel (rows_kernel).
// NOTE: AMD Zen 4, 2 threads, 16 [8192 x 2048] layers: 32 rows 2.91 / 2.81 ms without against
// 2.75 / 2.74 with, 64 rows 5.16 / 5.19 against 4.96 / 4.96; 16 rows (2 blocks) 1.73 / 1.76
// against 1.84 / 1.88. Prefetching the current panel ahead of the loads (16-64 pairs) cost
// 3-10% at 1-8 rows in every run there (the hardware prefetchers stream it on their own).
constexpr int64_t kPrefetchBlocks = 3;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

inline __m512bh load_pair(const bf16* w) { return as_bh(_mm512_loadu_si512(w)); }

// The k pair x[2j .. 2j + 1] of an activation row packed by pack_rows, in every lane.
inline __m512bh broadcast_pair(const int32_t* pairs, int64_t j) {
  return as_bh(_mm512_set1_epi32(pairs[j]));
}

inline void prefetch_pair(const bf16* w) {
  __builtin_prefetch(w, 0, 3);
  __builtin_prefetch(w + 32, 0, 3);
}

// The store masks of the panel's two 16-column halves (cols: the panel's columns inside N).
inline void half_masks(int cols, __mmask16* mask) {
  for (int h = 0; h < 2; ++h) {
    const int n = std::clamp(cols - 16 * h, 0, 16);
    mask[h] = static_cast<__mmask16>((1u << n) - 1u);
  }
}

inline void store_half(bf16* y, __m512 v, __mmask16 mask) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(y, mask, reinterpret_cast<const __m256i&>(h));
}

// y[r, 0..32) = acc[r] + bias for the panel's columns inside N.
template <int MR>
inline void store_rows(const __m512 (&acc)[MR][2], bf16* y, int64_t ldy, int cols, const float* bias) {
  __mmask16 mask[2];
  half_masks(cols, mask);
  __m512 b[2];
  for (int h = 0; h < 2; ++h) {
    b[h] = bias != nullptr ? _mm512_maskz_loadu_ps(mask[h], bias + 16 * h) : _mm512_setzero_ps();
  }
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < 2; ++h) {
      if (mask[h] != 0) store_half(y + r * ldy + 16 * h, _mm512_add_ps(acc[r][h], b[h]), mask[h]);
    }
  }
}

// MR rows of a row block through panel w (KP k pairs). xa: the block's activations by k pair,
// [KP, MR] pairs (pack_rows), so that the MR broadcasts of a pair read one 4 * MR-byte run
// through one pointer (x's rows read directly took 12 pointers, more than the free registers).
// next: the thread's next panel, of which this block fetches the pairs block, block + blocks,
// ... over the loop; nullptr for none.
template <int MR>
[[gnu::noinline]] void rows_kernel(const int32_t* xa, const bf16* w, int64_t KP, bf16* y,
                                   int64_t ldy, int cols, const float* bias, const bf16* next,
                                   int64_t block, int64_t blocks) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const bf16* ahead = next != nullptr ? next + block * kPairElems : nullptr;  // pair to fetch
  int64_t due = 0;
  for (int64_t j = 0; j < KP; ++j, xa += MR) {
    if (ahead != nullptr && --due < 0) {
      prefetch_pair(ahead);
      ahead += blocks * kPairElems;
      due = blocks - 1;
    }
    const __m512bh w0 = load_pair(w + j * kPairElems);
    const __m512bh w1 = load_pair(w + j * kPairElems + 32);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512bh xr = broadcast_pair(xa, r);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
  }
  store_rows<MR>(acc, y, ldy, cols, bias);
}

// 1..kMaxRows rows (a compile-time count per call, so the accumulators stay in registers).
template <int MR = kMaxRows>
void rows_through_panel(int rows, const int32_t* xa, const bf16* w, int64_t KP, bf16* y,
                        int64_t ldy, int cols, const float* bias, const bf16* next, int64_t block,
                        int64_t blocks) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      rows_through_panel<MR - 1>(rows, xa, w, KP, y, ldy, cols, bias, next, block, blocks);
      return;
    }
  }
  rows_kernel<MR>(xa, w, KP, y, ldy, cols, bias, next, block, blocks);
}

// Rows [m, m + r) of x [., K] by k pair into xa: xa[j * r + i] = x[m + i, 2j .. 2j + 1] (one row:
// the row as it is, read as pairs).
inline void pack_rows(const bf16* x, int64_t K, int64_t m, int r, int32_t* xa) {
  const int64_t KP = K / 2;
  for (int i = 0; i < r; ++i) {
    const bf16* row = x + (m + i) * K;
    for (int64_t j = 0; j < KP; ++j) std::memcpy(xa + j * r + i, row + 2 * j, 4);
  }
}

// One row through two panels at once: two weight streams per thread. NOTE: AMD Zen 4, 2
// threads, 16 [8192 x 2048] layers at 1 row, two runs: one panel at a time 1.12 / 1.23 ms,
// two 1.04 / 1.10, three 1.08 / 1.19, four 1.04 / 1.14.
void row_through_two_panels(const int32_t* x, const bf16* w0, const bf16* w1, int64_t KP,
                            bf16* y0, bf16* y1, int cols0, int cols1, const float* bias0,
                            const float* bias1) {
  __m512 acc[2][1][2];
  for (auto& a : acc) a[0][0] = a[0][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < KP; ++j) {
    const __m512bh xr = broadcast_pair(x, j);
    const bf16* w[2] = {w0 + j * kPairElems, w1 + j * kPairElems};
    for (int p = 0; p < 2; ++p) {
      acc[p][0][0] = _mm512_dpbf16_ps(acc[p][0][0], xr, load_pair(w[p]));
      acc[p][0][1] = _mm512_dpbf16_ps(acc[p][0][1], xr, load_pair(w[p] + 32));
    }
  }
  store_rows<1>(acc[0], y0, 0, cols0, bias0);
  store_rows<1>(acc[1], y1, 0, cols1, bias1);
}

void run(const bf16* xp, int64_t M, int64_t K, const bf16* wp, int64_t P, const float* bias,
         bf16* yp, int64_t N) {
  const int64_t KP = K / 2, panel_elems = K * kPanel;
  const int64_t fit = kChunkBytes / (K * 2) / kMaxRows * kMaxRows;
  const int64_t row_chunk = std::max(kMinRowChunk, fit);
  auto cols_of = [&](int64_t p) { return static_cast<int>(std::min(kPanel, N - p * kPanel)); };
  auto bias_of = [&](int64_t p) { return bias != nullptr ? bias + p * kPanel : nullptr; };
  // NOTE: not value-initialised: pack_rows fills it
  std::unique_ptr<int32_t[]> packed_rows(new int32_t[std::min(M, row_chunk) * KP]);
  for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
    const int64_t m1 = std::min(M, m0 + row_chunk), rows = m1 - m0;
    const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
    // Blocks of equal size (16 rows: 8 + 8, not 12 + 4); block b is rows [first(b), first(b + 1)).
    auto first = [&](int64_t b) { return rows * b / blocks; };
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        pack_rows(xp + m0 * K, K, first(b), static_cast<int>(first(b + 1) - first(b)),
                  packed_rows.get() + first(b) * KP);
      }
    });
    pagedattn_claims::Claims panels(P, kPanelsPerClaim);
    panels.run([&](pagedattn_claims::Claims& claims) {
      int64_t begin = 0, end = 0;
      bool claimed = claims.next(begin, end);
      while (claimed) {
        int64_t next_begin = 0, next_end = 0;
        const bool next_claimed = claims.next(next_begin, next_end);
        int64_t p = begin;
        if (rows == 1) {
          for (; p + 1 < end; p += 2) {
            bf16* y = yp + m0 * N + p * kPanel;
            row_through_two_panels(packed_rows.get(), wp + p * panel_elems,
                                   wp + (p + 1) * panel_elems, KP, y, y + kPanel, cols_of(p),
                                   cols_of(p + 1), bias_of(p), bias_of(p + 1));
          }
        }
        for (; p < end; ++p) {
          // The thread's next panel streams in over this one's row blocks.
          const bf16* next = nullptr;
          if (blocks >= kPrefetchBlocks) {
            if (p + 1 < end) {
              next = wp + (p + 1) * panel_elems;
            } else if (next_claimed) {
              next = wp + next_begin * panel_elems;
            }
          }
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t m = m0 + first(b);
            rows_through_panel(static_cast<int>(first(b + 1) - first(b)),
                               packed_rows.get() + first(b) * KP, wp + p * panel_elems, KP,
                               yp + m * N + p * kPanel, N, cols_of(p), bias_of(p), next, b,
                               blocks);
          }
        }
        claimed = next_claimed;
        begin = next_begin;
        end = next_end;
      }
    });
  }
}

}  // namespace
#endif  // PAGEDATTN_DPBF16

bool linear_dpbf16_available() {
#ifdef PAGEDATTN_DPBF16
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16, contiguous (K even); packed [ceil(N / 32), K / 2, 32, 2] bfloat16 (see
// above); bias [N] float32 or None. Returns y [M, N] bfloat16 (fp32 sums rounded once).
torch::Tensor linear_dpbf16(torch::Tensor x, torch::Tensor packed, int64_t N,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(linear_dpbf16_available(), "linear_dpbf16 needs a build with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  x.scalar_type() == torch::kBFloat16,
              "x must be a contiguous bfloat16 [M, K] tensor on CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanelColumns && packed.size(3) == 2 &&
                  packed.is_contiguous() && packed.scalar_type() == torch::kBFloat16,
              "packed must be a contiguous bfloat16 [panels, K / 2, 32, 2] tensor");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), "x has K=", x.size(1), ", the weight K=",
              packed.size(1) * 2);
  const float* b = panel_linear_bias(bias, N, packed.size(0));
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
#ifdef PAGEDATTN_DPBF16
  if (M > 0) {
    run(x.data_ptr<bf16>(), M, x.size(1), reinterpret_cast<const bf16*>(packed.data_ptr()),
              packed.size(0), b, y.data_ptr<bf16>(), N);
  }
#else
  (void)b;  // NOTE: unreachable (the first check refuses), kept so the checks compile everywhere
#endif
  return y;
}
