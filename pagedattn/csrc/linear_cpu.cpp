// Skinny GEMM for decode steps on CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation.
//
// W is packed once at load into panels of 32 output columns, k-major: panel p holds, for every k,
// the 32 weights W[32p .. 32p+31, k] side by side, so one panel is one contiguous stream that is
// read front to back. Storage is float32, or bfloat16 interleaved so that one 64-byte load gives
// both halves of the panel in fp32 with one shift and one mask (even bf16 lanes = columns 0..15,
// odd lanes = columns 16..31; on narrower vectors each 32-byte or 16-byte part gives the matching
// slice of both halves). Columns past N are zero.
//
// The micro-kernel is written on vec_cpu.h's vectors (one source for AVX2, AVX-512 and NEON). It
// keeps an MR x 32 block of y in MR * 32 / kWidth accumulators and, for each k, loads the panel's
// 32 weights once and multiplies them with MR broadcast activations (on AVX2, fp32 panels run 6
// rows through each 16-column half instead: kHalfPanels). Threads claim the panels a
// few at a time (claims_cpu.h); every thread runs all rows of a chunk (at least 128 rows, or as
// many as fit in 1 MB of activations) through its panels, so the weights of a decode step stream
// from memory once, a prefill re-reads them once per chunk, and the activations stay in L2. The sum over k runs in
// order, one fused multiply-add per term, in fp32 whatever the storage (on AVX2 and NEON a bf16
// panel that many rows share is widened to fp32 once first; see kWidenPanels).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "claims_cpu.h"
#include "ops_cpu.h"
#include "vec_cpu.h"

namespace {

using bf16 = c10::BFloat16;
using pagedattn_vec::fVec;
using pagedattn_vec::kWidth;

constexpr int64_t kPanel = 32;  // output columns per panel
constexpr int kPanelVecs = kPanel / kWidth;
static_assert(kWidth <= 16 && kPanel % kWidth == 0, "a panel row must be whole vectors");
static_assert(kPanel == 32, "panel_linear_bias (ops_cpu.h) counts panels of 32 columns");
// MR: rows per micro-kernel call: accumulators in all registers but two, at most 12: 12 on
// AVX-512 (24 accumulators), 3 on AVX2 and NEON (12 and 24; there the MR broadcasts and one
// weight vector take the rest, see kBroadcastsFirst). NOTE: on AVX2 (x86-64-v3 build on the
// AVX-512 Xeon, 2 threads, SmolLM2-135M's 30 layers, fp32, 32 rows) MR 3 took 76.8-79.4 ms
// against MR 2's 96.5-104 ms (which keeps the whole weight row in registers); at 1 row both
// stream ~20 GB/s.
#ifndef PAGEDATTN_PANEL_ROWS
#define PAGEDATTN_PANEL_ROWS std::min(12, (pagedattn_vec::kNumRegs - 2) / kPanelVecs)
#endif
constexpr int kMaxRows = PAGEDATTN_PANEL_ROWS;
#ifndef PAGEDATTN_CHUNK_BYTES
#define PAGEDATTN_CHUNK_BYTES (1 << 20)
#endif
constexpr int64_t kMinRowChunk = 128;  // rows that share one pass over the weights, at least
constexpr int64_t kPanelsPerClaim = 8;  // panels a thread claims at a time, at most
// ... and at most this many bytes of fp32 activations, so that the chunk stays in L2 while every
// panel runs over it (fewer passes over the weights in a long prefill).
constexpr int64_t kChunkBytes = PAGEDATTN_CHUNK_BYTES;
#ifndef PAGEDATTN_PREFETCH
#define PAGEDATTN_PREFETCH 32
#endif
constexpr int64_t kPrefetch = PAGEDATTN_PREFETCH;  // panel rows (k steps) to prefetch ahead
#ifndef PAGEDATTN_ROW_PREFETCH
#define PAGEDATTN_ROW_PREFETCH 64
#endif
constexpr int64_t kRowPrefetch = PAGEDATTN_ROW_PREFETCH;  // ... in row_through_two_panels
#ifndef PAGEDATTN_PREFETCH_NEXT_PANEL
#define PAGEDATTN_PREFETCH_NEXT_PANEL 1
#endif
// A panel's row blocks fetch the thread's next panel (SpreadPrefetch).
constexpr bool kPrefetchNextPanel = PAGEDATTN_PREFETCH_NEXT_PANEL;
// Where MR is small (AVX2, NEON: 3 rows), a bf16 panel that at least kWidenRowBlocks blocks of
// MR rows run through is widened to fp32 once per panel and call, into a per-thread buffer, and
// runs the fp32 micro-kernel: widening inside the micro-kernel costs a load and two ops per 4
// weight vectors of 12 FMAs there. NOTE: x86-64-v3 build on the AMX Xeon, 2 threads, bf16:
// - four layers of SmolLM2-135M: 32 rows 6.54 -> 5.38 ms, 2,048 rows 401 -> 280 ms (fp32
//   panels 5.39 / 275 ms); with the buffer not 64-byte aligned, 6.17 / 311 ms;
// - its 30 layers: 12 rows 24.3 -> 23.5 ms, 16 rows 31.6 -> 28.9, 32 rows 52.9 -> 45.1; from 2
//   blocks (4 rows) it cost time, 12.4 -> 17.8 ms.
// On AVX-512 (MR 12, 24 FMAs per widened row) it cost time at 32 rows (2.77 -> 3.42 ms, four
// layers) and saved none at 2,048.
#ifndef PAGEDATTN_WIDEN_PANELS
#define PAGEDATTN_WIDEN_PANELS (kMaxRows <= 4)
#endif
constexpr bool kWidenPanels = PAGEDATTN_WIDEN_PANELS;
#ifndef PAGEDATTN_WIDEN_ROW_BLOCKS
#define PAGEDATTN_WIDEN_ROW_BLOCKS 4
#endif
constexpr int64_t kWidenRowBlocks = PAGEDATTN_WIDEN_ROW_BLOCKS;
// Where a whole panel row takes 4 vectors of 16 registers (AVX2), fp32 panels run 6 rows at a
// time through each half of the panel (16 columns: 12 accumulators, 2 weight vectors and one
// broadcast), the other micro-kernel's 3 rows x 32 columns left for the last rows. Per step k
// the half loads 2 weight vectors and 6 activations for 12 FMAs, where 3 x 32 loads 4 and 3:
// half the weight bytes per FMA out of the cache. NOTE: AMD EPYC Zen 2, 2 threads, a standalone
// copy of both loops over [8192 x 2048] fp32 panels: 126 rows 82 -> 167 GFLOP/s, 510 rows 84 ->
// 181 (the two cores' FMA peak: 194). In the extension, [8192 x 2048] at 32 / 128 / 512 rows:
// fp32 118 / 125 / 126 -> 146 / 171 / 172 GFLOP/s, bf16 (widened) 115 / 123 / 124 -> 133 / 157 /
// 159; a 1B model's bf16 uniform run (bench throughput) 27.3 -> 35.6 tok/s.
#ifndef PAGEDATTN_HALF_PANELS
#define PAGEDATTN_HALF_PANELS (kPanelVecs == 4 && pagedattn_vec::kNumRegs == 16)
#endif
constexpr bool kHalfPanels = PAGEDATTN_HALF_PANELS;
constexpr int kHalfRows = 6;
constexpr int kHalfVecs = kPanelVecs / 2;
constexpr int64_t kHalfUnrollK = 4;  // K steps per pass of its loop

// The 32 weights of step k of a panel as kPanelVecs fp32 vectors, columns in order.
inline void load_panel_row(const float* w, fVec* out) {
  for (int v = 0; v < kPanelVecs; ++v) out[v] = fVec::loadu(w + v * kWidth);
}

// Interleaved bf16: 32-bit lane i holds columns i (low half) and 16 + i (high half).
inline void load_panel_row(const bf16* w, fVec* out) {
  constexpr int kHalf = kPanelVecs / 2;
  for (int c = 0; c < kHalf; ++c) {
    pagedattn_vec::widen_bf16_pairs(w + 2 * c * kWidth, out[c], out[kHalf + c]);
  }
}

// Ask for the 32 weights of panel row k of w (one cache line in bf16, two in fp32).
template <typename T>
inline void prefetch_panel_row(const T* w, int64_t k) {
  const char* row = reinterpret_cast<const char*>(w + k * kPanel);
  __builtin_prefetch(row, 0, 3);
  if (sizeof(T) == 4) __builtin_prefetch(row + 64, 0, 3);
}

// Asks for a range of cache lines (into L2) a few at a time over a micro-kernel's K steps, so
// that the next panel streams in from memory while the current one, already in cache, runs
// through its later row blocks. Without it a panel arrived only when its first row block read it,
// and the FMAs waited on memory for that block.
class SpreadPrefetch {
 public:
  SpreadPrefetch() = default;
  SpreadPrefetch(const void* begin, int64_t bytes, int64_t steps)
      : next_(static_cast<const char*>(begin)), end_(next_ + std::max<int64_t>(bytes, 0)) {
    const int64_t lines = (std::max<int64_t>(bytes, 0) + kLine - 1) / kLine;
    if (lines == 0 || steps <= 0) return;
    per_ = (lines + steps - 1) / steps;
    every_ = std::max<int64_t>(1, steps / ((lines + per_ - 1) / per_));
    countdown_ = every_;
  }

  inline void step() {
    if (next_ >= end_ || --countdown_ > 0) return;
    countdown_ = every_;
    for (int64_t i = 0; i < per_; ++i, next_ += kLine) __builtin_prefetch(next_, 0, 2);
  }

 private:
  static constexpr int64_t kLine = 64;
  const char* next_ = nullptr;
  const char* end_ = nullptr;
  int64_t every_ = 1, per_ = 0, countdown_ = 1;
};

// b[v]: the bias of vector v of a panel (zero without a bias, or past N).
inline void load_panel_bias(const float* bias, const int* cols, fVec* b) {
  for (int v = 0; v < kPanelVecs; ++v) {
    b[v] = bias != nullptr && cols[v] > 0 ? pagedattn_vec::load(bias + v * kWidth, cols[v])
                                         : fVec(0.0f);
  }
}

// y[0, 32) = acc + b, for the columns inside N.
template <typename O>
inline void store_panel_row(O* y, const fVec* acc, const fVec* b, const int* cols) {
  for (int v = 0; v < kPanelVecs; ++v) {
    if (cols[v] > 0) pagedattn_vec::store(y + v * kWidth, acc[v] + b[v], cols[v]);
  }
}

// Whether the MR-row micro-kernel on T keeps the MR broadcast activations in registers and runs
// the panel's weight vectors through them one at a time: in builds where the other order (the
// weights of step k in registers, each row broadcast in turn) does not fit the registers at
// kMaxRows rows, for every MR where this one fits.
// NOTE: the AVX2 kernel (3 rows x 32 columns: 12 accumulators, 4 weight vectors) compiled in the
// other order re-loaded its fourth weight vector for every row, 9 loads and ~30 instructions per
// 12 FMAs. A standalone copy of the loop on one core of the AMX Xeon (x86-64-v3 build, K 576, 32
// rows, 48 panels from L3 / 8 panels in L2; one core's FMA peak ~120 GFLOP/s): weights first
// 89 / 99 GFLOP/s, broadcasts first 99 / 112, with K unrolled by 4 103 / 119. On AVX-512 (2 weight
// vectors) the weights fit beside any MR; broadcasts first (K unrolled) there took 8 rows from 27.5
// to 30 ms (bench linear, 30 layers), and unrolling K alone cost time at 12 rows (200 -> 197
// GFLOP/s, the standalone loop).
template <int MR, typename T>
constexpr bool kBroadcastsFirst =
    std::is_same_v<T, float> &&
    kMaxRows * kPanelVecs + kPanelVecs + 1 > pagedattn_vec::kNumRegs &&
    MR * kPanelVecs + MR + 1 <= pagedattn_vec::kNumRegs;
// K steps per pass of the micro-kernel's loop where the broadcasts come first (see above).
template <int MR, typename T>
constexpr int64_t kUnrollK = kBroadcastsFirst<MR, T> ? 4 : 1;

// SpreadPrefetch::step() calls of the MR-row micro-kernel over K steps.
template <int MR, typename T>
constexpr int64_t kernel_passes(int64_t K) {
  return K / kUnrollK<MR, T> + K % kUnrollK<MR, T>;
}

// acc[r][.] += x[r, k] * w[k, .] for the MR rows, one step k of the panel.
template <int MR, typename T>
inline void panel_step(const float* x, int64_t ldx, const T* w, int64_t k,
                       fVec (&acc)[MR][kPanelVecs]) {
  if (kPrefetch > 0) prefetch_panel_row(w, k + kPrefetch);
  if constexpr (kBroadcastsFirst<MR, T>) {
    fVec xr[MR];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) xr[r] = fVec(x[r * ldx + k]);
#pragma GCC unroll 8
    for (int v = 0; v < kPanelVecs; ++v) {
      const fVec wv = fVec::loadu(w + k * kPanel + v * kWidth);
#pragma GCC unroll 12
      for (int r = 0; r < MR; ++r) acc[r][v] = at::vec::fmadd(xr[r], wv, acc[r][v]);
    }
  } else {
    fVec wv[kPanelVecs];
    load_panel_row(w + k * kPanel, wv);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const fVec xr(x[r * ldx + k]);
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = at::vec::fmadd(xr, wv[v], acc[r][v]);
    }
  }
}

// cols[v]: how many of the kWidth columns of vector v lie inside the weight (N's last panel).
// ahead: stepped once per pass of the loop (kernel_passes<MR, T>(K) in all).
template <int MR, typename T, typename O>
inline void micro_kernel(const float* x, int64_t ldx, const T* w, int64_t K, O* y, int64_t ldy,
                         const int* cols, const float* bias, SpreadPrefetch& ahead) {
  constexpr int64_t kUnroll = kUnrollK<MR, T>;
  fVec acc[MR][kPanelVecs];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = fVec(0.0f);
  }
  int64_t k = 0;
  for (; k + kUnroll <= K; k += kUnroll) {
    ahead.step();
#pragma GCC unroll 4
    for (int64_t u = 0; u < kUnroll; ++u) panel_step<MR, T>(x, ldx, w, k + u, acc);
  }
  for (; k < K; ++k) {
    ahead.step();
    panel_step<MR, T>(x, ldx, w, k, acc);
  }
  fVec b[kPanelVecs];
  load_panel_bias(bias, cols, b);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) store_panel_row(y + r * ldy, acc[r], b, cols);
}

// The micro-kernel in a function of its own. NOTE: inlined into its callers (all MR in one
// function), the x86-64-v3 build's unrolled broadcasts-first loop spilled accumulators to the
// stack; on its own it keeps all 16 registers for the loop.
template <int MR, typename T, typename O>
[[gnu::noinline]] void micro_kernel_outlined(const float* x, int64_t ldx, const T* w, int64_t K,
                                             O* y, int64_t ldy, const int* cols,
                                             const float* bias, SpreadPrefetch& ahead) {
  micro_kernel<MR, T, O>(x, ldx, w, K, y, ldy, cols, bias, ahead);
}

// counts[v]: how many of the kWidth columns of vector v of panel p lie inside N.
inline void panel_columns(int64_t N, int64_t p, int* counts) {
  const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
  for (int v = 0; v < kPanelVecs; ++v) {
    counts[v] = static_cast<int>(std::clamp<int64_t>(cols - v * kWidth, 0, kWidth));
  }
}

// One row through two panels at once, the same sums as micro_kernel<1> on each. One weight
// stream per thread left bandwidth idle. NOTE: SmolLM2-135M's 30 layers + LM head at 1 row, AMX
// Xeon, 2 threads: x86-64-v3 build bf16 14.8 -> 12.2 ms, fp32 24.5 -> 21.8; x86-64-v4 bf16
// 13.3 -> 12.3, fp32 25.1 -> 22.1 (with kRowPrefetch 64; at 32 as the micro-kernel: bf16 v3 12.5).
template <typename T, typename O>
void row_through_two_panels(const float* x, const T* w0, const T* w1, int64_t K, O* y0, O* y1,
                            const int* cols0, const int* cols1, const float* bias0,
                            const float* bias1) {
  fVec acc0[kPanelVecs], acc1[kPanelVecs];
  for (int v = 0; v < kPanelVecs; ++v) acc0[v] = acc1[v] = fVec(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    if (kRowPrefetch > 0) {
      prefetch_panel_row(w0, k + kRowPrefetch);
      prefetch_panel_row(w1, k + kRowPrefetch);
    }
    const fVec xk(x[k]);
    fVec wv[kPanelVecs];
    load_panel_row(w0 + k * kPanel, wv);
    for (int v = 0; v < kPanelVecs; ++v) acc0[v] = at::vec::fmadd(xk, wv[v], acc0[v]);
    load_panel_row(w1 + k * kPanel, wv);
    for (int v = 0; v < kPanelVecs; ++v) acc1[v] = at::vec::fmadd(xk, wv[v], acc1[v]);
  }
  fVec b[kPanelVecs];
  load_panel_bias(bias0, cols0, b);
  store_panel_row(y0, acc0, b, cols0);
  load_panel_bias(bias1, cols1, b);
  store_panel_row(y1, acc1, b, cols1);
}

// The micro-kernel for 1..MR rows (MR a compile-time count, so the accumulators stay in
// registers).
template <typename T, typename O, int MR = kMaxRows>
void rows_through_panel(int rows, const float* x, int64_t ldx, const T* w, int64_t K, O* y,
                        int64_t ldy, const int* cols, const float* bias, SpreadPrefetch& ahead) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      rows_through_panel<T, O, MR - 1>(rows, x, ldx, w, K, y, ldy, cols, bias, ahead);
      return;
    }
  }
  if constexpr (kBroadcastsFirst<MR, T>) {
    micro_kernel_outlined<MR, T, O>(x, ldx, w, K, y, ldy, cols, bias, ahead);
  } else {
    micro_kernel<MR, T, O>(x, ldx, w, K, y, ldy, cols, bias, ahead);
  }
}

// acc[r][.] += x[r, k] * w[k, half .] for 6 rows and the 16 columns of one half of a fp32
// panel, every step k; then y = acc + bias for the columns inside N (cols, bias: the panel's).
// The same sums, in the same order, as micro_kernel on the whole panel.
template <typename O>
[[gnu::noinline]] void half_panel_kernel(const float* x, int64_t ldx, const float* w, int64_t K,
                                         O* y, int64_t ldy, const int* cols, const float* bias,
                                         int half, SpreadPrefetch& ahead) {
  fVec acc[kHalfRows][kHalfVecs];
#pragma GCC unroll 6
  for (int r = 0; r < kHalfRows; ++r) {
    for (int v = 0; v < kHalfVecs; ++v) acc[r][v] = fVec(0.0f);
  }
  const float* wh = w + half * kHalfVecs * kWidth;
  auto step = [&](int64_t k) {
    fVec wv[kHalfVecs];
    for (int v = 0; v < kHalfVecs; ++v) wv[v] = fVec::loadu(wh + k * kPanel + v * kWidth);
#pragma GCC unroll 6
    for (int r = 0; r < kHalfRows; ++r) {
      const fVec xr(x[r * ldx + k]);
      for (int v = 0; v < kHalfVecs; ++v) acc[r][v] = at::vec::fmadd(xr, wv[v], acc[r][v]);
    }
  };
  int64_t k = 0;
  for (; k + kHalfUnrollK <= K; k += kHalfUnrollK) {
    ahead.step();
    if (kPrefetch > 0) prefetch_panel_row(w, k + kPrefetch);
#pragma GCC unroll 4
    for (int64_t u = 0; u < kHalfUnrollK; ++u) step(k + u);
  }
  for (; k < K; ++k) {
    ahead.step();
    step(k);
  }
  fVec b[kPanelVecs];
  load_panel_bias(bias, cols, b);
  for (int r = 0; r < kHalfRows; ++r) {
    for (int v = 0; v < kHalfVecs; ++v) {
      const int c = half * kHalfVecs + v;
      if (cols[c] > 0) pagedattn_vec::store(y + r * ldy + c * kWidth, acc[r][v] + b[c], cols[c]);
    }
  }
}

// What row block `block` of `blocks` prefetches of the next panel: an equal slice of its
// next_bytes, spread over the block's micro-kernel passes (nothing without next).
inline SpreadPrefetch block_prefetch(const void* next, int64_t next_bytes, int64_t block,
                                     int64_t blocks, int64_t passes) {
  if (next == nullptr || blocks <= 0) return {};
  const int64_t slice = (next_bytes + blocks - 1) / blocks;
  const int64_t offset = block * slice;
  return SpreadPrefetch(static_cast<const char*>(next) + offset,
                        std::min(slice, next_bytes - offset), passes);
}

// Rows m0 .. m1 of x through one panel w, MR rows at a time (y: the panel's first column). Each
// block asks for an equal slice of next_bytes of next (if given) while it runs on w (which the
// previous panel's blocks fetched). NOTE: the first block fetched none (it read w from memory
// before the next panel was fetched ahead): with it taking a slice too, 32 rows took 47.8-48.3
// ms against 48.2-49.7 (AVX2 cap) and 39.2-39.7 against 40.0-40.3 (AVX-512 cap), bench linear,
// 30 layers.
template <typename T, typename O>
void rows_through_chunk(int64_t m0, int64_t m1, const float* xp, int64_t K, const T* w, O* y,
                        int64_t N, const int* cols, const float* bias, const void* next = nullptr,
                        int64_t next_bytes = 0) {
  int64_t m = m0;
  if constexpr (kHalfPanels && std::is_same_v<T, float>) {
    // 6-row blocks through each half of the panel (kHalfPanels), the rest below.
    const int64_t blocks = (m1 - m0) / kHalfRows;
    const int64_t passes = 2 * (K / kHalfUnrollK + K % kHalfUnrollK);  // both halves
    for (int64_t block = 0; block < blocks; ++block, m += kHalfRows) {
      SpreadPrefetch ahead = block_prefetch(next, next_bytes, block, blocks, passes);
      for (int half = 0; half < 2; ++half) {
        half_panel_kernel<O>(xp + m * K, K, w, K, y + m * N, N, cols, bias, half, ahead);
      }
    }
    if (blocks > 0) next = nullptr;  // NOTE: fetched by the blocks above
  }
  const int64_t blocks = (m1 - m + kMaxRows - 1) / kMaxRows;
  for (int64_t block = 0; m < m1; m += kMaxRows, ++block) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - m));
    SpreadPrefetch ahead =
        block_prefetch(next, next_bytes, block, blocks, kernel_passes<kMaxRows, T>(K));
    rows_through_panel<T, O>(rows, xp + m * K, K, w, K, y + m * N, N, cols, bias, ahead);
  }
}

// The bf16 panel w as fp32 in buffer: element k * 32 + c is the weight of column c at step k.
// Returns its start, aligned to 64 bytes (so that no vector load splits a cache line).
const float* widen_panel(const bf16* w, int64_t K, std::vector<float>& buffer) {
  constexpr int64_t kAlign = 64 / sizeof(float);
  buffer.resize(K * kPanel + kAlign);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  float* out = buffer.data() + (-(address / sizeof(float))) % kAlign;
  fVec wv[kPanelVecs];
  for (int64_t k = 0; k < K; ++k) {
    if (kPrefetch > 0) prefetch_panel_row(w, k + kPrefetch);
    load_panel_row(w + k * kPanel, wv);
    for (int v = 0; v < kPanelVecs; ++v) wv[v].store(out + k * kPanel + v * kWidth);
  }
  return out;
}

template <typename T, typename O>
void run(const float* xp, int64_t M, int64_t K, const torch::Tensor& packed, const float* bias,
         O* yp, int64_t N) {
  const int64_t P = packed.size(0);
  const T* wp = reinterpret_cast<const T*>(packed.data_ptr());
  const int64_t fit = kChunkBytes / (K * static_cast<int64_t>(sizeof(float))) / kMaxRows * kMaxRows;
  const int64_t row_chunk = std::max(kMinRowChunk, fit);
  for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
    const int64_t m1 = std::min(M, m0 + row_chunk);
    pagedattn_claims::Claims panels(P, kPanelsPerClaim);
    panels.run([&](pagedattn_claims::Claims& claims) {
      int64_t p_begin = 0, p_end = 0;
      thread_local std::vector<float> scratch;  // a widened bf16 panel (kWidenPanels)
      auto panel_bias = [&](int64_t q) { return bias != nullptr ? bias + q * kPanel : nullptr; };
      bool claimed = claims.next(p_begin, p_end);
      while (claimed) {
        // The thread's next claim, taken when this claim's last panel starts, so that its first
        // panel streams in while that one runs (SpreadPrefetch) as the claim's other panels do.
        int64_t n_begin = 0, n_end = 0;
        bool asked = false, next_claimed = false;
        auto claim_ahead = [&]() {
          if (!asked) next_claimed = claims.next(n_begin, n_end);
          asked = true;
          return next_claimed;
        };
        int64_t p = p_begin;
        if (m1 - m0 == 1) {
          // NOTE: one row streams two panels at a time: one stream per thread left bandwidth
          // idle (see row_through_two_panels).
          for (; p + 1 < p_end; p += 2) {
            int counts[2][kPanelVecs];
            panel_columns(N, p, counts[0]);
            panel_columns(N, p + 1, counts[1]);
            O* y = yp + m0 * N + p * kPanel;
            row_through_two_panels<T, O>(xp + m0 * K, wp + p * K * kPanel,
                                         wp + (p + 1) * K * kPanel, K, y, y + kPanel, counts[0],
                                         counts[1], panel_bias(p), panel_bias(p + 1));
          }
        }
        for (; p < p_end; ++p) {
          const T* w = wp + p * K * kPanel;
          const float* b = panel_bias(p);
          int col_counts[kPanelVecs];
          panel_columns(N, p, col_counts);
          // The thread's next panel, fetched while this one runs: the claim's next, or the
          // first of the thread's next claim. NOTE: not where the rows make one block: fetching
          // it there too gained nothing (bench linear, 4 and 8 rows at the AVX-512 cap).
          const T* next = nullptr;
          if (kPrefetchNextPanel && m1 - m0 > kMaxRows) {
            if (p + 1 < p_end) {
              next = w + K * kPanel;
            } else if (claim_ahead()) {
              next = wp + n_begin * K * kPanel;
            }
          }
          const int64_t next_bytes = K * kPanel * static_cast<int64_t>(sizeof(T));
          if constexpr (std::is_same_v<T, bf16> && kWidenPanels) {
            if (m1 - m0 >= kWidenRowBlocks * kMaxRows) {
              // NOTE: several row blocks share this panel: widen it once (exact), then run
              // them all on the fp32 micro-kernel instead of widening it again per block.
              const float* wide = widen_panel(w, K, scratch);
              rows_through_chunk<float, O>(m0, m1, xp, K, wide, yp + p * kPanel, N, col_counts,
                                           b, next, next_bytes);
              continue;
            }
          }
          rows_through_chunk<T, O>(m0, m1, xp, K, w, yp + p * kPanel, N, col_counts, b, next,
                                   next_bytes);
        }
        claimed = claim_ahead();
        p_begin = n_begin;
        p_end = n_end;
      }
    });
  }
}

}  // namespace

// Whether this build's micro-kernel runs on vector instructions (AVX2, AVX-512, NEON/SVE); the
// scalar build runs the same code on at::vec's portable arrays.
bool linear_packed_vectorized() {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512) || defined(__aarch64__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 or bfloat16, contiguous; packed [ceil(N / 32), K, 32] float32 or bfloat16
// (interleaved); bias [N] float32 or None. Returns y [M, N] in x's dtype: a bf16 x is widened to
// fp32 once, and the fp32 sums are rounded to bf16 once, on store.
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t N,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_packed runs on CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be a contiguous float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed must be a contiguous [panels, K, 32] tensor from pack_linear_weight");
  TORCH_CHECK(packed.size(1) == x.size(1), "x has K=", x.size(1), ", the weight K=",
              packed.size(1));
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 || packed.scalar_type() == torch::kBFloat16,
              "packed weights are float32 or bfloat16");
  const float* b = panel_linear_bias(bias, N, packed.size(0));
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  std::unique_ptr<float[]> widened;  // NOTE: not value-initialised: every element is written
  const float* xp;
  if (x.scalar_type() == torch::kFloat32) {
    xp = x.data_ptr<float>();
  } else {
    widened.reset(new float[M * K]);
    const bf16* src = x.data_ptr<bf16>();
    float* dst = widened.get();
    at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * K; i < r1 * K; ++i) dst[i] = static_cast<float>(src[i]);
    });
    xp = widened.get();
  }
  const bool w32 = packed.scalar_type() == torch::kFloat32;
  if (x.scalar_type() == torch::kFloat32) {
    float* yp = y.data_ptr<float>();
    if (w32) {
      run<float, float>(xp, M, K, packed, b, yp, N);
    } else {
      run<bf16, float>(xp, M, K, packed, b, yp, N);
    }
  } else {
    bf16* yp = y.data_ptr<bf16>();
    if (w32) {
      run<float, bf16>(xp, M, K, packed, b, yp, N);
    } else {
      run<bf16, bf16>(xp, M, K, packed, b, yp, N);
    }
  }
  return y;
}
