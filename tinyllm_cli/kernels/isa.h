// What every kernel file shares: the storage types (how a dtype's elements load to and store
// from float32), the vector registers of this build's ISA behind one set of names (VecF, vload,
// vfma, ...), the per-thread scratch buffers, and the row tiles and weight-stream prefetch of
// the matmuls.
//
// ISA levels: the extension is compiled with -march=native (kernels/__init__.py), so the
// compiler's feature macros say what this CPU has, and each kernel picks its vector path from
// the TINYLLM_* macros defined below, at compile time. VecF is 16 float32 lanes with AVX-512,
// 8 with AVX2; without either only the portable loops are built.
//
// Numerics, for every op: loads widen to float32, all arithmetic is float32, and each result is
// rounded once to the tensor's dtype (bfloat16: round to nearest even, as PyTorch rounds). The
// exception: bfloat16 dot products (AVX512-BF16: q4_linear, panel_linear's bfloat16 panels, and
// bfloat16 attention, whose softmax weights round to bfloat16 before P.V), where each product is
// exact in float32 and sums are float32.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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

// ---- the vector paths this build has ----------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TINYLLM_PANEL_WIDE 1  // panel_linear's 8 x 48 AVX-512 tile (panels.h)
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TINYLLM_Q4_BF16DOT 1  // q4_linear on bfloat16 dot products
#endif
#if !defined(TINYLLM_Q4_BF16DOT) && (defined(__AVX512F__) || defined(__AVX2__))
#define TINYLLM_Q4_FLOAT 1  // q4_linear on float32 FMAs, through the panel tile
#endif
#if defined(TINYLLM_PANEL_WIDE) && defined(TINYLLM_Q4_BF16DOT)
#define TINYLLM_Q4_WIDE 1  // q4_wide_linear: big 4-bit steps on the wide tile
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#define TINYLLM_Q8_VEC 1  // Q8_0 activation quantization in vectors (q8.h)
#endif
#if defined(__AVX2__)
#define TINYLLM_Q4_INT8 1  // q4_q8_linear's AVX2 tile (vpmaddubsw)
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TINYLLM_VNNI 1  // q4_q8_linear's and int8_q8_linear's AVX512-VNNI tiles (vpdpbusd)
#endif

namespace tinyllm {

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

// ---- vectors -----------------------------------------------------------------------------

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

#if defined(__AVX512F__) || defined(__AVX2__)
// The vector registers, one width per build: W float32 lanes (16 with AVX-512, 8 with AVX2,
// which every x86 server core of the last decade has, AMD and Intel alike).
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int kLanes = 16;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset1(float f) { return _mm512_set1_ps(f); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline VecF vfnmadd(VecF a, VecF b, VecF c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
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
// loads plainly: a masked load of scores just stored waits on the stores.)
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
inline VecF vsub(VecF a, VecF b) { return _mm256_sub_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm256_div_ps(a, b); }
inline VecF vfnmadd(VecF a, VecF b, VecF c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
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

// exp(r) for |r| <= ln2 / 2: fast_exp's degree-6 polynomial, one FMA a step.
inline VecF vexp_poly(VecF r) {
  VecF p = vset1(1.0f / 720);
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  return vfma(p, r, vset1(1.0f));
}

// fast_exp on every lane, the same steps with each rounding explicit (a multiply, then FMAs).
inline VecF vexp(VecF x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  const VecF n = vround(vmul(x, vset1(1.44269504088896341f)));
  const VecF r = vfma(n, vset1(2.12194440e-4f), vfma(n, vset1(-0.693359375f), x));
  return vmul(vexp_poly(r), vexp2i(n));
}

#endif

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

// tile.template operator()<R>(r) for the R = rows (1 <= rows <= H) known only at run time: one
// compiled tile per height.
template <int64_t H, typename Tile>
inline void tile_of_height(int64_t rows, int64_t r, Tile& tile) {
  if constexpr (H > 1) {
    if (rows < H) return tile_of_height<H - 1>(rows, r, tile);
  }
  tile.template operator()<H>(r);
}

// Rows [r0, r1) in tiles of H rows (kTileRows unless given): tile.template operator()<R>(r) for
// each tile of R rows starting at row r (the last one takes the remainder), R a compile-time
// constant so each height gets its own unrolled tile. The VNNI tiles and panel_linear's AVX-512
// tile are 8 rows high; AVX2's 16 registers hold fewer.
constexpr int64_t kTileRows = 8;
template <int64_t H = kTileRows, typename Tile>
inline void row_tiles(int64_t r0, int64_t r1, Tile&& tile) {
  for (int64_t r = r0; r < r1; r += H) tile_of_height<H>(std::min(H, r1 - r), r, tile);
}

#if defined(__AVX512F__) || defined(__AVX2__)
// A row tile's share of the next weight block, prefetched into L2 while the tile computes this
// one. Where one block's rows take several tiles one after the other, the first tile waits on
// memory and the rest compute from L2; splitting the next block's prefetch over all of them runs
// the weight stream under every tile's compute. The tile at `row` of `rows` takes its 1 / tiles
// of the `bytes` at `next` and prefetches `step` more of them at each of its `steps` steps, one
// prefetch per cache line; tiles are `tile_rows` high. Default-constructed (or with next ==
// nullptr): nothing to prefetch.
struct NextShare {
  const char* line = nullptr;  // the next line to prefetch
  const char* upto = nullptr;  // prefetched up to here so far
  int64_t step = 0;
  NextShare() = default;
  NextShare(const void* next, int64_t bytes, int64_t rows, int64_t row, int64_t steps, int64_t tile_rows = kTileRows) {
    if (!next) return;
    const int64_t tiles = (rows + tile_rows - 1) / tile_rows, share = (bytes + tiles - 1) / tiles;
    line = upto = static_cast<const char*>(next) + row / tile_rows * share;
    step = (share + steps - 1) / steps;
  }
  bool on() const { return step > 0; }
  // One step's share.
  [[gnu::always_inline]] inline void advance() {
    for (upto += step; line < upto; line += 64) _mm_prefetch(line, _MM_HINT_T1);
  }
};
#endif

}  // namespace tinyllm
