// The ops that tinyllm registers as torch.ops.tinyllm.* (bindings.cpp), one declaration each,
// grouped by the file that defines them; and what the fused layer shares with Python: the
// linear kinds and the DecoderStack object.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace tinyllm {

// ---- attention.cpp ----------------------------------------------------------------------------
// Every query row of a step (decode rows and prefill rows alike) attends to its sequence's first
// row_len positions, read where they live in the block pool (no gather copy, no padding),
// grouped-query heads without repeating K/V.
//   q            [T, H, D]      float32 / bfloat16 / float16; the last dim contiguous
//   k_pool       [P, Hkv, D]    one layer's pool, contiguous; slot p holds one token's K
//   v_pool       [P, Hkv, D]
//   block_tables [S, NB] int64  physical block ids, one row per sequence of the step (padding ignored)
//   row_seq      [T] int64      the table row of each query row
//   row_len      [T] int64      positions it attends to: [0, row_len) (a decode row: the whole
//                               sequence; a prefill row at position p: p + 1, which is causal)
//   returns      [T, H, D]      softmax(q . K^T * scale) V
// Position p of sequence s lives at slot block_tables[s][p / block_size] * block_size + p % block_size.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& row_seq, const at::Tensor& row_len,
                           int64_t block_size, double scale);

// ---- elementwise.cpp: the fused elementwise ops around it ------------------------------------
at::Tensor add_rms_norm_(at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                         double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor& rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed);

// ---- argmax.cpp: greedy sampling ---------------------------------------------------------------
at::Tensor argmax(const at::Tensor& x);
at::Tensor panel_argmax(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ws, const at::Tensor& rows,
                        const at::Tensor& norms);

// ---- matmul_panels.cpp: tinyllm's float32 / bfloat16 matmul --------------------------------------
std::string panel_isa();
at::Tensor panel_pack(const at::Tensor& w);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// ---- quant4.cpp: the 4-bit matmuls of quant: gguf ----------------------------------------------
at::Tensor q4_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor q4_linear_portable(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor q4_q8_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor q4_q8_linear_portable(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor q4_wide_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
std::string q4_isa();
std::string q4_q8_isa();

// ---- int8.cpp: int8 weights (the output projection of quant: gguf) ------------------------------
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool float32_out);
at::Tensor int8_pack(const at::Tensor& q);
at::Tensor int8_q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor int8_q8_linear_portable(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);

// ---- fused_layer.cpp: one decoder layer, and every layer, in one call ----------------------------

// How each of a layer's four linears runs, as the Python model holds it (model/fused.py's
// LinearKind holds the same values and checks them against linear_kinds() before it builds a stack).
enum class LinearKind : int64_t {
  kTorch = 0,          // F.linear(x, w, bias)
  kTorchInt4 = 1,      // torch's CPU int4 matmul: w packed, aux its scales and zeros, groups of 32
  kOneDnn = 2,         // oneDNN with a pre-packed weight (model/gemm.py's PackedLinear)
  kQ4 = 3,             // q4_linear, w as q4_pack made it
  kOneDnnWidened = 4,  // kOneDnn with the weight packed in float32 for a bfloat16 model on a CPU without
                       // bfloat16 matmuls: x widened, the output rounded back to x's dtype
  kPanel = 5,          // panel_linear, w as panel_pack made it
  kQ4Int8 = 6,         // q4_q8_linear: kQ4 with int8 activations
};

// Every LinearKind by its Python name, for the load-time check.
c10::Dict<std::string, int64_t> linear_kinds();

// A model's decoder layers' static arguments (what decoder_layer takes besides the step's tensors),
// held once, at load, so that a step crosses from Python into C++ once rather than parsing every
// layer's 23 arguments (four of them lists) again in every layer's call.
// Invariant: decoder_stack is decoder_layer called layer by layer, in order, with the same
// arguments (keep on the last layer only): the same bits.
struct DecoderStack : torch::CustomClassHolder {
  struct Layer {
    std::vector<at::Tensor> weights;
    std::vector<int64_t> kinds;  // LinearKind values
    c10::List<std::optional<at::Tensor>> aux, biases;
    at::Tensor input_norm, post_norm;
    int64_t mlp_rows;
  };
  std::vector<Layer> layers;
  double eps;
  int64_t n_heads, n_kv, head_dim;
};

c10::intrusive_ptr<DecoderStack> decoder_stack_new(at::TensorList weights, at::IntArrayRef kinds,
                                                   const c10::List<std::optional<at::Tensor>>& aux,
                                                   const c10::List<std::optional<at::Tensor>>& biases,
                                                   at::TensorList input_norms, at::TensorList post_norms, double eps,
                                                   at::IntArrayRef mlp_rows, int64_t n_heads, int64_t n_kv,
                                                   int64_t head_dim);
std::tuple<at::Tensor, at::Tensor> decoder_stack(const c10::intrusive_ptr<DecoderStack>& stack, at::Tensor& x,
                                                 const at::Tensor& cos, const at::Tensor& sin_signed,
                                                 at::TensorList k_pools, at::TensorList v_pools,
                                                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                 const at::Tensor& row_seq, const at::Tensor& row_len,
                                                 int64_t block_size, const std::optional<at::Tensor>& keep);

}  // namespace tinyllm
