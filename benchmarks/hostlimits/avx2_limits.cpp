// This host's AVX2 + FMA limits, measured with 256-bit (ymm) instructions only: the ceiling an
// AVX2 code path can reach here, whatever wider units the CPU also has.
//
// - fma_gflops(threads): independent chains of vfmadd231ps ymm (12 accumulators, so the FMA
//   latency of 4-5 cycles never stalls two pipes), 16 FLOPs per instruction; every thread runs the
//   same loop and the rate is the total over the slowest thread's time.
// - l1_load_gbps(threads): ymm loads from an 8 KiB buffer (in L1) summed into 8 accumulators
//   (sum_loads): the load-port rate.
// - stream_gbps(threads): a sum over 256 MiB (beyond every cache) read with ymm loads: the
//   streaming read bandwidth from memory.
//
// Built with -O2 -mavx2 -mfma (no AVX-512 flag), so the compiler can emit nothing wider. Each
// figure is the best of `reps` timed runs (a shared host can only make a run slower).
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

using clk = std::chrono::steady_clock;

double seconds_since(clk::time_point t0) {
  return std::chrono::duration<double>(clk::now() - t0).count();
}

// Runs body(thread_index) on `threads` threads started together; returns the wall seconds.
template <class F>
double on_threads(int threads, F body) {
  std::vector<std::thread> pool;
  auto t0 = clk::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& th : pool) th.join();
  return seconds_since(t0);
}

float fma_loop(long iters, float seed) {
  __m256 a0 = _mm256_set1_ps(seed), a1 = _mm256_set1_ps(seed + 1), a2 = _mm256_set1_ps(seed + 2),
         a3 = _mm256_set1_ps(seed + 3), a4 = _mm256_set1_ps(seed + 4), a5 = _mm256_set1_ps(seed + 5),
         a6 = _mm256_set1_ps(seed + 6), a7 = _mm256_set1_ps(seed + 7), a8 = _mm256_set1_ps(seed + 8),
         a9 = _mm256_set1_ps(seed + 9), a10 = _mm256_set1_ps(seed + 10), a11 = _mm256_set1_ps(seed + 11);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < iters; ++i) {
    a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c); a2 = _mm256_fmadd_ps(a2, m, c);
    a3 = _mm256_fmadd_ps(a3, m, c); a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
    a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c); a8 = _mm256_fmadd_ps(a8, m, c);
    a9 = _mm256_fmadd_ps(a9, m, c); a10 = _mm256_fmadd_ps(a10, m, c); a11 = _mm256_fmadd_ps(a11, m, c);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];  // returned so the loop is not dead code
}

// Sum of n floats (n a multiple of 64) with ymm loads into 8 independent accumulators, half by
// vaddps and half by vfmadd231ps (x * 1 + acc), so the adds have both the FADD and the FMA pipes
// and the loads, not the adds, set the pace.
float sum_loads(const float* p, long n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  for (long i = 0; i < n; i += 64) {
    s0 = _mm256_add_ps(s0, _mm256_load_ps(p + i));
    s1 = _mm256_fmadd_ps(_mm256_load_ps(p + i + 8), one, s1);
    s2 = _mm256_add_ps(s2, _mm256_load_ps(p + i + 16));
    s3 = _mm256_fmadd_ps(_mm256_load_ps(p + i + 24), one, s3);
    s4 = _mm256_add_ps(s4, _mm256_load_ps(p + i + 32));
    s5 = _mm256_fmadd_ps(_mm256_load_ps(p + i + 40), one, s5);
    s6 = _mm256_add_ps(s6, _mm256_load_ps(p + i + 48));
    s7 = _mm256_fmadd_ps(_mm256_load_ps(p + i + 56), one, s7);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)),
                           _mm256_add_ps(_mm256_add_ps(s4, s5), _mm256_add_ps(s6, s7)));
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];
}

float* aligned_floats(long n) {
  auto* p = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
  TORCH_CHECK(p != nullptr, "out of memory");
  for (long i = 0; i < n; ++i) p[i] = 1e-6f * (i % 97);
  return p;
}

volatile float sink;

}  // namespace

double fma_gflops(int64_t threads, int64_t iters, int64_t reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r)
    best = std::min(best, on_threads(threads, [&](int t) { sink = fma_loop(iters, 1.0f + t); }));
  return double(threads) * iters * 12 * 16 / best / 1e9;
}

double l1_load_gbps(int64_t threads, int64_t passes, int64_t reps) {
  const long n = 2048;  // 8 KiB per thread: well inside a 32-48 KiB L1
  std::vector<float*> bufs;
  for (int t = 0; t < threads; ++t) bufs.push_back(aligned_floats(n));
  double best = 1e30;
  for (int r = 0; r < reps; ++r)
    best = std::min(best, on_threads(threads, [&](int t) {
      float s = 0;
      for (long k = 0; k < passes; ++k) {
        asm volatile("" ::: "memory");  // the buffer may have changed: every pass loads it again
        s += sum_loads(bufs[t], n);
      }
      sink = s;
    }));
  for (auto* b : bufs) std::free(b);
  return double(threads) * passes * n * sizeof(float) / best / 1e9;
}

double stream_gbps(int64_t threads, int64_t mib, int64_t reps) {
  const long n = mib * (1L << 20) / sizeof(float);
  float* buf = aligned_floats(n);  // one buffer, split between the threads
  const long part = n / threads / 64 * 64;
  double best = 1e30;
  for (int r = 0; r < reps; ++r)
    best = std::min(best, on_threads(threads, [&](int t) { sink = sum_loads(buf + t * part, part); }));
  std::free(buf);
  return double(threads) * part * sizeof(float) / best / 1e9;
}

TORCH_LIBRARY(tinyllm_hostlimits, m) {
  m.def("fma_gflops(int threads, int iters, int reps) -> float", &fma_gflops);
  m.def("l1_load_gbps(int threads, int passes, int reps) -> float", &l1_load_gbps);
  m.def("stream_gbps(int threads, int mib, int reps) -> float", &stream_gbps);
}
