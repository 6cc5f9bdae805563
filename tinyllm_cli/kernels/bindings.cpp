// Registers every op of ops.h as torch.ops.tinyllm.* (one TORCH_LIBRARY for the whole extension).
#include <torch/library.h>

#include "ops.h"

using namespace tinyllm;

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
  m.def("linear_kinds() -> Dict(str, int)", &linear_kinds);
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

