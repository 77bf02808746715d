// The extension's C++ entry points shared across its source files (bindings and the decode
// stack call them); each is defined in the file named above it.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <vector>

// The weights of a 1-2 row linear_amx call (the dot-product path), fetched into the caches of
// the threads other than the caller's while the caller runs other work (linear_amx_cpu.cpp; the
// decode stack's gaps between its linears). aim() names the linear; warm() runs on each helper
// thread until `busy` drops, taking the linear's work items from the front one by one and asking
// for their lines in the order the kernel reads them; linear_amx_warmed(..., &warmup) gives each
// thread the items it warmed first and then hands out the rest as usual.
struct DotWarmup {
  const void* packed = nullptr;
  int64_t N = 0, K = 0;
  int64_t limit = 0;               // items the helpers may take (the rest stay for the caller)
  std::atomic<int64_t> next{0};    // the next item a helper takes
  std::vector<int> owner;          // owner[i]: the thread that warmed item i (i < taken())

  // The linear to warm: its packing, out features N and in features K; threads in the region.
  void aim(const torch::Tensor& packed_weight, int64_t N, int64_t K, int64_t threads);
  // Warm items on thread `thread` (> 0) while busy holds.
  void warm(int thread, const std::atomic<bool>& busy);
  // Items the helpers took (each is its owner's in the next linear_amx call).
  int64_t taken() const { return std::min(next.load(std::memory_order_relaxed), limit); }
};

// paged_attention_cpu.cpp
void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                  torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                  double scale, int64_t sliding_window, double soft_cap, int64_t partition_size,
                  bool amx, double k_scale = 1.0, double v_scale = 1.0);
void paged_prefill(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                   torch::Tensor value_cache, torch::Tensor block_table, int64_t seq_len,
                   double scale, int64_t sliding_window, double soft_cap, double k_scale = 1.0,
                   double v_scale = 1.0);
// Flush denormals to zero (FTZ/DAZ) in the calling thread and every intra-op thread; returns the
// number of pool threads set (0 where the build has no such mode).
int64_t set_flush_denormal_all_threads(bool on);
// The checks shared by the 32-column panel GEMMs (linear_cpu.cpp, linear_dpbf16_cpu.cpp): N
// outputs fit the packing's `panels`, and the optional bias is a float32 [N] tensor, whose data
// this returns (nullptr without one).
inline const float* panel_linear_bias(const c10::optional<torch::Tensor>& bias, int64_t N,
                                      int64_t panels) {
  TORCH_CHECK(N > (panels - 1) * 32 && N <= panels * 32, "N=", N, " does not match ", panels,
              " panels");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                  bias->numel() == N,
              "bias must be a contiguous float32 [N] tensor");
  return bias->data_ptr<float>();
}
// linear_cpu.cpp
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t N,
                            c10::optional<torch::Tensor> bias);
bool linear_packed_vectorized();
// linear_dpbf16_cpu.cpp
torch::Tensor linear_dpbf16(torch::Tensor x, torch::Tensor packed, int64_t N,
                            c10::optional<torch::Tensor> bias);
bool linear_dpbf16_available();
// linear_amx_cpu.cpp
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, int64_t N,
                         c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> scale);
torch::Tensor linear_amx_warmed(torch::Tensor x, torch::Tensor packed, int64_t N,
                                c10::optional<torch::Tensor> bias,
                                c10::optional<torch::Tensor> scale, DotWarmup* warmup);
// Whether linear_amx multiplies `rows` rows of bf16 weights on the dot-product path.
bool linear_amx_dot_rows(int64_t rows);
bool linear_amx_available();
// step_ops_cpu.cpp
void cache_write(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                 torch::Tensor value_cache, torch::Tensor slot_mapping, double k_scale = 1.0,
                 double v_scale = 1.0);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> residual);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gemma_rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_last_dim(torch::Tensor logits);
// decode_stack_cpu.cpp
void register_decode_stack(pybind11::module& m);
void register_moe(pybind11::module& m);
// shm_collectives_cpu.cpp
void register_shm_collectives(pybind11::module& m);
// lora_cpu.cpp
void lora_apply(torch::Tensor y, torch::Tensor x, torch::Tensor slots, torch::Tensor a,
                std::vector<torch::Tensor> b, int64_t max_loras, int64_t max_rank);
// kv_gather_cpu.cpp
void gather_dequant_fp8(torch::Tensor out, torch::Tensor cache, torch::Tensor block_ids,
                        double scale);
void gather_dequant_u8(torch::Tensor out, torch::Tensor cache, torch::Tensor block_ids);
