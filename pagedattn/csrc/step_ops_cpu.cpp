// Small per-layer ops of a CPU forward step, each one call instead of a chain of PyTorch ops:
// writing K/V into the paged cache through the slot mapping, the rotary embedding in place,
// RMSNorm (optionally adding the residual first), Gemma's (1 + w) RMSNorm, SwiGLU, GeGLU, and
// the greedy argmax over logits.
//
// The cache write and the rotation compute exactly what the PyTorch code they replace computes
// (pagedattn.attention.ops.reshape_and_cache, pagedattn.model.layers.apply_rotary): a copy, and a
// rotation that rounds after every multiply and add, in the tensor's dtype, with no fused
// multiply-add. The norms and the gated activations round where the PyTorch code rounds, but sum
// squares and take exp/tanh in their own way, so they can differ from it in the last bits of fp32.
// All of them are written on vec_cpu.h's vectors (one source for AVX2, AVX-512 and NEON); the
// build passes -ffp-contract=off, so a multiply and an add are never fused behind the code's back
// (the rotation rounds after each).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_cpu.h"

namespace {

using bf16 = c10::BFloat16;
using pagedattn_vec::fVec;
using pagedattn_vec::kWidth;
using pagedattn_vec::load;
using pagedattn_vec::round_as;
using pagedattn_vec::store;

// The slot value the engine uses for padding tokens (pagedattn.attention.layout.PAD_SLOT_ID).
constexpr int64_t kPadSlot = -1;
constexpr int64_t kU8ScaleBytes = 8;  // a u8 cache row's trailer: float32 scale, float32 min

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

// write_rows into an fp8 cache: each element x / scale, saturated to the format's largest finite
// value (no NaN/Inf is ever stored), rounded to nearest even as torch's conversion (c10's type).
template <typename S, typename Src, typename F>
void write_rows_fp8(const torch::Tensor& src, torch::Tensor& cache, const S* slots, int64_t T,
                    float scale) {
  const int64_t heads = src.size(1), D = src.size(2);
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  const Src* base = static_cast<const Src*>(src.data_ptr());
  uint8_t* dst = static_cast<uint8_t*>(cache.data_ptr());
  const float limit = static_cast<float>(std::numeric_limits<F>::max());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot == kPadSlot) continue;
    uint8_t* out = dst + slot * heads * D;
    for (int64_t h = 0; h < heads; ++h) {
      const Src* row = base + t * s0 + h * s1;
      for (int64_t i = 0; i < D; ++i) {
        const float x = std::min(std::max(static_cast<float>(row[i]) / scale, -limit), limit);
        out[h * D + i] = F(x).x;
      }
    }
  }
}

// write_rows into a u8 cache (pagedattn/attention/u8.py): each [D] row as D bytes
// round((x - min) * (1 / scale)) with scale = (max - min) / 255, then scale and min as float32.
// The float32 operations and their order are u8.quantize's, so the bytes are the same.
template <typename S, typename Src>
void write_rows_u8(const torch::Tensor& src, torch::Tensor& cache, const S* slots, int64_t T) {
  const int64_t heads = src.size(1), D = src.size(2), row = D + kU8ScaleBytes;
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  const Src* base = static_cast<const Src*>(src.data_ptr());
  uint8_t* dst = static_cast<uint8_t*>(cache.data_ptr());
  const float inv255 = static_cast<float>(1.0 / 255.0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot == kPadSlot) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const Src* x = base + t * s0 + h * s1;
      uint8_t* out = dst + (slot * heads + h) * row;
      float lo = static_cast<float>(x[0]), hi = lo;
      for (int64_t i = 1; i < D; ++i) {
        const float v = static_cast<float>(x[i]);
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      const float scale = (hi - lo) * inv255;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      for (int64_t i = 0; i < D; ++i) {
        const float q = std::nearbyint((static_cast<float>(x[i]) - lo) * inv);
        out[i] = static_cast<uint8_t>(std::min(std::max(q, 0.0f), 255.0f));
      }
      std::memcpy(out + D, &scale, sizeof(float));
      std::memcpy(out + D + sizeof(float), &lo, sizeof(float));
    }
  }
}

template <typename S>
void write_rows_u8_any(const torch::Tensor& src, torch::Tensor& cache, const S* slots, int64_t T) {
  if (src.scalar_type() == torch::kFloat32) {
    write_rows_u8<S, float>(src, cache, slots, T);
  } else {
    write_rows_u8<S, bf16>(src, cache, slots, T);
  }
}

template <typename S>
void write_rows_quantized(const torch::Tensor& src, torch::Tensor& cache, const S* slots,
                          int64_t T, double scale) {
  const bool e4m3 = cache.scalar_type() == torch::kFloat8_e4m3fn;
  const float sc = static_cast<float>(scale);
  if (src.scalar_type() == torch::kFloat32) {
    e4m3 ? write_rows_fp8<S, float, c10::Float8_e4m3fn>(src, cache, slots, T, sc)
         : write_rows_fp8<S, float, c10::Float8_e5m2>(src, cache, slots, T, sc);
  } else {
    e4m3 ? write_rows_fp8<S, bf16, c10::Float8_e4m3fn>(src, cache, slots, T, sc)
         : write_rows_fp8<S, bf16, c10::Float8_e5m2>(src, cache, slots, T, sc);
  }
}

// Rows per thread, at least, of the row-wise step ops (norms, activations, rotary): fewer rows
// run on the calling thread, where a parallel region would cost more than the work.
// NOTE: was 256 rows (64 for the activations), so a decode step's 32 rows ran on one thread
// while the other waited: SmolLM2 bf16 at 32 rows, AMX Xeon, the worker thread spent 35% of
// the decode step idle, the main thread 4.8% in rms_rows and 4.7% in silu_mul_rows.
constexpr int64_t kRowsPerThread = 8;

// body(r0, r1) over [0, rows): split across threads when each gets kRowsPerThread rows or more.
template <typename Body>
void for_rows(int64_t rows, const Body& body) {
  if (rows < 2 * kRowsPerThread) {
    body(0, rows);
  } else {
    at::parallel_for(0, rows, kRowsPerThread, body);
  }
}

// Neox rotation of one [D] row: out[i] = x[i] cos[i] - x[i+h] sin[i],
// out[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h]; each product and the sum rounded to T.
template <typename T>
void rotate_row(T* x, const T* cos, const T* sin, int64_t half) {
  using pagedattn_vec::round_as;
  int64_t i = 0;
  for (; i + kWidth <= half; i += kWidth) {
    const fVec x1 = load(x + i), x2 = load(x + i + half);
    const fVec a1 = round_as(x1 * load(cos + i), x), b1 = round_as(fVec(-0.0f) - x2 * load(sin + i), x);
    const fVec a2 = round_as(x2 * load(cos + i + half), x);
    const fVec b2 = round_as(x1 * load(sin + i + half), x);
    store(x + i, a1 + b1);
    store(x + i + half, a2 + b2);
  }
  for (; i < half; ++i) {
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
  for_rows(T_, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; ++h) rotate_row<T>(xp + t * s0 + h * s1, cp + t * D, sp + t * D, D / 2);
    }
  });
}

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), with x = T(x + residual) stored back into
// residual first when residual is given. Llama's RMSNorm, in fp32 between the roundings.
template <typename T>
void rms_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t H,
              float eps) {
  auto body = [&](int64_t r0, int64_t r1) {
    std::vector<float> row(H);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      float ss = 0.0f;
      int64_t i0 = 0;
      if (residual != nullptr) {
        T* res = residual + r * H;
        for (; i0 + kWidth <= H; i0 += kWidth) {
          const fVec sum = load(xr + i0) + load(res + i0);
          store(res + i0, sum);
          store(row.data() + i0, round_as(sum, xr));
        }
        for (int64_t i = i0; i < H; ++i) {
          const T sum = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(res[i]));
          res[i] = sum;
          row[i] = static_cast<float>(sum);
        }
      } else {
        for (int64_t i = 0; i < H; ++i) row[i] = static_cast<float>(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + r * H;
      int64_t j0 = 0;
      const fVec vinv(inv);
      for (; j0 + kWidth <= H; j0 += kWidth) {
        const fVec normed = round_as(load(row.data() + j0) * vinv, o);
        store(o + j0, load(weight + j0) * normed);
      }
      for (int64_t i = j0; i < H; ++i) {
        const float normed = static_cast<float>(round_to<T>(row[i] * inv));
        o[i] = round_to<T>(static_cast<float>(weight[i]) * normed);
      }
    }
  };
  for_rows(rows, body);
}

// out[t, i] = T(T(silu(g)) * u) with g = gate_up[t, i], u = gate_up[t, I + i].
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
      int64_t i = 0;
      const fVec one(1.0f), zero(0.0f);
      for (; i + kWidth <= I; i += kWidth) {
        const fVec gv = load(g + i);
        // silu(g) = g / (1 + exp(-g)); exp_nonpos takes arguments <= 0, so use exp(-|g|):
        // for g < 0, g / (1 + exp(-g)) = g * e / (1 + e) with e = exp(g).
        const fVec e = pagedattn_vec::exp_nonpos(zero - gv.abs());
        const fVec numer = fVec::blendv(gv, gv * e, gv < zero);
        const fVec silu = round_as(numer / (one + e), g);
        store(o + i, silu * load(u + i));
      }
      for (; i < I; ++i) {
        const float gv = static_cast<float>(g[i]);
        const T silu = round_to<T>(gv / (1.0f + std::exp(-gv)));
        o[i] = round_to<T>(static_cast<float>(silu) * static_cast<float>(u[i]));
      }
    }
  };
  for_rows(rows, body);
}

// out = T(x * rsqrt(mean(x^2) + eps) * (1 + weight)): Gemma's RMSNorm, all in fp32 and rounded
// once (the weights are zero-centred).
template <typename T>
void gemma_rms_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t H, float eps) {
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        const float v = static_cast<float>(xr[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + r * H;
      int64_t i = 0;
      const fVec vinv(inv), one(1.0f);
      for (; i + kWidth <= H; i += kWidth) {
        store(o + i, (load(xr + i) * vinv) * (one + load(weight + i)));
      }
      for (; i < H; ++i) {
        const float scale = 1.0f + static_cast<float>(weight[i]);
        o[i] = round_to<T>(static_cast<float>(xr[i]) * inv * scale);
      }
    }
  };
  for_rows(rows, body);
}

// gelu with the tanh approximation: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
constexpr float kGeluC = 0.7978845608028654f, kGeluA = 0.044715f;

// out[t, i] = T(T(gelu_tanh(g)) * u) with g = gate_up[t, i], u = gate_up[t, I + i] (GeGLU).
template <typename T>
void gelu_tanh_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
      int64_t i = 0;
      const fVec half(0.5f), one(1.0f), zero(0.0f), minus_two(-2.0f);
      const fVec c(kGeluC), a(kGeluA);
      for (; i + kWidth <= I; i += kWidth) {
        const fVec gv = load(g + i);
        const fVec y = c * at::vec::fmadd(a * gv, gv * gv, gv);
        // tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2 |y|) <= 1, then y's sign.
        const fVec e = pagedattn_vec::exp_nonpos(minus_two * y.abs());
        fVec t = (one - e) / (one + e);
        t = fVec::blendv(t, zero - t, y < zero);
        const fVec gelu = round_as((half * gv) * (one + t), g);
        store(o + i, gelu * load(u + i));
      }
      for (; i < I; ++i) {
        const float gv = static_cast<float>(g[i]);
        const float t = std::tanh(kGeluC * (gv + kGeluA * gv * gv * gv));
        const T gelu = round_to<T>(0.5f * gv * (1.0f + t));
        o[i] = round_to<T>(static_cast<float>(gelu) * static_cast<float>(u[i]));
      }
    }
  };
  for_rows(rows, body);
}

// Index of the first maximum of each row; a NaN counts as the maximum (the first NaN wins), as
// in torch.argmax. Two passes: the maximum (and whether any NaN exists), then its first position.
// T is float or bf16 (compared as their exact fp32 values).
template <typename T>
void argmax_rows(const T* x, int64_t* out, int64_t rows, int64_t V) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * V;
      float best = -std::numeric_limits<float>::infinity();
      bool has_nan = false;
      int64_t i = 0;
      fVec vmax(best), nan_lanes(0.0f);
      for (; i + kWidth <= V; i += kWidth) {
        const fVec v = load(row + i);
        nan_lanes = nan_lanes | v.isnan();
        vmax = at::vec::maximum(vmax, v);  // NOTE: NaN lanes propagate; has_nan covers them
      }
      best = at::vec::vec_reduce_all(
          [](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, vmax);
      has_nan = nan_lanes.zero_mask() != (1 << kWidth) - 1;
      for (; i < V; ++i) {
        const float v = static_cast<float>(row[i]);
        has_nan |= std::isnan(v);
        best = v > best ? v : best;
      }
      int64_t idx = -1;
      i = 0;
      if (!has_nan) {
        const fVec target(best);
        for (; i + kWidth <= V; i += kWidth) {
          // zero_mask: a bit per lane that is not the maximum.
          const int hit = ~(load(row + i) == target).zero_mask() & ((1 << kWidth) - 1);
          if (hit != 0) {
            idx = i + __builtin_ctz(static_cast<unsigned>(hit));
            break;
          }
        }
      }
      for (; idx < 0 && i < V; ++i) {
        const float v = static_cast<float>(row[i]);
        if (has_nan ? std::isnan(v) : v == best) idx = i;
      }
      idx = idx < 0 ? 0 : idx;
      out[r] = idx;
    }
  });
}

}  // namespace

// key/value [T, Hkv, D] (any row strides, D contiguous); caches [num_blocks, B, Hkv, D]
// contiguous in the same dtype; slot_mapping [T'] int32/int64 with T' <= T (-1 = skip).
void cache_write(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                 torch::Tensor value_cache, torch::Tensor slot_mapping, double k_scale,
                 double v_scale) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value must be [T, Hkv, D]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, B, Hkv, D] (flash layout)");
  const bool fp8 = key_cache.scalar_type() == torch::kFloat8_e4m3fn ||
                   key_cache.scalar_type() == torch::kFloat8_e5m2;
  const bool u8 = key_cache.scalar_type() == torch::kByte;
  TORCH_CHECK((fp8 || u8) ? (value_cache.scalar_type() == key_cache.scalar_type() &&
                     key.scalar_type() == value.scalar_type() &&
                     (key.scalar_type() == torch::kFloat32 || key.scalar_type() == torch::kBFloat16))
                  : (key.scalar_type() == key_cache.scalar_type() &&
                     value.scalar_type() == value_cache.scalar_type()),
              "key/value and the caches must share a dtype (fp8/u8 caches: float32/bfloat16 K/V)");
  const int64_t cache_row = key.size(2) + (u8 ? kU8ScaleBytes : 0);
  TORCH_CHECK(key.size(1) == key_cache.size(2) && cache_row == key_cache.size(3) &&
                  value.sizes() == key.sizes(),
              "key/value heads and head size must match the cache");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous(), "slot_mapping must be 1-D");
  const int64_t T = slot_mapping.size(0);
  TORCH_CHECK(key.size(0) >= T, "slot_mapping has ", T, " entries but key has ", key.size(0),
              " tokens");
  if (u8) {
    if (slot_mapping.scalar_type() == torch::kInt64) {
      write_rows_u8_any<int64_t>(key, key_cache, slot_mapping.data_ptr<int64_t>(), T);
      write_rows_u8_any<int64_t>(value, value_cache, slot_mapping.data_ptr<int64_t>(), T);
    } else {
      TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt32, "slot_mapping must be int32/int64");
      write_rows_u8_any<int32_t>(key, key_cache, slot_mapping.data_ptr<int32_t>(), T);
      write_rows_u8_any<int32_t>(value, value_cache, slot_mapping.data_ptr<int32_t>(), T);
    }
    return;
  }
  if (fp8) {
    TORCH_CHECK(k_scale > 0 && v_scale > 0, "k_scale and v_scale must be positive");
    if (slot_mapping.scalar_type() == torch::kInt64) {
      write_rows_quantized<int64_t>(key, key_cache, slot_mapping.data_ptr<int64_t>(), T, k_scale);
      write_rows_quantized<int64_t>(value, value_cache, slot_mapping.data_ptr<int64_t>(), T,
                                    v_scale);
    } else {
      TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt32, "slot_mapping must be int32/int64");
      write_rows_quantized<int32_t>(key, key_cache, slot_mapping.data_ptr<int32_t>(), T, k_scale);
      write_rows_quantized<int32_t>(value, value_cache, slot_mapping.data_ptr<int32_t>(), T,
                                    v_scale);
    }
    return;
  }
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

// x [T, H] contiguous; weight [H]; residual [T, H] (updated in place to x + residual) or None.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [H] in x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must be contiguous, with x's shape and dtype");
  }
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), H = x.size(1);
  if (x.scalar_type() == torch::kFloat32) {
    rms_rows<float>(x.data_ptr<float>(),
                    residual.has_value() ? residual->data_ptr<float>() : nullptr,
                    weight.data_ptr<float>(), out.data_ptr<float>(), rows, H,
                    static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rms_norm takes float32 or bfloat16");
    rms_rows<bf16>(x.data_ptr<bf16>(), residual.has_value() ? residual->data_ptr<bf16>() : nullptr,
                   weight.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, H,
                   static_cast<float>(eps));
  }
  return out;
}

// gate_up [T, 2I] contiguous -> [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] tensor");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({rows, I}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, I);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "silu_and_mul: float32 or bfloat16");
    silu_mul_rows<bf16>(gate_up.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, I);
  }
  return out;
}

// x [..., H] contiguous; weight [H] in x's dtype -> Gemma RMSNorm of each row.
torch::Tensor gemma_rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x must be a contiguous [..., H] tensor");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [H] in x's dtype");
  auto out = torch::empty_like(x);
  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  if (x.scalar_type() == torch::kFloat32) {
    gemma_rms_rows<float>(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(),
                          rows, H, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "gemma_rms_norm takes float32 or bfloat16");
    gemma_rms_rows<bf16>(x.data_ptr<bf16>(), weight.data_ptr<bf16>(), out.data_ptr<bf16>(), rows,
                         H, static_cast<float>(eps));
  }
  return out;
}

// gate_up [T, 2I] contiguous -> [T, I]: GeGLU with gelu's tanh approximation.
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] tensor");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({rows, I}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    gelu_tanh_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, I);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16,
                "gelu_tanh_and_mul: float32 or bfloat16");
    gelu_tanh_mul_rows<bf16>(gate_up.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, I);
  }
  return out;
}

// logits [N, V] float32 or bf16 contiguous -> [N] int64: the first index of each row's maximum.
torch::Tensor argmax_last_dim(torch::Tensor logits) {
  const bool bf16_logits = logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == torch::kFloat32 || bf16_logits) && logits.size(1) > 0,
              "logits must be a contiguous float32 or bf16 [N, V] tensor with V > 0");
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kInt64));
  if (bf16_logits) {
    argmax_rows(reinterpret_cast<const bf16*>(logits.data_ptr<at::BFloat16>()),
                out.data_ptr<int64_t>(), logits.size(0), logits.size(1));
  } else {
    argmax_rows(logits.data_ptr<float>(), out.data_ptr<int64_t>(), logits.size(0), logits.size(1));
  }
  return out;
}
