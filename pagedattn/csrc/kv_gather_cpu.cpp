// Gathering whole blocks of an fp8 paged KV cache through a block list, dequantized as they are
// copied: out[i] = cache[block_ids[i]] * scale, in float32 or bfloat16.
//
// The PyTorch path (index_select, then float8 -> float) reads the context twice and its float8
// conversion runs one element at a time (~3 ns each here); this op widens 8 or 16 bytes per
// instruction with vec_cpu.h's fp8 load, the one the decode kernel uses. The product is rounded
// once, as (x.float() * scale).to(dtype) rounds it, so the result is bit-identical to the torch
// reference (pagedattn.attention.fp8.dequantize).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ops_cpu.h"
#include "vec_cpu.h"

namespace {

using bf16 = c10::BFloat16;
using pagedattn_vec::fVec;
using pagedattn_vec::kWidth;
using pagedattn_vec::load;
using pagedattn_vec::store;

template <typename F, typename T>
void gather_rows(const F* cache, const int64_t* ids, T* out, int64_t n, int64_t row,
                 float scale) {
  // NOTE: load() of e4m3 gives the value / 256 (vec_cpu.h); unit * scale is exact (power of 2).
  const float mul = pagedattn_vec::kFp8Unit<F> * scale;
  const fVec vmul(mul);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const F* src = cache + ids[i] * row;
      T* dst = out + i * row;
      int64_t j = 0;
      for (; j + kWidth <= row; j += kWidth) store(dst + j, load(src + j) * vmul);
      if (j < row) store(dst + j, load(src + j, row - j) * vmul, row - j);
    }
  });
}

template <typename F>
void gather_typed(const torch::Tensor& cache, const int64_t* ids, torch::Tensor& out, int64_t n,
                  int64_t row, float scale) {
  const F* src = reinterpret_cast<const F*>(cache.data_ptr());
  if (out.scalar_type() == torch::kFloat32) {
    gather_rows<F, float>(src, ids, out.data_ptr<float>(), n, row, scale);
  } else {
    gather_rows<F, bf16>(src, ids, reinterpret_cast<bf16*>(out.data_ptr()), n, row, scale);
  }
}

}  // namespace

void gather_dequant_fp8(torch::Tensor out, torch::Tensor cache, torch::Tensor block_ids,
                        double scale) {
  const auto kind = cache.scalar_type();
  TORCH_CHECK(kind == torch::kFloat8_e4m3fn || kind == torch::kFloat8_e5m2,
              "gather_dequant_fp8 reads an fp8 (e4m3 / e5m2) cache, not ", kind);
  TORCH_CHECK(cache.dim() >= 2 && cache.is_contiguous(), "the cache must be contiguous blocks");
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == torch::kInt64 &&
                  block_ids.is_contiguous(),
              "block_ids must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16,
              "out must be float32 or bfloat16");
  const int64_t n = block_ids.size(0), num_blocks = cache.size(0);
  const int64_t row = cache.numel() / std::max<int64_t>(num_blocks, 1);
  TORCH_CHECK(out.is_contiguous() && out.numel() == n * row,
              "out must be contiguous with block_ids.size(0) blocks of the cache's shape");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "block id ", ids[i], " is out of range [0, ",
                num_blocks, ")");
  }
  const float sc = static_cast<float>(scale);
  if (kind == torch::kFloat8_e4m3fn) {
    gather_typed<pagedattn_vec::fp8_e4m3>(cache, ids, out, n, row, sc);
  } else {
    gather_typed<pagedattn_vec::fp8_e5m2>(cache, ids, out, n, row, sc);
  }
}

// Whole blocks of a u8 cache [num_blocks, B, Hkv, D + 8] through a block list, dequantized into
// out [n, B, Hkv, D]: q * scale + min per row (two roundings, as u8.dequantize).
void gather_dequant_u8(torch::Tensor out, torch::Tensor cache, torch::Tensor block_ids) {
  TORCH_CHECK(cache.scalar_type() == torch::kByte && cache.dim() == 4 && cache.is_contiguous(),
              "gather_dequant_u8 reads a contiguous u8 cache [num_blocks, B, Hkv, D + 8]");
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == torch::kInt64 &&
                  block_ids.is_contiguous(),
              "block_ids must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16,
              "out must be float32 or bfloat16");
  const int64_t n = block_ids.size(0), num_blocks = cache.size(0);
  const int64_t row = cache.size(3), D = row - 8;
  const int64_t rows_per_block = cache.size(1) * cache.size(2);
  TORCH_CHECK(D > 0 && out.is_contiguous() && out.numel() == n * rows_per_block * D,
              "out must be contiguous [n, B, Hkv, D]");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "block id ", ids[i], " is out of range [0, ",
                num_blocks, ")");
  }
  const uint8_t* src = cache.data_ptr<uint8_t>();
  auto run = [&](auto* dst) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t r = 0; r < rows_per_block; ++r) {
          const uint8_t* q = src + (ids[b] * rows_per_block + r) * row;
          auto* o = dst + (b * rows_per_block + r) * D;
          float sc, mn;
          std::memcpy(&sc, q + D, sizeof(float));
          std::memcpy(&mn, q + D + sizeof(float), sizeof(float));
          const fVec vsc(sc), vmn(mn);
          int64_t j = 0;
          for (; j + kWidth <= D; j += kWidth) store(o + j, load(q + j) * vsc + vmn);
          if (j < D) store(o + j, load(q + j, D - j) * vsc + vmn, D - j);
        }
      }
    });
  };
  if (out.scalar_type() == torch::kFloat32) {
    run(out.data_ptr<float>());
  } else {
    run(reinterpret_cast<bf16*>(out.data_ptr()));
  }
}
