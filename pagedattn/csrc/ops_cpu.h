// The extension's C++ entry points shared across its source files (bindings and the decode
// stack call them); each is defined in the file named above it.
#pragma once

#include <torch/extension.h>

// paged_attention_cpu.cpp
void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                  torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                  double scale, int64_t sliding_window, double soft_cap, int64_t partition_size,
                  bool amx, double k_scale = 1.0, double v_scale = 1.0);
// linear_cpu.cpp
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t N,
                            c10::optional<torch::Tensor> bias);
bool linear_packed_vectorized();
// linear_amx_cpu.cpp
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, int64_t N,
                         c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> scale);
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
// shm_collectives_cpu.cpp
void register_shm_collectives(pybind11::module& m);
// lora_cpu.cpp
void lora_apply(torch::Tensor y, torch::Tensor x, torch::Tensor slots, torch::Tensor a,
                std::vector<torch::Tensor> b, int64_t max_loras, int64_t max_rank);
// kv_gather_cpu.cpp
void gather_dequant_fp8(torch::Tensor out, torch::Tensor cache, torch::Tensor block_ids,
                        double scale);
void gather_dequant_u8(torch::Tensor out, torch::Tensor cache, torch::Tensor block_ids);
