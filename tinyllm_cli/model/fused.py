"""The one-call decoder stack: how ``llama.py``'s layers are handed to tinyllm's C++ kernels
(``kernels.decoder_stack_new`` once at load, ``kernels.decoder_stack`` once a step), and the row
chunking that the C++ layer and the Python layer share. It reads the layers' modules and imports
nothing from ``llama.py``: ``model`` below is a ``llama.LlamaModel``, ``layer`` a ``DecoderLayer``.

The stack runs the same ops in the same order as the Python layers on their native path
(``DecoderLayer.forward`` with ``native``), without returning to Python between them; tests
compare the two bit for bit.

Invariants:
- ``LinearKind`` is the C++ ``LinearKind`` (``kernels/ops.h``) value for value:
  ``check_linear_kinds`` compares the two before the first stack is built, so a mismatch is an
  error, never a wrong matmul.
- A model has a stack only where every layer has ``fused_layer_args``: no per-head q/k norm
  (Qwen3) and every linear of a known kind. Otherwise its Python layers run, each with the fused
  elementwise kernels where ``native``.
- Row chunks (``mlp_chunk_rows``) and kept rows (``keep_rows``) apply only on tinyllm's panels
  (``row_independent``), whose output rows depend on their own input rows alone: the bits are
  those of one pass over every row.
"""

from __future__ import annotations

from enum import IntEnum
from functools import lru_cache
from typing import NamedTuple

from torch import Tensor, nn

from .. import kernels as native
from . import quant as quant_forms
from .gemm import PackedLinear, PanelLinear
from .quant import Int4Linear, Q4Linear


class LinearKind(IntEnum):
    """How the C++ layer runs one of a layer's linears (``run_linear`` in kernels/fused_layer.cpp)."""

    TORCH = 0           # F.linear(x, w, bias)
    TORCH_INT4 = 1      # torch's CPU int4 matmul: w packed, aux its scales and zeros (quant.Int4Linear)
    ONEDNN = 2          # oneDNN with a pre-packed weight (gemm.PackedLinear)
    Q4 = 3              # tinyllm's 4-bit matmul (quant.Q4Linear)
    ONEDNN_WIDENED = 4  # ONEDNN with the weight in float32 for a bfloat16 model (PackedLinear.widen)
    PANEL = 5           # tinyllm's panels (gemm.PanelLinear)
    Q4_INT8 = 6         # Q4 with int8 activations (Q4Linear.int8)


class LinearSpec(NamedTuple):
    """One linear in the kernel's terms."""

    weight: Tensor
    kind: LinearKind
    aux: Tensor | None  # TORCH_INT4's scales and zeros
    bias: Tensor | None


class FusedLayerArgs(NamedTuple):
    """One layer's static arguments to the C++ layer."""

    linears: tuple[LinearSpec, LinearSpec, LinearSpec, LinearSpec]  # qkv, o_proj, gate_up, down
    input_norm: Tensor
    post_norm: Tensor
    eps: float
    mlp_rows: int  # mlp_chunk_rows: a step of more rows runs its MLP in chunks; 0: never


@lru_cache(maxsize=None)
def check_linear_kinds() -> None:
    """Raise unless the loaded kernels number the linear kinds as ``LinearKind`` does."""
    theirs = native.linear_kinds()
    ours = {kind.name: kind.value for kind in LinearKind}
    if theirs != ours:
        raise RuntimeError(f"tinyllm's kernels number the linear kinds {theirs}, model/fused.py {ours}: "
                           f"rebuild the kernels from this source (python -m tinyllm_cli.kernels)")


def linear_spec(m: nn.Module) -> LinearSpec | None:
    """``m`` in the kernel's terms, or None for a module it does not know."""
    if isinstance(m, Int4Linear):
        return LinearSpec(m.packed, LinearKind.TORCH_INT4, m.scales_zeros, m.bias)
    if isinstance(m, Q4Linear):
        return LinearSpec(m.packed, LinearKind.Q4_INT8 if m.int8 else LinearKind.Q4, None, m.bias)
    if isinstance(m, PackedLinear):
        return LinearSpec(m.packed, LinearKind.ONEDNN_WIDENED if m.widen else LinearKind.ONEDNN, None, m.bias)
    if isinstance(m, PanelLinear):
        return LinearSpec(m.packed, LinearKind.PANEL, None, m.bias)
    if type(m) is nn.Linear:
        return LinearSpec(m.weight, LinearKind.TORCH, None, m.bias)
    return None


def fused_layer_args(layer: nn.Module) -> FusedLayerArgs | None:
    """The C++ layer's static arguments for ``layer`` (a ``llama.DecoderLayer``), or None where it does not apply: Qwen3's
    per-head q/k norm, or a linear of a kind it does not know."""
    if layer.qk_norm is not None:
        return None
    specs = tuple(linear_spec(m) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    if any(spec is None for spec in specs):
        return None
    return FusedLayerArgs(specs, layer.input_norm.weight, layer.post_norm.weight, layer.input_norm.eps,
                          mlp_chunk_rows(layer))


def stack_layers(model: nn.Module):
    """Every layer's ``fused_layer_args`` held by one kernel object (``model.stack``), which runs
    the whole stack in one call a step; None unless every layer has them."""
    args = [fused_layer_args(layer) for layer in model.layers]
    if not args or any(a is None for a in args):
        return None
    check_linear_kinds()
    linears = [spec for a in args for spec in a.linears]
    first = model.layers[0]
    return native.decoder_stack_new(
        [s.weight for s in linears], [int(s.kind) for s in linears], [s.aux for s in linears],
        [s.bias for s in linears], [a.input_norm for a in args], [a.post_norm for a in args], args[0].eps,
        [a.mlp_rows for a in args], first.n_heads, first.n_kv, first.head_dim)


def run_stack(model: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, attn,
              logits_index: Tensor | None) -> tuple[Tensor, Tensor, bool] | None:
    """Every layer over the step's embedded rows ``x`` in one kernel call, where the model has a
    stack and ``attn`` is the paged kernel path: the residual stream, the last MLP output (not yet
    added to it), and whether only the ``logits_index`` rows were carried past the last layer's
    K/V write (``keep_rows``). None where the Python layers must run instead."""
    rows = getattr(attn, "kernel", None) if model.stack is not None else None  # a StepAttention's KernelRows
    if rows is None:
        return None
    if model.quant == "gguf" and quant_forms.big_step(x.shape[0], model.int8_activations):
        return None  # Q4Linear leaves its 4-bit tiles for a step this big: the Python layers' modules run it
    keep = keep_rows(model.layers[-1], logits_index, x.shape[0])
    x, r = native.decoder_stack(model.stack, x, cos, sin, attn.k_pools, attn.v_pools, attn.slot_mapping,
                                rows.tables, rows.row_seq, rows.row_len, rows.block_size, keep)
    return x, r, keep is not None


# A big step's gate_up output stays under this many bytes per MLP chunk (mlp_chunk_rows).
MLP_CHUNK_BYTES = 16 << 20


def mlp_chunk_rows(layer: nn.Module) -> int:
    """Rows per MLP chunk of a big step, in the C++ layer and the Python one (0: the whole step
    at once).

    Why: glibc serves an allocation over 32 MiB with a fresh mmap every time, whose pages all fault
    on first write: a long prompt step's gate_up output at a 1.5B shape is 50-100 MB, tens of
    thousands of faults in every layer. In chunks whose gate_up output stays under 16 MiB, the
    allocations come back from the heap, and each chunk's SiLU output is still in cache for the
    down projection. Only on tinyllm's panels (``row_independent``), so chunking changes no bit."""
    if not row_independent(layer.gate_up, layer.down):
        return 0
    row_bytes = layer.gate_up.packed.shape[0] * layer.gate_up.packed.element_size()
    return max(256, MLP_CHUNK_BYTES // row_bytes)


def chunk_size(t: int, rows: int) -> int:
    """Rows per chunk when ``t`` rows run in chunks of about ``rows``: equal chunks, each a whole
    number of the panels' 8-row tiles (the last one shorter). The C++ layer splits the same way."""
    chunks = -(-t // rows)  # ceil division throughout
    per_chunk = -(-t // chunks)
    return -(-per_chunk // 8) * 8


def keep_rows(layer: nn.Module, logits_index: Tensor | None, rows: int) -> Tensor | None:
    """The rows the model's last layer carries past its K/V write: ``logits_index``, where fewer
    than the step's ``rows`` have their logits computed (a prompt step: one row per prompt out of
    hundreds; a chunk that does not finish its prompt: none). Else None: every row, selected after
    the layer.

    Why: nothing reads the last layer's output for the other rows, only its K and V (written for
    every row), so their attention, o_proj and MLP are skipped: most of one layer of a long prompt
    step. Only where the o_proj and MLP linears are tinyllm's panels (``row_independent``), so the
    kept rows' bits are those of the whole step (the attention kernel serves each row alone)."""
    if logits_index is None or logits_index.shape[0] >= rows:
        return None
    return logits_index if row_independent(layer.o_proj, layer.gate_up, layer.down) else None


def row_independent(*linears: nn.Module) -> bool:
    """Whether each output row of these linears depends on its input row alone, bit for bit,
    whatever the rows beside it: tinyllm's panels (oneDNN's or the 4-bit kernels' choice of
    kernel may depend on the row count)."""
    return all(isinstance(m, PanelLinear) for m in linears)
