// Linear layers and embeddings on GGUF weights kept in their stored blocks
// (quant_blocks_cpu.h): pagedattn/cpu/linear.py's GGUFLinear packs one QuantLinear per layer.
//
// - Decode (fewer rows than the layer's prefill_rows): each activation row is quantised per
//   block to int8 (Q8_0 blocks of 32 for the legacy types, Q8_K blocks of 256 for the K types,
//   as llama.cpp does) and every weight row is met with up to kMaxRows activation rows at a time
//   (quant_dot_cpu.h). at::parallel_for splits the output rows over the threads.
// - Prefill: a tile of weight rows is dequantised to float32 and multiplied by at::mm, tile by
//   tile, so no whole float copy of the weight ever exists; the activations are the decode
//   path's int8 blocks widened back (as_int8_activations), as llama.cpp quantises them at every
//   batch size.
// - Parts (of every type) whose rows come in eights are repacked at load into rows
//   interleaved 8 at a time (quant_x8_cpu.h, quant_x8_legacy_cpu.h) and multiplied by that
//   kernel at every row count, prefill included: the part is held once, in that layout (its
//   rows as stored are not kept).
// - A layer is one or more parts (a fused qkv or gate/up projection whose pieces were stored in
//   different types); row r of a part lands in output column index[r] (llama.cpp's permuted
//   q/k rows are put back in place this way, without copying the weight).
// - quant_embedding: the rows of the asked ids, dequantised (tied LM heads share the blocks).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops_cpu.h"
#include "quant_amx_cpu.h"
#include "quant_dot_cpu.h"
#include "quant_linear_cpu.h"
#include "quant_x8_zmm_cpu.h"
#include "vec_cpu.h"

namespace pagedattn_quant {
namespace {

constexpr int64_t kTileFloats = 1 << 18;  // dequantised floats per prefill tile (1 MiB)
constexpr int64_t kRowsPerTask = 8;       // output rows per parallel_for grain (decode)
// Decode: a tile of kTileN weight rows meets kChunkM activation rows at a time, so the int8
// activations in play stay in L2 however many rows the step has (at 512 rows of a 2048-wide
// layer they are 1.1 MB: streamed once per weight row, the kernel fell from 98 to 77 GFLOP/s).
constexpr int64_t kTileN = 16;
constexpr int64_t kChunkM = 64;
// ... and each row asks for the bytes kRowPrefetchBytes past it (quant_dot_cpu.h) in its
// tile's first chunk; the later chunks find the tile in cache.

// ---- activations to int8 blocks ----

// 32 floats -> int8 with scale d = max|x| / 127 (round to nearest even); returns sum(q).
inline int quantize_32(const float* x, float id, int8_t* q) {
#ifdef PAGEDATTN_QUANT_X86
  const __m256 s = _mm256_set1_ps(id);
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), s));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), s));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), s));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), s));
  const int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
  i0 = _mm256_packs_epi32(i0, i1);
  i2 = _mm256_packs_epi32(i2, i3);
  i0 = _mm256_packs_epi16(i0, i2);
  i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i0);
  return sum;
#else
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    const int v = static_cast<int>(std::nearbyint(x[j] * id));
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
#endif
}

inline float max_abs(const float* x, int64_t n) {
  using pagedattn_vec::fVec;
  constexpr int64_t W = fVec::size();
  fVec amax(0.0f);
  int64_t i = 0;
  for (; i + W <= n; i += W) amax = at::vec::maximum(amax, fVec::loadu(x + i).abs());
  float r = at::vec::vec_reduce_all<float>(
      [](fVec a, fVec b) { return at::vec::maximum(a, b); }, amax);
  for (; i < n; ++i) r = std::max(r, std::fabs(x[i]));
  return r;
}

void quantize_row_q8_0(const float* x, int64_t K, ActQ8_0* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    const float d = max_abs(xb, kBlock) / 127.0f;
    const int sum = quantize_32(xb, d > 0.0f ? 1.0f / d : 0.0f, out[b].qs);
    out[b].d = d;
    out[b].sum = sum;
    out[b].s = d * static_cast<float>(sum);
  }
}

void quantize_row_q8_k(const float* x, int64_t K, ActQ8_K* out) {
  for (int64_t b = 0; b < K / kBlockK; ++b) {
    const float* xb = x + b * kBlockK;
    const float d = max_abs(xb, kBlockK) / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int c = 0; c < kBlockK / kBlock; ++c) {
      quantize_32(xb + c * kBlock, id, out[b].qs + c * kBlock);
      for (int g = 0; g < 2; ++g) {
        int s = 0;
        for (int j = 0; j < 16; ++j) s += out[b].qs[c * kBlock + g * 16 + j];
        out[b].bsums[2 * c + g] = static_cast<int16_t>(s);
      }
      out[b].sums32[c] = static_cast<int16_t>(out[b].bsums[2 * c] + out[b].bsums[2 * c + 1]);
    }
    out[b].d = d;
  }
}

// The rows of x as the dot kernels see them: each block of values quantised to int8 as for
// the dot kernels (Q8_K blocks for K types, Q8_0 blocks otherwise), then widened back (d * q).
// The prefill tiles multiply these, so a token's output does not depend on whether its step
// had enough rows for tiles: the two paths differ by float rounding, not by int8 activations.
at::Tensor as_int8_activations(const at::Tensor& x32, bool k_type) {
  const int64_t M = x32.size(0), K = x32.size(1);
  at::Tensor out = at::empty_like(x32);
  const float* x = x32.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
    std::vector<ActQ8_0> a0(k_type ? 0 : K / kBlock);
    std::vector<ActQ8_K> ak(k_type ? K / kBlockK : 0);
    for (int64_t m = b; m < e; ++m) {
      float* ym = y + m * K;
      if (k_type) {
        quantize_row_q8_k(x + m * K, K, ak.data());
        for (int64_t i = 0; i < K; ++i) ym[i] = ak[i / kBlockK].d * ak[i / kBlockK].qs[i % kBlockK];
      } else {
        quantize_row_q8_0(x + m * K, K, a0.data());
        for (int64_t i = 0; i < K; ++i) ym[i] = a0[i / kBlock].d * a0[i / kBlock].qs[i % kBlock];
      }
    }
  });
  return out;
}

// ---- dequantisation (prefill tiles, embeddings, tests; the kernels per type: quant_dot_cpu.h) ----

void dequant_row(int type, const uint8_t* row, int64_t K, float* y) {
  switch (type) {
    case kQ4_0: return dequant_legacy<kQ4_0>(row, K, y);
    case kQ4_1: return dequant_legacy<kQ4_1>(row, K, y);
    case kQ5_0: return dequant_legacy<kQ5_0>(row, K, y);
    case kQ5_1: return dequant_legacy<kQ5_1>(row, K, y);
    case kQ8_0: return dequant_legacy<kQ8_0>(row, K, y);
    case kIQ4_NL: return dequant_legacy<kIQ4_NL>(row, K, y);
    case kQ4_K: return dequant_q45_k<false>(row, K, y);
    case kQ5_K: return dequant_q45_k<true>(row, K, y);
    case kQ6_K: return dequant_q6_k(row, K, y);
    case kQ2_K: return dequant_q23_k<kQ2_K>(row, K, y);
    case kQ3_K: return dequant_q23_k<kQ3_K>(row, K, y);
    case kIQ4_XS: return dequant_iq4_xs(row, K, y);
    default: TORCH_CHECK(false, "ggml type ", type, " has no quantised kernel");
  }
}

// ---- the dot kernels by type ----

template <int MB>
void dot_rows(int type, const uint8_t* row, int64_t K, const void* const* act, float* sums) {
  const auto* a0 = reinterpret_cast<const ActQ8_0* const*>(act);
  const auto* ak = reinterpret_cast<const ActQ8_K* const*>(act);
  switch (type) {
    case kQ4_0: return dot_legacy<kQ4_0, MB>(row, K / kBlock, a0, sums);
    case kQ4_1: return dot_legacy<kQ4_1, MB>(row, K / kBlock, a0, sums);
    case kQ5_0: return dot_legacy<kQ5_0, MB>(row, K / kBlock, a0, sums);
    case kQ5_1: return dot_legacy<kQ5_1, MB>(row, K / kBlock, a0, sums);
    case kQ8_0: return dot_legacy<kQ8_0, MB>(row, K / kBlock, a0, sums);
    case kIQ4_NL: return dot_legacy<kIQ4_NL, MB>(row, K / kBlock, a0, sums);
    case kQ4_K: return dot_q45_k<kQ4_K, MB>(row, K / kBlockK, ak, sums);
    case kQ5_K: return dot_q45_k<kQ5_K, MB>(row, K / kBlockK, ak, sums);
    case kQ6_K: return dot_q6_k<MB>(row, K / kBlockK, ak, sums);
    case kQ2_K: return dot_q23_k<kQ2_K, MB>(row, K / kBlockK, ak, sums);
    case kQ3_K: return dot_q23_k<kQ3_K, MB>(row, K / kBlockK, ak, sums);
    case kIQ4_XS: return dot_iq4_xs<MB>(row, K / kBlockK, ak, sums);
    default: TORCH_CHECK(false, "ggml type ", type, " has no quantised kernel");
  }
}

// dot_rows for mb activation rows, 1 <= mb <= MB.
template <int MB = kMaxRows>
void dot_rows_n(int mb, int type, const uint8_t* row, int64_t K, const void* const* act, float* sums) {
  if constexpr (MB > 1) {
    if (mb < MB) return dot_rows_n<MB - 1>(mb, type, row, K, act, sums);
  }
  dot_rows<MB>(type, row, K, act, sums);
}

// A tensor [rows, bytes] of an x8 type (rows a multiple of 8) as [rows / 8, blocks * x8 block
// bytes] (quant_x8_cpu.h, quant_x8_legacy_cpu.h).
at::Tensor interleave_rows(const at::Tensor& data, int type, int64_t K) {
  const int64_t groups = data.size(0) / 8, nb = K / block_values(type), row_bytes = data.size(1);
  const int64_t block = x8_block_bytes(type);
  at::Tensor out = at::empty({groups, nb * block}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) repack_x8(type, src + g * 8 * row_bytes, nb, dst + g * nb * block);
  });
  return out;
}

// Every row of x [M, K] as Q8_0 blocks (M * K / 32), on the threads, then zero blocks up to
// `rows` rows (the AMX tiles' whole sixteens).
std::vector<ActQ8_0> quantize_rows_q8_0(const float* x, int64_t M, int64_t K, int64_t rows) {
  std::vector<ActQ8_0> out(std::max(M, rows) * (K / kBlock));
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_row_q8_0(x + m * K, K, out.data() + m * (K / kBlock));
  });
  return out;
}

// Every row of x [M, K] as Q8_K blocks (M * K / 256), on the threads; zeros up to `rows` rows.
std::vector<ActQ8_K> quantize_rows_q8_k(const float* x, int64_t M, int64_t K, int64_t rows) {
  std::vector<ActQ8_K> out(std::max(M, rows) * (K / kBlockK));
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_row_q8_k(x + m * K, K, out.data() + m * (K / kBlockK));
  });
  return out;
}

// Rows ``ids`` of a [V, K] weight, each written by row(id, y) as float32, in ``dtype``:
// [..., K] (the embedding lookups and QuantLinear.rows).
template <typename RowFn>
at::Tensor gather_rows(const at::Tensor& ids, int64_t V, int64_t K, at::ScalarType dtype, const RowFn& row) {
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t T = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < V, "token id ", id[t], " >= ", V);
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) row(id[t], y + t * K);
  });
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  return out.to(dtype).view(shape);
}

void check_blocks(const at::Tensor& data, int type, int64_t K) {
  TORCH_CHECK(is_supported(type), "ggml type ", type, " has no quantised kernel");
  TORCH_CHECK(K % block_values(type) == 0, "K=", K, " is not a whole number of ", block_values(type),
              "-value blocks of ggml type ", type);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2, "quantised blocks: uint8 [rows, bytes]");
  TORCH_CHECK(data.size(1) == K / block_values(type) * block_bytes(type),
              "quantised rows hold ", data.size(1), " bytes, ggml type ", type, " needs ",
              K / block_values(type) * block_bytes(type), " for K=", K);
  TORCH_CHECK(data.stride(1) == 1 && data.stride(0) == data.size(1), "quantised rows must be contiguous");
}

#ifdef PAGEDATTN_QUANT_AMX
// Groups [0, pairs * 2) of an x8 part on the AMX tiles, two at a time: every activation row
// (act: rows16 rows, the rows past M zeros) against each pair; y[m * N + cols[n]] for m < M.
void run_x8_amx(int type, const uint8_t* blocks, int64_t group_bytes, int64_t pairs, int64_t nb,
                const void* act, int64_t M, int64_t rows16, const int32_t* cols, int64_t N, float* y) {
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    x8_amx::configure(x8_amx::values(type));
    std::vector<float> tmp(rows16 * 16);
    for (int64_t pair = p0; pair < p1; ++pair) {
      const uint8_t* g0 = blocks + 2 * pair * group_bytes;
      x8_amx::gemm_pair(type, g0, g0 + group_bytes, nb, act, rows16, tmp.data());
      for (int64_t m = 0; m < M; ++m) {
        for (int n = 0; n < 16; ++n) y[m * N + cols[16 * pair + n]] = tmp[m * 16 + n];
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

QuantLinear::QuantLinear(std::vector<at::Tensor> data, std::vector<int64_t> types,
                         std::vector<c10::optional<at::Tensor>> index, int64_t N, int64_t K,
                         c10::optional<at::Tensor> bias, int64_t prefill_rows, bool interleave,
                         int64_t amx_rows)
    : data_(std::move(data)), types_(std::move(types)), N_(N), K_(K), prefill_rows_(prefill_rows),
      amx_rows_(amx_rows) {
  TORCH_CHECK(data_.size() == types_.size() && index.size() == data_.size(),
              "QuantLinear: one type and one index per part");
  int64_t rows = 0;
  for (size_t p = 0; p < data_.size(); ++p) {
    check_blocks(data_[p], static_cast<int>(types_[p]), K);
    starts_.push_back(rows);
    std::vector<int32_t> cols(data_[p].size(0));
    if (index[p].has_value()) {
      const at::Tensor idx = index[p]->to(at::kInt).contiguous();
      TORCH_CHECK(idx.numel() == data_[p].size(0), "QuantLinear: one index per row");
      std::copy(idx.data_ptr<int32_t>(), idx.data_ptr<int32_t>() + idx.numel(), cols.begin());
    } else {
      for (size_t r = 0; r < cols.size(); ++r) cols[r] = static_cast<int32_t>(rows + r);
    }
    for (int32_t c : cols) TORCH_CHECK(c >= 0 && c < N, "QuantLinear: column ", c, " >= N=", N);
    cols_.push_back(std::move(cols));
    rows += data_[p].size(0);
    needs_q8_0_ |= !is_k_type(static_cast<int>(types_[p]));
    needs_q8_k_ |= is_k_type(static_cast<int>(types_[p]));
    // NOTE: every supported type (check_blocks) has an x8 form (quant_x8_legacy_cpu.h)
    const bool x8 = interleave && data_[p].size(0) % 8 == 0;
    x8_.push_back(x8);
    if (x8) data_[p] = interleave_rows(data_[p], static_cast<int>(types_[p]), K);
  }
  TORCH_CHECK(rows == N, "QuantLinear: parts hold ", rows, " rows, N=", N);
  row_of_col_.assign(N, {-1, -1});
  for (size_t p = 0; p < cols_.size(); ++p) {
    for (size_t r = 0; r < cols_[p].size(); ++r) row_of_col_[cols_[p][r]] = {static_cast<int32_t>(p), static_cast<int32_t>(r)};
  }
  for (const auto& [p, r] : row_of_col_) TORCH_CHECK(p >= 0, "QuantLinear: an output column no row fills");
  if (bias.has_value()) bias_ = bias->to(at::kFloat).contiguous();
}

at::Tensor QuantLinear::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.size(-1) == K_, "QuantLinear: input has ", x.size(-1), " features, K=", K_);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "QuantLinear: float32 or bfloat16 input");
  at::Tensor x32 = x.reshape({-1, K_}).to(at::kFloat).contiguous();
  const int64_t M = x32.size(0);
  at::Tensor out = at::empty({M, N_}, x32.options());
  if (M > 0) {
    if (M >= prefill_rows_) {
      prefill(x32, out);
    } else {
      decode(x32, out);
    }
    if (bias_.defined()) out.add_(bias_);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N_;
  return out.to(dtype).view(shape);
}

at::Tensor QuantLinear::rows(const at::Tensor& ids, at::ScalarType dtype) const {
  return gather_rows(ids, N_, K_, dtype, [&](int64_t id, float* y) {
    const auto [p, r] = row_of_col_[id];
    const int type = static_cast<int>(types_[p]);
    const uint8_t* base = data_[p].data_ptr<uint8_t>();
    const int64_t stride = data_[p].size(1), nb = K_ / block_values(type);
    const uint8_t* grp = base + r / 8 * stride;
    if (x8_[p]) {
      dequant_x8(type, grp, nb, r % 8, y);
    } else {
      dequant_row(type, base + r * stride, K_, y);
    }
  });
}

std::vector<std::string> QuantLinear::layouts() const {
  std::vector<std::string> out;
  for (bool x8 : x8_) out.emplace_back(x8 ? "x8" : "rows");
  return out;
}

int64_t QuantLinear::nbytes() const {
  int64_t total = 0;
  for (const auto& d : data_) total += d.numel();
  return total;
}

void QuantLinear::decode(const at::Tensor& x32, at::Tensor& out) const {
  const int64_t M = x32.size(0), K = K_;
  const float* x = x32.data_ptr<float>();
  const int64_t R = act_rows(M);
  const std::vector<ActQ8_0> a0 = needs_q8_0_ ? quantize_rows_q8_0(x, M, K, R) : std::vector<ActQ8_0>();
  const std::vector<ActQ8_K> ak = needs_q8_k_ ? quantize_rows_q8_k(x, M, K, R) : std::vector<ActQ8_K>();
  run_x8(a0, ak, M, out);
  if (std::all_of(x8_.begin(), x8_.end(), [](bool b) { return b; })) return;
  float* y = out.data_ptr<float>();
  const int64_t N = N_;
  // NOTE: part by part, so each one's rows are shared out over all threads (a fused layer's
  // x8 parts are done by then).
  for (size_t p = 0; p < data_.size(); ++p) {
    if (x8_[p]) continue;
    at::parallel_for(starts_[p], starts_[p] + data_[p].size(0), kRowsPerTask, [&](int64_t p0, int64_t p1) {
      const int type = static_cast<int>(types_[p]);
      const uint8_t* base = data_[p].data_ptr<uint8_t>();
      const int64_t row_bytes = data_[p].size(1);
      const bool k_type = is_k_type(type);
      for (int64_t n0 = p0; n0 < p1; n0 += kTileN) {
        const int64_t n1 = std::min(p1, n0 + kTileN);
        for (int64_t c0 = 0; c0 < M; c0 += kChunkM) {
          const int64_t c1 = std::min(M, c0 + kChunkM);
          for (int64_t n = n0; n < n1; ++n) {
            const int64_t r = n - starts_[p];
            const uint8_t* row = base + r * row_bytes;
            if (c0 == 0) prefetch_span(row + kRowPrefetchBytes, row_bytes);
            const int64_t col = cols_[p][r];
            for (int64_t m0 = c0; m0 < c1; m0 += kMaxRows) {
              const int mb = static_cast<int>(std::min<int64_t>(kMaxRows, c1 - m0));
              const void* act[kMaxRows];
              for (int i = 0; i < mb; ++i) {
                act[i] = k_type ? static_cast<const void*>(ak.data() + (m0 + i) * (K / kBlockK))
                                : static_cast<const void*>(a0.data() + (m0 + i) * (K / kBlock));
              }
              float sums[kMaxRows];
              dot_rows_n(mb, type, row, K, act, sums);
              for (int i = 0; i < mb; ++i) y[(m0 + i) * N + col] = sums[i];
            }
          }
        }
      }
    });
  }
}

// Whether the x8 parts can run on AMX-INT8 tiles here (quant_amx_cpu.h): built for them, and
// Linux granted the tiles.
bool quant_amx_available() {
#ifdef PAGEDATTN_QUANT_AMX
  return linear_amx_available();
#else
  return false;
#endif
}

// Whether the x8 parts run on the AMX tiles at this many rows.
bool QuantLinear::amx(int64_t M) const {
  return amx_rows_ > 0 && M >= amx_rows_ && quant_amx_available();
}

// Rows the activations are quantised into: whole sixteens where the tiles run.
int64_t QuantLinear::act_rows(int64_t M) const { return amx(M) ? (M + 15) / 16 * 16 : M; }

// The interleaved parts: each thread takes whole groups of 8 rows; activation rows are met in
// chunks that stay in L2 (kChunkBytes), kX8Rows at a time (fewer for the last). From amx_rows_
// rows the tiles take the groups two at a time (an odd count's last one stays here).
void QuantLinear::run_x8(const std::vector<ActQ8_0>& a0, const std::vector<ActQ8_K>& ak, int64_t M,
                         at::Tensor& out) const {
  constexpr int64_t kChunkBytes = 256 << 10;
  if (std::none_of(x8_.begin(), x8_.end(), [](bool b) { return b; })) return;
  const int64_t N = N_;
  float* y = out.data_ptr<float>();
  for (size_t p = 0; p < data_.size(); ++p) {
    if (!x8_[p]) continue;
    const int type = static_cast<int>(types_[p]);
    const bool legacy = !is_k_type(type);  // Q8_0 activation blocks
    const int64_t nb = K_ / block_values(type);
    const int64_t act_bytes = nb * static_cast<int64_t>(legacy ? sizeof(ActQ8_0) : sizeof(ActQ8_K));
    const int64_t chunk = std::max<int64_t>(kX8Rows, kChunkBytes / act_bytes / kX8Rows * kX8Rows);
    const uint8_t* blocks = data_[p].data_ptr<uint8_t>();
    const int64_t group_bytes = data_[p].size(1), groups = data_[p].size(0);
    const std::vector<int32_t>& cols = cols_[p];
    int64_t first = 0;  // the groups from here run the AVX kernels
#ifdef PAGEDATTN_QUANT_AMX
    if (amx(M) && has_x8_amx(type)) {
      first = groups / 2 * 2;
      const void* act = legacy ? static_cast<const void*>(a0.data()) : static_cast<const void*>(ak.data());
      run_x8_amx(type, blocks, group_bytes, groups / 2, nb, act, M, act_rows(M), cols.data(), N, y);
    }
#endif
    const bool pairs = has_x8_pair(type, M);  // two groups at once (quant_x8_zmm_cpu.h)
    at::parallel_for(first, groups, 1, [&](int64_t g0, int64_t g1) {
      float tmp[kX8Rows * 16];
      for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t c1 = std::min(M, c0 + chunk);
        for (int64_t g = g0; g < g1; ++g) {
          const uint8_t* grp = blocks + g * group_bytes;
          const int w = pairs && g + 1 < g1 ? 16 : 8;
          for (int64_t m0 = c0; m0 < c1; m0 += kX8Rows) {
            const int mb = static_cast<int>(std::min<int64_t>(kX8Rows, c1 - m0));
            const void* act[kX8Rows];
            for (int i = 0; i < mb; ++i) {
              act[i] = legacy ? static_cast<const void*>(a0.data() + (m0 + i) * nb)
                            : static_cast<const void*>(ak.data() + (m0 + i) * nb);
            }
            const bool first = m0 == c0;  // the chunk's later rows find the group in cache
#ifdef PAGEDATTN_X8_PAIRS
            if (w == 16) gemm_x8_pair_rows(mb, type, grp, group_bytes, nb, act, tmp, first);
#endif
            if (w == 8) gemm_x8_rows(mb, type, grp, nb, act, tmp, first);
            for (int i = 0; i < mb; ++i) {
              for (int r = 0; r < w; ++r) y[(m0 + i) * N + cols[8 * g + r]] = tmp[w * i + r];
            }
          }
          g += w / 16;
        }
      }
    });
  }
}

void QuantLinear::prefill(const at::Tensor& x32, at::Tensor& out) const {
  const int64_t K = K_;
  const int64_t tile_rows = std::max<int64_t>(16, kTileFloats / K);
  at::Tensor tile = at::empty({tile_rows, K}, x32.options());
  bool tiles_need_q8_0 = false, tiles_need_q8_k = false, x8_q8_0 = false, x8_q8_k = false;
  for (size_t p = 0; p < data_.size(); ++p) {
    const bool k_type = is_k_type(static_cast<int>(types_[p]));
    if (x8_[p]) {
      (k_type ? x8_q8_k : x8_q8_0) = true;
    } else {
      (k_type ? tiles_need_q8_k : tiles_need_q8_0) = true;
    }
  }
  at::Tensor x_q8_0 = tiles_need_q8_0 ? as_int8_activations(x32, false) : at::Tensor();
  at::Tensor x_q8_k = tiles_need_q8_k ? as_int8_activations(x32, true) : at::Tensor();
  if (x8_q8_0 || x8_q8_k) {
    const float* x = x32.data_ptr<float>();
    const int64_t M = x32.size(0);
    const int64_t R = act_rows(M);
    run_x8(x8_q8_0 ? quantize_rows_q8_0(x, M, K, R) : std::vector<ActQ8_0>(),
           x8_q8_k ? quantize_rows_q8_k(x, M, K, R) : std::vector<ActQ8_K>(), M, out);
  }
  for (size_t p = 0; p < data_.size(); ++p) {
    if (x8_[p]) continue;
    const int type = static_cast<int>(types_[p]);
    const at::Tensor& xq = is_k_type(type) ? x_q8_k : x_q8_0;
    const uint8_t* base = data_[p].data_ptr<uint8_t>();
    const int64_t rows = data_[p].size(0), row_bytes = data_[p].size(1);
    bool contiguous_cols = true;
    for (int64_t r = 0; r < rows; ++r) contiguous_cols &= cols_[p][r] == cols_[p][0] + r;
    for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
      const int64_t t = std::min(tile_rows, rows - r0);
      float* w = tile.data_ptr<float>();
      at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) dequant_row(type, base + (r0 + i) * row_bytes, K, w + i * K);
      });
      at::Tensor part = at::mm(xq, tile.narrow(0, 0, t).t());  // [M, t]
      if (contiguous_cols) {
        out.narrow(1, cols_[p][r0], t).copy_(part);
      } else {
        at::Tensor idx = at::from_blob(const_cast<int32_t*>(cols_[p].data() + r0), {t},
                                       at::TensorOptions().dtype(at::kInt)).to(at::kLong);
        out.index_copy_(1, idx, part);
      }
    }
  }
}

// Rows ``ids`` of a [V, K] quantised table, dequantised, in ``dtype``: [T, K].
at::Tensor quant_embedding(const at::Tensor& data, int64_t type, int64_t K, const at::Tensor& ids,
                           at::ScalarType dtype) {
  check_blocks(data, static_cast<int>(type), K);
  const uint8_t* base = data.data_ptr<uint8_t>();
  const int64_t row_bytes = data.size(1);
  return gather_rows(ids, data.size(0), K, dtype, [&](int64_t id, float* y) {
    dequant_row(static_cast<int>(type), base + id * row_bytes, K, y);
  });
}

// A whole [rows, K] quantised tensor as float32 (the dequantised path and tests).
at::Tensor quant_dequantize(const at::Tensor& data, int64_t type, int64_t K) {
  check_blocks(data, static_cast<int>(type), K);
  const int64_t rows = data.size(0), row_bytes = data.size(1);
  at::Tensor out = at::empty({rows, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* base = data.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) dequant_row(static_cast<int>(type), base + r * row_bytes, K, y + r * K);
  });
  return out;
}

// Whether the dot kernels run on x86 vector instructions here (AVX2 maddubs / VNNI).
std::string quant_kernel_isa() {
#ifdef PAGEDATTN_QUANT_VNNI
  return "avx512vnni";
#elif defined(PAGEDATTN_QUANT_X86)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace pagedattn_quant

void bind_quant(pybind11::module_& m) {
  namespace py = pybind11;
  using pagedattn_quant::QuantLinear;
  // NOTE: held by shared_ptr: the decode stack (decode_stack_cpu.cpp) calls the same layers.
  py::class_<QuantLinear, std::shared_ptr<QuantLinear>>(m, "QuantLinear")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<c10::optional<at::Tensor>>, int64_t, int64_t,
                    c10::optional<at::Tensor>, int64_t, bool, int64_t>(),
           py::arg("data"), py::arg("types"), py::arg("index"), py::arg("N"), py::arg("K"),
           py::arg("bias"), py::arg("prefill_rows"), py::arg("interleave") = true,
           py::arg("amx_rows") = 0)
      .def("forward", &QuantLinear::forward, "y = x @ W^T (+ bias), W in GGUF blocks")
      .def("nbytes", &QuantLinear::nbytes, "Bytes of the stored blocks")
      .def("rows", &QuantLinear::rows,
           "Rows ``ids`` of the weight (output features), dequantised, in ``dtype``",
           py::arg("ids"), py::arg("dtype"))
      .def("layouts", &QuantLinear::layouts,
           "Per part: 'x8' (rows interleaved 8 at a time) or 'rows' (blocks as stored)")
      .def_property_readonly("prefill_rows", &QuantLinear::prefill_rows,
                             "Rows from which forward dequantises tiles (below: int8 dot kernels)");
  m.def("quant_embedding", &pagedattn_quant::quant_embedding,
        "Rows of a GGUF-block table, dequantised", py::arg("data"), py::arg("type"), py::arg("K"),
        py::arg("ids"), py::arg("dtype"));
  m.def("quant_dequantize", &pagedattn_quant::quant_dequantize,
        "A GGUF-block tensor [rows, K] as float32", py::arg("data"), py::arg("type"), py::arg("K"));
  m.def("quant_amx_available", &pagedattn_quant::quant_amx_available,
        "Whether interleaved Q4_K, Q6_K and Q8_0 layers can run on AMX-INT8 tiles here");
  m.def("quant_kernel_isa", &pagedattn_quant::quant_kernel_isa,
        "The instructions the quantised dot kernels run on: avx512vnni, avx2 or scalar");
}
