// The shared-memory collectives of tensor-parallel ranks on one machine
// (pagedattn/distributed/shm_all_reduce.py holds the file's layout and the protocol).
//
// The Python version of one all-reduce cost 65-140 us of interpreter and view overhead for a
// [32, 576] float32 tensor (73 KB; SmolLM2-135M, 2 ranks), about 60 of them per decode step.
// Here one call publishes, waits and sums: the copy into the rank's slot, a release store of
// the sequence number, acquire loads of the peers' (spinning with the CPU's pause hint, then
// yielding the core), and the sum of the slots in rank order, so every rank gets the same bits.
//
// A call waits at most max_wait_s and then returns done = false with nothing summed; the caller
// checks that its peers are alive and calls again with publish = false to go on waiting.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <sched.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "ops_cpu.h"
#include "vec_cpu.h"

namespace {

using bf16 = c10::BFloat16;
using pagedattn_vec::fVec;
using pagedattn_vec::kWidth;
using pagedattn_vec::load;
using pagedattn_vec::store;
using Clock = std::chrono::steady_clock;

// One sequence number per rank, each on its own cache line (int64s; as shm_all_reduce.py).
constexpr int64_t kFlagStride = 8;
// Pause-hinted spins before each wait starts giving the core away between looks.
constexpr int64_t kSpinsBeforeYield = 2048;
// Elements per parallel work item of the sum (a [32, 576] tensor is one item).
constexpr int64_t kSumGrain = 1 << 16;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

struct Shm {
  uint8_t* base;
  int64_t world;
  int64_t slot_bytes;

  int64_t* flag(int64_t rank) const { return reinterpret_cast<int64_t*>(base) + rank * kFlagStride; }
  uint8_t* slot(int64_t seq, int64_t rank) const {
    const int64_t header = world * kFlagStride * static_cast<int64_t>(sizeof(int64_t));
    return base + header + ((seq & 1) * world + rank) * slot_bytes;
  }
};

Shm shm_of(const torch::Tensor& buf, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(buf.scalar_type() == torch::kUInt8 && buf.is_contiguous() && buf.dim() == 1,
              "shm collectives: the mapped file must be a contiguous 1-d uint8 tensor");
  TORCH_CHECK(world >= 1 && slot_bytes > 0, "shm collectives: world and slot size must be > 0");
  const int64_t need = world * kFlagStride * 8 + 2 * world * slot_bytes;
  TORCH_CHECK(buf.numel() >= need, "shm collectives: the mapped file holds ", buf.numel(),
              " bytes, the layout needs ", need);
  return Shm{buf.data_ptr<uint8_t>(), world, slot_bytes};
}

// Publish x's bytes (when given) as this rank's part of collective seq.
void publish(const Shm& shm, int64_t rank, int64_t seq, const void* data, int64_t n_bytes) {
  if (data != nullptr) std::memcpy(shm.slot(seq, rank), data, n_bytes);
  __atomic_store_n(shm.flag(rank), seq, __ATOMIC_RELEASE);
}

// Whether every rank published seq within max_wait_s; adds the time spent to waited.
bool wait_all(const Shm& shm, int64_t seq, double max_wait_s, double& waited) {
  const auto t0 = Clock::now();
  bool done = true;
  for (int64_t r = 0; r < shm.world && done; ++r) {
    const int64_t* flag = shm.flag(r);
    for (int64_t spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq; ++spins) {
      if (spins < kSpinsBeforeYield) {
        cpu_relax();
        continue;
      }
      sched_yield();
      if ((spins & 255) == 0 &&
          std::chrono::duration<double>(Clock::now() - t0).count() > max_wait_s) {
        done = false;
        break;
      }
    }
  }
  waited += std::chrono::duration<double>(Clock::now() - t0).count();
  return done;
}

template <typename T>
void sum_slots(const Shm& shm, int64_t seq, T* out, int64_t n) {
  at::parallel_for(0, n, kSumGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kWidth <= end; i += kWidth) {
      fVec acc = load(reinterpret_cast<const T*>(shm.slot(seq, 0)) + i);
      for (int64_t r = 1; r < shm.world; ++r) {
        acc = acc + load(reinterpret_cast<const T*>(shm.slot(seq, r)) + i);
      }
      store(out + i, acc);
    }
    if (i < end) {
      const int64_t rest = end - i;
      fVec acc = load(reinterpret_cast<const T*>(shm.slot(seq, 0)) + i, rest);
      for (int64_t r = 1; r < shm.world; ++r) {
        acc = acc + load(reinterpret_cast<const T*>(shm.slot(seq, r)) + i, rest);
      }
      store(out + i, acc, rest);
    }
  });
}

// x (contiguous float32 or bfloat16, at most slot_bytes) summed over the ranks, in place.
// Returns (done, seconds waited for the last peer).
std::tuple<bool, double> shm_all_reduce(torch::Tensor buf, torch::Tensor x, int64_t rank,
                                        int64_t world, int64_t seq, int64_t slot_bytes,
                                        bool first_call, double max_wait_s) {
  const Shm shm = shm_of(buf, world, slot_bytes);
  TORCH_CHECK(x.is_contiguous(), "shm_all_reduce: x must be contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "shm_all_reduce: x must be float32 or bfloat16");
  const int64_t n_bytes = x.numel() * x.element_size();
  TORCH_CHECK(n_bytes <= slot_bytes, "shm_all_reduce: ", n_bytes, " bytes exceed a slot of ",
              slot_bytes);
  if (first_call) publish(shm, rank, seq, x.data_ptr(), n_bytes);
  double waited = 0.0;
  if (!wait_all(shm, seq, max_wait_s, waited)) return {false, waited};
  // NOTE: a rank writes this slot set again two collectives later, only after every peer has
  // published the one in between, i.e. has finished this sum.
  if (x.scalar_type() == torch::kFloat) {
    sum_slots(shm, seq, x.data_ptr<float>(), x.numel());
  } else {
    sum_slots(shm, seq, reinterpret_cast<bf16*>(x.data_ptr<at::BFloat16>()), x.numel());
  }
  return {true, waited};
}

// Rank 0: out[N, world * D] = the ranks' x[N, D] side by side; other ranks only publish x.
// Rank 0's own part is copied from x, not through its slot. Returns (done, seconds waited).
std::tuple<bool, double> shm_gather_first(torch::Tensor buf, torch::Tensor x,
                                          c10::optional<torch::Tensor> out, int64_t rank,
                                          int64_t world, int64_t seq, int64_t slot_bytes,
                                          bool first_call, double max_wait_s) {
  const Shm shm = shm_of(buf, world, slot_bytes);
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "shm_gather_first: x must be contiguous [N, D]");
  const int64_t n_bytes = x.numel() * x.element_size();
  TORCH_CHECK(n_bytes <= slot_bytes, "shm_gather_first: ", n_bytes, " bytes exceed a slot of ",
              slot_bytes);
  if (first_call) publish(shm, rank, seq, rank == 0 ? nullptr : x.data_ptr(), n_bytes);
  double waited = 0.0;
  if (!wait_all(shm, seq, max_wait_s, waited)) return {false, waited};
  if (rank != 0) return {true, waited};
  TORCH_CHECK(out.has_value(), "shm_gather_first: rank 0 needs out");
  torch::Tensor o = *out;
  const int64_t rows = x.size(0), row_bytes = x.size(1) * x.element_size();
  TORCH_CHECK(o.is_contiguous() && o.scalar_type() == x.scalar_type() && o.size(0) == rows &&
                  o.size(1) == world * x.size(1),
              "shm_gather_first: out must be contiguous [N, world * D] of x's dtype");
  auto* dst = static_cast<uint8_t*>(o.data_ptr());
  const auto* own = static_cast<const uint8_t*>(x.data_ptr());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint8_t* row = dst + i * world * row_bytes;
      std::memcpy(row, own + i * row_bytes, row_bytes);
      for (int64_t r = 1; r < world; ++r) {
        std::memcpy(row + r * row_bytes, shm.slot(seq, r) + i * row_bytes, row_bytes);
      }
    }
  });
  return {true, waited};
}

}  // namespace

void register_shm_collectives(pybind11::module& m) {
  m.def("shm_all_reduce", &shm_all_reduce,
        "Sum x over the ranks through the shared-memory file buf (publish, wait, sum in rank "
        "order); returns (done, seconds waited)",
        py::arg("buf"), py::arg("x"), py::arg("rank"), py::arg("world"), py::arg("seq"),
        py::arg("slot_bytes"), py::arg("first_call"), py::arg("max_wait_s"));
  m.def("shm_gather_first", &shm_gather_first,
        "Rank 0 gets the ranks' x side by side in out; others publish x; returns (done, seconds "
        "waited)",
        py::arg("buf"), py::arg("x"), py::arg("out"), py::arg("rank"), py::arg("world"),
        py::arg("seq"), py::arg("slot_bytes"), py::arg("first_call"), py::arg("max_wait_s"));
}
