// The 4-bit matmuls of quant: gguf, all on q4_pack's layout: q4_linear (bfloat16 rows, on
// bfloat16 dot products with AVX512-BF16, else on the panel tile's float32 FMAs), q4_q8_linear
// (rows quantized to int8, integer dot products: AVX512-VNNI or AVX2), q4_wide_linear (big steps
// on the wide tile), and plain loops for each that the tests compare against.
#include "isa.h"
#include "ops.h"
#include "panels.h"
#include "q8.h"

namespace tinyllm {

// ---- the 4-bit layout (q4_pack) --------------------------------------------------------
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
// Why not torch's int4 matmul: its inner loop converts every weight to float32 for an FMA, about
// four times the instructions per weight of the bf16 dot here.
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

namespace {

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

// ---- q4_linear on bfloat16 dot products (AVX512-BF16) ----------------------------------------

#if defined(TINYLLM_Q4_BF16DOT)

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

// ---- the 4-bit matmul on float32 FMAs (CPUs without AVX512-BF16) ---------------------------
//
// Without bfloat16 dot instructions (AVX2 CPUs such as AMD Zen 2/3, AVX-512 without BF16 such as
// Intel Skylake-SP to Ice Lake) q4_pack's blocks run through the panel matmul's float32 tile:
// a panel of PANEL_NR outputs is PANEL_NR / 16 blocks. Each weight is decoded to float32 as
// w = (128 + q) * scale + (min - 128 scale) (q4_code128), and the tile accumulates x * w over k
// in order, as panel_tile does over a float32 panel.
// Up to 4 rows (a single stream's step, a speculative verify step) decode in registers on the
// way to the FMAs; more rows decode each panel once per row chunk into a float32 buffer in
// L1/L2 and run panel_tile over it, so the decode is shared by every row tile (at a few rows the
// buffer's fixed cost outweighs that).
// Both decode to the same float32 weight and sum in the same order: a row's output does not
// depend on how many rows share its step (so speculative decoding's verify step of k + 1 rows
// reproduces plain decoding's one-row steps exactly).
#if defined(TINYLLM_Q4_FLOAT)
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
          auto tile = [&]<int64_t R>(int64_t) { q4_direct_tile<R>(x + m0 * k_len, k_len, pn, b, out, PANEL_NR); };
          tile_of_height<4>(m1 - m0, 0, tile);
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
// shift, an AND, an OR and an FMA to become a float32: more products per cycle.
//
// The codes are read straight from q4_pack's layout. Lane j of code vector i holds, in its four
// low nibbles, inputs 8i + (0, 4, 1, 5) of output j, and in its high nibbles 8i + (2, 6, 3, 7);
// q8_quantize stores each group's activations in that order, so one broadcast 32-bit word of x
// meets the four codes of every output lane (vpmaddubsw then vpmaddwd sum them in the lane).
// Per group, 8 vpmaddubsw results (each at most 2 * 15 * 127) add up in int16 without overflow.

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

#if defined(TINYLLM_Q4_INT8)
// R (<= 3: 2R int16 and 2R float32 accumulators fill the 16 registers) rows x one block of 16
// outputs, over every group: q4_q8_rows_portable's arithmetic, 8 outputs per register. Each row
// tile decodes the codes again: the vpmaddubsw rate bounds the tile, not the decode, so decoding
// a block once into a byte buffer for all tiles gains nothing.
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
        // Keeps each vector's products summed as they come: free to reassociate integer adds, GCC
        // otherwise computes a group's 8R products first and spills them (~60 stores a group at R = 3).
        asm volatile("" : "+x"(sum[r][0]), "+x"(sum[r][1]));
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

#if defined(TINYLLM_VNNI)
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
#if defined(TINYLLM_VNNI)
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
        row_tiles<3>(r0, r1, [&]<int64_t R>(int64_t r) {
          q4_q8_tile<R>(xq + r * k, d + r * groups, dsum + r * groups, k, wb, bb, y + r * n + b * 16, n);
        });
      }
      return;
    }
#endif
    q4_q8_rows_portable(xq + r0 * k, d + r0 * groups, dsum + r0 * groups, r1 - r0, k, w, b0, b1, bias,
                        y + r0 * n, n);
  });
}

// ---- big 4-bit steps on the wide tile -------------------------------------------------------
//
// q4_wide_linear: x [M, K] bfloat16 @ the 4-bit weight^T on panel_linear's AVX-512 tile. Each
// thread decodes one 48-output panel's K block (1,024 inputs, 96 KB) to bfloat16 scale * q + min
// (a float32 FMA rounded once: the weight q4_unpack gives, up to that FMA's single rounding) into
// an L2 buffer in the tile's k-pair-major order, and the 8 x 48 bfloat16 tile runs every row over
// it: the decode is paid once per panel block, not once per row tile, so at a prompt's row count
// the step runs at the tile's bfloat16 rate. model/quant.py's big_step says when it is used.
#if defined(TINYLLM_Q4_WIDE)
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

}  // namespace

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

namespace {

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

// x [M, K] bfloat16 @ w^T (+ bias) -> [M, N] bfloat16, w as q4_pack made it. ``portable`` forces
// the plain loops (tests compare the two).
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

}  // namespace

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return q4_matmul(x, packed, bias, false);
}

at::Tensor q4_linear_portable(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return q4_matmul(x, packed, bias, true);
}

namespace {

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

}  // namespace

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
#if defined(TINYLLM_VNNI)
  return "avx512-vnni";
#elif defined(TINYLLM_Q4_INT8)
  return "avx2";
#else
  return "";
#endif
}

}  // namespace tinyllm
