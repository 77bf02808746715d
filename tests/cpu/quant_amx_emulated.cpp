// The AMX-INT8 kernels of pagedattn/csrc/quant_amx_cpu.h with the tiles emulated
// (amx_emulator.h), against the AVX-512 VNNI kernels of quant_x8_cpu.h on the same random blocks
// and activations: the outputs must be the same bit for bit. Built and run by
// test_quant_amx.py; prints one line per case and exits 1 on a difference.
#include "amx_emulator.h"
#include "quant_amx_cpu.h"

#include <cstdio>
#include <random>
#include <vector>

using namespace pagedattn_quant;

namespace {

std::mt19937 rng(0);

int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
uint16_t half(float x) { return c10::Half(x).x; }
float scale() { return std::uniform_real_distribution<float>(0.001f, 0.05f)(rng); }

template <typename T>
void random_bytes(T* p, size_t n) {
  auto* b = reinterpret_cast<uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(uniform(0, 255));
}

// Activation rows as the quantiser writes them: int8 values, a scale, and their sums.
std::vector<ActQ8_K> act_k(int64_t rows, int64_t nb) {
  std::vector<ActQ8_K> a(rows * nb);
  for (auto& blk : a) {
    blk.d = scale();
    for (auto& q : blk.qs) q = static_cast<int8_t>(uniform(-127, 127));
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += blk.qs[16 * g + j];
      blk.bsums[g] = static_cast<int16_t>(s);
    }
    for (int c = 0; c < 8; ++c) blk.sums32[c] = static_cast<int16_t>(blk.bsums[2 * c] + blk.bsums[2 * c + 1]);
  }
  return a;
}

std::vector<ActQ8_0> act_0(int64_t rows, int64_t nb) {
  std::vector<ActQ8_0> a(rows * nb);
  for (auto& blk : a) {
    blk.d = scale();
    int s = 0;
    for (auto& q : blk.qs) s += (q = static_cast<int8_t>(uniform(-127, 127)));
    blk.sum = s;
    blk.s = blk.d * static_cast<float>(s);
  }
  return a;
}

// Rows [0, N) of a random layer of `type` as x8 groups (N / 8 groups of nb x8 blocks).
std::vector<uint8_t> random_groups(int type, int64_t N, int64_t nb) {
  const int64_t rows_bytes = nb * block_bytes(type);
  std::vector<uint8_t> rows(N * rows_bytes);
  random_bytes(rows.data(), rows.size());
  for (int64_t i = 0; i < N * nb; ++i) {  // finite scales
    uint8_t* blk = rows.data() + i * block_bytes(type);
    if (type == kQ4_K) {
      auto* b = reinterpret_cast<BlockQ4_K*>(blk);
      b->d = half(scale());
      b->dmin = half(scale());
    } else if (type == kQ6_K) {
      reinterpret_cast<BlockQ6_K*>(blk)->d = half(scale());
    } else {
      reinterpret_cast<BlockQ8_0*>(blk)->d = half(scale());
    }
  }
  const int64_t group_bytes = nb * x8_block_bytes(type);
  std::vector<uint8_t> groups(N / 8 * group_bytes);
  for (int64_t g = 0; g < N / 8; ++g) {
    const uint8_t* from = rows.data() + g * 8 * rows_bytes;
    uint8_t* to = groups.data() + g * group_bytes;
    if (type == kQ4_K) repack_q45_k_x8(from, nb, reinterpret_cast<BlockQ4_Kx8*>(to));
    if (type == kQ6_K) repack_q6_k_x8(from, nb, reinterpret_cast<BlockQ6_Kx8*>(to));
    if (type == kQ8_0) repack_q8_0_x8(from, nb, reinterpret_cast<BlockQ8_0x8*>(to));
  }
  return groups;
}

// Returns the number of outputs that differ from the VNNI kernel's.
int check(int type, int64_t K, int64_t rows16) {
  const bool k_type = type != kQ8_0;
  const int64_t nb = K / (k_type ? kBlockK : kBlock), N = 32;
  const std::vector<uint8_t> groups = random_groups(type, N, nb);
  const int64_t group_bytes = nb * x8_block_bytes(type);
  const std::vector<ActQ8_K> ak = k_type ? act_k(rows16, nb) : std::vector<ActQ8_K>();
  const std::vector<ActQ8_0> a0 = k_type ? std::vector<ActQ8_0>() : act_0(rows16, nb);
  const void* act = k_type ? static_cast<const void*>(ak.data()) : static_cast<const void*>(a0.data());
  const size_t act_bytes = k_type ? sizeof(ActQ8_K) : sizeof(ActQ8_0);
  x8_amx::configure(x8_amx::values(type));
  int bad = 0;
  float max_abs = 0.0f;
  std::vector<float> out(rows16 * 16);
  for (int64_t pair = 0; pair < N / 16; ++pair) {
    const uint8_t* g0 = groups.data() + 2 * pair * group_bytes;
    x8_amx::gemm_pair(type, g0, g0 + group_bytes, nb, act, rows16, out.data());
    for (int64_t m = 0; m < rows16; ++m) {
      // the VNNI kernels, one activation row against each group: 8 outputs each
      const void* row[1] = {static_cast<const uint8_t*>(act) + m * nb * act_bytes};
      float ref[16];
      gemm_x8<1>(type, g0, nb, row, ref, false);
      gemm_x8<1>(type, g0 + group_bytes, nb, row, ref + 8, false);
      for (int n = 0; n < 16; ++n) {
        const float got = out[m * 16 + n];
        max_abs = std::max(max_abs, std::fabs(ref[n]));
        if (std::memcmp(&got, &ref[n], sizeof(float)) != 0) {
          if (bad++ < 5) std::printf("  type %d row %ld col %d: %.9g against %.9g\n", type, static_cast<long>(m), n, got, ref[n]);
        }
      }
    }
  }
  std::printf("type %d K %ld rows %ld: %d of %ld outputs differ (largest |output| %.3g)\n", type,
              static_cast<long>(K), static_cast<long>(rows16), bad, static_cast<long>(rows16 * N), max_abs);
  return bad;
}

}  // namespace

int main() {
  int bad = 0;
  for (int64_t rows : {16, 32, 48}) {
    bad += check(kQ4_K, 512, rows);
    bad += check(kQ6_K, 768, rows);
    bad += check(kQ8_0, 96, rows);   // 3 blocks: the odd one pairs with zero weights
    bad += check(kQ8_0, 128, rows);
  }
  return bad == 0 ? 0 : 1;
}
