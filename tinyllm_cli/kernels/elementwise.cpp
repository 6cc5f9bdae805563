// The fused elementwise ops of a decoder layer: add_rms_norm_ (residual add + RMSNorm), silu_mul
// (SwiGLU's silu(gate) * up) and rope_ (rotary embedding in place). Each replaces several eager
// ops, which a one-token step feels as dispatch overhead and a batched step as extra passes over
// memory. float32 arithmetic, one rounding per output.
#include "isa.h"
#include "ops.h"

namespace tinyllm {

// ---- fused elementwise ops -----------------------------------------------------------------
// The row functions stay out of line: inlined into the parallel lambdas, gcc lost track of their
// pointers and left the loops scalar (silu_mul ran at 4 ns an element instead of ~0.3).

template <typename S>
[[gnu::noinline]] void add_rms_norm_row(typename S::T* __restrict__ x, const typename S::T* __restrict__ r,
                      const typename S::T* __restrict__ w, typename S::T* __restrict__ out, int64_t n, float eps) {
  if (r != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = S::st(S::ld(x[i]) + S::ld(r[i]));  // rounded as a plain add
  }
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += S::ld(x[i]) * S::ld(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = S::st(S::ld(x[i]) * inv * S::ld(w[i]));
}

// x += residual (when given), then out = x * rsqrt(mean(x^2) + eps) * weight.
// x [T, N] contiguous, updated in place; weight [N]; returns out [T, N].
at::Tensor add_rms_norm_(at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                         double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "x [T, N] and weight contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "weight [N] in x's dtype");
  at::Tensor r;
  if (residual.has_value()) {
    r = residual->contiguous();
    TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type(), "residual must match x");
  }
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch(x.scalar_type(), "add_rms_norm_", [&]<typename S>() {
    auto* xp = ptr<S>(x);
    const auto* rp = r.defined() ? ptr<S>(r) : nullptr;
    const auto* wp = ptr<S>(weight);
    auto* op = ptr<S>(out);
    for_rows(rows, n, [&](int64_t t) {
      add_rms_norm_row<S>(xp + t * n, rp ? rp + t * n : nullptr, wp, op + t * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

inline float silu_times(float g, float u) { return g / (1.0f + fast_exp(-g)) * u; }

#if defined(__AVX512F__) || defined(__AVX2__)
// silu_times on every lane, with the roundings GCC gives the scalar form (it contracts
// `x * log2e + shift`, `x - n * c1`, each polynomial step and `1 + p * 2^n` into FMAs), so a lane
// is the scalar's bits. Written out because GCC leaves the scalar loop scalar for AVX2 (the clamp
// becomes branches it cannot if-convert without AVX-512's masks): 3 ns an element instead of 0.2.
inline VecF vsilu_times(VecF g, VecF u) {
  const VecF x = vmin(vmax(vsub(vzero(), g), vset1(-87.0f)), vset1(88.0f));
  const VecF shift = vset1(12582912.0f);
  const VecF n = vsub(vfma(x, vset1(1.44269504088896341f), shift), shift);
  const VecF r = vfma(n, vset1(2.12194440e-4f), vfnmadd(n, vset1(0.693359375f), x));
  return vmul(vdiv(g, vfma(vexp_poly(r), vexp2i(n), vset1(1.0f))), u);
}
#endif

template <typename S>
[[gnu::noinline]] void silu_mul_row(const typename S::T* __restrict__ g, const typename S::T* __restrict__ u,
                  typename S::T* __restrict__ o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (!std::is_same_v<S, F16>) {
    alignas(64) float out[kLanes];
    for (; i + kLanes <= n; i += kLanes) {
      const VecF v = vsilu_times(vload(g + i), vload(u + i));
      if constexpr (std::is_same_v<S, F32>) {
        vstore(o + i, v);
      } else {
        vstore(out, v);
        for (int l = 0; l < kLanes; ++l) o[i + l] = S::st(out[l]);
      }
    }
  }
#endif
  for (; i < n; ++i) o[i] = S::st(silu_times(S::ld(g[i]), S::ld(u[i])));
}

// gate_up [T, 2I] (gate then up, as the fused projection writes them) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "gate_up [T, 2I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, inter}, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_mul", [&]<typename S>() {
    const auto* gp = ptr<S>(gate_up);
    auto* op = ptr<S>(out);
    for_rows(rows, inter, [&](int64_t t) { silu_mul_row<S>(gp + t * stride, gp + t * stride + inter, op + t * inter, inter); });
  });
  return out;
}

template <typename S>
[[gnu::noinline]] void rope_head(typename S::T* __restrict__ v, const typename S::T* __restrict__ c, const typename S::T* __restrict__ s,
               int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = S::ld(v[i]), b = S::ld(v[i + half]);
    v[i] = S::st(a * S::ld(c[i]) + b * S::ld(s[i]));
    v[i + half] = S::st(b * S::ld(c[i + half]) + a * S::ld(s[i + half]));
  }
}

// Rotary embedding in place, HF's rotate_half convention: x * cos + roll(x, D/2) * sin_signed,
// where sin_signed carries rotate_half's minus on its first half. x [T, heads, D] (last dim
// contiguous, any row strides: a view of the fused qkv output); cos, sin_signed [T, 1, D].
at::Tensor& rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x [T, heads, D], D even");
  const auto c = cos.contiguous(), sn = sin_signed.contiguous();
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(c.numel() == rows * dim && sn.numel() == rows * dim, "cos / sin [T, 1, D]");
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && sn.scalar_type() == x.scalar_type(), "cos / sin in x's dtype");
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  dispatch(x.scalar_type(), "rope_", [&]<typename S>() {
    auto* xp = ptr<S>(x);
    const auto* cp = ptr<S>(c);
    const auto* sp = ptr<S>(sn);
    for_rows(rows, heads * dim, [&](int64_t t) {
      for (int64_t h = 0; h < heads; ++h) rope_head<S>(xp + t * s0 + h * s1, cp + t * dim, sp + t * dim, dim / 2);
    });
  });
  return x;
}

}  // namespace tinyllm
