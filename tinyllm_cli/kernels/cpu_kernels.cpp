// tinyllm's CPU kernels, registered as torch.ops.tinyllm.* (kernels/__init__.py builds this file).
//
// paged_attention: every query row of a step (decode rows and prefill rows alike) attends to
// its sequence's first row_len positions, read where they live in the block pool (no gather
// copy, no padding), grouped-query heads without repeating K/V.
//   q            [T, H, D]      float32 / bfloat16 / float16; the last dim contiguous
//   k_pool       [P, Hkv, D]    one layer's pool, contiguous; slot p holds one token's K
//   v_pool       [P, Hkv, D]
//   block_tables [S, NB] int64  physical block ids, one row per sequence of the step (padding ignored)
//   row_seq      [T] int64      the table row of each query row
//   row_len      [T] int64      positions it attends to: [0, row_len) (a decode row: the whole
//                               sequence; a prefill row at position p: p + 1, which is causal)
//   returns      [T, H, D]      softmax(q . K^T * scale) V
// Position p of sequence s lives at slot block_tables[s][p / block_size] * block_size + p % block_size.
// Work is split over (row, kv head) pairs: each pair reads its K/V rows once for all
// G = H / Hkv query heads that share them.
//
// Three fused elementwise ops the decoder layer runs around it: add_rms_norm_ (residual add +
// RMSNorm), silu_mul (SwiGLU's silu(gate) * up) and rope_ (rotary embedding in place); and
// decoder_layer, which runs a whole layer (those ops, the weight matmuls, the K/V write and
// paged_attention) in one call from Python.
//
// Numerics, for every op: loads widen to float32, all arithmetic is float32, and each result is
// rounded once to the tensor's dtype (bfloat16: round to nearest even, as PyTorch rounds).
// Inner loops run over raw storage (float, or uint16_t bits for bfloat16) so that they vectorize.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

// ---- storage types: how a dtype's elements load to and store from float32 -------------------

struct F32 {
  using T = float;
  static float ld(float v) { return v; }
  static float st(float f) { return f; }
};

struct BF16 {
  using T = uint16_t;  // bfloat16 bits
  static float ld(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static uint16_t st(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // nearest, ties to even
    return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);  // NaN stays NaN
  }
};

struct F16 {
  using T = c10::Half;
  static float ld(c10::Half v) { return static_cast<float>(v); }
  static c10::Half st(float f) { return static_cast<c10::Half>(f); }
};

struct I8 {  // int8 weights (int8_linear); loads only
  using T = int8_t;
  static float ld(int8_t v) { return static_cast<float>(v); }
};

template <typename S>
typename S::T* ptr(const at::Tensor& t) {
  return reinterpret_cast<typename S::T*>(t.data_ptr());
}

// Calls fn.template operator()<S>() with the storage type of ``dtype``.
template <typename Fn>
void dispatch(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn.template operator()<F32>(); break;
    case at::kBFloat16: fn.template operator()<BF16>(); break;
    case at::kHalf: fn.template operator()<F16>(); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16 only, not ", dtype);
  }
}

// exp(x), vectorizable (std::exp is not, and one call per element costs more than the rest of
// a row's work): x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 Taylor polynomial
// (relative error < 2e-7, about float32's rounding), 2^n written straight into the exponent
// bits. x is clamped to [-87, 88], where expf is still finite and normal.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in its low bits
  const float n = (x * 1.44269504088896341f + shift) - shift;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in two for exactness
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Rows [0, rows) in parallel; small steps (one decode token) stay on one thread, where waking
// the pool would cost more than the work.
template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(t);
  });
}

// ---- paged attention ----------------------------------------------------------------------

// q . k over n floats, n a multiple of 16: 16 partial sums stay in one vector register and are
// added as a tree at the end. gcc reduces an `omp simd` sum lane by lane, 15 dependent scalar
// adds per dot product, which made that paged attention's bottleneck.
template <typename S>
inline float dot16(const float* q, const typename S::T* k, int64_t n) {
  float part[16] = {};
  for (int64_t d0 = 0; d0 < n; d0 += 16)
#pragma omp simd
    for (int64_t l = 0; l < 16; ++l) part[l] += q[d0 + l] * S::ld(k[d0 + l]);
  for (int64_t w = 8; w > 0; w /= 2)
#pragma omp simd
    for (int64_t l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// q . k over a head. With DIM known (a multiple of 16) the loops unroll into whole registers.
template <typename S, int64_t DIM>
inline float dot(const float* q, const typename S::T* k, int64_t dim) {
  if constexpr (DIM > 0 && DIM % 16 == 0) {
    return dot16<S>(q, k, DIM);
  } else {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < dim; ++d) s += q[d] * S::ld(k[d]);
    return s;
  }
}

// DIM > 0: the head size known at compile time (64 and 128 are), so the inner loops unroll into
// whole vector registers; DIM == 0 reads it from ``dim_rt``.
// One thread's buffers, reused across the (row, kv head) pairs it serves.
struct Scratch {
  std::vector<float> qf, scores, acc, inv_sum;
};

template <typename S, int64_t DIM>
void attend_pair(const typename S::T* q, int64_t q_stride_h, const typename S::T* k_pool,
                 const typename S::T* v_pool, const int64_t* table, int64_t len, int64_t block_size, int64_t hkv,
                 int64_t kv_head, int64_t groups, int64_t dim_rt, float scale, typename S::T* out, Scratch& buf) {
  using T = typename S::T;
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  const int64_t row_stride = hkv * dim;  // elements between two consecutive slots of the pool
  auto& qf = buf.qf;
  auto& scores = buf.scores;
  auto& acc = buf.acc;
  auto& inv_sum = buf.inv_sum;
  qf.resize(groups * dim);
  scores.resize(groups * len);
  acc.assign(groups * dim, 0.0f);
  inv_sum.resize(groups);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = S::ld(q[g * q_stride_h + d]) * scale;

  // Pass 1: scores, block by block (no division per position; a block's slots are consecutive),
  // one K row read per position for all G query heads.
  for (int64_t start = 0, j = 0; start < len; start += block_size, ++j) {
    const int64_t n = std::min(block_size, len - start);
    const T* k = k_pool + table[j] * block_size * row_stride + kv_head * dim;
    for (int64_t o = 0; o < n; ++o, k += row_stride) {
      for (int64_t g = 0; g < groups; ++g)
        scores[g * len + start + o] = dot<S, DIM>(qf.data() + g * dim, k, dim);
    }
  }
  // Softmax per query head.
  for (int64_t g = 0; g < groups; ++g) {
    float* sg = scores.data() + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < len; ++p) m = std::max(m, sg[p]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < len; ++p) {
      sg[p] = fast_exp(sg[p] - m);
      total += sg[p];
    }
    inv_sum[g] = 1.0f / total;
  }
  // Pass 2: the weighted sum of V rows, again one read per position.
  for (int64_t start = 0, j = 0; start < len; start += block_size, ++j) {
    const int64_t n = std::min(block_size, len - start);
    const T* v = v_pool + table[j] * block_size * row_stride + kv_head * dim;
    for (int64_t o = 0; o < n; ++o, v += row_stride) {
      for (int64_t g = 0; g < groups; ++g) {
        const float w = scores[g * len + start + o];
        float* ag = acc.data() + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ag[d] += w * S::ld(v[d]);
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = S::st(acc[g * dim + d] * inv_sum[g]);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& row_seq, const at::Tensor& row_len,
                           int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q [T,H,D], pools [P,Hkv,D]");
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu(), "paged_attention runs on the CPU");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "K/V pools must be contiguous");
  TORCH_CHECK(q.stride(2) == 1, "q's last dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "q and the pools must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && row_seq.scalar_type() == at::kLong &&
              row_len.scalar_type() == at::kLong, "int64 tables, row_seq and row_len");
  const auto tables = block_tables.contiguous();
  const auto seq_c = row_seq.contiguous(), len_c = row_len.contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), hkv = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == dim && heads % hkv == 0, "head_dim or head counts do not match");
  TORCH_CHECK(seq_c.numel() == rows && len_c.numel() == rows, "one row_seq and one row_len per row of q");
  const int64_t groups = heads / hkv, nseq = tables.size(0), nb = tables.size(1), slots = k_pool.size(0);
  const int64_t* seq_p = seq_c.data_ptr<int64_t>();
  const int64_t* len_p = len_c.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  std::vector<int64_t> need(nseq, 0);  // blocks each sequence's longest row reads
  int64_t positions = 0;               // the step's work: positions read, summed over rows
  for (int64_t t = 0; t < rows; ++t) {
    positions += len_p[t];
    TORCH_CHECK(seq_p[t] >= 0 && seq_p[t] < nseq, "a row's sequence is outside the block tables");
    TORCH_CHECK(len_p[t] >= 1 && len_p[t] <= nb * block_size, "a row's length is outside its block table");
    need[seq_p[t]] = std::max(need[seq_p[t]], (len_p[t] + block_size - 1) / block_size);
  }
  for (int64_t sq = 0; sq < nseq; ++sq)
    for (int64_t j = 0; j < need[sq]; ++j)
      TORCH_CHECK(tp[sq * nb + j] >= 0 && (tp[sq * nb + j] + 1) * block_size <= slots, "a block id is outside the pool");
  auto out = at::empty({rows, heads, dim}, q.options());
  dispatch(q.scalar_type(), "paged_attention", [&]<typename S>() {
    const auto* qp = ptr<S>(q);
    const auto* kp = ptr<S>(k_pool);
    const auto* vp = ptr<S>(v_pool);
    auto* op = ptr<S>(out);
    const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
    auto pair_fn = dim == 64 ? &attend_pair<S, 64> : dim == 128 ? &attend_pair<S, 128> : &attend_pair<S, 0>;
    // A small step (one sequence decoding: a few microseconds of work) runs on this thread;
    // waking the pool for it cost more than the work.
    const int64_t grain = positions * hkv < 8192 ? rows * hkv : 1;
    at::parallel_for(0, rows * hkv, grain, [&](int64_t begin, int64_t end) {
      Scratch buf;
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t t = pair / hkv, h = pair % hkv;
        pair_fn(qp + t * qs0 + h * groups * qs1, qs1, kp, vp, tp + seq_p[t] * nb, len_p[t], block_size, hkv, h,
                groups, dim, static_cast<float>(scale), op + (t * heads + h * groups) * dim, buf);
      }
    });
  });
  return out;
}

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

template <typename S>
[[gnu::noinline]] void silu_mul_row(const typename S::T* __restrict__ g, const typename S::T* __restrict__ u,
                  typename S::T* __restrict__ o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gv = S::ld(g[i]);
    o[i] = S::st(gv / (1.0f + fast_exp(-gv)) * S::ld(u[i]));
  }
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

// ---- int8 weight-only matmul for a few rows --------------------------------------------------

// One output row block: y[m][n] = scale[n] * sum_k x[m][k] * q[n][k], for n in [n0, n1).
// Each weight row (K int8, K a multiple of 16) is read once for all M activation rows, which are
// float32 already.
template <typename S>
[[gnu::noinline]] void int8_rows(const float* xf, int64_t rows, int64_t k, const int8_t* q, const typename S::T* scale,
               typename S::T* y, int64_t n_out, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = q + n * k;
    const float sc = S::ld(scale[n]);
    for (int64_t m = 0; m < rows; ++m) {
      y[m * n_out + n] = S::st(dot16<I8>(xf + m * k, w, k) * sc);
    }
  }
}

// x [M, K] @ (q [N, K] int8 * scale [N])^T -> [M, N] in x's dtype, as torch's _weight_int8pack_mm.
// For one row (one sequence decoding) it streams the weight faster than torch's kernel (the
// default model's 28 MB output matrix, once per token: 1.9 vs 2.2-2.4 ms from memory, 2 cores);
// from two rows on torch's wins (each extra row costs a full pass of arithmetic here).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "x [M,K], q [N,K] int8");
  TORCH_CHECK(x.size(1) == q.size(1) && q.size(1) % 16 == 0, "K must match and be a multiple of 16");
  TORCH_CHECK(scale.numel() == q.size(0) && scale.scalar_type() == x.scalar_type(), "scale [N] in x's dtype");
  const int64_t rows = x.size(0), k = x.size(1), n_out = q.size(0);
  const auto xf = x.to(at::kFloat).contiguous();
  const auto sc = scale.contiguous();
  auto y = at::empty({rows, n_out}, x.options());
  dispatch(x.scalar_type(), "int8_linear", [&]<typename S>() {
    const float* xp = xf.data_ptr<float>();
    const auto* sp = ptr<S>(sc);
    auto* yp = ptr<S>(y);
    at::parallel_for(0, n_out, 512, [&](int64_t n0, int64_t n1) {
      int8_rows<S>(xp, rows, k, q.data_ptr<int8_t>(), sp, yp, n_out, n0, n1);
    });
  });
  return y;
}

// ---- one decoder layer in one call ---------------------------------------------------------

// A weight matmul as the Python model holds it (model/llama.py, fused_layer_args):
// kind 0 = F.linear(x, w, bias); 1 = torch's CPU int4 matmul (w packed, aux its scales and
// zeros, groups of 32); 2 = oneDNN with a pre-packed weight (model/gemm.py's PackedLinear).
at::Tensor run_linear(int64_t kind, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& aux,
                      const std::optional<at::Tensor>& bias) {
  if (kind == 0) return at::linear(x, w, bias);
  if (kind == 1) {
    auto y = at::_weight_int4pack_mm_for_cpu(x.contiguous(), w, 32, *aux);
    return bias.has_value() ? y.add_(*bias) : y;
  }
  TORCH_CHECK(kind == 2, "unknown linear kind ", kind);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                 std::optional<std::string>(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The decoder layer of model/llama.py (DecoderLayer.forward on its native path), op for op,
// without a return to Python between them: a one-token step runs ~25 small operators per layer,
// and each costs a few microseconds of Python and dispatch when called from Python.
// x [T, hidden] is the residual stream (updated in place: x += r, x += attention output);
// returns the MLP output, which the next layer (or the final norm) adds to x.
// Linears, in order: qkv, o_proj, gate_up, down.
at::Tensor decoder_layer(at::Tensor& x, const std::optional<at::Tensor>& r, at::TensorList weights,
                         at::IntArrayRef kinds, const c10::List<std::optional<at::Tensor>>& aux,
                         const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& input_norm,
                         const at::Tensor& post_norm, double eps, const at::Tensor& cos, const at::Tensor& sin_signed,
                         at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& row_seq, const at::Tensor& row_len,
                         int64_t block_size, int64_t n_heads, int64_t n_kv, int64_t head_dim) {
  TORCH_CHECK(weights.size() == 4 && kinds.size() == 4 && aux.size() == 4 && biases.size() == 4, "four linears");
  const int64_t t = x.size(0), q_size = n_heads * head_dim, kv_size = n_kv * head_dim;
  auto lin = [&](int64_t i, const at::Tensor& in) { return run_linear(kinds[i], in, weights[i], aux.get(i), biases.get(i)); };
  // The kernels below are called directly, not through the dispatcher; the scopes name them for
  // torch.profiler (bench --profile) as if they had been (free while no profiler runs).
  auto norm = [&](const std::optional<at::Tensor>& res, const at::Tensor& w) {
    RECORD_FUNCTION("tinyllm::add_rms_norm_", std::vector<c10::IValue>());
    return add_rms_norm_(x, res, w, eps);
  };
  auto qkv = lin(0, norm(r, input_norm));
  auto qk = qkv.narrow(1, 0, q_size + kv_size).view({t, n_heads + n_kv, head_dim});
  {
    RECORD_FUNCTION("tinyllm::rope_", std::vector<c10::IValue>());
    rope_(qk, cos, sin_signed);
  }
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, n_kv, head_dim});
  k_pool.index_copy_(0, slot_mapping, qk.narrow(1, n_heads, n_kv));
  v_pool.index_copy_(0, slot_mapping, v);
  at::Tensor o;
  {
    RECORD_FUNCTION("tinyllm::paged_attention", std::vector<c10::IValue>());
    o = paged_attention(qk.narrow(1, 0, n_heads), k_pool, v_pool, block_tables, row_seq, row_len, block_size,
                        1.0 / std::sqrt(static_cast<double>(head_dim)));
  }
  auto h = norm(lin(1, o.view({t, q_size})), post_norm);
  auto gate_up = lin(2, h);
  at::Tensor act;
  {
    RECORD_FUNCTION("tinyllm::silu_mul", std::vector<c10::IValue>());
    act = silu_mul(gate_up);
  }
  return lin(3, act);
}

}  // namespace

TORCH_LIBRARY(tinyllm, m) {
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor row_seq, "
        "Tensor row_len, int block_size, float scale) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin_signed) -> Tensor(a!)");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("decoder_layer(Tensor(a!) x, Tensor? r, Tensor[] weights, int[] kinds, Tensor?[] aux, Tensor?[] biases, "
        "Tensor input_norm, Tensor post_norm, float eps, Tensor cos, Tensor sin_signed, Tensor(b!) k_pool, "
        "Tensor(c!) v_pool, Tensor slot_mapping, Tensor block_tables, Tensor row_seq, Tensor row_len, "
        "int block_size, int n_heads, int n_kv, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(tinyllm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("decoder_layer", &decoder_layer);
  m.impl("int8_linear", &int8_linear);
}

// oneDNN's packed weights are MkldnnCPU tensors, and the dispatcher routes a call by its
// arguments' keys: the layer kernel takes them among its weights.
TORCH_LIBRARY_IMPL(tinyllm, MkldnnCPU, m) { m.impl("decoder_layer", &decoder_layer); }
