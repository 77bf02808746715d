// The fused sparse MoE block (moe_cpu.cpp, whose file comment says how it runs), declared here
// so that the compiled decode stack (decode_stack_cpu.cpp) runs the blocks Python built.
#pragma once

#include <torch/extension.h>

#include <utility>
#include <vector>

#include "decode_linear_cpu.h"

class MoEExperts {
 public:
  MoEExperts(std::vector<DecodeLinear> gate_up, std::vector<DecodeLinear> down);

  int64_t num_experts() const { return static_cast<int64_t>(gate_up_.size()); }

  // x [T, H] float32/bfloat16; weights [T, k] float32; ids [T, k] int64 -> [T, H] in x's dtype.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& weights,
                        const torch::Tensor& ids) const;

 private:
  std::vector<DecodeLinear> gate_up_, down_;
};

// The router's softmax, top-k and (renormalize) division of router logits [T, E], as
// pagedattn.model.moe.route computes them: (float32 weights [T, k], int64 expert ids [T, k]).
std::pair<torch::Tensor, torch::Tensor> moe_route(const torch::Tensor& logits, int64_t top_k,
                                                  bool renormalize);
