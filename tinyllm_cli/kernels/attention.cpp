// paged_attention (ops.h): every query row of a step attends to its sequence's positions where
// they live in the block pool. Work is split over (row, kv head) pairs, each reading its K/V rows
// once for all G = H / Hkv query heads that share them, or over blocks of a prompt's consecutive
// rows (attend_block), which share the K and V they read. Three paths, chosen per call:
//   attend_pair      portable loops, any head size and dtype (float16 always takes it);
//   attend_pair_vec  float32 / bfloat16 heads of 64 or 128 with AVX2 or AVX-512, head in registers;
//   attend_block     the same heads, a prompt's rows in blocks, bit for bit attend_pair_vec's results.
// Scores, softmax and P.V are float32 (bfloat16 heads with AVX512-BF16: bfloat16 products, each
// exact in float32, with the softmax weights rounded to bfloat16 before P.V); each output is
// rounded once to the dtype.
#include "isa.h"
#include "ops.h"

namespace tinyllm {
namespace {

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
  // Eight independent running maxima: one chain would wait on each max's latency. The maximum
  // does not depend on the order it is taken in.
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
// Scores stored kLanes at a time, with their running maximum kept beside them (the scoring
// loops fold each chunk in as they store it: reading the scores back for the maximum would wait
// on those stores). The maximum does not depend on the order it is taken in.
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
  // flight.
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
        // chunk's V rows ahead of the V pass.
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
      // separately, two loads per FMA.
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
    // after next while this one is transposed.
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
// rows (a speculative verify, a short chunk after cached positions) costs more than it saves:
// blocks pay from about 8 rows where a pair serves a group of query heads, and from about 4
// where it serves one (one kv head per query head).
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

}  // namespace

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

}  // namespace tinyllm
