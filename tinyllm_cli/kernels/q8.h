// Int8 activations (quant_activations: int8, model/quant.py): each row of x is quantized per group
// of 32 inputs as llama.cpp's Q8_0 is, d = max|x| / 127, xq = round-half-even(x * (127 / max|x|))
// in -127..127; the matmuls that take them (q4_q8_linear in quant4.cpp, int8_q8_linear in
// int8.cpp) then multiply in integers. q8_quantize is defined in int8.cpp.
#pragma once

#include "isa.h"

namespace tinyllm {

constexpr int kQ8Order[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // position t of a code vector's 8 inputs

// Rows [m, k] quantized per group, in the calling thread's scratch: codes q [m, k], d [m, k/32],
// sum [m, k/32] = the sum of each group's codes (int8_q8_linear), dsum = d * sum (q4_q8_linear).
struct Q8Rows {
  int8_t* q;
  float* d;
  int32_t* sum;
  float* dsum;
};

// x [m, k] bfloat16 -> Q8Rows. The codes of a group are stored in kQ8Order (q4_q8_linear) or in
// input order (int8_q8_linear). Straight from the bfloat16 bits (widening is exact): no float32
// copy of x first. ``portable`` takes the plain loop.
Q8Rows q8_quantize(const uint16_t* x, int64_t m, int64_t k, bool q4_order, bool portable);

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
// tiles' NextShare: only where the step's m rows are one chunk of 2-6 tiles (a decode step), the
// case where a thread reads its blocks once and the next block's stream can run under this one's
// compute. Over several chunks a thread walks its blocks once per chunk, and there it does not pay.
inline const void* q8_next_block(const void* w, int64_t bytes, int64_t b, int64_t b1, int64_t m) {
  const bool share = m > kTileRows && m <= kQ8RowChunk && b + 1 < b1;
  return share ? static_cast<const char*>(w) + (b + 1) * bytes : nullptr;
}
#endif

}  // namespace tinyllm
