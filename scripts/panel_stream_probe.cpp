// What slows the panel GEMM's 32-row decode pass at AVX-512: its FMAs, its weight stream, or the
// two together. A standalone copy of the pass (32 rows: blocks of 12, 12 and 8 rows through each
// 32-column panel of K = 576, as linear_cpu.cpp's AVX-512 build runs it), over 590 MB of panels
// so that they stream from memory, one slice of panels per thread.
//
//   g++ -O3 -march=native -pthread -o /tmp/probe scripts/panel_stream_probe.cpp
//   /tmp/probe MODE THREADS [PERCENT]
//
// MODE:
//   stream   the engine's scheme: each row block fetches a third of the next panel (prefetch T1,
//            spread over its K loop) while it computes on the current one;
//   none     the same without the next panel's prefetch (the hardware prefetchers only);
//   compute  the FMAs alone: the micro-kernel reads two panels that stay in L2;
//   both     the FMAs on the L2 panels beside the stream's prefetches of the real next panel
//            (PERCENT of its lines, 100 by default): how much the prefetches slow the FMAs;
//   sweep    no FMAs: prefetch T1 over every line of the panels, then nothing else.
// Prints GFLOP/s of the pass and the panels' bytes per second (for compute and both: bytes the
// FMAs read from L2, not from memory). Needs AVX-512F.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

namespace {

constexpr int K = 576, M = 32, kPanel = 32, kAhead = 32;  // kAhead: K steps of the L1 prefetch
constexpr long kPanels = 8000;                           // 590 MB of fp32 panels
constexpr long kLines = K * kPanel * 4 / 64;             // cache lines per panel
enum class Mode { kStream, kNone, kCompute, kBoth, kSweep };

double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// y[MR rows][32] = x[MR rows][K] . w[K][32]; prefetches `lines` lines from `next` (T1) spread
// over the K loop.
template <int MR>
__attribute__((noinline)) void block(const float* x, const float* w, float* y, long ldy,
                                     const char* next, long lines) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const long every = lines > 0 ? std::max<long>(1, K / lines) : K + 1;
  const long per = lines > 0 ? (lines + K - 1) / K : 0;
  long done = 0;
  for (int k = 0; k < K; ++k) {
    const char* ahead = reinterpret_cast<const char*>(w + (k + kAhead) * kPanel);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    if (k % every == 0) {
      for (long i = 0; i < per && done < lines; ++i, ++done) {
        _mm_prefetch(next + 64 * done, _MM_HINT_T1);
      }
    }
    const __m512 w0 = _mm512_loadu_ps(w + k * kPanel), w1 = _mm512_loadu_ps(w + k * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  for (; done < lines; ++done) _mm_prefetch(next + 64 * done, _MM_HINT_T1);
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}

void pass(Mode mode, long percent, const float* x, const float* panels, const float* l2,
          float* y, long p0, long p1) {
  const long ldy = kPanel * kPanels;
  for (long p = p0; p < p1; ++p) {
    const float* real = panels + p * K * kPanel;
    const char* next = reinterpret_cast<const char*>(real + (p + 1 < p1 ? K * kPanel : 0));
    if (mode == Mode::kSweep) {
      for (long i = 0; i < kLines; ++i) _mm_prefetch(next + 64 * i, _MM_HINT_T1);
      continue;
    }
    const bool in_l2 = mode == Mode::kCompute || mode == Mode::kBoth;
    const float* w = in_l2 ? l2 + (p % 2) * K * kPanel : real;
    long lines = mode == Mode::kStream ? kLines : mode == Mode::kBoth ? kLines * percent / 100 : 0;
    const long third = lines / 3;
    float* out = y + p * kPanel;
    block<12>(x, w, out, ldy, next, third);
    block<12>(x + 12 * K, w, out + 12 * ldy, ldy, next + 64 * third, third);
    block<8>(x + 24 * K, w, out + 24 * ldy, ldy, next + 128 * third, lines - 2 * third);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* names[] = {"stream", "none", "compute", "both", "sweep"};
  int m = 0;
  while (m < 5 && (argc < 2 || std::strcmp(argv[1], names[m]) != 0)) ++m;
  if (argc < 3 || m == 5) {
    std::fprintf(stderr, "usage: %s stream|none|compute|both|sweep THREADS [PERCENT]\n", argv[0]);
    return 2;
  }
  const Mode mode = static_cast<Mode>(m);
  const int threads = std::atoi(argv[2]);
  const long percent = argc > 3 ? std::atol(argv[3]) : 100;
  const size_t bytes = sizeof(float) * K * kPanel * kPanels;
  auto* panels = static_cast<float*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  std::fill(panels, panels + bytes / sizeof(float), 0.001f);
  std::vector<float> x(M * K, 0.5f), l2(2 * K * kPanel, 0.001f), y(M * kPanel * kPanels);
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    const double start = now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back(pass, mode, percent, x.data(), panels, l2.data(), y.data(),
                        kPanels * t / threads, kPanels * (t + 1) / threads);
    }
    for (auto& t : pool) t.join();
    best = std::min(best, now() - start);
  }
  std::printf("%s, %d threads, %ld%%: %.1f GFLOP/s, %.1f GB/s\n", names[m], threads, percent,
              mode == Mode::kSweep ? 0.0 : 2.0 * M * K * kPanel * kPanels / best / 1e9,
              bytes / best / 1e9);
  munmap(panels, bytes);
  return 0;
}
