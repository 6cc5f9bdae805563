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
// paged_attention) in one call, and decoder_stack, which runs every layer of a step in one call
// from Python (their static arguments held by a DecoderStack made once, at load).
//
// And the matmuls of quant: gguf: q4_linear (4-bit weights in q4_pack's layout) and int8_linear
// (int8 rows with a per-row scale, e.g. the output projection), and with int8 activations
// (quantized per group of 32, integer dot products) q4_q8_linear and int8_q8_linear.
//
// Numerics, for every op: loads widen to float32, all arithmetic is float32, and each result is
// rounded once to the tensor's dtype (bfloat16: round to nearest even, as PyTorch rounds). The
// exception: bfloat16 dot products (AVX512-BF16: q4_linear, and bfloat16 attention, whose softmax
// weights round to bfloat16 before P.V), where each product is exact in float32 and sums are float32.
// Inner loops run over raw storage (float, or uint16_t bits for bfloat16) so that they vectorize;
// the hot matmul and attention loops have AVX-512 and AVX2 intrinsic paths next to portable ones.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
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
  std::vector<float> max;          // each query head's running maximum score, one vector of lanes each
  std::vector<int64_t> rows;       // pool element offset of each position's K/V row (the vector path)
  std::vector<int64_t> next_rows;  // the same for the thread's next pair, if its K/V are to be prefetched
  std::vector<uint16_t> wb;        // bfloat16 softmax weights of a batch of heads (the bfloat16 V pass)
  // attend_block: K transposed by chunks of one (sequence, kv head), and its pool offsets.
  std::vector<float> kt;
  std::vector<int64_t> prompt_rows;
  int64_t kt_seq = -1, kt_head = -1, kt_positions = 0;
};

// The pool element offset of each of a pair's ``len`` positions' K/V rows (kv head ``kv_head``).
inline void pair_rows(const int64_t* table, int64_t len, int64_t block_size, int64_t row_stride, int64_t head_off,
                      std::vector<int64_t>& rows, int64_t from = 0) {  // positions [from, len); those before kept
  rows.resize(len);
  for (int64_t j = from / block_size, p = from; p < len; ++j) {
    const int64_t end = std::min(len, (j + 1) * block_size), base = (table[j] * block_size) * row_stride + head_off;
    for (; p < end; ++p) rows[p] = base + (p - j * block_size) * row_stride;
  }
}

// s[p] = exp(s[p] - max s) in place; returns their sum (softmax's denominator).
inline float softmax_numerators(float* s, int64_t len) {
  // Eight independent running maxima: one chain waited on each max's latency, ~12% of a decode
  // step's attention (Ice Lake). The maximum does not depend on the order it is taken in.
  float lanes[8];
  std::fill(lanes, lanes + 8, -std::numeric_limits<float>::infinity());
  int64_t p = 0;
  for (; p + 8 <= len; p += 8)
    for (int j = 0; j < 8; ++j) lanes[j] = std::max(lanes[j], s[p + j]);
  float m = *std::max_element(lanes, lanes + 8);
  for (; p < len; ++p) m = std::max(m, s[p]);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (p = 0; p < len; ++p) {
    s[p] = fast_exp(s[p] - m);
    total += s[p];
  }
  return total;
}

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
  for (int64_t g = 0; g < groups; ++g) inv_sum[g] = 1.0f / softmax_numerators(scores.data() + g * len, len);
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

#if defined(__AVX512F__) || defined(__AVX2__)
// The attention vector path's registers, one width per build: W float32 lanes (16 with AVX-512,
// 8 with AVX2, which every x86 server core of the last decade has, AMD and Intel alike).
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int kLanes = 16;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset1(float f) { return _mm512_set1_ps(f); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline float vsum(VecF v) { return _mm512_reduce_add_ps(v); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload(const uint16_t* p) {  // bfloat16 bits: widen to the high half of each lane
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
// Lanes [0, n) of p; the others are ``fill``. And the store of lanes [0, n). (A whole vector
// loads plainly: a masked load of scores just stored waited on the stores, a fifth of a short
// prompt row's softmax on Zen 4.)
inline VecF vload_n(const float* p, int64_t n, float fill) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_mask_loadu_ps(vset1(fill), first_lanes(n), p);
}
inline void vstore_n(float* p, VecF v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
inline VecF vkeep_n(VecF v, int64_t n) { return _mm512_maskz_mov_ps(first_lanes(n), v); }  // lanes >= n zeroed
inline VecF vfill_n(VecF v, int64_t n, float fill) { return _mm512_mask_mov_ps(vset1(fill), first_lanes(n), v); }
inline VecF vmax(VecF a, VecF b) { return _mm512_max_ps(a, b); }
inline float vmax_lanes(VecF v) { return _mm512_reduce_max_ps(v); }
inline VecF vmin(VecF a, VecF b) { return _mm512_min_ps(a, b); }
inline VecF vround(VecF v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF vexp2i(VecF n) {  // 2^n for integral n in [-126, 127], built in the exponent bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}

// Lane i of the result = the sum of v[i]'s 16 lanes: 16 dot products finished with 15 adds and
// 30 shuffles, where one horizontal sum each costs ~8 dependent operations.
inline VecF sum_lanes(VecF v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // a[i], per 128-bit quarter: (v2i, v2i+1, v2i, v2i+1) half sums
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // b[i], per quarter: v4i .. v4i+3 summed over that quarter
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // c[i]: quarters (b2i.q0+q1, b2i.q2+q3, b2i+1.q0+q1, b2i+1.q2+q3)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  // (v0-3, v4-7, v8-11, v12-15), each quarter now summed over all four
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// r[i] lane j -> r[j] lane i (a 16 x 16 transpose of 32-bit elements): pairs of rows interleaved
// by 32 bits, then by 64 (b[4i + c] holds rows 4i..4i+3 of column 4L + c in its 128-bit lane L),
// then the 128-bit lanes across b[c], b[4 + c], b[8 + c], b[12 + c].
inline void transpose_lanes(VecF r[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
    b[4 * i + 1] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
    b[4 * i + 2] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
    b[4 * i + 3] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 p0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44), p1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xEE);
    const __m512 p2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44), p3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(p0, p2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(p0, p2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(p1, p3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(p1, p3, 0xDD);
  }
}
#else
using VecF = __m256;
constexpr int kLanes = 8;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vset1(float f) { return _mm256_set1_ps(f); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload(const uint16_t* p) {  // bfloat16 bits: widen to the high half of each lane
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256i first_lanes(int64_t n) {  // all ones in lanes [0, n)
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline VecF vload_n(const float* p, int64_t n, float fill) {
  if (n >= 8) return _mm256_loadu_ps(p);
  const __m256i m = first_lanes(n);
  return _mm256_blendv_ps(vset1(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void vstore_n(float* p, VecF v, int64_t n) { _mm256_maskstore_ps(p, first_lanes(n), v); }
inline VecF vkeep_n(VecF v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(first_lanes(n))); }
inline VecF vfill_n(VecF v, int64_t n, float fill) {
  return _mm256_blendv_ps(vset1(fill), v, _mm256_castsi256_ps(first_lanes(n)));
}
inline VecF vmax(VecF a, VecF b) { return _mm256_max_ps(a, b); }
inline float vmax_lanes(VecF v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
inline VecF vmin(VecF a, VecF b) { return _mm256_min_ps(a, b); }
inline VecF vround(VecF v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF vexp2i(VecF n) {  // 2^n for integral n in [-126, 127], built in the exponent bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float vsum(VecF v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// Lane i of the result = the sum of v[i]'s 8 lanes: three rounds of pairwise adds (hadd works
// per 128-bit half), then the two halves added; 7 adds and 2 permutes for 8 dot products.
inline VecF sum_lanes(VecF v[8]) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // per half: v0..v3, v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// r[i] lane j -> r[j] lane i (8 x 8): rows interleaved by 32 bits, then 64, then the halves.
inline void transpose_lanes(VecF r[8]) {
  __m256 a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    b[4 * i] = _mm256_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
    b[4 * i + 1] = _mm256_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
    b[4 * i + 2] = _mm256_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
    b[4 * i + 3] = _mm256_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(b[c], b[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(b[c], b[4 + c], 0x31);
  }
}
#endif

// fast_exp on every lane, the same steps with each rounding explicit (a multiply, then FMAs).
inline VecF vexp(VecF x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  const VecF n = vround(vmul(x, vset1(1.44269504088896341f)));
  const VecF r = vfma(n, vset1(2.12194440e-4f), vfma(n, vset1(-0.693359375f), x));
  VecF p = vset1(1.0f / 720);
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return vmul(p, vexp2i(n));
}

// Scores stored kLanes at a time, with their running maximum kept beside them (the scoring
// loops fold each chunk in as they store it: reading the scores back for the maximum waited on
// those stores). The maximum does not depend on the order it is taken in.
inline void store_scores(float* s, VecF v, int64_t n, float* running_max) {
  if (n >= kLanes) {
    vstore(s, v);
  } else {
    vstore_n(s, v, n);
    v = vfill_n(v, n, -std::numeric_limits<float>::infinity());
  }
  vstore(running_max, vmax(vload(running_max), v));
}

// softmax_numerators on whole vectors, the last one masked, given the scores' maximum: the
// vector path's softmax (a compiler-vectorized loop finished its last < kLanes positions one at
// a time, a fifth of a short prompt row's softmax).
inline float softmax_numerators_vec(float* s, int64_t len, float max) {
  const float inf = std::numeric_limits<float>::infinity();
  const VecF mx = vset1(max);
  VecF total = vzero();
  for (int64_t p = 0; p < len; p += kLanes) {
    const VecF e = vexp(vload_n(s + p, len - p, -inf) - mx);
    vstore_n(s + p, e, len - p);
    total = vadd(total, vkeep_n(e, len - p));  // lanes past len held exp(-87): not summed
  }
  return vsum(total);
}

// One query head, ready for dot products with K rows: the lanes of partial(k) sum to q . k
// times the softmax scale, or to q . k when ``post`` (applied to the finished sums) is the scale.
template <typename S, int64_t DIM>
struct QueryRow {
  VecF qv[DIM / kLanes];
  float post = 1.0f;
  QueryRow(const typename S::T* q, float scale) {
    for (int i = 0; i < DIM / kLanes; ++i) qv[i] = vmul(vload(q + kLanes * i), vset1(scale));
  }
  VecF partial(const typename S::T* k) const {
    VecF acc = vmul(qv[0], vload(k));
    for (int i = 1; i < DIM / kLanes; ++i) acc = vfma(qv[i], vload(k + kLanes * i), acc);
    return acc;
  }
};

#if defined(__AVX512BF16__)
// bfloat16 heads: bf16 pair dot products, half the instructions of widening K and an FMA. Each
// product of two bfloat16 numbers is exact in float32, as in the widened path; q stays unscaled
// (scaling it first would round it), and the scale multiplies the finished sums.
template <int64_t DIM>
struct QueryRow<BF16, DIM> {
  __m512bh qb[DIM / 32];
  float post;
  QueryRow(const uint16_t* q, float scale) : post(scale) {
    for (int i = 0; i < DIM / 32; ++i) qb[i] = (__m512bh)_mm512_loadu_si512(q + 32 * i);
  }
  __m512 partial(const uint16_t* k) const {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], (__m512bh)_mm512_loadu_si512(k));
    for (int i = 1; i < DIM / 32; ++i) acc = _mm512_dpbf16_ps(acc, qb[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
    return acc;
  }
};
#endif

// How many query heads one pass over V serves: their accumulators (DIM / kLanes registers each)
// fill at most 24 of AVX-512's 32 registers (12 of AVX2's 16), the rest hold V and the weights.
template <int64_t DIM>
constexpr int kVHeads = std::max<int>(1, (kLanes == 16 ? 24 : 12) / static_cast<int>(DIM / kLanes));

// out[h * DIM + d] = sum_t w[h * ws + t] * V[t][d], t < len, for NH heads (ws >= len: the
// weights' row stride), in float32, over the rows at pool offsets ``rows``: each V row is loaded
// once for all NH heads (a group's heads share it, and attend_block's rows share it too). A head
// whose weights are exact zeros past some t gets the bits it would get with len = t (each
// accumulator adds 0 * v, which is +0 for a finite v, to a sum that is never -0).
template <typename S, int64_t DIM>
struct WeightedV {
  template <int NH>
  static void run(const typename S::T* v_pool, const int64_t* rows, const float* w, int64_t ws, int64_t len,
                  float* out, Scratch&) {
    constexpr int R = DIM / kLanes;
    VecF acc[NH][R];
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < R; ++i) acc[h][i] = vzero();
    for (int64_t t = 0; t < len; ++t) {
      const typename S::T* v = v_pool + rows[t];
      VecF wt[NH];
      for (int h = 0; h < NH; ++h) wt[h] = vset1(w[h * ws + t]);
      for (int i = 0; i < R; ++i) {
        const VecF vi = vload(v + kLanes * i);
        for (int h = 0; h < NH; ++h) acc[h][i] = vfma(wt[h], vi, acc[h][i]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < R; ++i) vstore(out + h * DIM + kLanes * i, acc[h][i]);
  }
};

#if defined(__AVX512BF16__)
// bfloat16 V: two positions per bf16 pair dot product, V rows t and t+1 interleaved element by
// element (unpack, once for all NH heads), each head's two softmax weights rounded to bfloat16 as
// a pair (as flash-attention kernels round P before the PV product; each product is then exact
// in float32). The weights are rounded 16 at a time into ``buf.wb`` (round to nearest even, as
// BF16::st), each head's row padded with a zero weight to an even length.
template <int64_t DIM>
struct WeightedV<BF16, DIM> {
  template <int NH>
  static void run(const uint16_t* v_pool, const int64_t* rows, const float* w, int64_t ws, int64_t len,
                  float* out, Scratch& buf) {
    constexpr int H = DIM / 32;  // 512-bit loads per row (32 bfloat16 each)
    const int64_t even = (len + 1) & ~int64_t{1};
    buf.wb.resize(NH * even + 16);
    for (int h = 0; h < NH; ++h) {
      uint16_t* wb = buf.wb.data() + h * even;
      for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
        const __m256bh r = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, w + h * ws + t));
        _mm256_mask_storeu_epi16(wb + t, m, (__m256i)r);
      }
      if (len < even) wb[len] = 0;
    }
    __m512 lo[NH][H], hi[NH][H];
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < H; ++i) lo[h][i] = hi[h][i] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t t = 0; t < len; t += 2) {
      const bool pair = t + 1 < len;
      const uint16_t* v0 = v_pool + rows[t];
      const uint16_t* v1 = pair ? v_pool + rows[t + 1] : nullptr;
      __m512bh wv[NH];
      for (int h = 0; h < NH; ++h) {
        int32_t wp;
        std::memcpy(&wp, buf.wb.data() + h * even + t, sizeof wp);
        wv[h] = (__m512bh)_mm512_set1_epi32(wp);
      }
      for (int i = 0; i < H; ++i) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * i);
        const __m512i b = pair ? _mm512_loadu_si512(v1 + 32 * i) : zero;
        const __m512bh ul = (__m512bh)_mm512_unpacklo_epi16(a, b), uh = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int h = 0; h < NH; ++h) {
          lo[h][i] = _mm512_dpbf16_ps(lo[h][i], ul, wv[h]);
          hi[h][i] = _mm512_dpbf16_ps(hi[h][i], uh, wv[h]);
        }
      }
    }
    // unpacklo/hi work per 128-bit quarter L: lane 4L + j of lo holds element 8L + j, of hi 8L + 4 + j.
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < H; ++i) {
        alignas(64) float a[16], b[16];
        _mm512_store_ps(a, lo[h][i]);
        _mm512_store_ps(b, hi[h][i]);
        float* row = out + h * DIM + 32 * i;
        for (int l = 0; l < 4; ++l)
          for (int j = 0; j < 4; ++j) {
            row[8 * l + j] = a[4 * l + j];
            row[8 * l + 4 + j] = b[4 * l + j];
          }
      }
  }
};
#endif

// Asks for the cache lines of one K/V row of DIM elements (into L1 for T0, L2 for T1).
template <int Hint, typename T, int64_t DIM>
inline void prefetch_row(const T* p) {
  for (int64_t b = 0; b < DIM * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, static_cast<_mm_hint>(Hint));
}

// WeightedV for ``nh`` (1 .. kVHeads) heads, the count as a compile-time constant.
template <typename S, int64_t DIM>
void weighted_v(int nh, const typename S::T* v_pool, const int64_t* rows, const float* w, int64_t ws, int64_t len, float* out,
                Scratch& buf) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((nh == I + 1 ? WeightedV<S, DIM>::template run<I + 1>(v_pool, rows, w, ws, len, out, buf) : void()), ...);
  }(std::make_integer_sequence<int, kVHeads<DIM>>{});
}

// The rest of n consecutive rows of one sequence and kv head (row i attends to its first
// len0 + i positions; a pair is n = 1) once their query vectors' scores are in ``scores`` (vector
// v = i * G + g at scores + v * stride, stride >= the last row's length) with their running maxima
// (store_scores, kLanes floats each): softmax per vector over its own row's positions, zeros after
// them up to the stride; then P.V for up to kVHeads vectors per pass over V, rows sharing it (a
// pass runs to its last row's length; a shorter row's zero weights leave its sums' bits as alone),
// each output rounded once to the dtype at out + i * out_stride_t + g * DIM.
template <typename S, int64_t DIM>
void softmax_v(float* scores, int64_t stride, int64_t len0, int64_t n, int64_t groups, const float* max,
               const typename S::T* v_pool, const int64_t* rows, typename S::T* out, int64_t out_stride_t,
               Scratch& buf) {
  const int64_t qv = n * groups;
  buf.inv_sum.resize(qv);
  for (int64_t v = 0; v < qv; ++v) {
    const int64_t len = len0 + v / groups;
    float* sv = scores + v * stride;
    buf.inv_sum[v] = 1.0f / softmax_numerators_vec(sv, len, vmax_lanes(vload(max + v * kLanes)));
    std::fill(sv + len, sv + stride, 0.0f);
  }
  for (int64_t v0 = 0; v0 < qv; v0 += kVHeads<DIM>) {
    const int nh = static_cast<int>(std::min<int64_t>(kVHeads<DIM>, qv - v0));
    const int64_t len = len0 + (v0 + nh - 1) / groups;
    alignas(64) float row[kVHeads<DIM> * DIM];
    weighted_v<S, DIM>(nh, v_pool, rows, scores + v0 * stride, stride, len, row, buf);
    for (int h = 0; h < nh; ++h) {
      const int64_t v = v0 + h, i = v / groups, g = v % groups;
      typename S::T* o = out + i * out_stride_t + g * DIM;
      for (int64_t d = 0; d < DIM; ++d) o[d] = S::st(row[h * DIM + d] * buf.inv_sum[v]);
    }
  }
}

// attend_pair's math with the head in registers (DIM = 64 or 128): scores kLanes positions at
// a time (QueryRow), then the weighted sums of V for up to kVHeads query heads per pass over V.
// Float32 arithmetic in another order; with AVX512-BF16, bfloat16 heads use bf16 pair dot
// products (QueryRow, WeightedV).
// attend_pair's signature (the head size is DIM, so its run-time copy goes unused).
template <typename S, int64_t DIM>
void attend_pair_vec(const typename S::T* q, int64_t q_stride_h, const typename S::T* k_pool,
                     const typename S::T* v_pool, const int64_t* table, int64_t len, int64_t block_size,
                     int64_t hkv, int64_t kv_head, int64_t groups, int64_t /*dim_rt*/, float scale,
                     typename S::T* out, Scratch& buf) {
  const int64_t row_stride = hkv * DIM;
  auto& rows = buf.rows;
  auto& scores = buf.scores;
  scores.resize(groups * len);
  pair_rows(table, len, block_size, row_stride, kv_head * DIM, rows);
  for (int64_t r = 0; r < std::min<int64_t>(len, kLanes); ++r) prefetch_row<_MM_HINT_T0, typename S::T, DIM>(k_pool + rows[r]);
  // The thread's next pair's K rows then V rows into L2 (paged_attention says which pairs get
  // them), a share at each chunk every query head of this pair scores: spread over the whole
  // scoring, not only the first head's pass, so the misses stay within what the cache can have in
  // flight. Measured on Zen 4 (2 cores, decode rows, K/V from memory): 1.2-1.4x spread over the
  // first head's pass only, 1.35x (float32) and 1.6-1.75x (bfloat16) over every head's.
  const int64_t next_n = static_cast<int64_t>(buf.next_rows.size()), next_total = 2 * next_n;
  const int64_t chunks = groups * ((len + kLanes - 1) / kLanes), next_step = (next_total + chunks - 1) / chunks;
  int64_t next_done = 0;
  auto prefetch_next = [&](int64_t upto) {
    for (upto = std::min(upto, next_total); next_done < upto; ++next_done) {
      const bool k = next_done < next_n;
      prefetch_row<_MM_HINT_T1, typename S::T, DIM>((k ? k_pool : v_pool) + buf.next_rows[k ? next_done : next_done - next_n]);
    }
  };
  buf.max.assign(groups * kLanes, -std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < groups; ++g) {
    const QueryRow<S, DIM> qr(q + g * q_stride_h, scale);
    const VecF post = vset1(qr.post);
    float* mx = buf.max.data() + g * kLanes;
    float* sg = scores.data() + g * len;
    for (int64_t p = 0; p < len; p += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, len - p);
      if (g == 0) {
        // A step reads each layer's K/V once, from memory, in blocks scattered over the pool, and
        // a head's rows are strided by the other heads' (the hardware prefetcher loses the stream
        // at every block): ask for the next chunk's K rows while this one is scored, and for this
        // chunk's V rows ahead of the V pass. 1.5-1.9x on decode steps whose K/V are not cached.
        for (int64_t r = p + kLanes; r < std::min(len, p + 2 * kLanes); ++r)
          prefetch_row<_MM_HINT_T0, typename S::T, DIM>(k_pool + rows[r]);
        for (int64_t r = p; r < p + n; ++r) prefetch_row<_MM_HINT_T1, typename S::T, DIM>(v_pool + rows[r]);
      }
      prefetch_next(next_done + next_step);
      // A last chunk of n < kLanes positions: zero partials for the rest, whose sums are not stored
      // (a position's lane of sum_lanes depends on its own partial only).
      VecF part[kLanes];
      for (int r = 0; r < kLanes; ++r) part[r] = r < n ? qr.partial(k_pool + rows[p + r]) : vzero();
      store_scores(sg + p, vmul(sum_lanes(part), post), n, mx);
    }
    if (g == groups - 1) prefetch_next(next_total);
  }
  softmax_v<S, DIM>(scores.data(), len, len, 1, groups, buf.max.data(), v_pool, rows.data(), out, 0, buf);
}

// ---- a prompt's rows in blocks: scores from K transposed, passes over V shared ------------------
// A prompt's consecutive rows read the same K rows, each one position more than the row before.
// attend_pair_vec scores one row at a time: 16 K rows of DIM elements multiplied lane-wise into
// 16 partial vectors, then sum_lanes (a transpose with adds) per head, and each head reloads the
// K rows. Here a block of the prompt's rows scores whole chunks together: the chunk's K is laid
// out transposed once per (sequence, kv head) and thread (vector m holds element m of the
// chunk's kLanes positions), and a lane's partial for kLanes positions is a few broadcast FMAs
// that up to 4 query vectors share. The lanes are then summed in sum_lanes' own order, so every
// score is bit for bit the one attend_pair_vec computes (a speculative verify's rows, a prompt
// in chunks and a prompt at once all agree with plain decoding): the same products, rounded the
// same, added in the same tree (a row's last chunk short of kLanes positions too: its missing
// positions' partials are zero in both, and their sums are not stored). The rows then share
// each pass over V (attend_block, WeightedV).
constexpr int kTileQ = 4;  // query vectors one pass over a chunk's K scores

template <typename S, int64_t DIM>
struct PromptTile {
  // bfloat16 with AVX512-BF16 multiplies pairs (vdpbf16ps, as QueryRow<BF16>): a K vector holds
  // element pairs as 32-bit words; otherwise K widens to float32 and q is scaled first.
#if defined(__AVX512BF16__)
  static constexpr bool kPairs = std::is_same_v<S, BF16>;
#else
  static constexpr bool kPairs = false;
#endif
  static constexpr int64_t M = kPairs ? DIM / 2 : DIM;  // 32-bit elements per K row
  static constexpr int kTerms = static_cast<int>(M / kLanes);  // products summed in each lane

  // q's coefficients as QueryRow uses them: float32 q * scale, or q's raw bfloat16 pairs (the
  // scale then multiplies the finished sums: post).
  static float post(float scale) { return kPairs ? scale : 1.0f; }
  static void coefficients(const typename S::T* q, float scale, float* c) {
    if constexpr (kPairs) {
      std::memcpy(c, q, DIM * sizeof(typename S::T));
    } else {
      for (int64_t d = 0; d < DIM; ++d) c[d] = S::ld(q[d]) * scale;
    }
  }

  // A chunk's first n K rows (pool offsets rows[j]) into kt[m * kLanes + j], zeros after them:
  // kLanes x kLanes blocks transposed in registers (element by element it cost a verify of a few
  // rows over cached positions more than the rows alone took).
  static void transpose(const typename S::T* k_pool, const int64_t* rows, int64_t n, float* kt) {
    for (int64_t sl = 0; sl < M / kLanes; ++sl) {
      VecF r[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        const typename S::T* k = k_pool + rows[std::min<int64_t>(j, n - 1)];
#if defined(__AVX512BF16__)
        if constexpr (kPairs) {  // 32-bit words sl * kLanes .. : the pairs, bits unchanged
          r[j] = j < n ? _mm512_loadu_ps(reinterpret_cast<const float*>(k) + sl * kLanes) : vzero();
          continue;
        }
#endif
        r[j] = j < n ? vload(k + sl * kLanes) : vzero();
      }
      transpose_lanes(r);
      for (int l = 0; l < kLanes; ++l) vstore(kt + (sl * kLanes + l) * kLanes, r[l]);
    }
  }

  // Lane l's partial for kLanes positions and R query vectors: QueryRow::partial's products and
  // order (a multiply, then an FMA per further register of the row; or vdpbf16ps from zero).
  template <int R>
  static void lane(int l, const float* kt, const float* const c[R], VecF (&p)[R]) {
    for (int i = 0; i < kTerms; ++i) {
      const int64_t m = static_cast<int64_t>(i) * kLanes + l;
      VecF k = vload(kt + m * kLanes);
      // In a register for all R query vectors, each coefficient an embedded broadcast: left to
      // itself GCC loaded k again as every FMA's memory operand and broadcast the coefficients
      // separately, two loads per FMA (1.2x slower, Zen 4).
      asm("" : "+v"(k));
      for (int r = 0; r < R; ++r) {
#if defined(__AVX512BF16__)
        if constexpr (kPairs) {
          int32_t pair;
          std::memcpy(&pair, c[r] + m, sizeof pair);
          p[r] = _mm512_dpbf16_ps(i == 0 ? _mm512_setzero_ps() : p[r], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)_mm512_castps_si512(k));
          continue;
        }
#endif
        p[r] = i == 0 ? vmul(vset1(c[r][m]), k) : vfma(vset1(c[r][m]), k, p[r]);
      }
    }
  }

  // R query vectors' scores at one chunk: sum_lanes' tree over the lanes' partials, times post;
  // lanes [0, n[r]) stored to out[r].
  template <int R>
  static void chunk(const float* kt, const float* const c[R], float* const out[R], const int64_t n[R], float* const mx[R],
                    float post_scale) {
    VecF a[R], b[R], x[R], sum[R], half[R];
    auto pair_sum = [&](int l0, int l1, VecF (&s)[R]) {  // s = partial l0 + partial l1
      lane<R>(l0, kt, c, a);
      lane<R>(l1, kt, c, b);
      for (int r = 0; r < R; ++r) s[r] = vadd(a[r], b[r]);
    };
    // sum_lanes: AVX-512 adds lanes (j, j+2) then (j, j+1) within each quarter, then the quarters
    // (0, 1), (2, 3), then the halves; AVX2's hadds add (j, j+1), then (j, j+2), then the halves.
    constexpr int kStep1 = kLanes == 16 ? 2 : 1, kStep2 = kLanes == 16 ? 1 : 2;
    for (int quarter = 0; quarter < kLanes / 4; ++quarter) {
      const int l = 4 * quarter;
      pair_sum(l, l + kStep1, x);
      pair_sum(l + kStep2, l + kStep2 + kStep1, b);
      for (int r = 0; r < R; ++r) x[r] = vadd(x[r], b[r]);  // the quarter's four lanes
      for (int r = 0; r < R; ++r) {
        if (kLanes == 8) {  // two quarters: the halves
          sum[r] = quarter == 0 ? x[r] : vadd(sum[r], x[r]);
        } else if (quarter % 2 == 0) {
          half[r] = x[r];
        } else {
          half[r] = vadd(half[r], x[r]);
          sum[r] = quarter == 1 ? half[r] : vadd(sum[r], half[r]);
        }
      }
    }
    const VecF ps = vset1(post_scale);
    for (int r = 0; r < R; ++r) store_scores(out[r], vmul(sum[r], ps), n[r], mx[r]);
  }
};

// One block of a sequence's consecutive rows for kv head h: rows i = 0 .. n-1 at q + i * q_stride_t
// attend to their first len0 + i positions (a prompt's rows, or a speculative verify's). The same
// results as attend_pair_vec on each (row, h) pair, bit for bit (PromptTile).
template <typename S, int64_t DIM>
void attend_block(const typename S::T* q, int64_t q_stride_t, int64_t q_stride_h, const typename S::T* k_pool,
                  const typename S::T* v_pool, const int64_t* table, int64_t seq, int64_t len0, int64_t n,
                  int64_t block_size, int64_t hkv, int64_t kv_head, int64_t groups, float scale, typename S::T* out,
                  int64_t out_stride_t, Scratch& buf) {
  using Tile = PromptTile<S, DIM>;
  const int64_t last = len0 + n - 1;  // the longest row's length
  // The thread's transposed K and pool offsets of this (sequence, kv head), extended to this
  // block's positions: a thread's blocks of one sequence and head come one after another. A
  // chunk transposed short (zeros past the block's last position) is transposed again.
  if (buf.kt_seq != seq || buf.kt_head != kv_head) {
    buf.kt_seq = seq, buf.kt_head = kv_head, buf.kt_positions = 0;
    buf.prompt_rows.clear();
  }
  if (static_cast<int64_t>(buf.prompt_rows.size()) < last)  // only the new positions
    pair_rows(table, last, block_size, hkv * DIM, kv_head * DIM, buf.prompt_rows, buf.prompt_rows.size());
  const int64_t* rows = buf.prompt_rows.data();
  const int64_t chunks = (last + kLanes - 1) / kLanes;
  if (buf.kt_positions < last) {
    buf.kt.resize(chunks * Tile::M * kLanes);
    // K of earlier positions (a chunk after cached ones, a long verify) comes from memory, in
    // blocks scattered over the pool and strided by the other heads' rows: ask for the chunk
    // after next while this one is transposed (8 rows over 1500 cached positions, 30 layers:
    // 0.76x -> 0.92x the rows in pairs, before the transpose moved into registers).
    constexpr int64_t kAhead = 2;
    for (int64_t p = buf.kt_positions / kLanes * kLanes; p < std::min(last, (buf.kt_positions / kLanes + kAhead) * kLanes); ++p)
      prefetch_row<_MM_HINT_T0, typename S::T, DIM>(k_pool + rows[p]);
    for (int64_t c = buf.kt_positions / kLanes; c < chunks; ++c) {
      for (int64_t p = (c + kAhead) * kLanes; p < std::min(last, (c + kAhead + 1) * kLanes); ++p)
        prefetch_row<_MM_HINT_T0, typename S::T, DIM>(k_pool + rows[p]);
      Tile::transpose(k_pool, rows + c * kLanes, std::min<int64_t>(kLanes, last - c * kLanes),
                      buf.kt.data() + c * Tile::M * kLanes);
    }
    buf.kt_positions = last;
  }
  // Scores: query vector v = i * G + g (row i, head g) at scores + v * last, its first len0 + i
  // entries (one stride for all, so that rows can share a pass over V).
  const int64_t qv = n * groups;
  buf.scores.resize(qv * last);
  buf.qf.resize(qv * DIM);
  buf.max.assign(qv * kLanes, -std::numeric_limits<float>::infinity());
  float* scores = buf.scores.data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < groups; ++g)
      Tile::coefficients(q + i * q_stride_t + g * q_stride_h, scale, buf.qf.data() + (i * groups + g) * DIM);
  const float post = Tile::post(scale);
  for (int64_t c = 0; c < chunks; ++c) {
    const float* kt = buf.kt.data() + c * Tile::M * kLanes;
    // the rows that reach into chunk c: len0 + i > c * kLanes
    const int64_t first = std::max<int64_t>(0, c * kLanes + 1 - len0);
    for (int64_t v = first * groups; v < qv; v += kTileQ) {
      const float* coef[kTileQ];
      float* dst[kTileQ];
      int64_t lanes[kTileQ];
      float* mx[kTileQ];
      const int r = static_cast<int>(std::min<int64_t>(kTileQ, qv - v));
      for (int j = 0; j < r; ++j) {
        const int64_t i = (v + j) / groups;
        coef[j] = buf.qf.data() + (v + j) * DIM;
        dst[j] = scores + (v + j) * last + c * kLanes;
        lanes[j] = std::min<int64_t>(kLanes, len0 + i - c * kLanes);
        mx[j] = buf.max.data() + (v + j) * kLanes;
      }
      [&]<int... I>(std::integer_sequence<int, I...>) {
        ((r == I + 1 ? Tile::template chunk<I + 1>(kt, coef, dst, lanes, mx, post) : void()), ...);
      }(std::make_integer_sequence<int, kTileQ>{});
    }
  }
  softmax_v<S, DIM>(scores, last, len0, n, groups, buf.max.data(), v_pool, rows, out, out_stride_t, buf);
}
#endif

// A step's attention work, in order: a (row, kv head) pair, or (with the vector path) a block of
// up to kBlockRows consecutive rows of one sequence, each one position longer than the row before
// (a prompt's rows), for one kv head. A run of such rows is laid out head by head, its blocks in
// order, so that a thread's blocks of one (sequence, head) follow each other (attend_block keeps
// their transposed K).
template <typename S>
using BlockFn = void (*)(const typename S::T*, int64_t, int64_t, const typename S::T*, const typename S::T*,
                         const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                         typename S::T*, int64_t, Scratch&);

struct AttnUnit {
  int64_t t0, t1, h;  // rows [t0, t1), kv head h
};
// A run shorter than min_block_rows stays in pairs: transposing a long context's K for a few
// rows (a speculative verify, a short chunk after cached positions) cost more than it saved.
// With K from memory (30 layers' pools, 1500 positions, Zen 4), blocks against pairs at 2 / 4 /
// 8 / 16 rows: 9 heads over 3 kv heads 0.70x / 0.81x / 1.05x / 1.20x; one kv head per head (32 x
// 64, 1000 positions), where a pair serves one query head alone, float32 1.62x / 2.42x / 2.97x
// at 2 / 4 / 8 rows and bfloat16 0.79x / 1.12x / 1.52x; 12 over 2 x 128 from 4 rows.
constexpr int64_t kBlockRows = 8;
inline int64_t min_block_rows(int64_t groups) { return groups == 1 ? 4 : 8; }

std::vector<AttnUnit> attention_units(const int64_t* seq, const int64_t* len, int64_t rows, int64_t hkv,
                                      int64_t groups, bool blocks) {
  std::vector<AttnUnit> units;
  units.reserve(rows * hkv);
  for (int64_t t = 0; t < rows;) {
    int64_t e = t + 1;
    while (blocks && e < rows && seq[e] == seq[t] && len[e] == len[e - 1] + 1) ++e;
    if (e - t >= min_block_rows(groups)) {
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t b = t; b < e; b += kBlockRows) units.push_back({b, std::min(e, b + kBlockRows), h});
    } else {
      for (int64_t r = t; r < e; ++r)
        for (int64_t h = 0; h < hkv; ++h) units.push_back({r, r + 1, h});
    }
    t = e;
  }
  return units;
}

// Where each thread's share of the units starts: contiguous ranges of about equal work
// (positions read, plus a fixed cost per row and head), since a prompt's causal rows grow longer
// down the prompt and an even split by count left one thread with ~3/4 of the work. A small
// step (a few microseconds: one sequence decoding) stays whole, on the calling thread: waking
// the pool would cost more than the work.
std::vector<int64_t> balanced_split(const std::vector<AttnUnit>& units, const int64_t* row_len, int64_t work) {
  const int64_t n = static_cast<int64_t>(units.size());
  const int64_t threads = work < 2048 ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  std::vector<int64_t> bounds{0};
  if (threads > 1) {
    constexpr int64_t kPairCost = 16;  // the set-up of a row's pair, in positions
    auto cost = [&](const AttnUnit& u) {
      int64_t c = 0;
      for (int64_t t = u.t0; t < u.t1; ++t) c += row_len[t] + kPairCost;
      return c;
    };
    int64_t total = 0;
    for (const auto& u : units) total += cost(u);
    int64_t done = 0;
    for (int64_t i = 0; i < n; ++i) {
      done += cost(units[i]);
      const int64_t part = static_cast<int64_t>(bounds.size());
      if (part < threads && done * threads >= total * part) bounds.push_back(i + 1);
    }
  }
  bounds.push_back(n);
  return bounds;
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
    bool vec = false;  // attend_pair_vec: the one that prefetches the next pair's rows
    BlockFn<S> block_fn = nullptr;  // with vec: attend_block
#if defined(__AVX512F__) || defined(__AVX2__)
    if constexpr (!std::is_same_v<S, F16>) {
      if (dim == 64) pair_fn = &attend_pair_vec<S, 64>;
      if (dim == 128) pair_fn = &attend_pair_vec<S, 128>;
      vec = dim == 64 || dim == 128;
      if (dim == 64) block_fn = &attend_block<S, 64>;
      if (dim == 128) block_fn = &attend_block<S, 128>;
    }
#endif
    const auto units = attention_units(seq_p, len_p, rows, hkv, groups, vec);
    const auto bounds = balanced_split(units, len_p, positions * heads);
    at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t part0, int64_t part1) {
      Scratch buf;
      for (int64_t i = bounds[part0]; i < bounds[part1]; ++i) {
        const auto [t, t1, h] = units[i];
        if (t1 - t > 1) {
          block_fn(qp + t * qs0 + h * groups * qs1, qs0, qs1, kp, vp, tp + seq_p[t] * nb, seq_p[t], len_p[t], t1 - t,
                   block_size, hkv, h, groups, static_cast<float>(scale), op + (t * heads + h * groups) * dim,
                   heads * dim, buf);
          continue;
        }
        // The next pair's K/V rows, prefetched under this pair's compute (attend_pair_vec): a
        // decode row's K/V come from memory, in blocks scattered over the pool, and the in-pair
        // prefetch alone waits on them chunk by chunk. Not where the next row is the same
        // sequence's as the row before it (a prompt's rows): it reads what that row read, one
        // position more, so its pairs find their rows in cache.
        buf.next_rows.clear();
        if (vec && i + 1 < bounds[part1] && units[i + 1].t1 - units[i + 1].t0 == 1) {
          const int64_t nt = units[i + 1].t0, nh = units[i + 1].h;
          if (!(nt > 0 && seq_p[nt] == seq_p[nt - 1]))
            pair_rows(tp + seq_p[nt] * nb, len_p[nt], block_size, hkv * dim, nh * dim, buf.next_rows);
        }
        pair_fn(qp + t * qs0 + h * groups * qs1, qs1, kp, vp, tp + seq_p[t] * nb, len_p[t], block_size, hkv, h,
                groups, dim, static_cast<float>(scale), op + (t * heads + h * groups) * dim, buf);
      }
    });
  });
  return out;
}

// ---- greedy sampling: argmax over rows -----------------------------------------------------

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

// ---- per-thread scratch -------------------------------------------------------------------

// Per-thread scratch buffers, kept across calls: one slot per use, grown to at least n floats.
// A buffer allocated per call costs a malloc each time, and past glibc's mmap threshold (128 KB)
// fresh pages to fault in on every call. A slot is used by one function at a time per thread.
enum ScratchSlot { kTileOut, kPanelBuf, kRowsIn, kQ8Rows, kWidePart, kScratchSlots };
inline float* scratch(ScratchSlot slot, int64_t n) {
  thread_local std::vector<float> bufs[kScratchSlots];
  auto& b = bufs[slot];
  if (static_cast<int64_t>(b.size()) < n) b.resize(n);
  return b.data();
}

// x [M, K] as contiguous float32 rows for a matmul: a decode step's few bfloat16 rows widened
// into the calling thread's scratch (no tensor allocated, no dispatch: a one-row matmul is a
// few microseconds of work), else x.to(float32) (no copy when x already is), held in ``keep``.
inline const float* float_rows(const at::Tensor& x, at::Tensor& keep) {
  if (x.scalar_type() == at::kBFloat16 && x.numel() <= (1 << 16)) {
    keep = x.contiguous();
    const auto* xb = reinterpret_cast<const uint16_t*>(keep.data_ptr());
    float* xs = scratch(kRowsIn, x.numel());
    for (int64_t i = 0; i < x.numel(); ++i) xs[i] = BF16::ld(xb[i]);
    return xs;
  }
  keep = x.to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// ---- register tiles of up to 8 rows ---------------------------------------------------------

// Rows [r0, r1) in tiles of kTileRows: tile.template operator()<R>(r) for each tile of R rows
// starting at row r (the last one takes the remainder), R a compile-time constant so each height
// gets its own unrolled tile. The VNNI tiles and panel_linear's AVX-512 tile are 8 rows high.
constexpr int64_t kTileRows = 8;
template <typename Tile>
inline void row_tiles(int64_t r0, int64_t r1, Tile&& tile) {
  static_assert(kTileRows == 8, "one case per tile height");
  for (int64_t r = r0; r < r1; r += kTileRows) {
    switch (std::min(kTileRows, r1 - r)) {
      case 8: tile.template operator()<8>(r); break;
      case 7: tile.template operator()<7>(r); break;
      case 6: tile.template operator()<6>(r); break;
      case 5: tile.template operator()<5>(r); break;
      case 4: tile.template operator()<4>(r); break;
      case 3: tile.template operator()<3>(r); break;
      case 2: tile.template operator()<2>(r); break;
      default: tile.template operator()<1>(r); break;
    }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// A row tile's share of the next weight block, prefetched into L2 while the tile computes this
// one. Where one block's rows take several tiles one after the other, the first tile waits on
// memory and the rest compute from L2; splitting the next block's prefetch over all of them runs
// the weight stream under every tile's compute. The tile at `row` of `rows` takes its 1 / tiles
// of the `bytes` at `next` and prefetches `step` more of them at each of its `steps` steps, one
// prefetch per cache line. Default-constructed (or with next == nullptr): nothing to prefetch.
struct NextShare {
  const char* line = nullptr;  // the next line to prefetch
  const char* upto = nullptr;  // prefetched up to here so far
  int64_t step = 0;
  NextShare() = default;
  NextShare(const void* next, int64_t bytes, int64_t rows, int64_t row, int64_t steps) {
    if (!next) return;
    const int64_t tiles = (rows + kTileRows - 1) / kTileRows, share = (bytes + tiles - 1) / tiles;
    line = upto = static_cast<const char*>(next) + row / kTileRows * share;
    step = (share + steps - 1) / steps;
  }
  bool on() const { return step > 0; }
  // One step's share.
  [[gnu::always_inline]] inline void advance() {
    for (upto += step; line < upto; line += 64) _mm_prefetch(line, _MM_HINT_T1);
  }
};
#endif

// ---- int8 weight-only matmul for a few rows --------------------------------------------------

// y[m][n] = scale[n] * sum_k x[m][k] * q[n][k] for n in [n0, n1), every row m; x is float32.
// O is the output's storage (the input dtype's, or F32 for float32 logits).
#if defined(__AVX512F__) || defined(__AVX2__)
// kLanes int8 weights widened to float32 (exact).
inline VecF vwiden_i8(const int8_t* q) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
#else
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
#endif
}

// R weight rows x MT activation rows: each weight vector is widened to float32 once for MT rows.
template <typename O, int R, int MT>
inline void int8_tile(const float* x, int64_t k, const int8_t* q, const float* scale, typename O::T* y, int64_t n_out) {
  VecF acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vzero();
  for (int64_t c = 0; c < k; c += kLanes) {
    VecF w[R];
    for (int r = 0; r < R; ++r) w[r] = vwiden_i8(q + r * k + c);
    for (int m = 0; m < MT; ++m) {
      const VecF xv = vload(x + m * k + c);
      for (int r = 0; r < R; ++r) acc[m][r] = vfma(w[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) y[m * n_out + r] = O::st(vsum(acc[m][r]) * scale[r]);
}
#endif

// Rows go R at a time, and the rows two steps ahead are prefetched: the matrix streams from
// memory once per step, and with the hardware prefetcher alone the loop waited on it (the
// default model's 28 MB: 2.1 -> 1.5 ms on 2 cores). Within a block, activation rows go MT at a
// time (4 with AVX-512's 32 registers, 2 with AVX2's 16), then one by one: each weight vector
// is widened once for the rows of a tile. With AVX2 the scalar loop took 47 ms for 16 rows of
// the default model's head (torch's kernel: 21-25); this one 11 (Zen 3, 2 cores).
template <typename O>
[[gnu::noinline]] void int8_rows(const float* xf, int64_t rows, int64_t k, const int8_t* q, const float* scale,
                                 typename O::T* y, int64_t n_out, int64_t n0, int64_t n1) {
  int64_t n = n0;
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr int R = 8;
  const char* end = reinterpret_cast<const char*>(q + n1 * k);
  for (; n + R <= n1; n += R) {
    const char* ahead = reinterpret_cast<const char*>(q + (n + 2 * R) * k);
    for (int64_t o = 0; o < R * k && ahead + o < end; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    // Activation rows m .. m + MT - 1 against the block's R weight rows, RT at a time.
    auto tiles = [&]<int RT, int MT>(int64_t m) {
      for (int64_t r = 0; r < R; r += RT)
        int8_tile<O, RT, MT>(xf + m * k, k, q + (n + r) * k, scale + n + r, y + m * n_out + n + r, n_out);
    };
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) tiles.template operator()<kLanes == 16 ? 4 : 2, 4>(m);
    for (; m + 2 <= rows; m += 2) tiles.template operator()<4, 2>(m);
    // One row: 8 widened weights and 8 accumulators would not fit AVX2's 16 registers.
    for (; m < rows; ++m) tiles.template operator()<kLanes == 16 ? R : 4, 1>(m);
  }
#endif
  for (; n < n1; ++n) {
    const int8_t* w = q + n * k;
    for (int64_t m = 0; m < rows; ++m) y[m * n_out + n] = O::st(dot16<I8>(xf + m * k, w, k) * scale[n]);
  }
}

// x [M, K] @ (q [N, K] int8 * scale [N])^T -> [M, N], as torch's _weight_int8pack_mm, in x's dtype
// or (float32_out) in float32: the output projection's logits, which rounded to bfloat16 tie
// tokens that float32 tells apart (a first answer of the bundled prompts flipped on one).
// One row streams the weight faster than torch's kernel (28 MB: ~1.2-1.5 ms vs 1.5-2.2 from memory).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool float32_out) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "x [M,K], q [N,K] int8");
  TORCH_CHECK(x.size(1) == q.size(1) && q.size(1) % 16 == 0, "K must match and be a multiple of 16");
  TORCH_CHECK(scale.numel() == q.size(0) && scale.scalar_type() == x.scalar_type(), "scale [N] in x's dtype");
  const int64_t rows = x.size(0), k = x.size(1), n_out = q.size(0);
  at::Tensor keep;
  const float* xp = float_rows(x, keep);
  const auto sc = scale.to(at::kFloat).contiguous();
  auto y = at::empty({rows, n_out}, x.options().dtype(float32_out ? at::kFloat : x.scalar_type()));
  auto run = [&]<typename O>() {
    const float* sp = sc.data_ptr<float>();
    auto* yp = ptr<O>(y);
    const int64_t threads = at::get_num_threads();
    at::parallel_for(0, n_out, std::max<int64_t>(512, (n_out + threads - 1) / threads), [&](int64_t n0, int64_t n1) {
      int8_rows<O>(xp, rows, k, q.data_ptr<int8_t>(), sp, yp, n_out, n0, n1);
    });
  };
  if (float32_out) {
    run.template operator()<F32>();
  } else {
    dispatch(x.scalar_type(), "int8_linear", run);
  }
  return y;
}

// ---- 4-bit weight matmul (quant: gguf) --------------------------------------------------------
//
// A [N, K] weight held as w = scale * q + min, q in 0..15, one (scale, min) per group of 32
// along K (GGUF's Q4_0 / Q4_1 / Q4_K all reduce to this). q4_pack lays it out for q4_linear as
// one uint8 tensor [N/16, K/32, 320]: for each block of 16 output rows and group of 32 inputs,
// 256 bytes of codes and then the 16 rows' scales and mins as float16 (32 bytes each).
// The codes are four 64-byte vectors, vector i covering inputs 8i..8i+7: the four bytes of
// 32-bit lane j (row j) hold (low nibble | high nibble << 4) q0|q2, q4|q6, q1|q3, q5|q7 of
// those eight inputs. One AND/OR per shift then yields bfloat16 pairs (q_a, q_b) for one
// AVX512-BF16 dot instruction: bf16 bits 0x4300 | q are exactly the number 128 + q, so
// sum (128 + q) x = sum q x + 128 sum x, and the 128 folds into the group's min.
//
// Numerics: x is bfloat16 (the quantized path's activations); each product is exact in float32
// and sums are float32; scale and min are float16 (exact for Q4_0 / Q4_1 files, whose scales are
// float16; Q4_K's 6-bit sub-scale products round to float16). The result is rounded once.
//
// Why not torch's int4 matmul: at one row it streams the default model's 66 MB of 4-bit layers
// at ~18 GB/s; its inner loop converts every weight to float32 for an FMA, ~4x the instructions
// per weight of the bf16 dot here, and at 16+ rows it tops out near 170 GFLOP/s on 2 cores.
// CPUs without AVX512-BF16 run the same layout on float32 FMAs: "the 4-bit matmul on float32
// FMAs", after panel_linear, whose tile it shares.

constexpr int64_t Q4_BLOCK = 320;  // bytes per (16 rows, 32 inputs)

at::Tensor q4_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "codes: uint8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / 32;
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0, "q4_pack: N must be a multiple of 16 and K of 32");
  TORCH_CHECK(scale.sizes() == min.sizes() && scale.numel() == n * groups, "scale / min: [N, K/32]");
  const auto c = codes.contiguous();
  const auto sc = scale.to(at::kHalf).contiguous(), mn = min.to(at::kHalf).contiguous();
  auto out = at::empty({n / 16, groups, Q4_BLOCK}, codes.options());
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(mn.data_ptr());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* o = op + (b * groups + g) * Q4_BLOCK;
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t row = b * 16 + j;
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t* q = cp + row * k + g * 32 + 8 * i;
            uint8_t* lane = o + i * 64 + j * 4;
            lane[0] = (q[0] & 15) | (q[2] & 15) << 4;
            lane[1] = (q[4] & 15) | (q[6] & 15) << 4;
            lane[2] = (q[1] & 15) | (q[3] & 15) << 4;
            lane[3] = (q[5] & 15) | (q[7] & 15) << 4;
          }
          std::memcpy(o + 256 + 2 * j, sp + row * groups + g, 2);
          std::memcpy(o + 288 + 2 * j, mp + row * groups + g, 2);
        }
      }
  });
  return out;
}

inline float half_bits_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Code r (0..7) of input group vector i, lane j: where q4_pack put input 8i + r of row j.
inline int q4_code(const uint8_t* block, int64_t i, int64_t j, int r) {
  static constexpr int byte_of[8] = {0, 2, 0, 2, 1, 3, 1, 3}, shift_of[8] = {0, 0, 4, 4, 0, 0, 4, 4};
  return (block[i * 64 + j * 4 + byte_of[r]] >> shift_of[r]) & 15;
}

// The one rounding of a q4_linear output: y = bf16(sum + bias), bias per column (or none).
inline uint16_t q4_out(float sum, const float* bias, int64_t col) {
  return BF16::st(bias != nullptr ? sum + bias[col] : sum);
}

// y[m][n] for blocks [b0, b1) without vector intrinsics: any CPU, and the tests' reference for
// the layout. fp32 arithmetic on the same bfloat16 inputs; differs from the fast path in
// summation order only. y and bias are indexed by global column (bias may be null).
void q4_rows_portable(const uint16_t* x, int64_t rows, int64_t k, const uint8_t* w, int64_t b0, int64_t b1,
                      const float* bias, uint16_t* y, int64_t ldy) {
  const int64_t groups = k / 32;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < 16; ++j) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* block = w + (b * groups + g) * Q4_BLOCK;
          const uint16_t* xg = x + m * k + g * 32;
          float dot = 0.0f, sum = 0.0f;
          for (int64_t i = 0; i < 4; ++i)
            for (int r = 0; r < 8; ++r) {
              const float xv = BF16::ld(xg[8 * i + r]);
              dot += static_cast<float>(q4_code(block, i, j, r)) * xv;
              sum += xv;
            }
          uint16_t s, mn;
          std::memcpy(&s, block + 256 + 2 * j, 2);
          std::memcpy(&mn, block + 288 + 2 * j, 2);
          total += half_bits_to_float(s) * dot + half_bits_to_float(mn) * sum;
        }
        y[m * ldy + b * 16 + j] = q4_out(total, bias, b * 16 + j);
      }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TINYLLM_Q4_BF16DOT 1

// MT rows x NB blocks of 16 outputs. Per group: two bf16-dot accumulators per (row, block) (two
// dependency chains each, so the dot unit never waits on its own latency), then
// acc += scale * dot + (min - 128 scale) * sum(x over the group).
// Prefetches the same group of the next tile (``ahead`` bytes on) while computing this one: in a
// one-row step the weights stream from memory, and the hardware prefetcher alone left the loop
// waiting on it.
// y and bias point at the tile's first column (bias may be null).
template <int MT, int NB>
inline void q4_tile(const uint16_t* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* w,
                    int64_t bstride, const float* bias, uint16_t* y, int64_t ldy, int64_t ahead, const uint8_t* end) {
  __m512 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(0x000F000F), magic = _mm512_set1_epi32(0x43004300);
  const __m512 c128 = _mm512_set1_ps(128.0f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = w + g * Q4_BLOCK;
    for (int b = 0; b < NB; ++b) {
      const uint8_t* next = gp + b * bstride + ahead;
      if (next + Q4_BLOCK <= end)
        for (int l = 0; l < Q4_BLOCK; l += 64) _mm_prefetch(reinterpret_cast<const char*>(next + l), _MM_HINT_T0);
    }
    __m512 d0[MT][NB], d1[MT][NB];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) d0[m][b] = d1[m][b] = _mm512_setzero_ps();
    const uint16_t* xg = x + g * 32;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      for (int b = 0; b < NB; ++b) {
        const __m512i v = _mm512_loadu_si512(gp + b * bstride + i * 64);
        // (v >> s) & 0x000F000F | 0x43004300: bf16 (128 + q_a, 128 + q_b) in each 32-bit lane
        const __m512bh p0 = (__m512bh)_mm512_ternarylogic_epi32(v, mask, magic, 0xEA);
        const __m512bh p1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 4), mask, magic, 0xEA);
        const __m512bh p2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 8), mask, magic, 0xEA);
        const __m512bh p3 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 12), mask, magic, 0xEA);
        for (int m = 0; m < MT; ++m) {
          int32_t pair[4];  // x at inputs (8i, 8i+1), (8i+2, 8i+3), ...: the order the lanes hold q in
          std::memcpy(pair, xg + m * ldx + 8 * i, sizeof pair);
          d0[m][b] = _mm512_dpbf16_ps(d0[m][b], p0, (__m512bh)_mm512_set1_epi32(pair[0]));
          d1[m][b] = _mm512_dpbf16_ps(d1[m][b], p1, (__m512bh)_mm512_set1_epi32(pair[1]));
          d0[m][b] = _mm512_dpbf16_ps(d0[m][b], p2, (__m512bh)_mm512_set1_epi32(pair[2]));
          d1[m][b] = _mm512_dpbf16_ps(d1[m][b], p3, (__m512bh)_mm512_set1_epi32(pair[3]));
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint8_t* sp = gp + b * bstride + 256;
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 32)));
      const __m512 off = _mm512_fnmadd_ps(c128, s, mn);  // min - 128 scale
      for (int m = 0; m < MT; ++m) {
        acc[m][b] = _mm512_fmadd_ps(s, _mm512_add_ps(d0[m][b], d1[m][b]), acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(off, _mm512_set1_ps(xsum[m * groups + g]), acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) {
      alignas(64) float sums[16];
      _mm512_store_ps(sums, acc[m][b]);
      for (int j = 0; j < 16; ++j) y[m * ldy + b * 16 + j] = q4_out(sums[j], bias, b * 16 + j);
    }
}

// Rows [0, MT) of x against blocks [b0, b1): tiles of NB blocks (as many as the registers hold
// for MT rows), then single blocks.
template <int MT>
void q4_row_tile(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* w, int64_t b0, int64_t b1,
                 int64_t end_block, const float* bias, uint16_t* y, int64_t ldy) {
  constexpr int NB = MT == 4 ? 2 : 4;
  const int64_t groups = k / 32, bstride = groups * Q4_BLOCK;
  const uint8_t* end = w + end_block * bstride;
  auto tile_bias = [&](int64_t b) { return bias != nullptr ? bias + b * 16 : nullptr; };
  int64_t b = b0;
  for (; b + NB <= b1; b += NB)
    q4_tile<MT, NB>(x, k, xsum, groups, w + b * bstride, bstride, tile_bias(b), y + b * 16, ldy, NB * bstride, end);
  for (; b < b1; ++b)
    q4_tile<MT, 1>(x, k, xsum, groups, w + b * bstride, bstride, tile_bias(b), y + b * 16, ldy, bstride, end);
}

// y and bias are indexed by global column (bias may be null).
void q4_rows_fast(const uint16_t* x, int64_t rows, int64_t k, const float* xsum, const uint8_t* w, int64_t b0,
                  int64_t b1, int64_t end_block, const float* bias, uint16_t* y, int64_t ldy) {
  const int64_t groups = k / 32;
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4)
    q4_row_tile<4>(x + m * k, k, xsum + m * groups, w, b0, b1, end_block, bias, y + m * ldy, ldy);
  for (; m + 2 <= rows; m += 2)
    q4_row_tile<2>(x + m * k, k, xsum + m * groups, w, b0, b1, end_block, bias, y + m * ldy, ldy);
  for (; m < rows; ++m) q4_row_tile<1>(x + m * k, k, xsum + m * groups, w, b0, b1, end_block, bias, y + m * ldy, ldy);
}
#endif


// ---- panel_linear: tinyllm's own float32 matmul ---------------------------------------------

// y [M, N] = x [M, K] @ w^T (+ bias), w as panel_pack laid it out: column panels of PANEL_NR
// outputs, each stored k-major ([K][PANEL_NR]; the last, partial one [K][N % PANEL_NR]), in
// float32 or bfloat16. Why: a decode step multiplies a few rows by every weight, and is bound by
// reading the weights once; oneDNN's packed matmul streams them at about a third of the memory
// bandwidth at 1-16 rows (model/gemm.py). Here each panel is read once per chunk of rows,
// sequentially, and a 6-row x PANEL_NR register tile accumulates all K products in float32.
// On AVX-512 float32 weights (and bfloat16 ones with AVX512-BF16) take the wide tile below
// instead (wide_panels); this one serves AVX2, and bfloat16 on AVX-512 without BF16.
// bfloat16 weights (half the bytes to read) widen exactly to float32: on load for up to 3 rows,
// else once per panel and chunk into a buffer. Rows arrive and leave float32.
// Thread t takes a contiguous range of panels, so each weight byte is read by one thread.
#if defined(__AVX512F__) || defined(__AVX2__)
constexpr const char* kPanelIsa = kLanes == 16 ? "avx512" : "avx2";
constexpr int64_t PANEL_NR = 2 * kLanes;
constexpr int64_t PANEL_MR = 6;  // 6 x 2 accumulators + 2 weight vectors + 1 broadcast fit 16 AVX2 registers
// Rows per chunk: the chunk's x rows (read once per panel) stay in L2/L3 while its panels stream.
constexpr int64_t PANEL_CHUNK_BYTES = 2 << 20;

template <int64_t R, typename W>
inline void panel_tile(const float* x, int64_t k_len, const W* w, const float* bias, float* y, int64_t ldy,
                       int64_t cols) {
  VecF lo[R], hi[R];
  for (int64_t r = 0; r < R; ++r) lo[r] = hi[r] = vzero();
  for (int64_t k = 0; k < k_len; ++k) {
    const VecF w0 = vload(w + k * PANEL_NR), w1 = vload(w + k * PANEL_NR + kLanes);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 8) * PANEL_NR), _MM_HINT_T0);
    for (int64_t r = 0; r < R; ++r) {
      const VecF a = vset1(x[r * k_len + k]);
      lo[r] = vfma(a, w0, lo[r]);
      hi[r] = vfma(a, w1, hi[r]);
    }
  }
  // Whole-register stores only: an element-wise epilogue makes GCC keep the accumulators in
  // memory through the k loop (measured 2x slower).
  if (bias) {
    const VecF b0 = vload(bias), b1 = vload(bias + kLanes);
    for (int64_t r = 0; r < R; ++r) {
      lo[r] = vadd(lo[r], b0);
      hi[r] = vadd(hi[r], b1);
    }
  }
  if (cols == PANEL_NR) {
    for (int64_t r = 0; r < R; ++r) {
      vstore(y + r * ldy, lo[r]);
      vstore(y + r * ldy + kLanes, hi[r]);
    }
    return;
  }
  alignas(64) float out[PANEL_NR];
  for (int64_t r = 0; r < R; ++r) {
    vstore(out, lo[r]);
    vstore(out + kLanes, hi[r]);
    std::memcpy(y + r * ldy, out, cols * sizeof(float));
  }
}

template <typename W>
inline void panel_rows(int64_t rows, const float* x, int64_t k_len, const W* w, const float* bias, float* y,
                       int64_t ldy, int64_t cols) {
  switch (rows) {
    case 6: return panel_tile<6>(x, k_len, w, bias, y, ldy, cols);
    case 5: return panel_tile<5>(x, k_len, w, bias, y, ldy, cols);
    case 4: return panel_tile<4>(x, k_len, w, bias, y, ldy, cols);
    case 3: return panel_tile<3>(x, k_len, w, bias, y, ldy, cols);
    case 2: return panel_tile<2>(x, k_len, w, bias, y, ldy, cols);
    default: return panel_tile<1>(x, k_len, w, bias, y, ldy, cols);
  }
}

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
          for (int64_t r = m0; r < m1; r += PANEL_MR)
            panel_rows(std::min<int64_t>(PANEL_MR, m1 - r), x + r * k_len, k_len, w + p * PANEL_NR * k_len, b,
                       y + r * n + p * PANEL_NR, n, cols);
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
#else
constexpr const char* kPanelIsa = "";
constexpr int64_t PANEL_NR = 16;
#endif

// ---- panel_linear's AVX-512 tile: float32 FMAs and bfloat16 dot products ---------------------
//
// On AVX-512 a float32 weight, and a bfloat16 one with an even K, are packed for a wider tile
// than panel_tile's: column panels of WIDE_NR outputs, each stored step-major
// ([K / S][cols][S], S = the inputs one instruction takes per output: 1 for a float32 FMA, 2 for
// vdpbf16ps or a widened pair, so a 512-bit load holds 16 outputs' weights for one step), the last panel
// [K / S][N % WIDE_NR][S]. A kTileRows-row x WIDE_NR register tile (24 of AVX-512's 32 registers;
// 3 weight vectors; one broadcast of the row's step) runs a K block; vdpbf16ps takes 32 products
// per instruction, twice an FMA's, at half the bytes. 8 x 48 ran 5-15% ahead of 6 x 64, 12 x 32
// and 9 x 48 from 4 to 1024 rows (Zen 4, bfloat16). Why: on the 135M model's fused layers (Zen 4,
// 2 cores) oneDNN's bfloat16 matmul runs 1.1-1.3x below this tile at 1-64 rows and level at
// 256-1460; in float32 oneDNN runs 1.25-1.4x below it at 1-32 rows, 1.04-1.14x at 64-1460
// (docs/performance.md).
// Each bfloat16 product is exact in float32 and every sum is float32 in k order (vdpbf16ps also
// flushes subnormal inputs and results to zero): F.linear in float32 up to summation order,
// rounded once to the output's dtype. K runs in blocks of WIDE_KC (one panel's block, 96-192 KB,
// stays in L2 while every row tile reads it), float32 partial sums kept between blocks; a row's
// output does not depend on the rows beside it.
// x enters in the dtype the tile multiplies: the weight's (on vdpbf16ps a bfloat16 panel rounds a
// float32 x to bfloat16: the products are bfloat16's; a float32 panel widens a bfloat16 x
// exactly), float32 for widened bfloat16 panels (x as given); the output is x's dtype.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TINYLLM_PANEL_WIDE 1
constexpr int64_t WIDE_NR = 48, WIDE_KC = 1024;  // rows per tile: kTileRows

template <typename W>
constexpr int64_t wide_step() { return std::is_same_v<W, F32> ? 1 : 2; }

// The rows' element type for weights W: W's own, except bfloat16 panels without AVX512-BF16,
// whose rows are float32 (panel_linear widens them once per call, exactly): there each 512-bit
// load of weight pairs becomes two float32 vectors (the even step's weights shifted up, the odd
// step's masked: one instruction each) and the row's two inputs are broadcast into FMAs.
template <typename W>
struct WideX {
  using T = typename W::T;
};
#if !defined(__AVX512BF16__)
template <>
struct WideX<BF16> {
  using T = float;
};
#endif

// Lanes [0, cols) of a 16-output block: as 16 float32 outputs, and as their 32 bfloat16 weights.
inline __mmask16 wide_mask(int64_t cols) { return cols >= 16 ? ~__mmask16(0) : (__mmask16(1) << cols) - 1; }
inline __mmask32 wide_mask2(int64_t cols) { return cols >= 16 ? ~__mmask32(0) : (__mmask32(1) << (2 * cols)) - 1; }

// BF16::st on 16 lanes, bit for bit (subnormals kept): the integer form.
inline __m256i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// 16 float32 to bfloat16 bits, rounded to nearest even as BF16::st (vcvtneps2bf16 also flushes
// subnormals to zero). Without AVX512-BF16 the integer form, which a tile calls out of line
// (wide_store_bf16).
inline __m256i wide_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return bf16_bits16(v);
#endif
}

#if !defined(__AVX512BF16__)
// rows x cols float32 (rows ld apart) -> bfloat16 y (rows ldy apart), rounded as wide_bf16. Out of
// line: inlined into a tile, the rounding's constants made GCC keep the accumulators in memory
// through the whole k loop (one store per accumulator and step pair).
[[gnu::noinline]] void wide_store_bf16(const float* v, int64_t ld, int rows, int64_t cols, uint16_t* y, int64_t ldy) {
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 mk = wide_mask(cols - c);
    for (int r = 0; r < rows; ++r)
      _mm256_mask_storeu_epi16(y + r * ldy + c, mk, wide_bf16(_mm512_loadu_ps(v + r * ld + c)));
  }
}
#endif

// R rows x NB blocks of 16 outputs over steps [0, steps) of one panel block (wld: elements per
// step). part holds the float32 sums between K blocks (first: start from zero; last: add bias,
// round, store y). cols < NB * 16 only in the last panel (masked loads and stores). The first row
// tile of a block prefetches the weights 16 steps ahead into L1 (pf; the others find them in L2),
// and every tile prefetches its share of the next block (nx: see NextShare, wide_rows).
template <int R, int NB, typename W, typename O>
[[gnu::always_inline]] inline void wide_tile(const typename WideX<W>::T* x, int64_t ldx, int64_t steps, const typename W::T* w, int64_t wld,
                      int64_t cols, float* part, bool first, bool last, const float* bias, typename O::T* y,
                      int64_t ldy, bool pf, NextShare nx) {
  constexpr int64_t S = wide_step<W>();
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      acc[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * WIDE_NR + b * 16);
  const bool full = cols == NB * 16;
#if !defined(__AVX512BF16__)
  __mmask16 pair_mask[NB];  // the block's whole pairs (one per 32-bit lane)
  __mmask32 odd_mask[NB];   // their odd halves
  for (int b = 0; b < NB; ++b) {
    pair_mask[b] = wide_mask(cols - b * 16);
    odd_mask[b] = wide_mask2(cols - b * 16) & 0xAAAAAAAAu;
  }
#endif
  if constexpr (S == 1) {
    // The step loop with whether the block is full and whether to prefetch fixed at compile time:
    // tested inside it, each step also ran two compares and branches beside its 24 FMAs (1.09x
    // at 64 rows, 1.15x at 1,460 on Ice Lake, medians of 8 interleaved runs).
    auto run = [&]<bool Full, bool Pf, bool Next>() __attribute__((always_inline)) {
      NextShare next = nx;  // a local copy the loop can keep in registers
      for (int64_t st = 0; st < steps; ++st) {
        const float* wk = w + st * wld;
        if constexpr (Pf)
          for (int b = 0; b < NB; ++b) _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * wld + b * 16), _MM_HINT_T0);
        if constexpr (Next) next.advance();
        __m512 wv[NB];
        for (int b = 0; b < NB; ++b)
          wv[b] = Full ? _mm512_loadu_ps(wk + b * 16) : _mm512_maskz_loadu_ps(wide_mask(cols - b * 16), wk + b * 16);
        for (int r = 0; r < R; ++r) {
          const __m512 a = _mm512_set1_ps(x[r * ldx + st]);
          for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(a, wv[b], acc[r][b]);
        }
      }
    };
    auto go = [&]<bool Next>() __attribute__((always_inline)) {
      if (full)
        pf ? run.template operator()<true, true, Next>() : run.template operator()<true, false, Next>();
      else
        pf ? run.template operator()<false, true, Next>() : run.template operator()<false, false, Next>();
    };
    nx.on() ? go.template operator()<true>() : go.template operator()<false>();
  } else {
    NextShare next = nx;
    for (int64_t st = 0; st < steps; ++st) {
      const typename W::T* wk = w + st * wld;
      if (pf)
        for (int b = 0; b < NB; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * wld + b * 16 * S), _MM_HINT_T0);
      if (next.on()) next.advance();
#if defined(__AVX512BF16__)
      __m512bh wv[NB];
      for (int b = 0; b < NB; ++b) {
        wv[b] = (__m512bh)(full ? _mm512_loadu_si512(wk + b * 32)
                                : _mm512_maskz_loadu_epi16(wide_mask2(cols - b * 16), wk + b * 32));
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // x at inputs 2 st, 2 st + 1
        std::memcpy(&pair, x + r * ldx + 2 * st, sizeof pair);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv[b], a);
      }
#else
      // Two float32 passes over the step's weight pairs, even input then odd (each accumulator
      // still sums in k order). Each pass loads the pairs (the second from L1): the even weights
      // shifted up, the odd ones by a load that zeroes the low halves, so only 3 weight vectors
      // are live beside the 24 accumulators. The masks are made once, before the loop.
      __m512 wv[NB];
      for (int b = 0; b < NB; ++b)
        wv[b] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_loadu_epi32(pair_mask[b], wk + b * 32), 16));
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * ldx + 2 * st]);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(a, wv[b], acc[r][b]);
      }
      for (int b = 0; b < NB; ++b) wv[b] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(odd_mask[b], wk + b * 32));
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * ldx + 2 * st + 1]);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(a, wv[b], acc[r][b]);
      }
#endif
    }
  }
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(part + r * WIDE_NR + b * 16, acc[r][b]);
    return;
  }
#if !defined(__AVX512BF16__)
  if constexpr (std::is_same_v<O, BF16>) {  // rounded out of line: see wide_bf16
    alignas(64) float out[R][NB * 16];
    for (int b = 0; b < NB; ++b) {
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(wide_mask(cols - b * 16), bias + b * 16) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) _mm512_store_ps(&out[r][b * 16], _mm512_add_ps(acc[r][b], bv));
    }
    wide_store_bf16(&out[0][0], NB * 16, R, cols, y, ldy);
    return;
  }
#endif
  for (int b = 0; b < NB; ++b) {
    const __mmask16 mk = wide_mask(cols - b * 16);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_add_ps(acc[r][b], bv);
      if constexpr (std::is_same_v<O, F32>)
        _mm512_mask_storeu_ps(y + r * ldy + b * 16, mk, v);
      else
        _mm256_mask_storeu_epi16(y + r * ldy + b * 16, mk, wide_bf16(v));
    }
  }
}

// Every row over one panel block, in tiles of up to kTileRows. With 2-32 tiles and the next
// block's weights right after this one's (next_follows), each tile prefetches 1 / tiles of them
// into L2 as it goes: without it the first tile of each block waited on memory and the others
// computed from L2 after it, one after the other; with it the stream runs under all of them
// (in-process A/B on Ice Lake, 30 layers of 135M weights, 16-40 alternations: float32 1.13x /
// 1.25x / 1.20x / 1.02x at 16 / 32 / 64 / 256 rows, 1.08-1.19x at the 1.5b shape; bfloat16
// widened 1.13x / 1.12x / 1.06x at 16 / 32 / 64). One tile is bound by the stream anyway (no
// change), and past 32 tiles (prompts) it lost 2-3%: left off there.
template <int NB, typename W, typename O>
void wide_rows(int64_t rows, const typename WideX<W>::T* x, int64_t ldx, int64_t steps, const typename W::T* w, int64_t wld,
               int64_t cols, float* part, bool first, bool last, const float* bias, typename O::T* y, int64_t ldy,
               bool next_follows) {
  static_assert(kTileRows == 8, "one case per tile height");
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const bool share_next = next_follows && tiles >= 2 && tiles <= 32;
  const int64_t bytes = steps * wld * int64_t(sizeof(typename W::T));
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const typename WideX<W>::T* xr = x + r * ldx;
    float* pr = part + r * WIDE_NR;
    typename O::T* yr = y + r * ldy;
    const bool pf = r == 0;
    const NextShare nx(share_next ? w + steps * wld : nullptr, bytes, rows, r, steps);
    switch (std::min<int64_t>(kTileRows, rows - r)) {
      case 8: wide_tile<8, NB, W, O>(xr, ldx, steps, w, wld, cols, pr, first, last, bias, yr, ldy, pf, nx); break;
      case 7: wide_tile<7, NB, W, O>(xr, ldx, steps, w, wld, cols, pr, first, last, bias, yr, ldy, pf, nx); break;
      case 6: wide_tile<6, NB, W, O>(xr, ldx, steps, w, wld, cols, pr, first, last, bias, yr, ldy, pf, nx); break;
      case 5: wide_tile<5, NB, W, O>(xr, ldx, steps, w, wld, cols, pr, first, last, bias, yr, ldy, pf, nx); break;
      case 4: wide_tile<4, NB, W, O>(xr, ldx, steps, w, wld, cols, pr, first, last, bias, yr, ldy, pf, nx); break;
      case 3: wide_tile<3, NB, W, O>(xr, ldx, steps, w, wld, cols, pr, first, last, bias, yr, ldy, pf, nx); break;
      case 2: wide_tile<2, NB, W, O>(xr, ldx, steps, w, wld, cols, pr, first, last, bias, yr, ldy, pf, nx); break;
      default: wide_tile<1, NB, W, O>(xr, ldx, steps, w, wld, cols, pr, first, last, bias, yr, ldy, pf, nx); break;
    }
  }
}

// y [M, N] (ldy = N) = x [M, K] (rows ldx apart) @ w^T (+ bias), w given block by block:
// block(p, k0, kl, cols) returns panel p's weights for inputs [k0, k0 + kl) in the tile's
// step-major order (S * cols elements per step). Thread t takes a contiguous range of panels: each
// weight byte is read from memory once. contiguous: each block starts where the one before it
// ends (panel_pack's layout), so the tiles can prefetch the next one (wide_rows); never past the
// thread's last block.
template <typename W, typename O, typename Block>
void wide_blocks(const typename WideX<W>::T* x, int64_t ldx, int64_t m, int64_t k, int64_t n, const float* bias,
                 typename O::T* y, bool contiguous, Block&& block) {
  constexpr int64_t S = wide_step<W>();
  const int64_t panels = (n + WIDE_NR - 1) / WIDE_NR;
  const int64_t grain = m * k * n < (1 << 16) ? panels : 1;  // a fork costs more than a tiny product
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    float* part = k > WIDE_KC ? scratch(kWidePart, m * WIDE_NR) : nullptr;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(WIDE_NR, n - p * WIDE_NR);
      const float* b = bias ? bias + p * WIDE_NR : nullptr;
      for (int64_t k0 = 0; k0 < k; k0 += WIDE_KC) {
        const int64_t kl = std::min<int64_t>(WIDE_KC, k - k0);
        const bool first = k0 == 0, last = k0 + kl == k;
        const typename W::T* wb = block(p, k0, kl, cols);
        auto run = [&](auto nb) {
          wide_rows<decltype(nb)::value, W, O>(m, x + k0, ldx, kl / S, wb, S * cols, cols, part, first, last, b,
                                                y + p * WIDE_NR, n, contiguous && !(last && p + 1 == p1));
        };
        switch ((cols + 15) / 16) {
          case 3: run(std::integral_constant<int, 3>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          default: run(std::integral_constant<int, 1>{}); break;
        }
      }
    }
  });
}

// wide_blocks over w as panel_pack laid it out.
template <typename W, typename O>
void wide_matmul(const typename WideX<W>::T* x, int64_t ldx, int64_t m, int64_t k, const typename W::T* w, int64_t n,
                 const float* bias, typename O::T* y) {
  wide_blocks<W, O>(x, ldx, m, k, n, bias, y, true, [&](int64_t p, int64_t k0, int64_t, int64_t cols) {
    return w + p * WIDE_NR * k + k0 * cols;
  });
}
#endif

// The step panel_pack lays w out for wide_matmul: 1 (float32), 2 (bfloat16 with an even K), or 0:
// panel_matmul's panels. panel_linear asks the same.
inline int64_t wide_panels(const at::Tensor& w) {
#if defined(TINYLLM_PANEL_WIDE)
  if (w.scalar_type() == at::kFloat) return 1;
  if (w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0) return 2;
#endif
  return 0;
}

// The vector width panel_linear was built for: "avx512", "avx2", or "" where it cannot run; with
// "-bf16" where bfloat16 weights run on bfloat16 dot products.
std::string panel_isa() {
#if defined(TINYLLM_PANEL_WIDE) && defined(__AVX512BF16__)
  return std::string(kPanelIsa) + "-bf16";
#else
  return kPanelIsa;
#endif
}

#if defined(TINYLLM_PANEL_WIDE)
// The wide panels' layout, [N / WIDE_NR][K / st][WIDE_NR][st] then the last [K / st][N % WIDE_NR][st],
// moved in 32-bit units (st inputs of one output: a float32, or a bfloat16 pair): each panel is a
// transpose of its rows' units, done 64 steps at a time so the block being turned stays in L1,
// panels split over the threads. torch's copy_ of the permuted view moved 4-byte pieces one
// element pair at a time: 6.5 s of a 1.5B bfloat16 model's 11.6 s load on 2 Zen 4 cores.
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
#endif

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

// ---- the 4-bit matmul on float32 FMAs (CPUs without AVX512-BF16) ---------------------------
//
// Without bfloat16 dot instructions (AVX2 CPUs such as AMD Zen 2/3, AVX-512 without BF16 such as
// Intel Skylake-SP to Ice Lake) q4_pack's blocks run through the panel matmul's float32 tile:
// a panel of PANEL_NR outputs is PANEL_NR / 16 blocks. Each weight is decoded to float32 as
// w = (128 + q) * scale + (min - 128 scale) (q4_code128), and the tile accumulates x * w over k
// in order, as panel_tile does over a float32 panel.
// Up to 4 rows (a single stream's step, a speculative verify step) decode in registers on the
// way to the FMAs; more rows decode each panel once per row chunk into a float32 buffer in
// L1/L2 and run panel_tile over it, so the decode is shared by every row tile (at 4 rows the
// buffer's fixed cost was 2x the in-register path on Zen 3; at 6 the two were level).
// Both decode to the same float32 weight and sum in the same order: a row's output does not
// depend on how many rows share its step (so speculative decoding's verify step of k + 1 rows
// reproduces plain decoding's one-row steps exactly).
#if !defined(TINYLLM_Q4_BF16DOT) && (defined(__AVX512F__) || defined(__AVX2__))
#define TINYLLM_Q4_FLOAT 1
#if defined(__AVX512F__)
using VecI = __m512i;
inline VecI vloadi(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VecF vhalves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
template <int S> inline VecI vshift(VecI v) { return S > 0 ? _mm512_slli_epi32(v, S) : _mm512_srli_epi32(v, -S); }
inline VecF vor_and(VecI v, int32_t mask, int32_t bits) {
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(mask)), _mm512_set1_epi32(bits)));
}
#else
using VecI = __m256i;
inline VecI vloadi(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecF vhalves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <int S> inline VecI vshift(VecI v) { return S > 0 ? _mm256_slli_epi32(v, S) : _mm256_srli_epi32(v, -S); }
inline VecF vor_and(VecI v, int32_t mask, int32_t bits) {
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(mask)), _mm256_set1_epi32(bits)));
}
#endif

// Where a panel's two halves of kLanes outputs live in q4_pack's blocks: with AVX2 (8 lanes) both
// halves are one block (lanes 0-7 at byte 0 of each 64-byte code vector and scale array, 8-15
// at byte 32 / 16); with AVX-512 (16 lanes) each half is a whole block, the second one bstride on.
struct Q4Panel {
  const uint8_t* lo;  // the lower half's first group
  int64_t hi;         // bytes from a lower-half address to the same upper-half one
  int64_t hi_half;    // the same for the float16 scale / min arrays
};
inline Q4Panel q4_panel(const uint8_t* w, int64_t p, int64_t bstride) {
  return kLanes == 8 ? Q4Panel{w + p * bstride, 32, 16} : Q4Panel{w + 2 * p * bstride, bstride, bstride};
}

// Code r of input group vector i: lane j's bits at (0, 16, 4, 20, 8, 24, 12, 28)[r] (q4_pack).
// Moved to bits 16..19 and OR'd with 0x43000000 it is the float32 128 + q exactly (exponent 7:
// mantissa bit 16 counts ones): a shift, an AND and an OR, where converting the integer would
// take a shift, an AND and a conversion on the FP pipes that the FMAs and stores also need.
// The 128 folds into the offset: w = (128 + q) * scale + (min - 128 scale).
constexpr int kQ4CodeAt[8] = {0, 16, 4, 20, 8, 24, 12, 28};
template <int R>
inline VecF q4_code128(VecI v) {
  constexpr int shift = 16 - kQ4CodeAt[R];
  if constexpr (shift != 0) v = vshift<shift>(v);
  return vor_and(v, 0x000F0000, 0x43000000);
}

// Calls fn.template operator()<R>() for R = 0..7: the eight inputs of a code vector, unrolled
// (the shifts need their counts at compile time).
template <typename F>
inline void for_codes(const F& fn) {
  [&]<int... R>(std::integer_sequence<int, R...>) { (fn.template operator()<R>(), ...); }(std::make_integer_sequence<int, 8>{});
}

// The panel as float32 [K][PANEL_NR] into buf, one whole k row at a time (both halves: writing
// the halves in two passes left each line to be fetched twice once the buffer outgrew L1).
// ``halves`` 1 leaves the upper half zero (the partial last panel of an AVX-512 build, one block).
[[gnu::noinline]] void q4_decode_panel(const Q4Panel& pn, int64_t groups, int halves, float* buf) {
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = pn.lo + g * Q4_BLOCK;
    const VecF s0 = vhalves(gp + 256), m0 = vfma(vset1(-128.0f), s0, vhalves(gp + 288));
    const VecF s1 = halves == 2 ? vhalves(gp + 256 + pn.hi_half) : vzero();
    const VecF m1 = halves == 2 ? vfma(vset1(-128.0f), s1, vhalves(gp + 288 + pn.hi_half)) : vzero();
    float* out = buf + g * 32 * PANEL_NR;
    for (int i = 0; i < 4; ++i) {
      const VecI v0 = vloadi(gp + i * 64), v1 = halves == 2 ? vloadi(gp + pn.hi + i * 64) : v0;
      for_codes([&]<int R>() {
        float* row = out + (8 * i + R) * PANEL_NR;
        vstore(row, vfma(q4_code128<R>(v0), s0, m0));
        vstore(row + kLanes, vfma(q4_code128<R>(v1), s1, m1));  // 0 * q + 0 for a missing half
      });
    }
  }
}

// R (<= 4) rows x one full panel, decoding the 4-bit codes in registers: panel_tile's arithmetic
// (the same float32 weights, the same order), without a buffer. Prefetches two groups ahead.
// Out of line, as q4_decode_panel: each call is a whole panel, and inlined into the parallel
// lambda's four row counts the register allocation only gets harder.
template <int64_t R>
[[gnu::noinline]] void q4_direct_tile(const float* x, int64_t k_len, const Q4Panel& pn, const float* bias, float* y, int64_t ldy) {
  VecF lo[R], hi[R];
  for (int64_t r = 0; r < R; ++r) lo[r] = hi[r] = vzero();
  for (int64_t g = 0; g < k_len / 32; ++g) {
    const uint8_t* gp = pn.lo + g * Q4_BLOCK;
    for (int l = 0; l < Q4_BLOCK; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(gp + 2 * Q4_BLOCK + l), _MM_HINT_T0);
      if (kLanes == 16) _mm_prefetch(reinterpret_cast<const char*>(gp + pn.hi + 2 * Q4_BLOCK + l), _MM_HINT_T0);
    }
    const VecF s0 = vhalves(gp + 256), m0 = vfma(vset1(-128.0f), s0, vhalves(gp + 288));
    const VecF s1 = vhalves(gp + 256 + pn.hi_half), m1 = vfma(vset1(-128.0f), s1, vhalves(gp + 288 + pn.hi_half));
    const float* xg = x + g * 32;
    for (int i = 0; i < 4; ++i) {
      const VecI v0 = vloadi(gp + i * 64), v1 = vloadi(gp + pn.hi + i * 64);
      for_codes([&]<int C>() {
        const VecF w0 = vfma(q4_code128<C>(v0), s0, m0);
        const VecF w1 = vfma(q4_code128<C>(v1), s1, m1);
        for (int64_t r = 0; r < R; ++r) {
          const VecF a = vset1(xg[r * k_len + 8 * i + C]);
          lo[r] = vfma(a, w0, lo[r]);
          hi[r] = vfma(a, w1, hi[r]);
        }
      });
    }
  }
  if (bias) {  // as panel_tile: the bias after the sum
    const VecF b0 = vload(bias), b1 = vload(bias + kLanes);
    for (int64_t r = 0; r < R; ++r) {
      lo[r] = vadd(lo[r], b0);
      hi[r] = vadd(hi[r], b1);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    vstore(y + r * ldy, lo[r]);
    vstore(y + r * ldy + kLanes, hi[r]);
  }
}

// y [m, n] bfloat16 = x [m, K] float32 @ w^T (+ bias), w as q4_pack made it; panel_matmul's
// threading and row chunks. Each panel's float32 sums go to a small per-thread tile
// ([chunk rows][PANEL_NR]) and are rounded once into y there: no float32 [m, n] result and no
// second pass over it (a one-row step's matmul is a few microseconds of work; the copies and
// allocations around it were a third of its time).
void q4_float_matmul(const float* x, int64_t m, int64_t k_len, const uint8_t* w, int64_t n, const float* bias,
                     uint16_t* y) {
  const int64_t groups = k_len / 32, bstride = groups * Q4_BLOCK, blocks = n / 16;
  const int64_t panels = (n + PANEL_NR - 1) / PANEL_NR, full = n / PANEL_NR;
  const int64_t chunk = std::max<int64_t>(PANEL_MR, PANEL_CHUNK_BYTES / (k_len * 4) / PANEL_MR * PANEL_MR);
  const int64_t grain = m * k_len * n < (1 << 16) ? panels : 1;
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    float* out = scratch(kTileOut, std::min(m, chunk) * PANEL_NR);
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
      const int64_t m1 = std::min(m, m0 + chunk);
      for (int64_t p = p0; p < p1; ++p) {
        const Q4Panel pn = q4_panel(w, p, bstride);
        const int64_t cols = std::min<int64_t>(PANEL_NR, n - p * PANEL_NR);
        alignas(64) float tail_bias[PANEL_NR] = {};
        if (bias && cols < PANEL_NR) std::memcpy(tail_bias, bias + p * PANEL_NR, cols * sizeof(float));
        const float* b = !bias ? nullptr : cols < PANEL_NR ? tail_bias : bias + p * PANEL_NR;
        if (p < full && m1 - m0 <= 4) {
          const float* xp = x + m0 * k_len;
          if (m1 - m0 == 4) q4_direct_tile<4>(xp, k_len, pn, b, out, PANEL_NR);
          else if (m1 - m0 == 3) q4_direct_tile<3>(xp, k_len, pn, b, out, PANEL_NR);
          else if (m1 - m0 == 2) q4_direct_tile<2>(xp, k_len, pn, b, out, PANEL_NR);
          else q4_direct_tile<1>(xp, k_len, pn, b, out, PANEL_NR);
        } else {
          float* wbuf = scratch(kPanelBuf, k_len * PANEL_NR);
          q4_decode_panel(pn, groups, p < full ? 2 : static_cast<int>(blocks - 2 * p), wbuf);
          for (int64_t r = m0; r < m1; r += PANEL_MR)
            panel_rows(std::min<int64_t>(PANEL_MR, m1 - r), x + r * k_len, k_len, wbuf, b,
                       out + (r - m0) * PANEL_NR, PANEL_NR, cols);
        }
        for (int64_t r = m0; r < m1; ++r)
          for (int64_t c = 0; c < cols; ++c) y[r * n + p * PANEL_NR + c] = BF16::st(out[(r - m0) * PANEL_NR + c]);
      }
    }
  });
}
#endif

// ---- the 4-bit matmul with int8 activations (integer dot products) --------------------------
//
// quant_activations: int8 (model/quant.py). Each row of x is quantized per group of 32 inputs as
// llama.cpp's Q8_0 is: d = max|x| / 127, xq = round-half-even(x * (127 / max|x|)) in -127..127.
// The result is exactly that of the dequantized weight against the dequantized row,
//   y = sum_g (d_g * scale_g * sum_e q_e xq_e + min_g * d_g * sum_e xq_e),
// with the inner sums in integers (exact) and the outer one in float32, group by group in order.
// Nothing in it depends on the other rows of the step, so a row's output is bitwise the same
// however many rows share the step (speculative decoding's verify steps rely on this).
//
// Why: without bfloat16 dot instructions the float32 path's rate is the FMA rate, 8 products
// per instruction. vpmaddubsw multiplies 32 byte pairs and adds adjacent products in one
// instruction, and a code needs one AND (or a shift and an AND) to become a byte instead of a
// shift, an AND, an OR and an FMA to become a float32: ~1.5x the products per cycle on Zen 3.
//
// The codes are read straight from q4_pack's layout. Lane j of code vector i holds, in its four
// low nibbles, inputs 8i + (0, 4, 1, 5) of output j, and in its high nibbles 8i + (2, 6, 3, 7);
// q8_quantize stores each group's activations in that order, so one broadcast 32-bit word of x
// meets the four codes of every output lane (vpmaddubsw then vpmaddwd sum them in the lane).
// Per group, 8 vpmaddubsw results (each at most 2 * 15 * 127) add up in int16 without overflow.

constexpr int kQ8Order[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // position t of a code vector's 8 inputs

// Rows [m, k] quantized per group, in the calling thread's scratch: codes q [m, k], d [m, k/32],
// sum [m, k/32] = the sum of each group's codes (int8_q8_linear), dsum = d * sum (q4_q8_linear).
struct Q8Rows {
  int8_t* q;
  float* d;
  int32_t* sum;
  float* dsum;
};

// One group of 32 inputs, quantized as Q8_0: d = max|x| / 127, codes round(x * 127 / max|x|)
// clamped to +-127 (a NaN input counts as 0 in the max and becomes -127), in kQ8Order or input order.
// The plain loop is the reference (q4_q8_linear_portable and int8_q8_linear_portable use it); the
// vector forms do the same float32 operations lane by lane (exact widening, |x|, max, one multiply
// by the same scalar, clamp, round to nearest even), so codes, d and sums are bitwise equal.
inline void q8_group_plain(const uint16_t* x, bool q4_order, int8_t* q, float& d, int32_t& sum) {
  float xg[32];
  for (int e = 0; e < 32; ++e) xg[e] = BF16::ld(x[e]);
  float amax = 0.0f;
  for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(xg[e]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int s = 0;
  for (int e = 0; e < 32; ++e) {
    const int src = q4_order ? 8 * (e / 8) + kQ8Order[e % 8] : e;
    const int v = static_cast<int>(std::nearbyint(std::min(127.0f, std::max(-127.0f, xg[src] * inv))));
    q[e] = static_cast<int8_t>(v);
    s += v;
  }
  d = amax / 127.0f;
  sum = s;
}

#if defined(__AVX512F__) || defined(__AVX2__)
#define TINYLLM_Q8_VEC 1
// Why vectors: the plain loop took ~4 ns an input (Ice Lake), as long as the whole VNNI matmul of
// a 576-output layer over the same rows; the vector forms are ~6x faster there.

// A group's 32 codes, given in input order, stored in kQ8Order (inside each 8 inputs, so the
// byte shuffle stays within 128-bit lanes) or as they are.
inline void q8_store_codes(__m256i codes, bool q4_order, int8_t* q) {
  if (q4_order) {
    const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                           0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    codes = _mm256_shuffle_epi8(codes, order);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), codes);
}

#if defined(__AVX512F__)
inline void q8_group_vec(const uint16_t* x, bool q4_order, int8_t* q, float& d, int32_t& sum) {
  const __m512 a = vload(x), b = vload(x + 16);
  // max_ps returns its second operand where either is NaN, and the running max (second) never
  // is: a NaN |x| leaves it as the plain loop's std::max does.
  const __m512 m = _mm512_max_ps(_mm512_abs_ps(b), _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps()));
  const float amax = _mm512_reduce_max_ps(m);
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  // max_ps(v, -127) is -127 for a NaN v, as std::max(-127, v) is.
  const __m512i ca = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a, inv), lo), hi));
  const __m512i cb = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(b, inv), lo), hi));
  q8_store_codes(_mm256_set_m128i(_mm512_cvtepi32_epi8(cb), _mm512_cvtepi32_epi8(ca)), q4_order, q);
  d = amax / 127.0f;
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ca, cb));
}
#else
inline void q8_group_vec(const uint16_t* x, bool q4_order, int8_t* q, float& d, int32_t& sum) {
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) {
    v[i] = vload(x + 8 * i);
    m = _mm256_max_ps(_mm256_and_ps(v[i], abs_mask), m);  // a NaN |x| leaves the running max
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], inv), lo), hi));
  // packs interleave 128-bit lanes: dwords come out as inputs 0-3, 8-11, 16-19, 24-27, 4-7, ...
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  q8_store_codes(_mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)), q4_order, q);
  d = amax / 127.0f;
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
}
#endif
#endif

// x [m, k] bfloat16 -> Q8Rows. The codes of a group are stored in kQ8Order (q4_q8_linear) or in
// input order (int8_q8_linear). Straight from the bfloat16 bits (widening is exact): no float32
// copy of x first. ``portable`` takes the plain loop.
Q8Rows q8_quantize(const uint16_t* x, int64_t m, int64_t k, bool q4_order, bool portable) {
  const int64_t groups = k / 32;
  float* buf = scratch(kQ8Rows, m * (3 * groups + k / 4));  // float slots; the codes take k / 4 a row
  const Q8Rows rows{reinterpret_cast<int8_t*>(buf + 3 * m * groups), buf, reinterpret_cast<int32_t*>(buf + m * groups),
                    buf + 2 * m * groups};
  at::parallel_for(0, m * groups, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // rows are contiguous, so group i of the flat array
#if defined(TINYLLM_Q8_VEC)
      if (!portable)
        q8_group_vec(x + i * 32, q4_order, rows.q + i * 32, rows.d[i], rows.sum[i]);
      else
#endif
        q8_group_plain(x + i * 32, q4_order, rows.q + i * 32, rows.d[i], rows.sum[i]);
      rows.dsum[i] = rows.d[i] * static_cast<float>(rows.sum[i]);
    }
  });
  return rows;
}

// Rows in chunks of kQ8RowChunk within each thread's range of blocks (16 outputs each): a thread
// reads its blocks once per chunk while the chunk's codes stay in L1/L2. body(b0, b1, r0, r1).
constexpr int64_t kQ8RowChunk = 48;
template <typename Body>
void q8_row_chunks(int64_t m, int64_t blocks, int64_t grain, Body&& body) {
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t r0 = 0; r0 < m; r0 += kQ8RowChunk) body(b0, b1, r0, std::min(m, r0 + kQ8RowChunk));
  });
}

#if defined(__AVX512F__) || defined(__AVX2__)
// Block b + 1 of a thread's blocks b < b1 (each `bytes` long, back to back from w), for the VNNI
// tiles' NextShare: only where the step's m rows are one chunk of 2-6 tiles (a decode step). In
// process A/B (Zen 4): the 4-bit layers 1.04x at 24-48 rows of 135M weights, 1.08x at 16 rows
// of the 1.5b shape; the int8 output matrix 1.18x at 16 rows, 1.02x at 32; Ice Lake 1.04x at 16
// rows. Over several chunks a thread walks its blocks once per chunk, and there it did not pay
// (Ice Lake, 256 rows: 0.97x).
inline const void* q8_next_block(const void* w, int64_t bytes, int64_t b, int64_t b1, int64_t m) {
  const bool share = m > kTileRows && m <= kQ8RowChunk && b + 1 < b1;
  return share ? static_cast<const char*>(w) + (b + 1) * bytes : nullptr;
}
#endif

// The one float32 step per (row, output, group): acc += isum * (scale * d) + min * dsum.
inline float q8_group(float acc, int32_t isum, float scale, float min, float d, float dsum) {
  return std::fma(min, dsum, std::fma(static_cast<float>(isum), scale * d, acc));
}

// Plain loops, the reference the vector tile must match bit for bit (and the path without AVX2).
void q4_q8_rows_portable(const int8_t* xq, const float* d, const float* dsum, int64_t m, int64_t k,
                         const uint8_t* w, int64_t b0, int64_t b1, const float* bias, uint16_t* y, int64_t n) {
  const int64_t groups = k / 32;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < 16; ++j) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* gp = w + (b * groups + g) * Q4_BLOCK;
          const int8_t* xg = xq + r * k + g * 32;
          int32_t isum = 0;
          for (int i = 0; i < 4; ++i)
            for (int t = 0; t < 4; ++t) {
              const uint8_t byte = gp[i * 64 + j * 4 + t];
              isum += (byte & 15) * xg[8 * i + t] + (byte >> 4) * xg[8 * i + 4 + t];
            }
          uint16_t sh, mh;
          std::memcpy(&sh, gp + 256 + 2 * j, 2);
          std::memcpy(&mh, gp + 288 + 2 * j, 2);
          acc = q8_group(acc, isum, half_bits_to_float(sh), half_bits_to_float(mh), d[r * groups + g], dsum[r * groups + g]);
        }
        y[r * n + b * 16 + j] = q4_out(acc, bias, b * 16 + j);
      }
}

#if defined(__AVX2__)
#define TINYLLM_Q4_INT8 1
// R (<= 3: 2R int16 and 2R float32 accumulators fill the 16 registers) rows x one block of 16
// outputs, over every group: q4_q8_rows_portable's arithmetic, 8 outputs per register. Each row
// tile decodes the codes again: decoding a block once into a byte buffer for all tiles was no
// faster at 16-256 rows on Zen 3 (the vpmaddubsw rate bounds the tile, not the decode).
template <int64_t R>
[[gnu::noinline]] void q4_q8_tile(const int8_t* xq, const float* d, const float* dsum, int64_t k, const uint8_t* wb,
                                  const float* bias, uint16_t* y, int64_t n) {
  const int64_t groups = k / 32;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = wb + g * Q4_BLOCK;
    for (int l = 0; l < Q4_BLOCK; l += 64) _mm_prefetch(reinterpret_cast<const char*>(gp + 2 * Q4_BLOCK + l), _MM_HINT_T0);
    __m256i sum[R][2];
    for (int64_t r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + i * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + i * 64 + 32));
      const __m256i lo0 = _mm256_and_si256(v0, nib), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);
      const __m256i lo1 = _mm256_and_si256(v1, nib), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
      for (int64_t r = 0; r < R; ++r) {
        int32_t wl, wh;
        std::memcpy(&wl, xq + r * k + g * 32 + 8 * i, 4);
        std::memcpy(&wh, xq + r * k + g * 32 + 8 * i + 4, 4);
        const __m256i xl = _mm256_set1_epi32(wl), xh = _mm256_set1_epi32(wh);
        sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl), _mm256_maddubs_epi16(hi0, xh)));
        sum[r][1] = _mm256_add_epi16(sum[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl), _mm256_maddubs_epi16(hi1, xh)));
      }
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 256)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 272)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 288)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 304)));
    for (int64_t r = 0; r < R; ++r) {  // q8_group, 8 outputs at a time
      const __m256 dr = _mm256_set1_ps(d[r * groups + g]), sr = _mm256_set1_ps(dsum[r * groups + g]);
      const __m256 f0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][0], ones));
      const __m256 f1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][1], ones));
      acc[r][0] = _mm256_fmadd_ps(m0, sr, _mm256_fmadd_ps(f0, _mm256_mul_ps(s0, dr), acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(m1, sr, _mm256_fmadd_ps(f1, _mm256_mul_ps(s1, dr), acc[r][1]));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    alignas(32) float out[16];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    for (int c = 0; c < 16; ++c) y[r * n + c] = q4_out(out[c], bias, c);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TINYLLM_Q4_VNNI 1
// The same tile on AVX512-VNNI (Zen 4, Ice Lake and later Xeons): one vpdpbusd multiplies 64 code /
// activation byte pairs and adds each four into an int32 lane, so one register holds a row's 16
// outputs and a group takes 8 instructions a row instead of q4_q8_tile's 32. The codes are the
// unsigned operand, x the signed one, as vpmaddubsw has them. The int32 sums are exact, so the
// outputs are bitwise those of q4_q8_rows_portable. With 32 registers a tile takes up to kTileRows
// rows against one decode of the block's codes.
template <int64_t R>
[[gnu::noinline]] void q4_q8_tile_vnni(const int8_t* xq, const float* d, const float* dsum, int64_t k, const uint8_t* wb,
                                       const float* bias, uint16_t* y, int64_t n, NextShare nx) {
  const int64_t groups = k / 32;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = wb + g * Q4_BLOCK;
    for (int l = 0; l < Q4_BLOCK; l += 64) _mm_prefetch(reinterpret_cast<const char*>(gp + 2 * Q4_BLOCK + l), _MM_HINT_T0);
    if (nx.on()) nx.advance();
    __m512i c[8];
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(gp + i * 64);
      c[2 * i] = _mm512_and_si512(v, nib);
      c[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 256)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 288)));
    __m512i sum[R];
    for (int64_t r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i)  // c[2j] meets x[8j..8j+3], c[2j+1] x[8j+4..8j+7]: the group's 32-bit word i
      for (int64_t r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xq + r * k + g * 32 + 4 * i, 4);
        sum[r] = _mm512_dpbusd_epi32(sum[r], c[i], _mm512_set1_epi32(word));
      }
    for (int64_t r = 0; r < R; ++r) {
      const __m512 dr = _mm512_set1_ps(d[r * groups + g]), sr = _mm512_set1_ps(dsum[r * groups + g]);
      acc[r] = _mm512_fmadd_ps(mn, sr, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(s, dr), acc[r]));
    }
  }
  // q4_out on 16 lanes (the bias added only where there is one: -0 + 0 would change the bits).
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n), bf16_bits16(bias ? _mm512_add_ps(acc[r], bv) : acc[r]));
}

#endif

// y [m, n] bfloat16 = x [m, k] bfloat16 @ w^T (+ bias) with x quantized per group (above).
void q4_q8_matmul(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias, uint16_t* y,
                  bool portable) {
  const int64_t groups = k / 32, blocks = n / 16;
  const Q8Rows q8 = q8_quantize(x, m, k, true, portable);
  const int8_t* xq = q8.q;
  const float *d = q8.d, *dsum = q8.dsum;
  const int64_t grain = m * k * n < (1 << 16) ? blocks : 1;  // tiny products on one thread
  q8_row_chunks(m, blocks, grain, [&](int64_t b0, int64_t b1, int64_t r0, int64_t r1) {
#if defined(TINYLLM_Q4_VNNI)
    if (!portable) {
      const int64_t bytes = groups * Q4_BLOCK;
      for (int64_t b = b0; b < b1; ++b)
        row_tiles(r0, r1, [&]<int64_t R>(int64_t r) {
          q4_q8_tile_vnni<R>(xq + r * k, d + r * groups, dsum + r * groups, k, w + b * bytes,
                             bias ? bias + b * 16 : nullptr, y + r * n + b * 16, n,
                             NextShare(q8_next_block(w, bytes, b, b1, m), bytes, m, r, groups));
        });
      return;
    }
#elif defined(TINYLLM_Q4_INT8)
    if (!portable) {
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* wb = w + b * groups * Q4_BLOCK;
        const float* bb = bias ? bias + b * 16 : nullptr;
        for (int64_t r = r0; r < r1; r += 3) {
          const int8_t* xr = xq + r * k;
          const float *dr = d + r * groups, *sr = dsum + r * groups;
          uint16_t* yr = y + r * n + b * 16;
          if (r1 - r >= 3) q4_q8_tile<3>(xr, dr, sr, k, wb, bb, yr, n);
          else if (r1 - r == 2) q4_q8_tile<2>(xr, dr, sr, k, wb, bb, yr, n);
          else q4_q8_tile<1>(xr, dr, sr, k, wb, bb, yr, n);
        }
      }
      return;
    }
#endif
    q4_q8_rows_portable(xq + r0 * k, d + r0 * groups, dsum + r0 * groups, r1 - r0, k, w, b0, b1, bias,
                        y + r0 * n, n);
  });
}

// ---- the int8 output projection with int8 activations (quant_activations: int8) -------------
//
// The tied embedding / output matrix of quant: gguf is int8 with one scale per row (int8_linear).
// With int8 activations its input is quantized as the 4-bit matmuls' is (q8_quantize: Q8_0 per
// group of 32, codes in input order), and on AVX512-VNNI the products run as integer dot products:
//   y[r][j] = scale[j] * sum_g d[r][g] * sum_{e in g} q[j][e] xq[r][e],
// the inner sums exact in int32, the outer one in float32, group by group in order: the result is
// the int8 weight against the Q8_0 round trip of the row, and a row's output does not depend on
// the rows beside it (bitwise). The weight is held in int8_pack's order, [N/16, K/4, 16, 4]: for
// each block of 16 rows and each 4 inputs, 64 bytes, row j's 4 inputs in 32-bit lane j, so one
// vpdpbusd multiplies 16 rows x 4 inputs against one broadcast word of a row of x. vpdpbusd wants
// its first operand unsigned: the weight is read as q + 128 (one XOR with 0x80 per vector, shared
// by a tile's rows), and 128 * sum(xq over the group) comes off each group's integer sum.

// Plain loops: the reference the vector tile matches bit for bit (and the path without VNNI).
void int8_q8_rows_portable(const int8_t* xq, const float* d, int64_t m, int64_t k, const int8_t* w, const float* scale,
                           int64_t b0, int64_t b1, float* y, int64_t n) {
  const int64_t groups = k / 32;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < 16; ++j) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t isum = 0;
          for (int64_t e = g * 32; e < g * 32 + 32; ++e)
            isum += w[((b * (k / 4) + e / 4) * 16 + j) * 4 + e % 4] * xq[r * k + e];
          acc = std::fma(static_cast<float>(isum), d[r * groups + g], acc);
        }
        y[r * n + b * 16 + j] = acc * scale[b * 16 + j];
      }
}

#if defined(TINYLLM_Q4_VNNI)
// R rows x one block of 16 rows of the weight, over every group.
template <int64_t R>
[[gnu::noinline]] void int8_q8_tile(const int8_t* xq, const float* d, const int32_t* sums, int64_t k, const int8_t* wb,
                                    const float* scale, float* y, int64_t n, NextShare nx) {
  const int64_t groups = k / 32;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* gp = wb + g * 512;  // 8 words of 4 inputs x 16 rows
    for (int l = 0; l < 512; l += 64) _mm_prefetch(reinterpret_cast<const char*>(gp + 1024 + l), _MM_HINT_T0);
    if (nx.on()) nx.advance();
    __m512i sum[R];
    for (int64_t r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(gp + 64 * i), flip);  // q + 128, unsigned
      for (int64_t r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xq + r * k + g * 32 + 4 * i, 4);
        sum[r] = _mm512_dpbusd_epi32(sum[r], wu, _mm512_set1_epi32(word));
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m512i isum = _mm512_sub_epi32(sum[r], _mm512_set1_epi32(128 * sums[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d[r * groups + g]), acc[r]);
    }
  }
  const __m512 sc = _mm512_loadu_ps(scale);
  for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, _mm512_mul_ps(acc[r], sc));
}
#endif

// y [m, n] float32 = x [m, k] bfloat16 (quantized per group) @ (w * scale)^T, w as int8_pack made it.
void int8_q8_matmul(const uint16_t* x, int64_t m, int64_t k, const int8_t* w, const float* scale, int64_t n, float* y,
                    bool portable) {
  const int64_t groups = k / 32, blocks = n / 16;
  const Q8Rows q8 = q8_quantize(x, m, k, false, portable);
  const int8_t* xq = q8.q;
  const float* d = q8.d;
  const int32_t* sums = q8.sum;
  // One contiguous range of blocks per thread: each streams its part of the matrix once per chunk.
  const int64_t threads = at::get_num_threads(), grain = std::max<int64_t>(1, (blocks + threads - 1) / threads);
  q8_row_chunks(m, blocks, grain, [&](int64_t b0, int64_t b1, int64_t r0, int64_t r1) {
#if defined(TINYLLM_Q4_VNNI)
    if (!portable) {
      const int64_t bytes = 16 * k;
      for (int64_t b = b0; b < b1; ++b)
        row_tiles(r0, r1, [&]<int64_t R>(int64_t r) {
          int8_q8_tile<R>(xq + r * k, d + r * groups, sums + r * groups, k, w + b * bytes, scale + b * 16,
                          y + r * n + b * 16, n, NextShare(q8_next_block(w, bytes, b, b1, m), bytes, m, r, groups));
        });
      return;
    }
#endif
    int8_q8_rows_portable(xq + r0 * k, d + r0 * groups, r1 - r0, k, w, scale, b0, b1, y + r0 * n, n);
  });
}

// q [N, K] int8 -> the same bytes in int8_q8_linear's order, [N/16, K/4, 16, 4].
at::Tensor int8_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(0) % 16 == 0 && q.size(1) % 32 == 0,
              "int8_pack: q must be int8 [N, K], N a multiple of 16 and K of 32");
  return q.view({q.size(0) / 16, 16, q.size(1) / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bfloat16, quantized per group of 32 @ (w * scale)^T -> [M, N] float32 logits; w as
// int8_pack made it, scale [N] float32. ``portable`` forces the plain loops (tests compare).
at::Tensor int8_q8_linear_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_q8_linear: x must be bfloat16 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.size(2) == 16 && w.size(3) == 4 && w.is_contiguous(),
              "int8_q8_linear: w must be int8_pack's [N/16, K/4, 16, 4]");
  TORCH_CHECK(w.size(1) * 4 == x.size(1), "int8_q8_linear: x has ", x.size(1), " inputs, the weight ", w.size(1) * 4);
  const int64_t n = w.size(0) * 16;
  TORCH_CHECK(scale.numel() == n, "int8_q8_linear: scale must have N elements");
  const auto xc = x.contiguous();
  const auto sc = scale.to(at::kFloat).contiguous();
  auto y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  int8_q8_matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr()), x.size(0), x.size(1), w.data_ptr<int8_t>(),
                 sc.data_ptr<float>(), n, y.data_ptr<float>(), portable);
  return y;
}

at::Tensor int8_q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  return int8_q8_linear_impl(x, w, scale, false);
}

at::Tensor int8_q8_linear_portable(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  return int8_q8_linear_impl(x, w, scale, true);
}

// ---- big 4-bit steps on the wide tile -------------------------------------------------------
//
// q4_wide_linear: x [M, K] bfloat16 @ the 4-bit weight^T on panel_linear's AVX-512 tile. Each
// thread decodes one 48-output panel's K block (1,024 inputs, 96 KB) to bfloat16 scale * q + min
// (a float32 FMA rounded once: the weight q4_unpack gives, up to that FMA's single rounding) into
// an L2 buffer in the tile's k-pair-major order, and the 8 x 48 bfloat16 tile runs every row over
// it: the decode is paid once per panel block, not once per row tile, so at a prompt's row count
// the step runs at the tile's bfloat16 rate (Zen 4, the default model's 4-bit layers at 1,460 rows:
// 410 GFLOP/s against the VNNI tile's 383 and the bfloat16 dot tile's 220; at 64 rows 334 against
// 346 and 217). model/quant.py sends big steps here where oneDNN has no AMX (with AMX, unpacking
// the weight for oneDNN is faster still), with either activation mode: rows stay bfloat16.
#if defined(TINYLLM_PANEL_WIDE) && defined(__AVX512BF16__) && defined(TINYLLM_Q4_BF16DOT)
#define TINYLLM_Q4_WIDE 1
static_assert(WIDE_KC % 32 == 0, "K blocks hold whole groups");

// Groups [g0, g1) of the 16-output block at wb, decoded into buf (ld elements per k pair) at
// column c0: lane j of the 64 bytes of vector i holds inputs 8i + 2t, 8i + 2t + 1 at bits 4t and
// 16 + 4t (q4_pack's order), which is the pair the tile wants.
inline void q4_decode_pairs(const uint8_t* wb, int64_t g0, int64_t g1, uint16_t* buf, int64_t ld, int64_t c0) {
  const __m512i nib = _mm512_set1_epi32(0xF);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = wb + g * Q4_BLOCK;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 256)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 288)));
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(gp + 64 * i);
      for (int t = 0; t < 4; ++t) {
        const __m512i sh = _mm512_srlv_epi32(v, _mm512_set1_epi32(4 * t));
        const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(sh, nib)), s, mn);
        const __m512 b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(sh, 16), nib)), s, mn);
        const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a)),
                                             _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b)), 16));
        _mm512_storeu_si512(buf + ((g - g0) * 16 + 4 * i + t) * ld + 2 * c0, pair);
      }
    }
  }
}

// y [m, n] bfloat16 = x [m, k] bfloat16 (contiguous) @ w^T (+ bias), w in q4_pack's layout: each
// panel block decoded into the calling thread's buffer, then wide_blocks' tile over it.
void q4_wide_matmul(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias,
                    uint16_t* y) {
  const int64_t groups = k / 32;
  wide_blocks<BF16, BF16>(x, k, m, k, n, bias, y, false, [&](int64_t p, int64_t k0, int64_t kl, int64_t cols) {
    auto* buf = reinterpret_cast<uint16_t*>(scratch(kPanelBuf, WIDE_KC * WIDE_NR / 2));  // bfloat16, two per slot
    for (int64_t blk = 0; blk < cols / 16; ++blk)
      q4_decode_pairs(w + (p * (WIDE_NR / 16) + blk) * groups * Q4_BLOCK, k0 / 32, (k0 + kl) / 32, buf, 2 * cols,
                      16 * blk);
    return static_cast<const uint16_t*>(buf);
  });
}
#endif

// The 4-bit kernel's vector path on this build: "avx512-bf16" (bf16 dot products), "avx2" or
// "avx512" (float32 FMAs), or "" (only the portable loops).
std::string q4_isa() {
#if defined(TINYLLM_Q4_BF16DOT)
  return "avx512-bf16";
#elif defined(TINYLLM_Q4_FLOAT)
  return kPanelIsa;
#else
  return "";
#endif
}

// x [M, K] bfloat16 @ w^T (+ bias) -> [M, N] bfloat16, w as q4_pack made it. ``portable`` forces
// the plain loops (tests compare the two).
// q4_linear's argument checks; returns the bias as float32 (undefined when there is none).
at::Tensor q4_check(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "q4_linear: x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == Q4_BLOCK &&
              packed.is_contiguous(), "q4_linear: w must be q4_pack's [N/16, K/32, 320]");
  TORCH_CHECK(packed.size(1) * 32 == x.size(1), "q4_linear: x has ", x.size(1), " inputs, the weight ", packed.size(1) * 32);
  if (!bias.has_value()) return {};
  auto b = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(b.numel() == packed.size(0) * 16, "q4_linear: bias must have N elements");
  return b;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                     bool portable) {
  const at::Tensor b = q4_check(x, packed, bias);
  const int64_t rows = x.size(0), k = x.size(1), groups = k / 32, blocks = packed.size(0), n = blocks * 16;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(TINYLLM_Q4_FLOAT)
  if (!portable) {
    at::Tensor keep;
    const float* xf = float_rows(x, keep);
    auto y = at::empty({rows, n}, x.options());
    q4_float_matmul(xf, rows, k, wp, n, bp, reinterpret_cast<uint16_t*>(y.data_ptr()));
    return y;
  }
#endif
  const auto xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  std::vector<float> xsum(rows * groups);  // sum of x over each group: the min's coefficient
  for (int64_t i = 0; i < rows * groups; ++i) {
    float s = 0.0f;
    for (int64_t e = 0; e < 32; ++e) s += BF16::ld(xp[i * 32 + e]);
    xsum[i] = s;
  }
  auto y = at::empty({rows, n}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // One contiguous range of blocks per thread: each streams its own part of the weight once.
  const int64_t threads = at::get_num_threads(), grain = (blocks + threads - 1) / threads;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    // Many rows: 8 blocks at a time stay in cache while every row tile passes over them.
    const int64_t chunk = rows <= 4 ? b1 - b0 : 8;
    for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
      const int64_t c1 = std::min(b1, c0 + chunk);
#if defined(TINYLLM_Q4_BF16DOT)
      if (!portable) {
        q4_rows_fast(xp, rows, k, xsum.data(), wp, c0, c1, b1, bp, yp, n);
        continue;
      }
#endif
      q4_rows_portable(xp, rows, k, wp, c0, c1, bp, yp, n);
    }
  });
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return q4_matmul(x, packed, bias, false);
}

at::Tensor q4_linear_portable(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return q4_matmul(x, packed, bias, true);
}

// q4_linear with x quantized to int8 per group of 32 (q4_q8_matmul); ``portable`` forces the plain loops.
at::Tensor q4_q8_linear_impl(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             bool portable) {
  const at::Tensor b = q4_check(x, packed, bias);
  const auto xc = x.contiguous();
  auto y = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  q4_q8_matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr()), x.size(0), x.size(1), packed.data_ptr<uint8_t>(), packed.size(0) * 16,
               b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()), portable);
  return y;
}

at::Tensor q4_q8_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return q4_q8_linear_impl(x, packed, bias, false);
}

at::Tensor q4_q8_linear_portable(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return q4_q8_linear_impl(x, packed, bias, true);
}

at::Tensor q4_wide_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const at::Tensor b = q4_check(x, packed, bias);
#if defined(TINYLLM_Q4_WIDE)
  const auto xc = x.contiguous();
  auto y = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  q4_wide_matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr()), x.size(0), x.size(1), packed.data_ptr<uint8_t>(),
                 packed.size(0) * 16, b.defined() ? b.data_ptr<float>() : nullptr,
                 reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
#else
  TORCH_CHECK(false, "q4_wide_linear needs a build with AVX-512 and AVX512-BF16");
#endif
}

// q4_q8_linear's vector path on this build: "avx512-vnni", "avx2" or "" (only the portable loops).
std::string q4_q8_isa() {
#if defined(TINYLLM_Q4_VNNI)
  return "avx512-vnni";
#elif defined(TINYLLM_Q4_INT8)
  return "avx2";
#else
  return "";
#endif
}

// ---- one decoder layer in one call ---------------------------------------------------------

// A weight matmul as the Python model holds it (model/llama.py, fused_layer_args):
// kind 0 = F.linear(x, w, bias); 1 = torch's CPU int4 matmul (w packed, aux its scales and
// zeros, groups of 32); 2 = oneDNN with a pre-packed weight (model/gemm.py's PackedLinear);
// 3 = q4_linear (w as q4_pack made it); 4 = kind 2 with the weight packed in float32 for a
// bfloat16 model on a CPU without bfloat16 matmuls: x widened, the output rounded back to x's dtype;
// 5 = panel_linear (w as panel_pack made it); 6 = q4_q8_linear (kind 3 with int8 activations).
at::Tensor run_linear(int64_t kind, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& aux,
                      const std::optional<at::Tensor>& bias) {
  if (kind == 0) return at::linear(x, w, bias);
  if (kind == 1) {
    auto y = at::_weight_int4pack_mm_for_cpu(x.contiguous(), w, 32, *aux);
    return bias.has_value() ? y.add_(*bias) : y;
  }
  if (kind == 3) {
    RECORD_FUNCTION("tinyllm::q4_linear", std::vector<c10::IValue>());
    return q4_linear(x, w, bias);
  }
  if (kind == 5) {
    RECORD_FUNCTION("tinyllm::panel_linear", std::vector<c10::IValue>());
    return panel_linear(x, w, bias);
  }
  if (kind == 6) {
    RECORD_FUNCTION("tinyllm::q4_q8_linear", std::vector<c10::IValue>());
    return q4_q8_linear(x, w, bias);
  }
  TORCH_CHECK(kind == 2 || kind == 4, "unknown linear kind ", kind);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{kind == 4 ? x.to(at::kFloat) : x, w, bias, std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::optional<std::string>(std::string())};
  op.callBoxed(&stack);
  return kind == 4 ? stack[0].toTensor().to(x.scalar_type()) : stack[0].toTensor();
}

// pool[slots[t]] = rows[t] for every row of the step: the K/V write, as index_copy_ does it
// (same checks), without its ~3 us of dispatch and TensorIterator set-up per call for what is a
// few hundred bytes a row.
void write_kv(at::Tensor& pool, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(pool.is_contiguous() && pool.dim() == 3 && rows.dim() == 3, "pool [P, Hkv, D], rows [T, Hkv, D]");
  TORCH_CHECK(rows.size(1) == pool.size(1) && rows.size(2) == pool.size(2) && rows.stride(2) == 1 &&
              rows.stride(1) == rows.size(2) && rows.scalar_type() == pool.scalar_type(), "rows must match the pool");
  const auto s = slots.contiguous();
  TORCH_CHECK(s.scalar_type() == at::kLong && s.numel() == rows.size(0), "one int64 slot per row");
  const int64_t n = rows.size(0), bytes = pool.stride(0) * pool.element_size(), total = pool.size(0);
  const int64_t* sp = s.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(pool.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  const int64_t src_stride = rows.stride(0) * rows.element_size();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < total, "K/V slot ", sp[t], " is outside the pool");
    std::memcpy(dst + sp[t] * bytes, src + t * src_stride, bytes);
  }
}

// The decoder layer of model/llama.py (DecoderLayer.forward on its native path), op for op,
// without a return to Python between them: a one-token step runs ~25 small operators per layer,
// and each costs a few microseconds of Python and dispatch when called from Python.
// x [T, hidden] is the residual stream (updated in place: x += r, x += attention output);
// returns it and the MLP output, which the next layer (or the final norm) adds to it.
// Linears, in order: qkv, o_proj, gate_up, down. mlp_rows > 0: a step of more rows runs its MLP
// (gate_up, SiLU * up, down) in chunks of about that many rows (model/llama.py's mlp_chunk_rows:
// only on linears whose rows do not depend on one another, so the output is the same bit for bit).
// keep (the model's last layer: the rows whose logits are wanted, model/llama.py's keep_rows):
// every row's K and V are computed and written, and only the kept rows go on through attention,
// o_proj and the MLP; the residual stream returned is theirs, [len(keep), hidden], a new tensor.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor& x, const std::optional<at::Tensor>& r, at::TensorList weights, at::IntArrayRef kinds,
    const c10::List<std::optional<at::Tensor>>& aux, const c10::List<std::optional<at::Tensor>>& biases,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps, const at::Tensor& cos,
    const at::Tensor& sin_signed, at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& row_seq, const at::Tensor& row_len, int64_t block_size,
    int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t mlp_rows, const std::optional<at::Tensor>& keep) {
  TORCH_CHECK(weights.size() == 4 && kinds.size() == 4 && aux.size() == 4 && biases.size() == 4, "four linears");
  const int64_t t = x.size(0), q_size = n_heads * head_dim, kv_size = n_kv * head_dim;
  auto lin = [&](int64_t i, const at::Tensor& in) { return run_linear(kinds[i], in, weights[i], aux.get(i), biases.get(i)); };
  // The kernels below are called directly, not through the dispatcher; the scopes name them for
  // torch.profiler (bench --profile) as if they had been (free while no profiler runs).
  auto norm = [&](at::Tensor& stream, const std::optional<at::Tensor>& res, const at::Tensor& w) {
    RECORD_FUNCTION("tinyllm::add_rms_norm_", std::vector<c10::IValue>());
    return add_rms_norm_(stream, res, w, eps);
  };
  auto qkv = lin(0, norm(x, r, input_norm));
  auto qk = qkv.narrow(1, 0, q_size + kv_size).view({t, n_heads + n_kv, head_dim});
  {
    RECORD_FUNCTION("tinyllm::rope_", std::vector<c10::IValue>());
    rope_(qk, cos, sin_signed);
  }
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, n_kv, head_dim});
  {
    RECORD_FUNCTION("tinyllm::write_kv", std::vector<c10::IValue>());
    write_kv(k_pool, slot_mapping, qk.narrow(1, n_heads, n_kv));
    write_kv(v_pool, slot_mapping, v);
  }
  auto q = qk.narrow(1, 0, n_heads);
  at::Tensor stream = x, seqs = row_seq, lens = row_len;
  if (keep.has_value()) {
    TORCH_CHECK(keep->scalar_type() == at::kLong && keep->dim() == 1, "keep: int64 row indices");
    q = q.index_select(0, *keep);
    seqs = row_seq.index_select(0, *keep);
    lens = row_len.index_select(0, *keep);
    stream = x.index_select(0, *keep);
  }
  const int64_t kept = stream.size(0);
  at::Tensor o;
  {
    RECORD_FUNCTION("tinyllm::paged_attention", std::vector<c10::IValue>());
    o = paged_attention(q, k_pool, v_pool, block_tables, seqs, lens, block_size,
                        1.0 / std::sqrt(static_cast<double>(head_dim)));
  }
  auto h = norm(stream, lin(1, o.view({kept, q_size})), post_norm);
  auto mlp = [&](const at::Tensor& in) {
    auto gate_up = lin(2, in);
    at::Tensor act;
    {
      RECORD_FUNCTION("tinyllm::silu_mul", std::vector<c10::IValue>());
      act = silu_mul(gate_up);
    }
    return lin(3, act);
  };
  if (mlp_rows <= 0 || kept <= mlp_rows) return {stream, mlp(h)};
  // Equal chunks, each a whole number of 8-row tiles (model/llama.py's chunk_size, the Python layer's split).
  const int64_t chunks = (kept + mlp_rows - 1) / mlp_rows, rows = ((kept + chunks - 1) / chunks + 7) / 8 * 8;
  auto out = at::empty({kept, x.size(1)}, x.options());
  for (int64_t r0 = 0; r0 < kept; r0 += rows) {
    const int64_t n = std::min(rows, kept - r0);
    out.narrow(0, r0, n).copy_(mlp(h.narrow(0, r0, n)));
  }
  return {stream, out};
}

// A model's decoder layers in one call per step: their static arguments (what decoder_layer takes
// besides the step's tensors) held once, at load, instead of parsed from Python in every layer's
// call. Why: torch.ops parses decoder_layer's 23 arguments (four of them lists, two of optional
// tensors) in ~22 us a call on Zen 4 (measured against an op that fails at its first check), 30
// times a step for the 135M model. Measured in process: a 16-row float32 decode step 27.85 ->
// 27.5 ms, a one-row step 17.77 -> 17.69 ms (the rest of the per-call cost is the layer's own
// tensor bookkeeping, which stays).
// Invariant: forward is decoder_layer called layer by layer, in order, with the same arguments
// (keep on the last layer only): the same bits.
struct DecoderStack : torch::CustomClassHolder {
  struct Layer {
    std::vector<at::Tensor> weights;
    std::vector<int64_t> kinds;
    c10::List<std::optional<at::Tensor>> aux, biases;
    at::Tensor input_norm, post_norm;
    int64_t mlp_rows;
  };
  std::vector<Layer> layers;
  double eps;
  int64_t n_heads, n_kv, head_dim;
};

// weights, kinds, aux, biases: four per layer, layer after layer (decoder_layer's order); norms and
// mlp_rows: one per layer.
c10::intrusive_ptr<DecoderStack> decoder_stack_new(at::TensorList weights, at::IntArrayRef kinds,
                                                   const c10::List<std::optional<at::Tensor>>& aux,
                                                   const c10::List<std::optional<at::Tensor>>& biases,
                                                   at::TensorList input_norms, at::TensorList post_norms, double eps,
                                                   at::IntArrayRef mlp_rows, int64_t n_heads, int64_t n_kv,
                                                   int64_t head_dim) {
  const int64_t n = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(post_norms.size()) == n && static_cast<int64_t>(mlp_rows.size()) == n,
              "decoder_stack_new: one input norm, post norm and mlp_rows per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * n && static_cast<int64_t>(kinds.size()) == 4 * n &&
                  static_cast<int64_t>(aux.size()) == 4 * n && static_cast<int64_t>(biases.size()) == 4 * n,
              "decoder_stack_new: four linears per layer");
  auto stack = c10::make_intrusive<DecoderStack>();
  stack->eps = eps;
  stack->n_heads = n_heads;
  stack->n_kv = n_kv;
  stack->head_dim = head_dim;
  for (int64_t i = 0; i < n; ++i) {
    DecoderStack::Layer layer{{}, {}, c10::List<std::optional<at::Tensor>>(), c10::List<std::optional<at::Tensor>>(),
                              input_norms[i], post_norms[i], mlp_rows[i]};
    for (int64_t j = 4 * i; j < 4 * i + 4; ++j) {
      layer.weights.push_back(weights[j]);
      layer.kinds.push_back(kinds[j]);
      layer.aux.push_back(aux.get(j));
      layer.biases.push_back(biases.get(j));
    }
    stack->layers.push_back(std::move(layer));
  }
  return stack;
}

// Every layer of the stack over the step: x [T, hidden] the embedded rows (updated in place as
// decoder_layer does); k_pools / v_pools one per layer; keep as decoder_layer's, on the last layer.
// Returns the residual stream and the last MLP output (the final norm adds them).
std::tuple<at::Tensor, at::Tensor> decoder_stack(const c10::intrusive_ptr<DecoderStack>& stack, at::Tensor& x,
                                                 const at::Tensor& cos, const at::Tensor& sin_signed,
                                                 at::TensorList k_pools, at::TensorList v_pools,
                                                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                 const at::Tensor& row_seq, const at::Tensor& row_len,
                                                 int64_t block_size, const std::optional<at::Tensor>& keep) {
  const int64_t n = static_cast<int64_t>(stack->layers.size());
  TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == n && static_cast<int64_t>(v_pools.size()) == n,
              "decoder_stack: one K and one V pool per layer");
  at::Tensor stream = x;
  std::optional<at::Tensor> r;
  const std::optional<at::Tensor> none;
  for (int64_t i = 0; i < n; ++i) {
    const auto& l = stack->layers[i];
    at::Tensor kp = k_pools[i], vp = v_pools[i];
    auto [s, mlp] = decoder_layer(stream, r, l.weights, l.kinds, l.aux, l.biases, l.input_norm, l.post_norm,
                                  stack->eps, cos, sin_signed, kp, vp, slot_mapping, block_tables, row_seq, row_len,
                                  block_size, stack->n_heads, stack->n_kv, stack->head_dim, l.mlp_rows,
                                  i == n - 1 ? keep : none);
    stream = s;
    r = mlp;
  }
  return {stream, *r};
}

}  // namespace

TORCH_LIBRARY(tinyllm, m) {
  m.class_<DecoderStack>("DecoderStack");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor row_seq, "
        "Tensor row_len, int block_size, float scale) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin_signed) -> Tensor(a!)");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, bool float32_out=False) -> Tensor");
  m.def("q4_pack(Tensor codes, Tensor scale, Tensor min) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("q4_linear_portable(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("q4_q8_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("q4_q8_linear_portable(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("q4_q8_isa() -> str", &q4_q8_isa);
  m.def("q4_wide_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int8_pack(Tensor q) -> Tensor");
  m.def("int8_q8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_q8_linear_portable(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("q4_isa() -> str", &q4_isa);
  m.def("panel_isa() -> str", &panel_isa);
  m.def("panel_pack(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");  // no tensor to dispatch on: one kernel for every key
  m.def("panel_argmax(Tensor x, Tensor w, Tensor ws, Tensor rows, Tensor norms) -> Tensor");
  m.def("decoder_stack_new(Tensor[] weights, int[] kinds, Tensor?[] aux, Tensor?[] biases, Tensor[] input_norms, "
        "Tensor[] post_norms, float eps, int[] mlp_rows, int n_heads, int n_kv, int head_dim) "
        "-> __torch__.torch.classes.tinyllm.DecoderStack", &decoder_stack_new);
  m.def("decoder_stack(__torch__.torch.classes.tinyllm.DecoderStack stack, Tensor(a!) x, Tensor cos, "
        "Tensor sin_signed, Tensor(b!)[] k_pools, Tensor(c!)[] v_pools, Tensor slot_mapping, Tensor block_tables, "
        "Tensor row_seq, Tensor row_len, int block_size, Tensor? keep=None) -> (Tensor, Tensor)", &decoder_stack);
}

TORCH_LIBRARY_IMPL(tinyllm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax", &argmax);
  m.impl("rope_", &rope_);
  m.impl("int8_linear", &int8_linear);
  m.impl("q4_pack", &q4_pack);
  m.impl("q4_linear", &q4_linear);
  m.impl("q4_linear_portable", &q4_linear_portable);
  m.impl("q4_q8_linear", &q4_q8_linear);
  m.impl("q4_q8_linear_portable", &q4_q8_linear_portable);
  m.impl("q4_wide_linear", &q4_wide_linear);
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_q8_linear", &int8_q8_linear);
  m.impl("int8_q8_linear_portable", &int8_q8_linear_portable);
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_argmax", &panel_argmax);
}

