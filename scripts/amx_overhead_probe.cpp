// The AVX-512 work of the AMX-INT8 kernels (pagedattn/csrc/quant_amx_cpu.h) alone, on any CPU
// with AVX-512 VNNI: the tile instructions become empty statements, so what is timed is the
// weights unpacked into tiles and every product's scaling, against the VNNI kernel
// (quant_x8_cpu.h) on the same work. One thread, 4,096 x 2,048 weights (cached), K = 2048.
//
//   TI=$(.venv/bin/python -c "import torch,os;print(os.path.dirname(torch.__file__)+'/include')")
//   g++ -O3 -std=c++17 -march=native -DCPU_CAPABILITY_AVX512 -DPAGEDATTN_AMX_EMULATE \
//       -ffp-contract=off -Ipagedattn/csrc -I$TI -o /tmp/amx_probe scripts/amx_overhead_probe.cpp
//   /tmp/amx_probe [type=12 (Q4_K) | 14 (Q6_K) | 8 (Q8_0)] [rows=32 (a multiple of 16)]
//
// AMD EPYC Zen 4 (no AMX), 2026-12-06, GOP/s-equivalent, VNNI kernel / work around the tiles:
// 16 rows Q4_K 256 / 733, Q6_K 220 / 685, Q8_0 187 / 908; 32 rows 306 / 980, 227 / 954,
// 193 / 1,191.
#include <immintrin.h>
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#define _tile_loadconfig(cfg) asm volatile("" : : "r"(cfg) : "memory")
#define _tile_loadd(t, base, stride) asm volatile("" : : "r"(base), "r"(stride) : "memory")
#define _tile_stored(t, base, stride) asm volatile("" : : "r"(base), "r"(stride) : "memory")
#define _tile_zero(t) asm volatile("" ::: "memory")
#define _tile_dpbssd(c, a, b) asm volatile("" ::: "memory")
#include "quant_amx_cpu.h"
#include <chrono>
#include <functional>
#include <cstdio>
#include <random>
#include <vector>
using namespace pagedattn_quant;
int main(int argc, char** argv) {
  const int type = argc > 1 ? atoi(argv[1]) : 12;
  const int64_t rows16 = argc > 2 ? atoi(argv[2]) : 32;
  const int64_t N = 4096, K = 2048;
  const bool kt = type != kQ8_0;
  const int64_t nb = K / (kt ? 256 : 32);
  const int64_t gb = nb * (type == kQ4_K ? sizeof(BlockQ4_Kx8) : type == kQ6_K ? sizeof(BlockQ6_Kx8) : sizeof(BlockQ8_0x8));
  std::vector<uint8_t> w(N / 8 * gb);
  std::mt19937 rng(0);
  for (auto& b : w) b = rng() & 0x3f;
  std::vector<ActQ8_K> ak(kt ? rows16 * nb : 0);
  std::vector<ActQ8_0> a0(kt ? 0 : rows16 * nb);
  for (auto& a : ak) { a.d = 0.01f; for (auto& q : a.qs) q = rng() % 50; }
  for (auto& a : a0) { a.d = 0.01f; for (auto& q : a.qs) q = rng() % 50; }
  const void* act = kt ? (const void*)ak.data() : (const void*)a0.data();
  std::vector<float> out(rows16 * 16);
  // VNNI kernel, 8 rows at a time, for comparison
  auto vnni = [&]() {
    float tmp[64];
    for (int64_t g = 0; g < N / 8; ++g)
      for (int64_t m0 = 0; m0 < rows16; m0 += 8) {
        const void* a[8];
        for (int i = 0; i < 8; ++i) a[i] = kt ? (const void*)(ak.data() + (m0 + i) * nb) : (const void*)(a0.data() + (m0 + i) * nb);
        gemm_x8_rows(8, type, w.data() + g * gb, nb, a, tmp, m0 == 0);
        asm volatile("" : : "r"(tmp) : "memory");
      }
  };
  auto amx = [&]() {
    for (int64_t p = 0; p < N / 16; ++p) x8_amx::gemm_pair(type, w.data() + 2 * p * gb, w.data() + (2 * p + 1) * gb, nb, act, rows16, out.data());
    asm volatile("" : : "r"(out.data()) : "memory");
  };
  const double ops = 2.0 * rows16 * N * K;
  for (int rep = 0; rep < 3; ++rep) {
    for (auto [name, f] : {std::pair<const char*, std::function<void()>>{"vnni x8", vnni}, {"amx minus tiles", amx}}) {
      f();
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 5; ++i) f();
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 5;
      std::printf("type %d rows %ld %-16s %.3f ms  %.0f GOP/s-equivalent\n", type, (long)rows16, name, s * 1e3, ops / s / 1e9);
    }
  }
}
