// The register tiles of panel_linear (matmul_panels.cpp), shared with the 4-bit matmuls
// (quant4.cpp), which run decoded 4-bit weights through the same tiles:
//   panel_tile  R (<= 6) rows x PANEL_NR outputs over a k-major float32 panel (AVX2 / AVX-512);
//   wide_tile   8 rows x 48 outputs over a step-major float32 or bfloat16 panel (AVX-512).
#pragma once

#include "isa.h"

namespace tinyllm {

// ---- the panel tile: float32 FMAs, AVX2 or AVX-512 -----------------------------------------------

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

// nx: this tile's share of the next panel, prefetched into L2 under its compute (a decode step's
// few rows: see panel_next).
template <int64_t R, typename W>
inline void panel_tile(const float* x, int64_t k_len, const W* w, const float* bias, float* y, int64_t ldy,
                       int64_t cols, NextShare nx) {
  VecF lo[R], hi[R];
  for (int64_t r = 0; r < R; ++r) lo[r] = hi[r] = vzero();
  auto run = [&]<bool Next>() __attribute__((always_inline)) {
    NextShare next = nx;  // a local copy the loop can keep in registers
    for (int64_t k = 0; k < k_len; ++k) {
      const VecF w0 = vload(w + k * PANEL_NR), w1 = vload(w + k * PANEL_NR + kLanes);
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + 8) * PANEL_NR), _MM_HINT_T0);
      if constexpr (Next) next.advance();
      for (int64_t r = 0; r < R; ++r) {
        const VecF a = vset1(x[r * k_len + k]);
        lo[r] = vfma(a, w0, lo[r]);
        hi[r] = vfma(a, w1, hi[r]);
      }
    }
  };
  nx.on() ? run.template operator()<true>() : run.template operator()<false>();
  // Whole-register stores only: an element-wise epilogue makes GCC keep the accumulators in
  // memory through the k loop.
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
                       int64_t ldy, int64_t cols, NextShare nx = {}) {
  auto tile = [&]<int64_t R>(int64_t) { panel_tile<R>(x, k_len, w, bias, y, ldy, cols, nx); };
  tile_of_height<PANEL_MR>(rows, 0, tile);
}

// The next panel for NextShare, where a step's rows are one chunk of at most 8 tiles (a decode
// step of a batch: each panel streams from memory once, and a tile would wait on it). One row
// keeps to the hardware prefetcher, which serves it as well; past 8 tiles a panel is reused from
// L2 by many tiles and its stream is not what bounds the step. (Figures: docs/performance.md,
// "AVX2".)
template <typename W>
inline const W* panel_next(const W* w, int64_t k_len, int64_t p, int64_t p1, int64_t full, int64_t m, int64_t chunk) {
  const bool share = m > 1 && m <= std::min<int64_t>(chunk, 8 * PANEL_MR) && p + 1 < std::min(p1, full);
  return share ? w + (p + 1) * PANEL_NR * k_len : nullptr;
}

#else
constexpr const char* kPanelIsa = "";
constexpr int64_t PANEL_NR = 16;
#endif

// ---- the wide tile: AVX-512 float32 FMAs and bfloat16 dot products ------------------------------
//
// On AVX-512 a float32 weight, and a bfloat16 one with an even K, are packed for a wider tile
// than panel_tile's: column panels of WIDE_NR outputs, each stored step-major
// ([K / S][cols][S], S = the inputs one instruction takes per output: 1 for a float32 FMA, 2 for
// vdpbf16ps or a widened pair, so a 512-bit load holds 16 outputs' weights for one step), the last panel
// [K / S][N % WIDE_NR][S]. A kTileRows-row x WIDE_NR register tile (24 of AVX-512's 32 registers;
// 3 weight vectors; one broadcast of the row's step) runs a K block; vdpbf16ps takes 32 products
// per instruction, twice an FMA's, at half the bytes. Of the tile shapes that fit the registers
// (6 x 64, 12 x 32, 9 x 48, 8 x 48), 8 x 48 is the fastest from 4 to 1,024 rows; and the tile runs
// ahead of oneDNN's matmul at decode row counts (the kernels README).
// Each bfloat16 product is exact in float32 and every sum is float32 in k order (vdpbf16ps also
// flushes subnormal inputs and results to zero): F.linear in float32 up to summation order,
// rounded once to the output's dtype. K runs in blocks of WIDE_KC (one panel's block, 96-192 KB,
// stays in L2 while every row tile reads it), float32 partial sums kept between blocks; a row's
// output does not depend on the rows beside it.
// x enters in the dtype the tile multiplies: the weight's (on vdpbf16ps a bfloat16 panel rounds a
// float32 x to bfloat16: the products are bfloat16's; a float32 panel widens a bfloat16 x
// exactly), float32 for widened bfloat16 panels (x as given); the output is x's dtype.
#if defined(TINYLLM_PANEL_WIDE)
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
// line (matmul_panels.cpp): inlined into a tile, the rounding's constants made GCC keep the
// accumulators in memory through the whole k loop.
void wide_store_bf16(const float* v, int64_t ld, int rows, int64_t cols, uint16_t* y, int64_t ldy);
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
    // tested inside it, each step would also run two compares and branches beside its 24 FMAs.
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
// into L2 as it goes: without it the first tile of each block waits on memory and the others
// compute from L2 after it, one after the other; with it the stream runs under all of them. One
// tile is bound by the stream anyway, and past 32 tiles (prompts) the prefetches cost more than
// they hide: left off there.
template <int NB, typename W, typename O>
void wide_rows(int64_t rows, const typename WideX<W>::T* x, int64_t ldx, int64_t steps, const typename W::T* w, int64_t wld,
               int64_t cols, float* part, bool first, bool last, const float* bias, typename O::T* y, int64_t ldy,
               bool next_follows) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const bool share_next = next_follows && tiles >= 2 && tiles <= 32;
  const int64_t bytes = steps * wld * int64_t(sizeof(typename W::T));
  row_tiles(0, rows, [&]<int64_t R>(int64_t r) {
    const NextShare nx(share_next ? w + steps * wld : nullptr, bytes, rows, r, steps);
    wide_tile<R, NB, W, O>(x + r * ldx, ldx, steps, w, wld, cols, part + r * WIDE_NR, first, last, bias, y + r * ldy,
                           ldy, r == 0, nx);
  });
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

}  // namespace tinyllm
