// int8 weights with one float scale per output row: the tied embedding / output matrix of
// quant: gguf. int8_linear multiplies float32 (or bfloat16, widened) rows by it;
// int8_q8_linear quantizes the rows to int8 first (q8.h) and runs integer dot products. This file
// also holds the Q8_0 activation quantizer (q8_quantize) that the 4-bit int8 path shares.
#include "isa.h"
#include "ops.h"
#include "q8.h"

namespace tinyllm {
namespace {

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
// memory once per step, and with the hardware prefetcher alone the loop waits on it. Within a
// block, activation rows go MT at a time (4 with AVX-512's 32 registers, 2 with AVX2's 16), then
// one by one: each weight vector is widened once for the rows of a tile.
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

// ---- the Q8_0 quantizer of int8 activations (q8.h) -----------------------------------------------

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

#if defined(TINYLLM_Q8_VEC)
// Why vectors: the plain loop takes about as long as the whole VNNI matmul of a small model's layer
// over the same rows; the vector forms are several times faster.

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

}  // namespace

// x [M, K] @ (q [N, K] int8 * scale [N])^T -> [M, N], as torch's _weight_int8pack_mm, in x's dtype
// or (float32_out) in float32: the output projection's logits, which rounded to bfloat16 tie
// tokens that float32 tells apart (a first answer of the bundled prompts flipped on one).
// One row streams the weight faster than torch's kernel.
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
// On AVX2 (without VNNI) the same products run on vpmaddubsw (int8_q8_tile_avx2).

namespace {

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

#if defined(TINYLLM_VNNI)
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

#if !defined(TINYLLM_VNNI) && defined(TINYLLM_Q4_INT8)
// The same products on AVX2 (vpmaddubsw, which wants its first operand unsigned): R rows x half h
// of a block (weight rows 8h..8h+7, the 32 bytes of each 64 that hold them), over every group.
// llama.cpp's sign trick: |q| unsigned against sign(q) * xq signed gives q * xq per byte, and a
// pair sums to at most 2 * 128 * 127 < 2^15, so vpmaddubsw never saturates; vpmaddwd then adds
// each 4 products into row j's int32 lane. The group sums are exact, and each group meets d in
// the same float32 FMA, in order: bitwise the plain loops' (and the VNNI tile's) result.
// Up to 4 rows: R int32 sums and R float32 accumulators with 5 working registers fit AVX2's 16.
template <int64_t R>
[[gnu::noinline]] void int8_q8_tile_avx2(const int8_t* xq, const float* d, int64_t k, const int8_t* wb, int h,
                                         const float* scale, float* y, int64_t n) {
  const int64_t groups = k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* gp = wb + g * 512 + 32 * h;  // 8 words of 4 inputs x 16 rows; this half's 32 bytes of each
    for (int l = 0; l < 512; l += 64) _mm_prefetch(reinterpret_cast<const char*>(gp - 32 * h + 1024 + l), _MM_HINT_T0);
    __m256i sum[R];
    for (int64_t r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 64 * i));
      const __m256i wa = _mm256_sign_epi8(w, w);  // |q| (-128 reads as 128 unsigned)
      for (int64_t r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xq + r * k + g * 32 + 4 * i, 4);
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(word), w);
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones));
        asm volatile("" : "+x"(sum[r]));  // summed as they come (else GCC hoists and spills the products)
      }
    }
    for (int64_t r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(d[r * groups + g]), acc[r]);
  }
  const __m256 sc = _mm256_loadu_ps(scale + 8 * h);
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(y + r * n + 8 * h, _mm256_mul_ps(acc[r], sc));
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
#if defined(TINYLLM_VNNI)
    if (!portable) {
      const int64_t bytes = 16 * k;
      for (int64_t b = b0; b < b1; ++b)
        row_tiles(r0, r1, [&]<int64_t R>(int64_t r) {
          int8_q8_tile<R>(xq + r * k, d + r * groups, sums + r * groups, k, w + b * bytes, scale + b * 16,
                          y + r * n + b * 16, n, NextShare(q8_next_block(w, bytes, b, b1, m), bytes, m, r, groups));
        });
      return;
    }
#elif defined(TINYLLM_Q4_INT8)
    if (!portable) {
      for (int64_t b = b0; b < b1; ++b)
        for (int h = 0; h < 2; ++h)
          row_tiles<4>(r0, r1, [&]<int64_t R>(int64_t r) {
            int8_q8_tile_avx2<R>(xq + r * k, d + r * groups, k, w + b * 16 * k, h, scale + b * 16, y + r * n + b * 16, n);
          });
      return;
    }
#endif
    int8_q8_rows_portable(xq + r0 * k, d + r0 * groups, r1 - r0, k, w, scale, b0, b1, y + r0 * n, n);
  });
}

}  // namespace

// q [N, K] int8 -> the same bytes in int8_q8_linear's order, [N/16, K/4, 16, 4].
at::Tensor int8_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(0) % 16 == 0 && q.size(1) % 32 == 0,
              "int8_pack: q must be int8 [N, K], N a multiple of 16 and K of 32");
  return q.view({q.size(0) / 16, 16, q.size(1) / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

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

}  // namespace

at::Tensor int8_q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  return int8_q8_linear_impl(x, w, scale, false);
}

at::Tensor int8_q8_linear_portable(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  return int8_q8_linear_impl(x, w, scale, true);
}

}  // namespace tinyllm
