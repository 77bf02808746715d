// A Llama-family decoder stack (Qwen3's q/k norms and sparse MoE layers included) run for
// decode steps in one C++ call.
//
// At batch 32 a SmolLM2 decode step spent ~10 ms of ~48 ms in the Python between its kernels
// (module calls, views, checks: ~25 small calls per layer, 30 layers); at batch 1 that is half of
// the step. DecodeStack runs the same kernels in the same order as LlamaDecoderLayer.forward
// (rms_norm, the linear kernel the tuner chose, rotary, cache_write, paged_decode, silu_and_mul),
// so its output is bit-identical to the Python path: only the interpreter between them is gone.
// The Python model builds it once after the weights are packed and uses it for steps whose rows
// are all decode rows (one query per sequence) below the linear plan's prefill split.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include "ops_cpu.h"
#include "decode_linear_cpu.h"
#include "moe_cpu.h"
#include "quant_linear_cpu.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <memory>
#include <utility>
#include <vector>

// One projection's LoRA slots (pagedattn.lora.layers.LoRALinear's buffers, shared): A [in,
// S * L * R] and each output slice's B [L * R, out_i]; undefined a: no LoRA on it.
struct LoRASlots {
  torch::Tensor a;
  std::vector<torch::Tensor> b;
  int64_t max_loras = 0, max_rank = 0;

  // y [T, out] += the LoRA delta of x [T, in] for the rows of slots >= 0.
  void apply(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& slots) const {
    if (a.defined()) lora_apply(y, x, slots, a, b, max_loras, max_rank);
  }
};

// A sparse layer's MLP: the router's linear, the fused experts and the routing rule.
struct DecodeMoE {
  DecodeLinear router;
  MoEExperts experts;
  int64_t top_k;
  bool renormalize;
};

struct DecodeLayer {
  torch::Tensor input_norm, post_norm;
  DecodeLinear qkv, o, gate_up, down;  // gate_up, down: unused where moe is set
  int64_t group;           // KV cache group (index into the per-group step inputs)
  int64_t sliding_window;  // 0: none
  LoRASlots lora[4];       // qkv, o, gate_up, down
  torch::Tensor q_norm, k_norm;    // per-head RMSNorm weights (Qwen3); undefined: none
  std::shared_ptr<DecodeMoE> moe;  // the MLP is a sparse MoE block; null: the dense MLP
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double eps, double scale,
              int64_t partition_size, bool amx_attention)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_size_(head_size),
        eps_(eps),
        scale_(scale),
        partition_size_(partition_size),
        amx_attention_(amx_attention) {}

  // gate_up and down: the dense MLP's; None for a layer whose MLP set_moe gives.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, DecodeLinear qkv,
                 DecodeLinear o, c10::optional<DecodeLinear> gate_up,
                 c10::optional<DecodeLinear> down, int64_t group, int64_t sliding_window) {
    DecodeLayer layer{std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o)};
    if (gate_up.has_value()) layer.gate_up = std::move(*gate_up);
    if (down.has_value()) layer.down = std::move(*down);
    layer.group = group;
    layer.sliding_window = sliding_window;
    layers_.push_back(std::move(layer));
  }

  // Layer `layer` normalises each query and key head (Qwen3's q_norm/k_norm weights) before
  // the rotation.
  void set_qk_norm(int64_t layer, torch::Tensor q_norm, torch::Tensor k_norm) {
    TORCH_CHECK(0 <= layer && layer < num_layers(), "set_qk_norm: no layer ", layer);
    layers_[layer].q_norm = std::move(q_norm);
    layers_[layer].k_norm = std::move(k_norm);
  }

  // Layer `layer`'s MLP is a sparse MoE block: router logits, softmax top-k, the fused experts.
  void set_moe(int64_t layer, DecodeLinear router, const MoEExperts& experts, int64_t top_k,
               bool renormalize) {
    TORCH_CHECK(0 <= layer && layer < num_layers(), "set_moe: no layer ", layer);
    layers_[layer].moe = std::make_shared<DecodeMoE>(
        DecodeMoE{std::move(router), experts, top_k, renormalize});
  }

  // The LoRA slots of one projection (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`.
  void set_lora(int64_t layer, int64_t projection, torch::Tensor a, std::vector<torch::Tensor> b,
                int64_t max_loras, int64_t max_rank) {
    TORCH_CHECK(0 <= layer && layer < num_layers() && 0 <= projection && projection < 4,
                "set_lora: no layer ", layer, " projection ", projection);
    layers_[layer].lora[projection] = {std::move(a), std::move(b), max_loras, max_rank};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Whether the helper threads fetch the next linear's weights in the gaps (see overlap()).
  bool warm_ahead() const { return warm_ahead_; }
  void set_warm_ahead(bool on) { warm_ahead_ = on; }
  // Work items of the linears that helper threads fetched ahead and then multiplied, in total.
  int64_t warmed_items() const { return warmed_items_.load(std::memory_order_relaxed); }

  // hidden [T, H] (the embeddings); cos/sin [T, D]; per layer its (key, value) caches; per KV
  // cache group its slot mapping [T], block tables [T, max_blocks] int32 and seq lens [T] int32.
  // kv_scales: per layer (k_scale, v_scale) of an FP8 cache, or empty (all 1.0).
  // lora_slots: each row's LoRA slot (int64 [T], -1: none), or None: no row adapts.
  // Returns (hidden, residual) after the last layer, as the Python layers leave them.
  std::pair<torch::Tensor, torch::Tensor> forward(
      torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
      const std::vector<std::pair<torch::Tensor, torch::Tensor>>& kv_caches,
      const std::vector<torch::Tensor>& slot_mappings,
      const std::vector<torch::Tensor>& block_tables, const std::vector<torch::Tensor>& seq_lens,
      const std::vector<std::pair<double, double>>& kv_scales,
      const c10::optional<torch::Tensor>& lora_slots) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeStack has ", layers_.size(),
                " layers but got ", kv_caches.size(), " KV caches");
    TORCH_CHECK(kv_scales.empty() || kv_scales.size() == layers_.size(),
                "kv_scales must be empty or one (k_scale, v_scale) per layer");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [T, H]");
    const int64_t T = hidden.size(0);
    const int64_t q_size = num_heads_ * head_size_, kv_size = num_kv_heads_ * head_size_;
    torch::Tensor residual;
    DotWarmup warmup;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecodeLayer& layer = layers_[i];
      const auto g = static_cast<size_t>(layer.group);
      TORCH_CHECK(g < slot_mappings.size() && g < block_tables.size() && g < seq_lens.size(),
                  "layer ", i, " reads KV cache group ", g, " that has no step inputs");
      torch::Tensor h;
      bool warm = overlap(layer.qkv, T, warmup, [&] {
        if (!residual.defined()) {
          residual = hidden;
          h = rms_norm(hidden, layer.input_norm, eps_, c10::nullopt);
        } else {
          h = rms_norm(hidden, layer.input_norm, eps_, residual);
        }
      });
      const bool lora = lora_slots.has_value();
      torch::Tensor qkv = layer.qkv(h, warm ? &warmup : nullptr);  // [T, q_size + 2 * kv_size]
      if (lora) layer.lora[0].apply(qkv, h, *lora_slots);
      const auto& [key_cache, value_cache] = kv_caches[i];
      const double k_scale = kv_scales.empty() ? 1.0 : kv_scales[i].first;
      const double v_scale = kv_scales.empty() ? 1.0 : kv_scales[i].second;
      torch::Tensor q, attn;
      warm = overlap(layer.o, T, warmup, [&] {
        torch::Tensor k;
        if (layer.q_norm.defined()) {
          // NOTE: as LlamaAttention with q/k norm: heads as rows, normalised, then rotated.
          q = rms_norm(qkv.narrow(1, 0, q_size).reshape({-1, head_size_}), layer.q_norm, eps_,
                       c10::nullopt)
                  .view({T, num_heads_, head_size_});
          k = rms_norm(qkv.narrow(1, q_size, kv_size).reshape({-1, head_size_}), layer.k_norm,
                       eps_, c10::nullopt)
                  .view({T, num_kv_heads_, head_size_});
          rotary_inplace(q, cos, sin);
          rotary_inplace(k, cos, sin);
        } else {
          rotary_inplace(qkv.narrow(1, 0, q_size + kv_size).view({T, -1, head_size_}), cos, sin);
          q = qkv.narrow(1, 0, q_size).view({T, num_heads_, head_size_});
          k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads_, head_size_});
        }
        auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads_, head_size_});
        cache_write(k, v, key_cache, value_cache, slot_mappings[g], k_scale, v_scale);
        q = q.contiguous();
        attn = torch::empty_like(q);
      });
      paged_decode(attn, q, key_cache, value_cache, block_tables[g], seq_lens[g], scale_,
                   layer.sliding_window, 0.0, partition_size_, amx_attention_, k_scale, v_scale);
      const auto attn_rows = attn.view({T, q_size});
      h = layer.o(attn_rows, warm ? &warmup : nullptr);
      if (lora) layer.lora[1].apply(h, attn_rows, *lora_slots);
      if (layer.moe) {
        const DecodeMoE& moe = *layer.moe;
        h = rms_norm(h, layer.post_norm, eps_, residual);
        auto [weights, ids] = moe_route(moe.router(h), moe.top_k, moe.renormalize);
        hidden = moe.experts.forward(h, weights, ids);
        continue;
      }
      warm = overlap(layer.gate_up, T, warmup,
                     [&] { h = rms_norm(h, layer.post_norm, eps_, residual); });
      auto gate_up = layer.gate_up(h, warm ? &warmup : nullptr);  // [T, 2 * I]
      if (lora) layer.lora[2].apply(gate_up, h, *lora_slots);
      torch::Tensor act;
      warm = overlap(layer.down, T, warmup, [&] { act = silu_and_mul(gate_up); });
      hidden = layer.down(act, warm ? &warmup : nullptr);
      if (lora) layer.lora[3].apply(hidden, act, *lora_slots);
    }
    return {hidden, residual};
  }

 private:
  // Runs fn on this thread while the other intra-op threads fetch the weights of `next`, the
  // linear that follows fn, into their caches (warmup; see DotWarmup). Only for AMX linears on
  // their dot-product path (1-2 rows), where the step streams weights and fn's small ops
  // otherwise leave the memory idle. Returns whether the helpers ran: then call next with
  // &warmup, so that each thread multiplies what it fetched.
  template <typename Fn>
  bool overlap(const DecodeLinear& next, int64_t rows, DotWarmup& warmup, const Fn& fn) const {
    const int64_t threads = at::get_num_threads();
    if (!warm_ahead_ || threads < 2 || at::in_parallel_region() ||
        static_cast<pagedattn_linear::Kernel>(next.kernel) != pagedattn_linear::Kernel::kAmx || !linear_amx_dot_rows(rows)) {
      fn();
      return false;
    }
    warmup.aim(next.a, next.out_features, next.a.numel() / next.out_features, threads);
    std::atomic<bool> busy{true};
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t) {
      if (begin != 0) return warmup.warm(static_cast<int>(begin), busy);
      // NOTE: the helpers spin until busy drops, so it drops even when fn throws.
      struct Done {
        std::atomic<bool>& busy;
        ~Done() { busy.store(false, std::memory_order_relaxed); }
      } done{busy};
      fn();
    });
    warmed_items_.fetch_add(warmup.taken(), std::memory_order_relaxed);
    return true;
  }

  int64_t num_heads_, num_kv_heads_, head_size_;
  double eps_, scale_;
  int64_t partition_size_;
  bool amx_attention_;  // paged_decode on AMX tiles (the tuner's attention choice "amx")
  bool warm_ahead_ = true;  // overlap(): helpers fetch the next linear's weights
  mutable std::atomic<int64_t> warmed_items_{0};
  std::vector<DecodeLayer> layers_;
};

void register_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeLinear>(m, "DecodeLinear")
      .def(py::init([](int64_t kernel, c10::optional<torch::Tensor> a,
                       c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> bias,
                       int64_t out_features,
                       std::shared_ptr<pagedattn_quant::QuantLinear> quant) {
             TORCH_CHECK(a.has_value() ||
                             kernel == static_cast<int64_t>(pagedattn_linear::Kernel::kGGUF),
                         "DecodeLinear: kernel ", kernel, " needs its packed weight a");
             TORCH_CHECK(quant || kernel != static_cast<int64_t>(pagedattn_linear::Kernel::kGGUF),
                         "DecodeLinear: the gguf kernel needs its QuantLinear");
             return DecodeLinear{kernel, a.value_or(torch::Tensor()), b.value_or(torch::Tensor()),
                                 std::move(bias), out_features, std::move(quant)};
           }),
           py::arg("kernel"), py::arg("a"), py::arg("b"), py::arg("bias"),
           py::arg("out_features"), py::arg("quant") = nullptr)
      .def("__call__", [](const DecodeLinear& linear, const torch::Tensor& x) { return linear(x); });
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, bool>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_size"), py::arg("eps"),
           py::arg("scale"), py::arg("partition_size"), py::arg("amx_attention"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_qk_norm", &DecodeStack::set_qk_norm, py::arg("layer"), py::arg("q_norm"),
           py::arg("k_norm"))
      .def("set_moe", &DecodeStack::set_moe, py::arg("layer"), py::arg("router"),
           py::arg("experts"), py::arg("top_k"), py::arg("renormalize"))
      .def("set_lora", &DecodeStack::set_lora, py::arg("layer"), py::arg("projection"),
           py::arg("a"), py::arg("b"), py::arg("max_loras"), py::arg("max_rank"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def_property("warm_ahead", &DecodeStack::warm_ahead, &DecodeStack::set_warm_ahead)
      .def_property_readonly("warmed_items", &DecodeStack::warmed_items)
      // NOTE: forward touches only tensors, so other Python threads (a server's event loop) run
      // while a step computes, as they do between the Python layers' ops.
      .def("forward", &DecodeStack::forward, py::arg("hidden"), py::arg("cos"), py::arg("sin"),
           py::arg("kv_caches"), py::arg("slot_mappings"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("kv_scales"), py::arg("lora_slots") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
