// The fused sparse mixture-of-experts block: the experts' SwiGLU MLPs on their tokens and the
// routing-weighted sum, in one C++ call (pagedattn.model.moe.SparseMoEBlock runs it).
//
// The (token, expert) pairs of a step are counted and sorted by expert (stable: a token's pairs
// stay in top-k order), each active expert runs its gate/up linear, silu_and_mul and its down
// linear on its rows with the kernel the tuner chose for it (DecodeLinear: packed floats, AMX
// tiles or GGUF blocks as stored), and the weighted rows are added into the output in expert
// order: out[t] += round(y * w), the order and roundings of transformers' loop over experts and
// of pagedattn.model.moe.grouped_moe, the Python reference. Only the chosen experts' weights are
// read. Where there are at least as many active experts as threads, the threads take whole
// experts, balanced by rows: one parallel region per block, not three per expert (a Q4_K block
// of 32 experts, top-4, at 32 tokens: 6.2 -> 4.8 ms on 2 AMD Zen 2 cores). With fewer active
// experts than threads, each expert's kernels split their output columns across the threads.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "decode_linear_cpu.h"
#include "moe_cpu.h"
#include "ops_cpu.h"

namespace {

// out [T, H] += w * y for each sorted pair: y the expert output row of the pair, token[p] its
// token, weight[p] its routing weight; columns split across threads, pairs in order per column.
template <typename T>
void add_weighted(T* out, const std::vector<const T*>& rows, const int64_t* token,
                  const std::vector<float>& weight, int64_t H) {
  at::parallel_for(0, H, 256, [&](int64_t begin, int64_t end) {
    for (size_t p = 0; p < rows.size(); ++p) {
      T* dst = out + token[p] * H;
      const T* src = rows[p];
      const float w = weight[p];
      for (int64_t c = begin; c < end; ++c) {
        // NOTE: the product rounds to T before the add, as (y * w).to(dtype) then index_add_.
        const T scaled = static_cast<T>(static_cast<float>(src[c]) * w);
        dst[c] = static_cast<T>(static_cast<float>(dst[c]) + static_cast<float>(scaled));
      }
    }
  });
}

// The row pointers of the experts' outputs, in sorted-pair order.
template <typename T>
std::vector<const T*> row_pointers(std::vector<torch::Tensor>& outputs) {
  std::vector<const T*> rows;
  for (auto& y : outputs) {
    y = y.contiguous();
    TORCH_CHECK(y.scalar_type() == c10::CppTypeToScalarType<T>::value,
                "an expert's down linear returned ", y.scalar_type());
    const T* base = y.data_ptr<T>();
    for (int64_t r = 0; r < y.size(0); ++r) rows.push_back(base + r * y.size(1));
  }
  return rows;
}

}  // namespace

MoEExperts::MoEExperts(std::vector<DecodeLinear> gate_up, std::vector<DecodeLinear> down)
    : gate_up_(std::move(gate_up)), down_(std::move(down)) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(),
              "MoEExperts needs one gate/up and one down linear per expert, got ",
              gate_up_.size(), " and ", down_.size());
}

torch::Tensor MoEExperts::forward(const torch::Tensor& x, const torch::Tensor& weights,
                                  const torch::Tensor& ids) const {
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "MoEExperts: float32 or bfloat16 rows, got ", x.scalar_type());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == torch::kInt64,
              "ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat32,
              "weights must be float32 [T, k]");
  const auto x_rows = x.contiguous();
  const auto ids_c = ids.contiguous();
  const auto weights_c = weights.contiguous();
  const int64_t T = x.size(0), k = ids.size(1), H = x.size(1), E = num_experts();
  const int64_t pairs = T * k;
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const float* w = weights_c.data_ptr<float>();

  // Counting sort of the pairs by expert, stable.
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(0 <= id[p] && id[p] < E, "expert id ", id[p], " out of range [0, ", E, ")");
    ++start[id[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  auto token_of = torch::empty({pairs}, torch::kInt64);  // the token of each sorted pair
  int64_t* token = token_of.data_ptr<int64_t>();
  std::vector<float> pair_weight(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t slot = fill[id[p]]++;
    token[slot] = p / k;
    pair_weight[slot] = w[p];
  }
  const auto rows = x_rows.index_select(0, token_of);  // [pairs, H], grouped by expert

  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] > start[e]) active.push_back(e);
  }
  std::vector<torch::Tensor> outputs(active.size());  // each active expert's [count, H]
  auto run = [&](size_t i) {
    const int64_t e = active[i];
    const auto expert_rows = rows.narrow(0, start[e], start[e + 1] - start[e]);
    outputs[i] = down_[e](silu_and_mul(gate_up_[e](expert_rows)));
  };
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && !at::in_parallel_region() &&
      static_cast<int64_t>(active.size()) >= threads) {
    // Each thread takes whole experts, the most rows first to the least loaded thread; the
    // kernels called inside the parallel region run on the calling thread.
    std::vector<size_t> order(active.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    auto rows_of = [&](size_t i) { return start[active[i] + 1] - start[active[i]]; };
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return rows_of(a) > rows_of(b); });
    std::vector<std::vector<size_t>> share(threads);
    std::vector<int64_t> load(threads, 0);
    for (size_t i : order) {
      const auto t = std::min_element(load.begin(), load.end()) - load.begin();
      share[t].push_back(i);
      load[t] += rows_of(i);
    }
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (size_t i : share[t]) run(i);
      }
    });
  } else {
    for (size_t i = 0; i < active.size(); ++i) run(i);
  }

  auto out = torch::zeros_like(x_rows);
  if (x.scalar_type() == torch::kFloat32) {
    add_weighted<float>(out.data_ptr<float>(), row_pointers<float>(outputs), token, pair_weight,
                        H);
  } else {
    add_weighted<c10::BFloat16>(out.data_ptr<c10::BFloat16>(),
                                row_pointers<c10::BFloat16>(outputs), token, pair_weight, H);
  }
  return out;
}

std::pair<torch::Tensor, torch::Tensor> moe_route(const torch::Tensor& logits, int64_t top_k,
                                                  bool renormalize) {
  auto probs = at::softmax(logits, -1, at::kFloat);  // [T, E]
  auto [weights, ids] = at::topk(probs, top_k, -1);  // [T, k] each
  if (renormalize) weights = weights / weights.sum(-1, true);
  return {weights, ids};
}

void register_moe(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<MoEExperts>(m, "MoEExperts")
      .def(py::init<std::vector<DecodeLinear>, std::vector<DecodeLinear>>(), py::arg("gate_up"),
           py::arg("down"))
      .def_property_readonly("num_experts", &MoEExperts::num_experts)
      .def("forward", &MoEExperts::forward, py::arg("x"), py::arg("weights"), py::arg("ids"),
           py::call_guard<py::gil_scoped_release>());
}
