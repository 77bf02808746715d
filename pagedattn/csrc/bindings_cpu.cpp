// The extension's Python module: the bindings of every kernel of pagedattn/csrc (declared in
// ops_cpu.h, defined in the file named there).
#include <torch/extension.h>

#include "ops_cpu.h"
#include "vec_cpu.h"

void bind_quant(pybind11::module_& m);  // quant_cpu.cpp: kernels on GGUF weight blocks

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &pagedattn_vec::isa_name,
        "The vector ISA this build was compiled for: avx512, avx2, neon, sve or scalar");
  m.def("vector_width", [] { return static_cast<int64_t>(pagedattn_vec::kWidth); },
        "fp32 lanes of the build's vectors (16 AVX-512, 8 AVX2, 4 NEON)");
  m.def("linear_packed", &linear_packed, "y = x @ W^T (+ bias) over 32-column weight panels");
  m.def("linear_packed_vectorized", &linear_packed_vectorized,
        "Whether linear_packed runs on vector instructions (AVX2, AVX-512, NEON)");
  m.def("linear_dpbf16", &linear_dpbf16,
        "y = x @ W^T (+ bias) in bf16 over 32-column panels of k pairs (AVX512-BF16 dot products)");
  m.def("linear_dpbf16_available", &linear_dpbf16_available,
        "Whether this build runs linear_dpbf16 (compiled with AVX512-BF16)");
  m.def("linear_amx", &linear_amx, "y = x @ W^T (+ bias) in bf16 on AMX tiles (decode rows)",
        py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("bias"),
        py::arg("scale") = py::none());
  m.def("linear_amx_available", &linear_amx_available,
        "Whether this build and CPU run linear_amx (AMX-BF16, tile state granted by the OS)");
  m.def("cache_write", &cache_write,
        "Write K/V rows into a flash-layout paged cache by slot (an fp8 cache: x / scale)",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("gather_dequant_fp8", &gather_dequant_fp8,
        "Whole blocks of an fp8 cache through a block list, dequantized (x * scale) into out",
        py::arg("out"), py::arg("cache"), py::arg("block_ids"), py::arg("scale"));
  m.def("gather_dequant_u8", &gather_dequant_u8,
        "Whole blocks of a u8 cache through a block list, dequantized (q * scale + min) into out",
        py::arg("out"), py::arg("cache"), py::arg("block_ids"));
  m.def("rotary_inplace", &rotary_inplace, "Neox rotary embedding of [T, H, D] in place");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H], optionally adding a residual in place first");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU of a fused [T, 2I] gate/up projection");
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma RMSNorm (scale 1 + w, one rounding) of [..., H]");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "GeGLU (tanh gelu) of a fused [T, 2I] gate/up");
  m.def("argmax_last_dim", &argmax_last_dim, "First index of each row's maximum");
  m.def("paged_decode", &paged_decode, "Paged decode attention over a flash-layout KV cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("soft_cap"), py::arg("partition_size"), py::arg("amx"), py::arg("k_scale") = 1.0,
        py::arg("v_scale") = 1.0);
  m.def("paged_prefill", &paged_prefill, "Causal prefill attention over a flash-layout KV cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_table"), py::arg("seq_len"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("soft_cap"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("set_flush_denormal_all_threads", &set_flush_denormal_all_threads,
        "Flush denormals to zero (FTZ/DAZ) in the calling thread and every intra-op thread");
  m.def("lora_apply", &lora_apply,
        "y += (x @ A_slot) @ B_slot per row of slot >= 0 (LoRALinear's stacked slots)",
        py::arg("y"), py::arg("x"), py::arg("slots"), py::arg("a"), py::arg("b"),
        py::arg("max_loras"), py::arg("max_rank"));
  register_decode_stack(m);
  register_moe(m);
  register_shm_collectives(m);
  bind_quant(m);
}
