// Skinny GEMM for decode steps on CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation.
//
// W is packed once at load into panels of 32 output columns, k-major: panel p holds, for every k,
// the 32 weights W[32p .. 32p+31, k] side by side, so one panel is one contiguous stream that is
// read front to back. Storage is float32, or bfloat16 interleaved so that one 64-byte load gives
// both halves of the panel in fp32 with one shift and one mask (even bf16 lanes = columns 0..15,
// odd lanes = columns 16..31). Columns past N are zero.
//
// The micro-kernel keeps an MR x 32 block of y in 2 * MR zmm accumulators and, for each k, loads
// the panel's 32 weights once and multiplies them with MR broadcast activations. Threads split the
// panels; every thread runs all rows of a chunk (at least 128 rows, or as many as fit in 1 MB of
// activations) through its panels, so the weights of a decode step stream from memory once, a
// prefill re-reads them once per chunk, and the activations stay in L2. The sum over k
// runs in order, one fused multiply-add per term, in fp32 whatever the storage.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "vec_cpu.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;      // output columns per panel
constexpr int kMaxRows = 12;        // MR: rows per micro-kernel call (24 accumulators)
#ifndef PAGEDATTN_CHUNK_BYTES
#define PAGEDATTN_CHUNK_BYTES (1 << 20)
#endif
constexpr int64_t kMinRowChunk = 128;  // rows that share one pass over the weights, at least
// ... and at most this many bytes of fp32 activations, so that the chunk stays in L2 while every
// panel runs over it (fewer passes over the weights in a long prefill).
constexpr int64_t kChunkBytes = PAGEDATTN_CHUNK_BYTES;
#ifndef PAGEDATTN_PREFETCH
#define PAGEDATTN_PREFETCH 32
#endif
constexpr int64_t kPrefetch = PAGEDATTN_PREFETCH;  // panel rows (k steps) to prefetch ahead

using bf16 = c10::BFloat16;

#ifdef __AVX512F__
// The 32 weights of step k of a panel, as two 16-lane fp32 vectors.
inline void load_panel_row(const float* w, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(w);
  hi = _mm512_loadu_ps(w + 16);
}

inline void load_panel_row(const bf16* w, __m512& lo, __m512& hi) {
  __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(w));
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

using pagedattn_vec::store16;

template <int MR, typename T, typename O>
void micro_kernel(const float* x, int64_t ldx, const T* w, int64_t K, O* y, int64_t ldy,
                  __mmask16 mask_lo, __mmask16 mask_hi, const float* bias) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = _mm512_setzero_ps();
    acc[r][1] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (kPrefetch > 0) {
      const char* ahead = reinterpret_cast<const char*>(w + (k + kPrefetch) * kPanel);
      _mm_prefetch(ahead, _MM_HINT_T0);
      if (sizeof(T) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    __m512 w_lo, w_hi;
    load_panel_row(w + k * kPanel, w_lo, w_hi);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xr, w_lo, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w_hi, acc[r][1]);
    }
  }
  __m512 b_lo = _mm512_setzero_ps(), b_hi = _mm512_setzero_ps();
  if (bias != nullptr) {
    b_lo = _mm512_maskz_loadu_ps(mask_lo, bias);
    b_hi = _mm512_maskz_loadu_ps(mask_hi, bias + 16);
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    store16(y + r * ldy, mask_lo, _mm512_add_ps(acc[r][0], b_lo));
    store16(y + r * ldy + 16, mask_hi, _mm512_add_ps(acc[r][1], b_hi));
  }
}

template <typename T, typename O>
void rows_through_panel(int rows, const float* x, int64_t ldx, const T* w, int64_t K, O* y,
                        int64_t ldy, __mmask16 mask_lo, __mmask16 mask_hi, const float* bias) {
  switch (rows) {
#define PAGEDATTN_MR_CASE(R)                                                         \
  case R:                                                                            \
    micro_kernel<R, T, O>(x, ldx, w, K, y, ldy, mask_lo, mask_hi, bias);             \
    break;
    PAGEDATTN_MR_CASE(1)
    PAGEDATTN_MR_CASE(2)
    PAGEDATTN_MR_CASE(3)
    PAGEDATTN_MR_CASE(4)
    PAGEDATTN_MR_CASE(5)
    PAGEDATTN_MR_CASE(6)
    PAGEDATTN_MR_CASE(7)
    PAGEDATTN_MR_CASE(8)
    PAGEDATTN_MR_CASE(9)
    PAGEDATTN_MR_CASE(10)
    PAGEDATTN_MR_CASE(11)
    PAGEDATTN_MR_CASE(12)
#undef PAGEDATTN_MR_CASE
    default:
      TORCH_CHECK(false, "rows per micro-kernel must be 1..", kMaxRows, ", got ", rows);
  }
}
#endif  // __AVX512F__

// Portable path: the same panel order and the same in-order fp32 sum, one output at a time.
template <typename T, typename O>
void panel_scalar(int64_t rows, const float* x, int64_t ldx, const T* w, int64_t K, O* y,
                  int64_t ldy, int64_t cols, const float* bias, bool interleaved) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      // Interleaved bf16 panels hold column j at lane 2j (j < 16) or 2(j - 16) + 1.
      const int64_t lane = interleaved ? (j < 16 ? 2 * j : 2 * (j - 16) + 1) : j;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        acc += x[r * ldx + k] * static_cast<float>(w[k * kPanel + lane]);
      }
      y[r * ldy + j] = static_cast<O>(acc + (bias != nullptr ? bias[j] : 0.0f));
    }
  }
}

template <typename T, typename O>
void run(const float* xp, int64_t M, int64_t K, const torch::Tensor& packed, const float* bias,
         O* yp, int64_t N) {
  const int64_t P = packed.size(0);
  const T* wp = reinterpret_cast<const T*>(packed.data_ptr());
  constexpr bool kInterleaved = std::is_same<T, bf16>::value;
  const int64_t fit = kChunkBytes / (K * static_cast<int64_t>(sizeof(float))) / kMaxRows * kMaxRows;
  const int64_t row_chunk = std::max(kMinRowChunk, fit);
  for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
    const int64_t m1 = std::min(M, m0 + row_chunk);
    at::parallel_for(0, P, 1, [&](int64_t p_begin, int64_t p_end) {
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
        const T* w = wp + p * K * kPanel;
        const float* b = bias != nullptr ? bias + p * kPanel : nullptr;
#ifdef __AVX512F__
        const __mmask16 mask_lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
        const __mmask16 mask_hi =
            cols >= 32 ? 0xFFFF : (cols > 16 ? static_cast<__mmask16>((1u << (cols - 16)) - 1) : 0);
        for (int64_t m = m0; m < m1; m += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - m));
          rows_through_panel<T, O>(rows, xp + m * K, K, w, K, yp + m * N + p * kPanel, N, mask_lo,
                                mask_hi, b);
        }
#else
        panel_scalar<T, O>(m1 - m0, xp + m0 * K, K, w, K, yp + m0 * N + p * kPanel, N, cols, b,
                        kInterleaved);
#endif
      }
    });
  }
}

}  // namespace

// Whether this build runs the AVX-512 micro-kernel (else the slow portable loop).
bool linear_packed_vectorized() {
#ifdef __AVX512F__
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
