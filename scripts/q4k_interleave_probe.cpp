// Whether Q4_K weights interleaved 8 rows at a time multiply faster than pagedattn's row-major
// dot kernel (csrc/quant_dot_cpu.h), the layout llama.cpp's repacked GEMM uses: one 32-byte load
// holds 4 values of each of 8 rows, one maddubs meets them with 4 broadcast activation values,
// and the int16 sums of a whole 32-value sub-block add up over 8 maddubs before one madd applies
// the 8 rows' scales (the row-major kernel follows every maddubs with a madd, and both run on
// the same port on Zen 2). Standalone: random Q4_K blocks [N, K], Q8_K activations [M, K]; it
// checks that both kernels agree, then times each over the same data on OpenMP threads.
//
//   g++ -O3 -mavx2 -mfma -mf16c -fopenmp -o /tmp/q4k_probe scripts/q4k_interleave_probe.cpp
//   OMP_NUM_THREADS=2 /tmp/q4k_probe N K M        (default 8192 2048 128)
//
// AMD EPYC Zen 2, 2 vCPUs, 2026-12-05 (N=8192, K=2048): x8 227 / 232 / 212 GFLOP/s at 32 / 128 /
// 512 rows against 140 / 137 / 105 for the row-major copy; the extension's own dot kernel (with
// its activation quantisation and threading) ran 126 / 124 / 122 the same minute. The extension
// now runs this layout (pagedattn/csrc/quant_x8_cpu.h, with the scales held as bytes).
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct ActQ8_K {
  float d;
  int16_t bsums[16];
  int8_t qs[256];
};

static float h2f(uint16_t h) { return _cvtsh_ss(h); }
static uint16_t f2h(float f) { return _cvtss_sh(f, 0); }

static void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ---- row-major dot kernel (pagedattn's current form), MB rows -------------------------------
template <int MB>
static void dot_rowmajor(const BlockQ4_K* row, int nb, const ActQ8_K* const* act, float* sums) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const BlockQ4_K* head = row + b;
    const float d = h2f(head->d), dmin = h2f(head->dmin);
    uint32_t u[4];
    std::memcpy(u, head->scales, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t u1 = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = u1;
    u[0] &= 0x3f3f3f3fu;
    const __m128i packed = _mm_set_epi32(u[3], u[2], u[1], u[0]);
    const __m128i sc16 = _mm_cvtepu8_epi16(packed);
    const __m256i scales = _mm256_set_m128i(sc16, sc16);
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(head->qs + 32 * j));
      __m256i lo = _mm256_and_si256(q, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      auto lane = [](int i) { return _mm_set1_epi16(static_cast<short>(((2 * i + 1) << 8) | (2 * i))); };
      const __m256i s_lo = _mm256_shuffle_epi8(scales, _mm256_set_m128i(lane(2 * j), lane(2 * j)));
      const __m256i s_hi =
          _mm256_shuffle_epi8(scales, _mm256_set_m128i(lane(2 * j + 1), lane(2 * j + 1)));
      for (int m = 0; m < MB; ++m) {
        const int8_t* y = act[m][b].qs + 64 * j;
        const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
        const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 32));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), s_lo));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), s_hi));
      }
    }
    const __m128i mn8 = _mm_unpackhi_epi64(packed, packed);
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * a.d), acc[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins)),
                               _mm256_set1_ps(-dmin * a.d), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    sums[m] = _mm_cvtss_f32(s);
  }
}

// ---- repacked: 8 rows interleaved ------------------------------------------------------------
// Per group of 8 rows and superblock: d[8], dmin[8] (float), scales as int8 pairs per sub-block
// (16 bytes: row r's scale at 2r and 2r+1), mins likewise per sub-block pair for the madd with
// bsums, then qs: for i in 0..3, c in 0..7: 32 bytes = rows 0..7 x their qs[32i + 4c .. +3].
struct BlockQ4_Kx8 {
  float d[8];
  float dmin[8];
  uint8_t sc[8][16];   // [sub-block][2r, 2r+1]
  uint8_t mn[4][32];   // [sub-block pair p][4r..4r+3]: row r's mins of 2p, 2p+1 as int16
  uint8_t qs[4][8][32];
};

static void repack(const BlockQ4_K* w, int N, int nb, std::vector<BlockQ4_Kx8>& out) {
  out.resize(static_cast<size_t>(N / 8) * nb);
  for (int g = 0; g < N / 8; ++g) {
    for (int b = 0; b < nb; ++b) {
      BlockQ4_Kx8& o = out[static_cast<size_t>(g) * nb + b];
      for (int r = 0; r < 8; ++r) {
        const BlockQ4_K& blk = w[static_cast<size_t>(g * 8 + r) * nb + b];
        o.d[r] = h2f(blk.d);
        o.dmin[r] = h2f(blk.dmin);
        for (int j = 0; j < 8; ++j) {
          uint8_t sc, mn;
          scale_min_k4(j, blk.scales, &sc, &mn);
          o.sc[j][2 * r] = o.sc[j][2 * r + 1] = sc;
          // mn[p][4r + 0..1] = int16 mn_{2p}, mn[p][4r + 2..3] = int16 mn_{2p+1}
          const int p = j / 2, h = j % 2;
          o.mn[p][4 * r + 2 * h] = mn;
          o.mn[p][4 * r + 2 * h + 1] = 0;
        }
        for (int i = 0; i < 4; ++i)
          for (int c = 0; c < 8; ++c) std::memcpy(&o.qs[i][c][4 * r], blk.qs + 32 * i + 4 * c, 4);
      }
    }
  }
}

// y[m][8 rows of group] for MB activation rows.
template <int MB>
static void gemm_x8(const BlockQ4_Kx8* grp, int nb, const ActQ8_K* const* act, float* out, int ldo) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int b = 0; b < nb; ++b) {
    const BlockQ4_Kx8& w = grp[b];
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      __m256i lo16[MB], hi16[MB];
      for (int m = 0; m < MB; ++m) lo16[m] = hi16[m] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs[i][c]));
        const __m256i lo = _mm256_and_si256(q, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        for (int m = 0; m < MB; ++m) {
          const int8_t* y = act[m][b].qs + 64 * i + 4 * c;
          int32_t ylo, yhi;
          std::memcpy(&ylo, y, 4);
          std::memcpy(&yhi, y + 32, 4);
          lo16[m] = _mm256_add_epi16(lo16[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(ylo)));
          hi16[m] = _mm256_add_epi16(hi16[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(yhi)));
        }
      }
      const __m256i s_lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc[2 * i])));
      const __m256i s_hi =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc[2 * i + 1])));
      for (int m = 0; m < MB; ++m) {
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(lo16[m], s_lo));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(hi16[m], s_hi));
      }
    }
    const __m256 d = _mm256_loadu_ps(w.d), dmin = _mm256_loadu_ps(w.dmin);
    for (int m = 0; m < MB; ++m) {
      const ActQ8_K& a = act[m][b];
      __m256i msum = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        // (bsum of sub-block 2p, of 2p+1) broadcast as int16 pairs
        const int16_t s0 = a.bsums[4 * p] + a.bsums[4 * p + 1];
        const int16_t s1 = a.bsums[4 * p + 2] + a.bsums[4 * p + 3];
        const __m256i bs = _mm256_set1_epi32((static_cast<uint16_t>(s1) << 16) | static_cast<uint16_t>(s0));
        const __m256i mn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mn[p]));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mn, bs));
      }
      const __m256 ad = _mm256_set1_ps(a.d);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, ad), acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + static_cast<size_t>(m) * ldo, acc[m]);
}

static void quantize_q8_k(const float* x, int K, ActQ8_K* out) {
  for (int b = 0; b < K / 256; ++b) {
    const float* v = x + 256 * b;
    float amax = 0;
    for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
    out[b].d = d;
    for (int i = 0; i < 256; ++i) out[b].qs[i] = static_cast<int8_t>(std::lrintf(v[i] * id));
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += out[b].qs[16 * g + i];
      out[b].bsums[g] = static_cast<int16_t>(s);
    }
  }
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 8192, K = argc > 2 ? atoi(argv[2]) : 2048;
  const int M = argc > 3 ? atoi(argv[3]) : 128;
  const int nb = K / 256;
  std::mt19937 rng(0);
  std::vector<BlockQ4_K> w(static_cast<size_t>(N) * nb);
  for (auto& blk : w) {
    blk.d = f2h(0.001f + (rng() % 1000) * 1e-6f);
    blk.dmin = f2h(0.0005f + (rng() % 1000) * 1e-6f);
    for (auto& s : blk.scales) s = rng();
    for (auto& q : blk.qs) q = rng();
  }
  std::vector<float> x(static_cast<size_t>(M) * K);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  std::vector<ActQ8_K> a(static_cast<size_t>(M) * nb);
  for (int m = 0; m < M; ++m) quantize_q8_k(x.data() + static_cast<size_t>(m) * K, K, a.data() + static_cast<size_t>(m) * nb);
  std::vector<BlockQ4_Kx8> wx;
  repack(w.data(), N, nb, wx);
  std::vector<float> y0(static_cast<size_t>(M) * N), y1(static_cast<size_t>(M) * N);

  auto run_rowmajor = [&] {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
      for (int m0 = 0; m0 < M; m0 += 8) {
        const ActQ8_K* act[8];
        for (int i = 0; i < 8; ++i) act[i] = a.data() + static_cast<size_t>(std::min(m0 + i, M - 1)) * nb;
        float s[8];
        dot_rowmajor<8>(w.data() + static_cast<size_t>(n) * nb, nb, act, s);
        for (int i = 0; i < 8 && m0 + i < M; ++i) y0[static_cast<size_t>(m0 + i) * N + n] = s[i];
      }
    }
  };
  auto run_x8 = [&] {
#pragma omp parallel for schedule(static)
    for (int g = 0; g < N / 8; ++g) {
      for (int m0 = 0; m0 < M; m0 += 4) {
        const ActQ8_K* act[4];
        for (int i = 0; i < 4; ++i) act[i] = a.data() + static_cast<size_t>(std::min(m0 + i, M - 1)) * nb;
        float tmp[4 * 8];
        gemm_x8<4>(wx.data() + static_cast<size_t>(g) * nb, nb, act, tmp, 8);
        for (int i = 0; i < 4 && m0 + i < M; ++i)
          std::memcpy(&y1[static_cast<size_t>(m0 + i) * N + 8 * g], tmp + 8 * i, 32);
      }
    }
  };
  run_rowmajor();
  run_x8();
  double err = 0, ref = 0;
  for (size_t i = 0; i < y0.size(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(y0[i] - y1[i])));
    ref = std::max(ref, static_cast<double>(std::fabs(y0[i])));
  }
  printf("max |rowmajor - x8| = %g (max |y| %g)\n", err, ref);
  auto time = [&](auto fn) {
    double best = 1e9;
    for (int r = 0; r < 5; ++r) {
      auto t = std::chrono::steady_clock::now();
      fn();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    }
    return best;
  };
  const double flop = 2.0 * M * N * K;
  const double t0 = time(run_rowmajor), t1 = time(run_x8);
  printf("N=%d K=%d M=%d threads=%d: rowmajor %.1f GFLOP/s, x8 %.1f GFLOP/s (%.2fx)\n", N, K, M,
         omp_get_max_threads(), flop / t0 / 1e9, flop / t1 / 1e9, t0 / t1);
}
