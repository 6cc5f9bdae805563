// panel_linear (ops.h): y = x @ w^T (+ bias) for float32 / bfloat16 weights that panel_pack laid
// out in column panels, on the tiles of panels.h: the wide AVX-512 tile where the build has it
// (TINYLLM_PANEL_WIDE), else the 6-row panel tile (AVX2, and bfloat16 on AVX-512 without BF16).
#include "isa.h"
#include "ops.h"
#include "panels.h"

namespace tinyllm {

#if defined(__AVX512F__) || defined(__AVX2__)
namespace {

// Panel p of w as float32 [K][PANEL_NR] into buf (the partial last panel zero-padded).
template <typename S>
void widen_panel(const typename S::T* w, int64_t n, int64_t k_len, int64_t p, float* buf) {
  const int64_t cols = std::min<int64_t>(PANEL_NR, n - p * PANEL_NR);
  const typename S::T* src = w + p * PANEL_NR * k_len;
  if (cols == PANEL_NR) {
    for (int64_t e = 0; e < k_len * PANEL_NR; e += kLanes) vstore(buf + e, vload(src + e));
    return;
  }
  for (int64_t k = 0; k < k_len; ++k)
    for (int64_t c = 0; c < PANEL_NR; ++c) buf[k * PANEL_NR + c] = c < cols ? S::ld(src[k * cols + c]) : 0.0f;
}

template <typename S>
void panel_matmul(const float* x, int64_t m, int64_t k_len, const typename S::T* w, int64_t n, const float* bias,
                  float* y) {
  const int64_t panels = (n + PANEL_NR - 1) / PANEL_NR, full = n / PANEL_NR;
  const int64_t chunk = std::max<int64_t>(PANEL_MR, PANEL_CHUNK_BYTES / (k_len * 4) / PANEL_MR * PANEL_MR);
  // Tiny products run on one thread: a fork costs more than they do.
  const int64_t grain = m * k_len * n < (1 << 16) ? panels : 1;
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
      const int64_t m1 = std::min(m, m0 + chunk);
      for (int64_t p = p0; p < p1; ++p) {
        // The tiles read float32 panels: a bfloat16 panel (and the partial last one) is widened
        // once per chunk into buf, which stays in L1/L2 for the chunk's tiles. Widening on every
        // tile's loads instead needs more than AVX2's 16 registers (GCC spills the accumulators).
        // Up to 3 rows (a single stream's step) fit in registers with the widening, and read
        // the bfloat16 panel directly: half the bytes of a float32 one.
        const int64_t cols = std::min<int64_t>(PANEL_NR, n - p * PANEL_NR);
        // A tile loads PANEL_NR bias entries as vectors: the partial last panel's are padded here.
        alignas(64) float tail_bias[PANEL_NR] = {};
        if (bias && cols < PANEL_NR) std::memcpy(tail_bias, bias + p * PANEL_NR, cols * sizeof(float));
        const float* b = !bias ? nullptr : cols < PANEL_NR ? tail_bias : bias + p * PANEL_NR;
        if (p < full && (std::is_same_v<typename S::T, float> || m1 - m0 <= 3)) {
          const auto* next = panel_next(w, k_len, p, p1, full, m, chunk);
          const int64_t bytes = PANEL_NR * k_len * sizeof(typename S::T);
          for (int64_t r = m0; r < m1; r += PANEL_MR)
            panel_rows(std::min<int64_t>(PANEL_MR, m1 - r), x + r * k_len, k_len, w + p * PANEL_NR * k_len, b,
                       y + r * n + p * PANEL_NR, n, cols, NextShare(next, bytes, m, r, k_len, PANEL_MR));
          continue;
        }
        float* buf = scratch(kPanelBuf, k_len * PANEL_NR);
        widen_panel<S>(w, n, k_len, p, buf);
        for (int64_t r = m0; r < m1; r += PANEL_MR)
          panel_rows(std::min<int64_t>(PANEL_MR, m1 - r), x + r * k_len, k_len, buf, b, y + r * n + p * PANEL_NR,
                     n, cols);
      }
    }
  });
}

}  // namespace
#endif

#if defined(TINYLLM_PANEL_WIDE)
#if !defined(__AVX512BF16__)
[[gnu::noinline]] void wide_store_bf16(const float* v, int64_t ld, int rows, int64_t cols, uint16_t* y, int64_t ldy) {
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 mk = wide_mask(cols - c);
    for (int r = 0; r < rows; ++r)
      _mm256_mask_storeu_epi16(y + r * ldy + c, mk, wide_bf16(_mm512_loadu_ps(v + r * ld + c)));
  }
}
#endif

namespace {

// wide_blocks over w as panel_pack laid it out.
template <typename W, typename O>
void wide_matmul(const typename WideX<W>::T* x, int64_t ldx, int64_t m, int64_t k, const typename W::T* w, int64_t n,
                 const float* bias, typename O::T* y) {
  wide_blocks<W, O>(x, ldx, m, k, n, bias, y, true, [&](int64_t p, int64_t k0, int64_t, int64_t cols) {
    return w + p * WIDE_NR * k + k0 * cols;
  });
}

// The wide panels' layout, [N / WIDE_NR][K / st][WIDE_NR][st] then the last [K / st][N % WIDE_NR][st],
// moved in 32-bit units (st inputs of one output: a float32, or a bfloat16 pair): each panel is a
// transpose of its rows' units, done 64 steps at a time so the block being turned stays in L1,
// panels split over the threads (torch's copy_ of the permuted view moves 4-byte pieces one
// element pair at a time, the larger part of a big model's load).
void wide_pack(const uint32_t* src, int64_t n, int64_t units, uint32_t* dst) {
  const int64_t panels = (n + WIDE_NR - 1) / WIDE_NR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(WIDE_NR, n - p * WIDE_NR);
      const uint32_t* from = src + p * WIDE_NR * units;
      uint32_t* to = dst + p * WIDE_NR * units;
      for (int64_t s0 = 0; s0 < units; s0 += 64) {
        const int64_t s1 = std::min<int64_t>(units, s0 + 64);
        for (int64_t c = 0; c < cols; ++c)
          for (int64_t st = s0; st < s1; ++st) to[st * cols + c] = from[c * units + st];
      }
    }
  });
}

}  // namespace
#endif

// The vector width panel_linear was built for: "avx512", "avx2", or "" where it cannot run; with
// "-bf16" where bfloat16 weights run on bfloat16 dot products.
std::string panel_isa() {
#if defined(TINYLLM_PANEL_WIDE) && defined(__AVX512BF16__)
  return std::string(kPanelIsa) + "-bf16";
#else
  return kPanelIsa;
#endif
}

// w [N, K] float32 / bfloat16 -> the same shape and dtype, in panel_linear's order.
at::Tensor panel_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "panel_pack: w must be float32 or bfloat16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  auto out = at::empty({n, k}, w.options()).view({-1});
#if defined(TINYLLM_PANEL_WIDE)
  if (const int64_t st = wide_panels(w)) {
    const auto src = w.contiguous();
    wide_pack(static_cast<const uint32_t*>(src.data_ptr()), n, k / st, static_cast<uint32_t*>(out.data_ptr()));
    return out.view({n, k});
  }
#endif
  const int64_t full = n / PANEL_NR;
  auto panels = w.narrow(0, 0, full * PANEL_NR).view({full, PANEL_NR, k}).transpose(1, 2);
  out.narrow(0, 0, full * PANEL_NR * k).view({full, k, PANEL_NR}).copy_(panels);
  if (n > full * PANEL_NR)
    out.narrow(0, full * PANEL_NR * k, (n - full * PANEL_NR) * k).view({k, n - full * PANEL_NR})
        .copy_(w.narrow(0, full * PANEL_NR, n - full * PANEL_NR).t());
  return out.view({n, k});
}

// x [M, K] float32 / bfloat16 @ w^T (+ bias) -> [M, N] in x's dtype (float32 accumulation,
// rounded once), w as panel_pack made it.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(*kPanelIsa, "panel_linear needs a CPU with AVX2 or AVX-512");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.is_contiguous(),
              "panel_linear: x [M, K] and a packed w [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "panel_linear: bias must have N elements");
    b = bias->to(at::kFloat).contiguous();  // no copy for a float32 model's bias
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(TINYLLM_PANEL_WIDE)
  if (const int64_t st = wide_panels(w)) {
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "panel_linear: x must be float32 or bfloat16");
    auto y = at::empty({m, n}, x.options());
    constexpr bool widen = std::is_same_v<WideX<BF16>::T, float>;  // bfloat16 panels, float32 rows
    auto xw = x.to(st == 2 && widen ? at::kFloat : w.scalar_type());  // no copy when x has that dtype
    if (xw.stride(1) != 1) xw = xw.contiguous();
    auto run = [&](auto wt) {
      using W = decltype(wt);
      using X = typename WideX<W>::T;
      const X* xp = reinterpret_cast<const X*>(xw.data_ptr());
      if (x.scalar_type() == at::kFloat)
        wide_matmul<W, F32>(xp, xw.stride(0), m, k, ptr<W>(w), n, bp, y.data_ptr<float>());
      else
        wide_matmul<W, BF16>(xp, xw.stride(0), m, k, ptr<W>(w), n, bp, ptr<BF16>(y));
    };
    if (st == 2)
      run(BF16{});
    else
      run(F32{});
    return y;
  }
#endif
  at::Tensor keep;
  const float* xf = float_rows(x, keep);
  auto y = at::empty({m, n}, x.options().dtype(at::kFloat));
#if defined(__AVX512F__) || defined(__AVX2__)
  if (w.scalar_type() == at::kFloat)
    panel_matmul<F32>(xf, m, k, w.data_ptr<float>(), n, bp, y.data_ptr<float>());
  else
    panel_matmul<BF16>(xf, m, k, ptr<BF16>(w), n, bp, y.data_ptr<float>());
#endif
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace tinyllm
