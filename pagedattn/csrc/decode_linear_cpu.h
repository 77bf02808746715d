// One packed linear layer as C++ calls it: the kernel the tuner chose and its packed tensors
// (pagedattn.cpu.linear.PackedLinear's), for the compiled decode stack and the fused MoE block.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <memory>

#include "ops_cpu.h"
#include "quant_linear_cpu.h"

namespace pagedattn_linear {

// The kernels of pagedattn.cpu.linear.LINEAR_KERNELS, numbered as their cpp_id.
enum class Kernel : int64_t {
  kTorch = 0, kPanels = 1, kMkl = 2, kOnednn = 3, kInt8 = 4, kAmx = 5, kInt8Amx = 6, kDpBf16 = 7,
  kGGUF = 8
};

inline torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                   const c10::optional<torch::Tensor>& bias) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 c10::string_view(""));
}

inline torch::Tensor mkl_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                const torch::Tensor& weight,
                                const c10::optional<torch::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, weight, bias, x.size(0));
}

}  // namespace pagedattn_linear

// One linear layer on the kernel the tuner chose, as PackedLinear calls it for a 2-D, contiguous
// input in the layer's dtype. kernel: 0 torch (a = weight), 1 panels (a = panels), 2 mkl (a =
// packed, b = weight), 3 onednn (a = packed), 4 int8 (a = int8 weight, b = scales), 5 amx
// (a = AMX tiles; bias float32), 6 int8_amx (a = int8 AMX tiles, b = float32 scales), 7 dpbf16
// (a = k-pair panels; bias float32), 8 gguf
// (quant: the layer's QuantLinear, the very object Python packed; bias inside it).
struct DecodeLinear {
  int64_t kernel;
  torch::Tensor a, b;
  c10::optional<torch::Tensor> bias;
  int64_t out_features;
  std::shared_ptr<const pagedattn_quant::QuantLinear> quant;

  // warmup: the items of this linear that helper threads fetched (AMX dot-product rows only).
  torch::Tensor operator()(const torch::Tensor& x, DotWarmup* warmup = nullptr) const {
    using pagedattn_linear::Kernel;
    switch (static_cast<Kernel>(kernel)) {
      case Kernel::kTorch:
        return at::linear(x, a, bias);
      case Kernel::kPanels:
        return linear_packed(x, a, out_features, bias);
      case Kernel::kDpBf16:
        return linear_dpbf16(x, a, out_features, bias);
      case Kernel::kMkl:
        return pagedattn_linear::mkl_linear(x, a, b, bias);
      case Kernel::kOnednn:
        return pagedattn_linear::onednn_linear(x, a, bias);
      case Kernel::kAmx:
        return linear_amx_warmed(x, a, out_features, bias, c10::nullopt, warmup);
      case Kernel::kInt8Amx:
        return linear_amx(x, a, out_features, bias, b);
      case Kernel::kGGUF:
        return quant->forward(x);
      case Kernel::kInt8: {
        auto out = at::_weight_int8pack_mm(x, a, b);
        if (bias.has_value()) out.add_(*bias);
        return out;
      }
    }
    TORCH_CHECK(false, "unknown linear kernel ", kernel);
  }
};
