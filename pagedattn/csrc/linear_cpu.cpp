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
// 32 weights once and multiplies them with MR broadcast activations. Threads claim the panels a
// few at a time (claims_cpu.h); every thread runs all rows of a chunk (at least 128 rows, or as
// many as fit in 1 MB of activations) through its panels, so the weights of a decode step stream
// from memory once, a prefill re-reads them once per chunk, and the activations stay in L2. The sum over k runs in
// order, one fused multiply-add per term, in fp32 whatever the storage.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "claims_cpu.h"
#include "vec_cpu.h"

namespace {

using bf16 = c10::BFloat16;
using pagedattn_vec::fVec;
using pagedattn_vec::kWidth;

constexpr int64_t kPanel = 32;  // output columns per panel
constexpr int kPanelVecs = kPanel / kWidth;
static_assert(kWidth <= 16 && kPanel % kWidth == 0, "a panel row must be whole vectors");
// MR: rows per micro-kernel call: accumulators in all registers but two (the broadcast and one
// weight vector; the other weight vectors feed the FMAs from L1), at most 12: 12 on AVX-512
// (24 accumulators), 3 on AVX2 and NEON. NOTE: on AVX2 (x86-64-v3 build on the AVX-512 Xeon,
// 2 threads, SmolLM2-135M's 30 layers, fp32, 32 rows) MR 3 took 76.8-79.4 ms against MR 2's
// 96.5-104 ms (which keeps the whole weight row in registers); at 1 row both stream ~20 GB/s.
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

// cols[v]: how many of the kWidth columns of vector v lie inside the weight (N's last panel).
template <int MR, typename T, typename O>
void micro_kernel(const float* x, int64_t ldx, const T* w, int64_t K, O* y, int64_t ldy,
                  const int* cols, const float* bias) {
  fVec acc[MR][kPanelVecs];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = fVec(0.0f);
  }
  for (int64_t k = 0; k < K; ++k) {
    if (kPrefetch > 0) {
      const char* ahead = reinterpret_cast<const char*>(w + (k + kPrefetch) * kPanel);
      __builtin_prefetch(ahead, 0, 3);
      if (sizeof(T) == 4) __builtin_prefetch(ahead + 64, 0, 3);
    }
    fVec wv[kPanelVecs];
    load_panel_row(w + k * kPanel, wv);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const fVec xr(x[r * ldx + k]);
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = at::vec::fmadd(xr, wv[v], acc[r][v]);
    }
  }
  fVec b[kPanelVecs];
  for (int v = 0; v < kPanelVecs; ++v) {
    b[v] = bias != nullptr && cols[v] > 0 ? pagedattn_vec::load(bias + v * kWidth, cols[v])
                                         : fVec(0.0f);
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) {
      if (cols[v] > 0) pagedattn_vec::store(y + r * ldy + v * kWidth, acc[r][v] + b[v], cols[v]);
    }
  }
}

// The micro-kernel for 1..MR rows (MR a compile-time count, so the accumulators stay in
// registers).
template <typename T, typename O, int MR = kMaxRows>
void rows_through_panel(int rows, const float* x, int64_t ldx, const T* w, int64_t K, O* y,
                        int64_t ldy, const int* cols, const float* bias) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      rows_through_panel<T, O, MR - 1>(rows, x, ldx, w, K, y, ldy, cols, bias);
      return;
    }
  }
  micro_kernel<MR, T, O>(x, ldx, w, K, y, ldy, cols, bias);
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
      int64_t p_begin, p_end;
      while (claims.next(p_begin, p_end)) {
        for (int64_t p = p_begin; p < p_end; ++p) {
          const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
          const T* w = wp + p * K * kPanel;
          const float* b = bias != nullptr ? bias + p * kPanel : nullptr;
          int col_counts[kPanelVecs];
          for (int v = 0; v < kPanelVecs; ++v) {
            col_counts[v] = static_cast<int>(std::clamp<int64_t>(cols - v * kWidth, 0, kWidth));
          }
          for (int64_t m = m0; m < m1; m += kMaxRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - m));
            rows_through_panel<T, O>(rows, xp + m * K, K, w, K, yp + m * N + p * kPanel, N,
                                     col_counts, b);
          }
        }
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
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "N=", N, " does not match ", packed.size(0), " panels");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 || packed.scalar_type() == torch::kBFloat16,
              "packed weights are float32 or bfloat16");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == N,
                "bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
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
