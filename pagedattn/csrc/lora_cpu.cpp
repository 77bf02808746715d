// Batched LoRA for decode-sized steps: y[t] += (x[t] @ A_slot) @ B_slot for each row t whose
// adapter slot is >= 0 (punica's shrink and expand, one row at a time).
//
// The weights are pagedattn.lora.layers.LoRALinear's buffers, shared with the torch path: A of S
// output slices, L slots and rank R as one [in, S * L * R] matrix (column (i * L + s) * R + r is
// rank r of slot s of slice i), and each slice's B as [L * R, out_i] (row s * R + r). The torch
// path multiplies every row by every slot and masks; this kernel reads only the row's own slot,
// so a row costs in * S * R + R * out multiply-adds. Rows of slot -1 are not touched (their
// output stays the base layer's, bit for bit). The rank R's columns accumulate in fp32 and the
// output is rounded once (bf16: one rounding of y + delta).

#include <torch/extension.h>

#include "ops_cpu.h"
#include "vec_cpu.h"

#include <algorithm>
#include <vector>

namespace {

using pagedattn_vec::fVec;
using pagedattn_vec::kWidth;
using pagedattn_vec::load;
using pagedattn_vec::store;

// Vector columns of A accumulated together, and partial sums per column (independent fmadd
// chains over the input): 8 accumulators fit every ISA's registers.
constexpr int kBlockCols = 4;
constexpr int kSplit = 2;
// Output vectors of one expand pass (independent chains over the rank).
constexpr int kBlockOut = 4;

// h[c] = sum_k x[k] * a[k * lda + col(c)], c < S * R: the row's S * R shrink columns in fp32.
// cols[v]: the first A column of vector column v (each covers kWidth columns of one slice, the
// last of a slice maybe fewer: lanes[v]).
template <typename T>
void shrink_row(const T* x, const T* a, int64_t in, int64_t lda, const int64_t* cols,
                const int64_t* lanes, int64_t num_vcols, float* h) {
  for (int64_t v0 = 0; v0 < num_vcols; v0 += kBlockCols) {
    const int64_t nv = std::min<int64_t>(kBlockCols, num_vcols - v0);
    fVec acc[kSplit][kBlockCols];
    for (auto& split : acc) {
      for (auto& vec : split) vec = fVec(0.0f);
    }
    int64_t k = 0;
    for (; k + kSplit <= in; k += kSplit) {
      for (int s = 0; s < kSplit; ++s) {
        const fVec xk(static_cast<float>(x[k + s]));
        const T* row = a + (k + s) * lda;
        for (int64_t v = 0; v < nv; ++v) {
          const int64_t n = lanes[v0 + v];
          const fVec w = n == kWidth ? load(row + cols[v0 + v]) : load(row + cols[v0 + v], n);
          acc[s][v] = at::vec::fmadd(xk, w, acc[s][v]);
        }
      }
    }
    for (; k < in; ++k) {
      const fVec xk(static_cast<float>(x[k]));
      const T* row = a + k * lda;
      for (int64_t v = 0; v < nv; ++v) {
        const int64_t n = lanes[v0 + v];
        const fVec w = n == kWidth ? load(row + cols[v0 + v]) : load(row + cols[v0 + v], n);
        acc[0][v] = at::vec::fmadd(xk, w, acc[0][v]);
      }
    }
    for (int64_t v = 0; v < nv; ++v) {
      fVec sum = acc[0][v];
      for (int s = 1; s < kSplit; ++s) sum = sum + acc[s][v];
      sum.store(h + (v0 + v) * kWidth, static_cast<int>(lanes[v0 + v]));
    }
  }
}

// y[o] += sum_r h[r] * b[r * out + o], o < out; y rounded once.
template <typename T>
void expand_row(T* y, const float* h, const T* b, int64_t rank, int64_t out) {
  int64_t o = 0;
  for (; o + kBlockOut * kWidth <= out; o += kBlockOut * kWidth) {
    fVec acc[kBlockOut];
    for (int j = 0; j < kBlockOut; ++j) acc[j] = load(y + o + j * kWidth);
    for (int64_t r = 0; r < rank; ++r) {
      const fVec hr(h[r]);
      const T* br = b + r * out + o;
      for (int j = 0; j < kBlockOut; ++j) acc[j] = at::vec::fmadd(hr, load(br + j * kWidth), acc[j]);
    }
    for (int j = 0; j < kBlockOut; ++j) store(y + o + j * kWidth, acc[j]);
  }
  for (; o < out; o += kWidth) {
    const int64_t n = std::min<int64_t>(kWidth, out - o);
    fVec acc = load(y + o, n);
    for (int64_t r = 0; r < rank; ++r) {
      acc = at::vec::fmadd(fVec(h[r]), load(b + r * out + o, n), acc);
    }
    store(y + o, acc, n);
  }
}

template <typename T>
void lora_rows(torch::Tensor& y, const torch::Tensor& x, const int64_t* slots,
               const torch::Tensor& a, const std::vector<torch::Tensor>& b, int64_t L, int64_t R) {
  const int64_t rows = x.size(0), in = x.size(1), S = static_cast<int64_t>(b.size());
  const int64_t lda = a.size(1), ldy = y.size(1);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  std::vector<const T*> bp(S);
  std::vector<int64_t> out(S), offset(S);
  for (int64_t i = 0, off = 0; i < S; ++i) {
    bp[i] = b[i].data_ptr<T>();
    out[i] = b[i].size(1);
    offset[i] = off;
    off += out[i];
  }
  // Vector columns of one slice's R ranks (relative to the slice's first column of slot s).
  const int64_t per_slice = (R + kWidth - 1) / kWidth;
  at::parallel_for(0, rows, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> h(S * per_slice * kWidth);
    std::vector<int64_t> cols(S * per_slice), lanes(S * per_slice);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t v = 0; v < per_slice; ++v) {
          cols[i * per_slice + v] = (i * L + s) * R + v * kWidth;
          lanes[i * per_slice + v] = std::min<int64_t>(kWidth, R - v * kWidth);
        }
      }
      shrink_row<T>(xp + t * in, ap, in, lda, cols.data(), lanes.data(), S * per_slice,
                    h.data());
      for (int64_t i = 0; i < S; ++i) {
        expand_row<T>(yp + t * ldy + offset[i], h.data() + i * per_slice * kWidth,
                      bp[i] + s * R * out[i], R, out[i]);
      }
    }
  });
}

}  // namespace

void lora_apply(torch::Tensor y, torch::Tensor x, torch::Tensor slots, torch::Tensor a,
                std::vector<torch::Tensor> b, int64_t max_loras, int64_t max_rank) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.is_contiguous(),
              "lora_apply: x [T, in] and y [T, out] must be contiguous");
  TORCH_CHECK(y.size(0) == x.size(0) && slots.numel() == x.size(0),
              "lora_apply: x, y and slots must have one entry per row");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "lora_apply: slots must be contiguous int64");
  TORCH_CHECK(!b.empty(), "lora_apply: one B per output slice");
  const int64_t S = static_cast<int64_t>(b.size());
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(0) == x.size(1) &&
                  a.size(1) == S * max_loras * max_rank,
              "lora_apply: A must be contiguous [in, slices * max_loras * max_rank]");
  int64_t total = 0;
  for (const auto& bi : b) {
    TORCH_CHECK(bi.dim() == 2 && bi.is_contiguous() && bi.size(0) == max_loras * max_rank &&
                    bi.scalar_type() == x.scalar_type(),
                "lora_apply: each B must be contiguous [max_loras * max_rank, out_i]");
    total += bi.size(1);
  }
  TORCH_CHECK(total == y.size(1), "lora_apply: the B slices give ", total, " columns, y has ",
              y.size(1));
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type(),
              "lora_apply: x, y, A and B must share one dtype");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) {
    TORCH_CHECK(sp[t] < max_loras, "lora_apply: slot ", sp[t], " of row ", t, " is not below ",
                max_loras);
  }
  if (x.scalar_type() == torch::kFloat32) {
    lora_rows<float>(y, x, sp, a, b, max_loras, max_rank);
  } else if (x.scalar_type() == torch::kBFloat16) {
    lora_rows<c10::BFloat16>(y, x, sp, a, b, max_loras, max_rank);
  } else {
    TORCH_CHECK(false, "lora_apply: float32 or bfloat16, not ", x.scalar_type());
  }
}
