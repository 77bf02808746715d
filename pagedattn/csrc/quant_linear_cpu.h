// QuantLinear: one linear layer on GGUF blocks as stored (quant_cpu.cpp, whose file comment says
// how decode and prefill run). Declared here so that the compiled decode stack
// (decode_stack_cpu.cpp) calls the same layers Python packed.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include "quant_blocks_cpu.h"

namespace pagedattn_quant {

class QuantLinear {
 public:
  // data[p]: uint8 [rows_p, bytes per row] blocks of ggml type types[p]; index[p]: the output
  // column of each of its rows (none: rows in order from the part's start); prefill_rows: rows
  // from which forward dequantises tiles into at::mm instead of the int8 dot kernels;
  // interleave: repack the parts of 8n rows (quant_x8_cpu.h, quant_x8_legacy_cpu.h), which
  // then run that kernel at every row count (off where the blocks must stay as stored: a tied
  // embedding's table);
  // amx_rows: rows from which those parts run on AMX-INT8 tiles where the CPU has them
  // (quant_amx_cpu.h; 0: never).
  QuantLinear(std::vector<at::Tensor> data, std::vector<int64_t> types,
              std::vector<c10::optional<at::Tensor>> index, int64_t N, int64_t K,
              c10::optional<at::Tensor> bias, int64_t prefill_rows, bool interleave,
              int64_t amx_rows = 0);

  // y = x @ W^T (+ bias): x float32 or bfloat16 [..., K] -> [..., N] in x's dtype.
  at::Tensor forward(const at::Tensor& x) const;
  int64_t prefill_rows() const { return prefill_rows_; }
  int64_t nbytes() const;
  std::vector<std::string> layouts() const;
  // Rows ``ids`` of the weight (output features) dequantised from the blocks held, in any layout:
  // [..., K]. A tied embedding looks its tokens up here; tools read the whole weight.
  at::Tensor rows(const at::Tensor& ids, at::ScalarType dtype) const;

 private:
  void decode(const at::Tensor& x32, at::Tensor& out) const;
  void prefill(const at::Tensor& x32, at::Tensor& out) const;
  void run_x8(const std::vector<ActQ8_0>& a0, const std::vector<ActQ8_K>& ak, int64_t M,
              at::Tensor& out) const;
  bool amx(int64_t M) const;
  int64_t act_rows(int64_t M) const;

  std::vector<at::Tensor> data_;
  std::vector<int64_t> types_;
  std::vector<bool> x8_;  // part p repacked by quant_x8_cpu.h
  std::vector<int64_t> starts_;
  std::vector<std::vector<int32_t>> cols_;
  std::vector<std::pair<int32_t, int32_t>> row_of_col_;  // output column -> (part, row)
  int64_t N_, K_, prefill_rows_, amx_rows_;
  at::Tensor bias_;
  bool needs_q8_0_ = false, needs_q8_k_ = false;
};

}  // namespace pagedattn_quant
