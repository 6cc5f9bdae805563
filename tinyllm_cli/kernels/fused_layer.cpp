// One decoder layer in one call (decoder_layer), and every layer of a step in one call
// (decoder_stack over a DecoderStack made once at load): model/llama.py's DecoderLayer.forward on
// its native path, op for op, without a return to Python between them. A one-token step runs ~25
// small operators per layer, and each costs a few microseconds of Python and dispatch when called
// from Python.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include "isa.h"
#include "ops.h"

namespace tinyllm {

namespace {

// oneDNN's matmul with a pre-packed weight (mkldnn::_linear_pointwise, as model/gemm.py's
// PackedLinear calls it); ``widened``: the weight is float32, x is widened to it and the output
// rounded back to x's dtype.
at::Tensor onednn_linear(bool widened, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{widened ? x.to(at::kFloat) : x, w, bias, std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::optional<std::string>(std::string())};
  op.callBoxed(&stack);
  return widened ? stack[0].toTensor().to(x.scalar_type()) : stack[0].toTensor();
}

// A weight matmul as the Python model holds it (LinearKind, ops.h).
at::Tensor run_linear(int64_t kind, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& aux,
                      const std::optional<at::Tensor>& bias) {
  switch (static_cast<LinearKind>(kind)) {
    case LinearKind::kTorch:
      return at::linear(x, w, bias);
    case LinearKind::kTorchInt4: {
      auto y = at::_weight_int4pack_mm_for_cpu(x.contiguous(), w, 32, *aux);
      return bias.has_value() ? y.add_(*bias) : y;
    }
    case LinearKind::kQ4: {
      RECORD_FUNCTION("tinyllm::q4_linear", std::vector<c10::IValue>());
      return q4_linear(x, w, bias);
    }
    case LinearKind::kPanel: {
      RECORD_FUNCTION("tinyllm::panel_linear", std::vector<c10::IValue>());
      return panel_linear(x, w, bias);
    }
    case LinearKind::kQ4Int8: {
      RECORD_FUNCTION("tinyllm::q4_q8_linear", std::vector<c10::IValue>());
      return q4_q8_linear(x, w, bias);
    }
    case LinearKind::kOneDnn:
    case LinearKind::kOneDnnWidened:
      return onednn_linear(kind == static_cast<int64_t>(LinearKind::kOneDnnWidened), x, w, bias);
  }
  TORCH_CHECK(false, "unknown linear kind ", kind);
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

// One decoder layer. x [T, hidden] is the residual stream (updated in place: x += r, x += attention output);
// returns it and the MLP output, which the next layer (or the final norm) adds to it.
// Linears, in order: qkv, o_proj, gate_up, down. mlp_rows > 0: a step of more rows runs its MLP
// (gate_up, SiLU * up, down) in chunks of about that many rows (model/fused.py's mlp_chunk_rows:
// only on linears whose rows do not depend on one another, so the output is the same bit for bit).
// keep (the model's last layer: the rows whose logits are wanted, model/fused.py's keep_rows):
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
  // torch.profiler (bench --torch-profile) as if they had been (free while no profiler runs).
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
  // Equal chunks, each a whole number of 8-row tiles (model/fused.py's chunk_size, the Python layer's split).
  const int64_t chunks = (kept + mlp_rows - 1) / mlp_rows, rows = ((kept + chunks - 1) / chunks + 7) / 8 * 8;
  auto out = at::empty({kept, x.size(1)}, x.options());
  for (int64_t r0 = 0; r0 < kept; r0 += rows) {
    const int64_t n = std::min(rows, kept - r0);
    out.narrow(0, r0, n).copy_(mlp(h.narrow(0, r0, n)));
  }
  return {stream, out};
}

}  // namespace

c10::Dict<std::string, int64_t> linear_kinds() {
  c10::Dict<std::string, int64_t> kinds;
  kinds.insert("TORCH", static_cast<int64_t>(LinearKind::kTorch));
  kinds.insert("TORCH_INT4", static_cast<int64_t>(LinearKind::kTorchInt4));
  kinds.insert("ONEDNN", static_cast<int64_t>(LinearKind::kOneDnn));
  kinds.insert("Q4", static_cast<int64_t>(LinearKind::kQ4));
  kinds.insert("ONEDNN_WIDENED", static_cast<int64_t>(LinearKind::kOneDnnWidened));
  kinds.insert("PANEL", static_cast<int64_t>(LinearKind::kPanel));
  kinds.insert("Q4_INT8", static_cast<int64_t>(LinearKind::kQ4Int8));
  return kinds;
}

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
      TORCH_CHECK(kinds[j] >= 0 && kinds[j] <= static_cast<int64_t>(LinearKind::kQ4Int8),
                  "decoder_stack_new: unknown linear kind ", kinds[j]);
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

}  // namespace tinyllm
