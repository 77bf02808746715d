// Small per-layer ops of a CPU forward step, each one call instead of a chain of PyTorch ops:
// writing K/V into the paged cache through the slot mapping, and the rotary embedding in place.
//
// Both compute exactly what the PyTorch code they replace computes (pagedattn.attention.ops.
// reshape_and_cache and pagedattn.model.layers.apply_rotary): the cache write is a copy, and the
// rotation rounds after every multiply and add, in the tensor's dtype, with no fused multiply-add.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace {

using bf16 = c10::BFloat16;

// The slot value the engine uses for padding tokens (pagedattn.attention.layout.PAD_SLOT_ID).
constexpr int64_t kPadSlot = -1;

template <typename S>
void write_rows(const torch::Tensor& src, torch::Tensor& cache, const S* slots, int64_t T) {
  const int64_t heads = src.size(1), D = src.size(2);
  const int64_t row_bytes = D * src.element_size();
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  const char* base = static_cast<const char*>(src.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t esize = src.element_size();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot == kPadSlot) continue;
    char* out = dst + slot * heads * row_bytes;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(out + h * row_bytes, base + (t * s0 + h * s1) * esize, row_bytes);
    }
  }
}

// Neox rotation of one [D] row: out[i] = x[i] cos[i] - x[i+h] sin[i],
// out[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h]; each product and the sum rounded to T.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_row(T* x, const T* cos, const T* sin,
                                                              int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const T a1 = static_cast<T>(x1 * static_cast<float>(cos[i]));
    const T b1 = static_cast<T>(-x2 * static_cast<float>(sin[i]));
    const T a2 = static_cast<T>(x2 * static_cast<float>(cos[i + half]));
    const T b2 = static_cast<T>(x1 * static_cast<float>(sin[i + half]));
    x[i] = static_cast<T>(static_cast<float>(a1) + static_cast<float>(b1));
    x[i + half] = static_cast<T>(static_cast<float>(a2) + static_cast<float>(b2));
  }
}

template <typename T>
void rotate(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; ++h) rotate_row<T>(xp + t * s0 + h * s1, cp + t * D, sp + t * D, D / 2);
    }
  });
}

}  // namespace

// key/value [T, Hkv, D] (any row strides, D contiguous); caches [num_blocks, B, Hkv, D]
// contiguous in the same dtype; slot_mapping [T'] int32/int64 with T' <= T (-1 = skip).
void cache_write(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                 torch::Tensor value_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value must be [T, Hkv, D]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, B, Hkv, D] (flash layout)");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == value_cache.scalar_type(),
              "key/value and the caches must share a dtype");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3) &&
                  value.sizes() == key.sizes(),
              "key/value heads and head size must match the cache");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous(), "slot_mapping must be 1-D");
  const int64_t T = slot_mapping.size(0);
  TORCH_CHECK(key.size(0) >= T, "slot_mapping has ", T, " entries but key has ", key.size(0),
              " tokens");
  if (slot_mapping.scalar_type() == torch::kInt64) {
    write_rows<int64_t>(key, key_cache, slot_mapping.data_ptr<int64_t>(), T);
    write_rows<int64_t>(value, value_cache, slot_mapping.data_ptr<int64_t>(), T);
  } else {
    TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt32, "slot_mapping must be int32/int64");
    write_rows<int32_t>(key, key_cache, slot_mapping.data_ptr<int32_t>(), T);
    write_rows<int32_t>(value, value_cache, slot_mapping.data_ptr<int32_t>(), T);
  }
}

// x [T, H, D] (any token/head strides, D contiguous) rotated in place by cos/sin [T, D].
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with contiguous rows");
  TORCH_CHECK(x.size(2) % 2 == 0, "head size must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2),
              "cos/sin must be contiguous [T, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos/sin must have x's dtype");
  if (x.scalar_type() == torch::kFloat32) {
    rotate<float>(x, cos, sin);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rotary_inplace takes float32 or bfloat16");
    rotate<bf16>(x, cos, sin);
  }
}
