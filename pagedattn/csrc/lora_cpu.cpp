// Batched LoRA for decode-sized steps: y[t] += (x[t] @ A_slot) @ B_slot for each row t whose
// adapter slot is >= 0 (punica's shrink and expand; the rows of one slot in blocks).
//
// The weights are pagedattn.lora.layers.LoRALinear's buffers, shared with the torch path: A of S
// output slices, L slots and rank R as [L, in, S * R] (slot s's block contiguous, column i * R + r
// is rank r of slice i), and each slice's B as [L * R, out_i] (row s * R + r). A row reads only
// its own slot's weights, so it costs in * S * R + R * out multiply-adds, and up to kRowBlock
// rows of a slot share each load of them. Rows of slot -1 are not touched (their
// output stays the base layer's, bit for bit). The rank R's columns accumulate in fp32 and the
// output is rounded once (bf16: one rounding of y + delta).

#include <torch/extension.h>

#include "ops_cpu.h"
#include "vec_cpu.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using pagedattn_vec::fVec;
using pagedattn_vec::kWidth;
using pagedattn_vec::load;
using pagedattn_vec::store;

// Rows of one slot run together (up to kRowBlock), so each load of A or B serves them all: a
// row at a time, rows of interleaved slots streamed every slot's weights from L3 per row.
constexpr int kRowBlock = 4;
// Vector columns of A per shrink pass, and output vectors per expand pass: kRowBlock times as
// many accumulators, 16 at most (AVX2 has 16 registers, AVX-512 and NEON 32).
constexpr int kBlockCols = 4;
constexpr int kBlockOut = 2;

// h[j][c] = sum_k x_j[k] * a[k * lda + cols[c]] for the NR rows x_j and NV vector columns c
// (each kWidth columns of one slice, the last of a slice maybe fewer: lanes[c]), in fp32.
// NOTE: NR and NV are template arguments so the accumulators stay in registers.
template <int NR, int NV, typename T>
void shrink_block(const float* const* x, const T* a, int64_t in, int64_t lda, const int64_t* cols,
                  const int64_t* lanes, float* h, int64_t ldh) {
  fVec acc[NR][NV];
  for (auto& row : acc) {
    for (auto& vec : row) vec = fVec(0.0f);
  }
  bool full = true;
  for (int v = 0; v < NV; ++v) full = full && lanes[v] == kWidth;
  for (int64_t k = 0; k < in; ++k) {
    fVec xk[NR];
    for (int j = 0; j < NR; ++j) xk[j] = fVec(x[j][k]);
    const T* row = a + k * lda;
    for (int v = 0; v < NV; ++v) {
      const fVec w = full ? load(row + cols[v]) : load(row + cols[v], lanes[v]);
      for (int j = 0; j < NR; ++j) acc[j][v] = at::vec::fmadd(xk[j], w, acc[j][v]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    for (int v = 0; v < NV; ++v) acc[j][v].store(h + j * ldh + v * kWidth, lanes[v]);
  }
}

// The shrink of all num_vcols vector columns, kBlockCols at a time.
template <int NR, typename T>
void shrink_rows(const float* const* x, const T* a, int64_t in, int64_t lda, const int64_t* cols,
                 const int64_t* lanes, int64_t num_vcols, float* h, int64_t ldh) {
  int64_t v = 0;
  for (; v + kBlockCols <= num_vcols; v += kBlockCols) {
    shrink_block<NR, kBlockCols, T>(x, a, in, lda, cols + v, lanes + v, h + v * kWidth, ldh);
  }
  const int64_t rest = num_vcols - v;
  float* hv = h + v * kWidth;
  if (rest == 3) shrink_block<NR, 3, T>(x, a, in, lda, cols + v, lanes + v, hv, ldh);
  if (rest == 2) shrink_block<NR, 2, T>(x, a, in, lda, cols + v, lanes + v, hv, ldh);
  if (rest == 1) shrink_block<NR, 1, T>(x, a, in, lda, cols + v, lanes + v, hv, ldh);
  static_assert(kBlockCols == 4, "the tail cases above cover 1 .. kBlockCols - 1 columns");
}

// y_j[o] += sum_r h_j[r] * b[r * out + o], o < out, for the NR rows y_j; y rounded once.
template <int NR, typename T>
void expand_rows(T* const* y, const float* h, int64_t ldh, const T* b, int64_t rank,
                 int64_t out) {
  int64_t o = 0;
  for (; o + kBlockOut * kWidth <= out; o += kBlockOut * kWidth) {
    fVec acc[NR][kBlockOut];
    for (int j = 0; j < NR; ++j) {
      for (int c = 0; c < kBlockOut; ++c) acc[j][c] = load(y[j] + o + c * kWidth);
    }
    for (int64_t r = 0; r < rank; ++r) {
      const T* br = b + r * out + o;
      fVec w[kBlockOut];
      for (int c = 0; c < kBlockOut; ++c) w[c] = load(br + c * kWidth);
      for (int j = 0; j < NR; ++j) {
        const fVec hr(h[j * ldh + r]);
        for (int c = 0; c < kBlockOut; ++c) acc[j][c] = at::vec::fmadd(hr, w[c], acc[j][c]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      for (int c = 0; c < kBlockOut; ++c) store(y[j] + o + c * kWidth, acc[j][c]);
    }
  }
  for (; o < out; o += kWidth) {
    const int64_t n = std::min<int64_t>(kWidth, out - o);
    for (int j = 0; j < NR; ++j) {
      fVec acc = load(y[j] + o, n);
      for (int64_t r = 0; r < rank; ++r) {
        acc = at::vec::fmadd(fVec(h[j * ldh + r]), load(b + r * out + o, n), acc);
      }
      store(y[j] + o, acc, n);
    }
  }
}

// One block of NR rows of slot s: the shrink of all S slices, then each slice's expand.
template <int NR, typename T>
void lora_block(const int64_t* rows, int64_t s, const T* xp, T* yp, int64_t in, int64_t ldy,
                const T* ap, int64_t lda, const std::vector<const T*>& bp,
                const std::vector<int64_t>& out, const std::vector<int64_t>& offset, int64_t R,
                std::vector<float>& h, std::vector<float>& xf) {
  const int64_t S = static_cast<int64_t>(bp.size());
  const int64_t per_slice = (R + kWidth - 1) / kWidth;  // vector columns of one slice's ranks
  const int64_t ldh = S * per_slice * kWidth;
  std::vector<int64_t> cols(S * per_slice), lanes(S * per_slice);
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t v = 0; v < per_slice; ++v) {
      cols[i * per_slice + v] = i * R + v * kWidth;
      lanes[i * per_slice + v] = std::min<int64_t>(kWidth, R - v * kWidth);
    }
  }
  // The rows in fp32 (bf16: widened once here, not once per use in the shrink's inner loop).
  const float* x[NR];
  if constexpr (std::is_same_v<T, float>) {
    for (int j = 0; j < NR; ++j) x[j] = xp + rows[j] * in;
  } else {
    xf.resize(NR * in);
    for (int j = 0; j < NR; ++j) {
      const T* src = xp + rows[j] * in;
      float* dst = xf.data() + j * in;
      int64_t k = 0;
      for (; k + kWidth <= in; k += kWidth) load(src + k).store(dst + k);
      for (; k < in; ++k) dst[k] = static_cast<float>(src[k]);
      x[j] = dst;
    }
  }
  h.resize(NR * ldh);
  shrink_rows<NR, T>(x, ap + s * in * lda, in, lda, cols.data(), lanes.data(), S * per_slice,
                     h.data(), ldh);
  for (int64_t i = 0; i < S; ++i) {
    T* y[NR];
    for (int j = 0; j < NR; ++j) y[j] = yp + rows[j] * ldy + offset[i];
    expand_rows<NR, T>(y, h.data() + i * per_slice * kWidth, ldh, bp[i] + s * R * out[i], R,
                       out[i]);
  }
}

template <typename T>
void lora_rows(torch::Tensor& y, const torch::Tensor& x, const int64_t* slots,
               const torch::Tensor& a, const std::vector<torch::Tensor>& b, int64_t L, int64_t R) {
  const int64_t num_rows = x.size(0), in = x.size(1), S = static_cast<int64_t>(b.size());
  const int64_t lda = a.size(2), ldy = y.size(1);
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
  // The rows grouped by slot (rows of no slot left out), in blocks of up to kRowBlock.
  std::vector<int64_t> order;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (first index into order, rows)
  order.reserve(num_rows);
  for (int64_t s = 0; s < L; ++s) {
    const auto first = static_cast<int64_t>(order.size());
    for (int64_t t = 0; t < num_rows; ++t) {
      if (slots[t] == s) order.push_back(t);
    }
    for (int64_t i = first; i < static_cast<int64_t>(order.size()); i += kRowBlock) {
      blocks.emplace_back(i, std::min<int64_t>(kRowBlock, static_cast<int64_t>(order.size()) - i));
    }
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> h, xf;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const auto [first, n] = blocks[blk];
      const int64_t* rows = order.data() + first;
      const int64_t s = slots[rows[0]];
      switch (n) {
        case 4:
          lora_block<4, T>(rows, s, xp, yp, in, ldy, ap, lda, bp, out, offset, R, h, xf);
          break;
        case 3:
          lora_block<3, T>(rows, s, xp, yp, in, ldy, ap, lda, bp, out, offset, R, h, xf);
          break;
        case 2:
          lora_block<2, T>(rows, s, xp, yp, in, ldy, ap, lda, bp, out, offset, R, h, xf);
          break;
        default:
          lora_block<1, T>(rows, s, xp, yp, in, ldy, ap, lda, bp, out, offset, R, h, xf);
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
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(0) == max_loras &&
                  a.size(1) == x.size(1) && a.size(2) == S * max_rank,
              "lora_apply: A must be contiguous [max_loras, in, slices * max_rank]");
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
