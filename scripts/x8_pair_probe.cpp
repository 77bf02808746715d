// QuantLinear::run_x8's loop over random x8 groups of one type, one group at a time
// (gemm_x8_rows) against two at a time on 512-bit vectors (gemm_x8_pair_rows,
// pagedattn/csrc/quant_x8_zmm_cpu.h), interleaved, the weights cycled over 12 layers; it prints
// ms per layer, the ratio, GOP/s and how many outputs differ (none should: same integer sums).
// Needs AVX512-BW and VNNI.
//
//   TI=$(.venv/bin/python -c "import torch,os;print(os.path.dirname(torch.__file__)+'/include')")
//   g++ -O3 -std=c++17 -march=native -DCPU_CAPABILITY_AVX512 -fopenmp -ffp-contract=off \
//       -Ipagedattn/csrc -I$TI -o /tmp/x8_pair_probe scripts/x8_pair_probe.cpp
//   OMP_NUM_THREADS=2 /tmp/x8_pair_probe TYPE ROWS     (TYPE: a ggml type id, 2 Q4_0 .. 23 IQ4_XS)
//
// Results (AMD Zen 4, 2026-12-06): quant_x8_zmm_cpu.h's file comment.
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include "quant_x8_zmm_cpu.h"
using namespace pagedattn_quant;
int main(int argc, char** argv) {
  const int type = atoi(argv[1]);
  const int64_t M = atoi(argv[2]);
  const int64_t N = type == kQ6_K ? 2048 : 8192, K = type == kQ6_K ? 8192 : 2048, G = N / 8;
  const int64_t nb = K / block_values(type);
  const int64_t gbytes = nb * x8_block_bytes(type);
  const int L = 12;
  std::mt19937 rng(0);
  std::vector<uint8_t> w(L * G * gbytes);
  for (auto& v : w) v = rng();
  for (int64_t i = 0; i < L * G * nb; ++i) {  // finite fp16 d (and dmin) of each x8 block
    uint16_t* d = reinterpret_cast<uint16_t*>(w.data() + i * x8_block_bytes(type));
    const bool two = type == kQ4_K || type == kQ5_K || type == kQ2_K || type == kQ3_K || type == kQ4_1 || type == kQ5_1;
    for (int r = 0; r < (two ? 16 : 8); ++r) d[r] = 0x1c00 + rng() % 256;
  }
  std::vector<ActQ8_K> a(is_k_type(type) ? M * nb : 0);
  for (auto& b : a) { b.d = 0.01f * (1 + rng() % 5); for (int i = 0; i < 256; ++i) b.qs[i] = (int8_t)(rng() % 255 - 127); for (int i=0;i<16;++i){int s=0; for(int l=0;l<16;++l) s+=b.qs[16*i+l]; b.bsums[i]=s;} for(int i=0;i<8;++i) b.sums32[i]=b.bsums[2*i]+b.bsums[2*i+1]; }
  std::vector<ActQ8_0> a0(is_k_type(type) ? 0 : M * nb);
  for (auto& b : a0) { b.d = 0.01f * (1 + rng() % 5); b.sum = 0; for (int i = 0; i < 32; ++i) { b.qs[i] = (int8_t)(rng() % 255 - 127); b.sum += b.qs[i]; } b.s = b.d * b.sum; }
  std::vector<float> y[2] = {std::vector<float>(M * N), std::vector<float>(M * N)};
  const int64_t act_bytes = nb * (int64_t)(is_k_type(type) ? sizeof(ActQ8_K) : sizeof(ActQ8_0));
  const int64_t chunk = std::max<int64_t>(kX8Rows, (256 << 10) / act_bytes / kX8Rows * kX8Rows);
  double best[2] = {1e9, 1e9};
  for (int rep = 0; rep < 16; ++rep) {
    const int kind = rep % 2;
    auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < L; ++l) {
      const uint8_t* blocks = w.data() + l * G * gbytes;
      float* yy = y[kind].data();
#pragma omp parallel
      {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t g0 = G * t / nt, g1 = G * (t + 1) / nt;
        float tmp[kX8Rows * 16];
        for (int64_t c0 = 0; c0 < M; c0 += chunk) {
          const int64_t c1 = std::min(M, c0 + chunk);
          for (int64_t g = g0; g < g1; ++g) {
            const uint8_t* grp = blocks + g * gbytes;
            const int wd = kind && g + 1 < g1 ? 16 : 8;
            for (int64_t m0 = c0; m0 < c1; m0 += kX8Rows) {
              const int mb = static_cast<int>(std::min<int64_t>(kX8Rows, c1 - m0));
              const void* act[kX8Rows];
              for (int i = 0; i < mb; ++i) {
                act[i] = is_k_type(type) ? static_cast<const void*>(a.data() + (m0 + i) * nb)
                                         : static_cast<const void*>(a0.data() + (m0 + i) * nb);
              }
              if (wd == 16) gemm_x8_pair_rows(mb, type, grp, gbytes, nb, act, tmp, m0 == c0);
              else gemm_x8_rows(mb, type, grp, nb, act, tmp, m0 == c0);
              for (int i = 0; i < mb; ++i) for (int r = 0; r < wd; ++r) yy[(m0 + i) * N + 8 * g + r] = tmp[wd * i + r];
            }
            g += wd / 16;
          }
        }
      }
    }
    best[kind] = std::min(best[kind], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / L);
  }
  int64_t diff = 0; for (size_t i = 0; i < y[0].size(); ++i) diff += y[0][i] != y[1][i];
  printf("type %d M=%ld: groups %.3f ms, pairs %.3f ms (%.2fx); %.0f / %.0f GOP/s; bit differences %ld\n", type, M, best[0] * 1e3, best[1] * 1e3, best[0] / best[1], 2.0 * M * N * K / best[0] / 1e9, 2.0 * M * N * K / best[1] / 1e9, diff);
}
