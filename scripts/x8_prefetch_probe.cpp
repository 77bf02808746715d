// One activation row (or four) through the interleaved Q4_K / Q6_K kernels of
// pagedattn/csrc/quant_x8_cpu.h, the weights cycled over `copies` layers so that they stream from
// DRAM (copies=1 and a small N: from cache). It prints GB/s of x8 blocks read; build it once per
// prefetch distance (blocks ahead) and hint to compare them.
//
//   TI=$(.venv/bin/python -c "import torch,os;print(os.path.dirname(torch.__file__)+'/include')")
//   g++ -O3 -std=c++17 -march=x86-64-v3 -DCPU_CAPABILITY_AVX2 -fopenmp -Ipagedattn/csrc -I$TI \
//       -DPAGEDATTN_X8_PREFETCH=3 -DPAGEDATTN_X8_HINT=_MM_HINT_T1 -DPAGEDATTN_QUANT_HINT=_MM_HINT_NTA \
//       -o /tmp/x8_probe scripts/x8_prefetch_probe.cpp
//   OMP_NUM_THREADS=2 /tmp/x8_probe [rows=1] [N=8192] [copies=12]     (K = 2048)
//
// AMD EPYC Zen 2, 2 threads, 2026-12-05, one row, GB/s Q6_K / Q4_K. From DRAM: 3 blocks ahead
// T0 18.9-19.0 / 20.9-21.5, 6 ahead T0 18.0 / 21.1, 3 ahead NTA 19.5-22.0 / 24.0-27.2, 6 ahead
// NTA 19.5 / 26. From L2 (N=1024, copies=1): T0 50 / 51, NTA 24 / 36 (the NTA lines leave the
// cache); a model's weights stream from DRAM at every step, so the extension prefetched NTA.
// AMD EPYC Zen 4, 2 threads, 2026-12-06 (-march=native), one row from DRAM, 3 ahead: NTA
// Q6_K 17.6-21.6, T1 (into L2) 30.2-35.5, Q4_K NTA 37.6-48.3, T1 33.1-36.4; 4 rows NTA
// leads for both (28.4 / 32.7 against 23.7 / 23.9). In QuantLinear Q4_K ran 5% faster with T1
// at 1 and 4 rows, Q6_K 8% slower at 4 rows: the x8 kernels prefetch T1 (PAGEDATTN_X8_HINT),
// Q6_K from 2 rows NTA (PAGEDATTN_QUANT_HINT).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "quant_x8_cpu.h"

using namespace pagedattn_quant;

template <typename X8, typename Row>
double gb_per_s(int64_t N, int64_t nb, int copies, int rows) {
  std::mt19937 rng(0);
  std::vector<uint8_t> stored(N * nb * sizeof(Row));
  for (auto& b : stored) b = static_cast<uint8_t>(rng());
  for (int64_t i = 0; i < N * nb; ++i) {
    Row* blk = reinterpret_cast<Row*>(stored.data()) + i;
    blk->d = _cvtss_sh(0.001f, 0);
    if constexpr (sizeof(Row) == sizeof(BlockQ4_K)) blk->dmin = _cvtss_sh(0.001f, 0);
  }
  std::vector<std::vector<uint8_t>> x8(copies, std::vector<uint8_t>(N / 8 * nb * sizeof(X8)));
  for (auto& layer : x8) {
    for (int64_t g = 0; g < N / 8; ++g) {
      const uint8_t* src = stored.data() + g * 8 * nb * sizeof(Row);
      X8* dst = reinterpret_cast<X8*>(layer.data()) + g * nb;
      if constexpr (sizeof(X8) == sizeof(BlockQ6_Kx8)) repack_q6_k_x8(src, nb, dst);
      else repack_q45_k_x8(src, nb, dst);
    }
  }
  std::vector<ActQ8_K> act(4 * nb);
  for (auto& a : act) {
    a.d = 0.01f;
    for (auto& q : a.qs) q = static_cast<int8_t>(rng() % 255 - 127);
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += a.qs[16 * g + i];
      a.bsums[g] = static_cast<int16_t>(s);
    }
  }
  const ActQ8_K* ap[4] = {act.data(), act.data() + nb, act.data() + 2 * nb, act.data() + 3 * nb};
  std::vector<float> out(4 * N);
  double best = 1e9;
  for (int rep = 0; rep < 200; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& layer : x8) {
#pragma omp parallel for schedule(static)
      for (int64_t g = 0; g < N / 8; ++g) {
        const X8* grp = reinterpret_cast<const X8*>(layer.data()) + g * nb;
        float* o = out.data() + 8 * g;
        if constexpr (sizeof(X8) == sizeof(BlockQ6_Kx8)) {
          rows == 1 ? gemm_q6_k_x8<1>(grp, nb, ap, o, 8) : gemm_q6_k_x8<4>(grp, nb, ap, o, 8);
        } else {
          rows == 1 ? gemm_q45_k_x8<1>(grp, nb, ap, o, 8) : gemm_q45_k_x8<4>(grp, nb, ap, o, 8);
        }
      }
    }
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best = std::min(best, dt.count() / copies);
  }
  return static_cast<double>(N / 8 * nb * sizeof(X8)) / best / 1e9;
}

int main(int argc, char** argv) {
  const int rows = argc > 1 ? atoi(argv[1]) == 1 ? 1 : 4 : 1;
  const int64_t N = argc > 2 ? atoll(argv[2]) : 8192, nb = 2048 / 256;
  const int copies = argc > 3 ? atoi(argv[3]) : 12;
  printf("prefetch %d blocks ahead, %d row(s), N=%lld, %d layers: Q6_K x8 %.1f GB/s, Q4_K x8 %.1f GB/s\n",
         PAGEDATTN_X8_PREFETCH, rows, static_cast<long long>(N), copies,
         gb_per_s<BlockQ6_Kx8, BlockQ6_K>(N, nb, copies, rows),
         gb_per_s<BlockQ4_Kx8, BlockQ4_K>(N, nb, copies, rows));
}
