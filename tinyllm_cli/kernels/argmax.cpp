// Greedy sampling: argmax over rows of float32 logits (torch.argmax's answer, NaN and ties
// included), and panel_argmax, which finds the same index through a bfloat16 screen of the output
// matrix and a few exact float32 columns (model/greedy_head.py).
#include "isa.h"
#include "ops.h"
#include "panels.h"

namespace tinyllm {
namespace {

// The index of a row's first NaN, or -1.
int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

// torch.argmax of one row: the first index of its maximum, a NaN counting as the maximum (the
// first NaN's index). The AVX-512 loop keeps each lane's best value and the first index it was
// seen at (strictly greater replaces), then takes the smallest index among the lanes holding the
// row's maximum, so ties resolve to the first occurrence as torch's do.
int64_t row_argmax(const float* x, int64_t n) {
  int64_t i = 0, arg = 0;
  float m = x[0];
#if defined(__AVX512F__)
  if (n >= 32) {
    __m512 best = _mm512_loadu_ps(x);
    __m512i best_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = best_i;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best = _mm512_mask_mov_ps(best, gt, v);
      best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    }
    if (nan) return first_nan(x, n);
    m = _mm512_reduce_max_ps(best);
    arg = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ), best_i);
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return first_nan(x, n);
    if (x[i] > m) {
      m = x[i];
      arg = i;
    }
  }
  return arg;
}

}  // namespace

// x [R, N] float32, rows contiguous -> [R] int64, torch.argmax(x, -1). The rows split over
// threads when there is enough work (a batch's logits); one row stays on the calling thread.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0 && x.stride(1) == 1 &&
              x.size(1) < (int64_t{1} << 31), "argmax: x must be float32 [R, N] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 17) / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * ld, n);
  });
  return out;
}
// ---- greedy rows through a screened output matrix -----------------------------------------
//
// argmax_j of (x @ w^T)[r, j] for every row r: the same index as row_argmax over the float32
// logits panel_linear(x, w) gives (the first maximum), reading a bfloat16 copy of w (ws) and a
// few of w's columns instead of all of w. On CPUs with bfloat16 dot products that is half the
// bytes and half the FMA time of the output matrix, the largest matmul of a small model's decode
// step (model/greedy_head.py says when it is used).
// 1. screen: s = panel_linear(x, ws): x rounded to bfloat16, products exact, float32 sums.
// 2. bound: with L_j the float32 logit panel_linear(x, w) computes (an fma chain over k in order)
//    and S_j = sum_k |x_k w_kj| <= ||x|| ||w_j|| (Cauchy-Schwarz),
//      |L_j - s_j| <= (2u + u^2) S_j          x and w rounded to bfloat16 (u = 2^-8)
//                     + 2.01 gamma_K S_j       both float32 sums (gamma_K ~ K 2^-24: at most K roundings each)
//                     + K 2^-124 (1 + ||w_j||) subnormals flushed to zero by vdpbf16ps
//    so e_j = C ||x|| ||w_j|| + K 2^-124 (1 + ||w_j||) with C = 2^-7 + 2^-15 + 3 K 2^-24 bounds
//    it (norms[j] >= ||w_j||, rounded up when stored). T = max_j (s_j - e_j) is at most some L_m;
//    every j with s_j + e_j < T has L_j < L_m, so only the others (candidates) can hold the
//    maximum, and every index that holds it is a candidate. The selection runs in float32; its
//    roundings stay far inside the bound's slack (see the loop).
// 3. the candidates' L_j exactly as the float32 tile computes them (acc = fma(x_k, w_kj, acc)
//    for k in order from zero, then + 0: wide_tile's chain), read from rows (w unpacked, one
//    contiguous row per candidate); the first maximum among them in index order. w's packed
//    panels serve only the rows that take their full logits.
// A row takes its full float32 logits and row_argmax instead when the bound cannot be trusted
// (x not finite, ||x|| >= 2^120, where rounding to bfloat16 might overflow, or ||x|| max ||w_j||
// >= 2^100, where a float32 partial sum might), or
// when more than 1/64 of the vocabulary are candidates (flat logits: the gather would cost more).
// No bias: model/greedy_head.py screens bias-free heads only.
at::Tensor panel_argmax(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ws, const at::Tensor& rows,
                        const at::Tensor& norms) {
#if defined(TINYLLM_PANEL_WIDE) && defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
              ws.scalar_type() == at::kBFloat16 && rows.scalar_type() == at::kFloat && norms.scalar_type() == at::kFloat,
              "panel_argmax: float32 x, w and rows, bfloat16 ws, float32 norms");
  TORCH_CHECK(w.sizes() == ws.sizes() && w.sizes() == rows.sizes() && norms.numel() == w.size(0) &&
              x.size(1) == w.size(1) && w.is_contiguous() && ws.is_contiguous() && rows.is_contiguous() &&
              norms.is_contiguous() && wide_panels(ws) == 2,
              "panel_argmax: w, ws (packed) and rows [N, K] alike (K even), one norm per output");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k < (int64_t{1} << 16), "panel_argmax: K must be below 65536");
  auto out = at::empty({m}, x.options().dtype(at::kLong));
  if (m == 0) return out;
  const auto xc = x.contiguous();
  const auto s = panel_linear(xc, ws, std::nullopt);  // [M, N] float32 screen
  const float* xp = xc.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  float max_norm = 0.0f;
  for (int64_t j = 0; j < n; ++j) max_norm = std::max(max_norm, np[j]);
  const double c = std::ldexp(1.0, -7) + std::ldexp(1.0, -15) + 3.0 * k * std::ldexp(1.0, -24);
  const float tiny = static_cast<float>(k * std::ldexp(1.0, -124));
  std::vector<uint8_t> full(m, 0);
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> cand;
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * k;
      const float* sr = sp + r * n;
      double ss = 0.0;
      for (int64_t i = 0; i < k; ++i) ss += double(xr[i]) * xr[i];
      const double nx = std::sqrt(ss) * (1.0 + 1e-12);
      if (!(nx < std::ldexp(1.0, 120) && nx * max_norm < std::ldexp(1.0, 100))) {
        full[r] = 1;
        continue;
      }
      // e_j = a ||w_j|| + tiny, in float32: each rounding here is below 2^-16 e_j (|s_j| <= 1.01
      // ||x|| ||w_j|| <= 2^7.1 e_j), inside the 2^-8 e_j of slack C carries.
      const float a = static_cast<float>((c * nx + tiny) * (1.0 + 1e-6));
      const __m512 av = _mm512_set1_ps(a), tv = _mm512_set1_ps(tiny);
      __m512 tm = _mm512_set1_ps(-INFINITY);
      int64_t j = 0;
      for (; j + 16 <= n; j += 16)
        tm = _mm512_max_ps(tm, _mm512_sub_ps(_mm512_loadu_ps(sr + j), _mm512_fmadd_ps(av, _mm512_loadu_ps(np + j), tv)));
      float t = _mm512_reduce_max_ps(tm);
      for (int64_t i = j; i < n; ++i) t = std::max(t, sr[i] - (a * np[i] + tiny));
      cand.clear();
      const __m512 tb = _mm512_set1_ps(t);
      for (j = 0; j + 16 <= n; j += 16) {
        const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(sr + j), _mm512_fmadd_ps(av, _mm512_loadu_ps(np + j), tv));
        for (uint32_t mk = _mm512_cmp_ps_mask(hi, tb, _CMP_GE_OQ); mk; mk &= mk - 1) cand.push_back(j + __builtin_ctz(mk));
      }
      for (int64_t i = j; i < n; ++i)
        if (sr[i] + (a * np[i] + tiny) >= t) cand.push_back(i);
      if (!(t > -INFINITY) || int64_t(cand.size()) * 64 > n) {  // a NaN screen, or flat logits
        full[r] = 1;
        continue;
      }
      int64_t best = -1;
      float best_v = 0.0f;
      for (const int64_t j : cand) {
        const float* wr = rp + j * k;
        float acc = 0.0f;
        for (int64_t i = 0; i < k; ++i) acc = std::fma(xr[i], wr[i], acc);
        acc += 0.0f;
        if (best < 0 || acc > best_v) {
          best = j;
          best_v = acc;
        }
      }
      op[r] = best;
    }
  });
  std::vector<int64_t> rest;
  for (int64_t r = 0; r < m; ++r)
    if (full[r]) rest.push_back(r);
  if (!rest.empty()) {
    const auto idx = at::tensor(rest, out.options());
    const auto logits = panel_linear(xc.index_select(0, idx), w, std::nullopt);
    for (size_t i = 0; i < rest.size(); ++i) op[rest[i]] = row_argmax(logits.data_ptr<float>() + i * n, n);
  }
  return out;
#else
  TORCH_CHECK(false, "panel_argmax needs a build with AVX-512 and AVX512-BF16");
#endif
}

}  // namespace tinyllm
