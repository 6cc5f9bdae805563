"""Greedy tokens from the output matrix: the argmax of each row's logits, and a faster exact way to
it for float32 models on CPUs with bfloat16 dot products.

Why: the output matrix (vocabulary x hidden) is the largest matmul of a small model's decode step
(a fifth of the default model's weight bytes), read by every step. A greedy row needs only the
index of its largest logit. ``GreedyScreen`` keeps a bfloat16 copy of the matrix and each
vocabulary row's norm; ``kernels.panel_argmax`` computes the row's logits from the copy (half the
bytes, half the FMA time on vdpbf16ps), bounds how far each can be from the float32 logit, and
recomputes in float32 only the few tokens that could still be the maximum (see its comment in
``kernels/argmax.cpp`` for the bound). What it saves is in docs/performance.md.

Invariants:
- ``head_argmax(model, h)`` is ``argmax(model.lm_head(h).float())`` for every head, screened or
  not: the same index, bit for bit (the first maximum; a NaN counts as the maximum). A screen is
  a shortcut, never an approximation.
- A head is screened only where that holds and pays: a float32 model whose head is a
  ``PanelLinear`` (gemm 'panel') without bias, finite weights, K below 65,536, on a CPU whose
  panels run bfloat16 dot products (``kernels.panel_isa()`` ends in '-bf16'). Elsewhere (no
  AVX512-BF16: the copy would only halve the bytes, at the float32 FMA rate) nothing is built.
- Memory: the bfloat16 copy (2 bytes a weight) and one float32 norm per vocabulary row; the
  float32 rows the candidates are recomputed from are the head's unpacked weight, which a tied
  head shares with the embedding table (nothing more) and an untied one keeps beside its packed
  panels (4 bytes a weight more). It is built once, when the model loads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import kernels as native
from .gemm import PanelLinear


def argmax(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` of [B, V] logits, the same indices (the first maximum; a NaN is the
    maximum). Float32 logits on the CPU take tinyllm's vectorized kernel: torch's argmax reads
    them markedly slower there, and a whole vocabulary per row is a visible part of a decode step."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1 and logits.shape[-1] > 0 and native.load()):
        return native.argmax(logits)
    return logits.argmax(-1)


class GreedyScreen:
    """What ``panel_argmax`` needs beside the head's packed float32 panels: the bfloat16 copy
    (packed alike), the float32 rows in row-major order (the head's own weight, kept: for a tied
    head that is the embedding table's storage) and each row's norm, rounded up (``row_norms``)."""

    def __init__(self, weight: Tensor, norms: Tensor):
        w = weight.detach()
        self.packed = native.panel_pack(w.bfloat16().contiguous())
        self.rows = w
        self.norms = norms


_NORM_ROWS = 4096  # rows widened to float64 at a time, so a large head never needs a float64 copy of itself


def row_norms(w: Tensor) -> Tensor:
    """Each row's Euclidean norm in float32, computed in float64 and rounded up (the bound needs
    every stored norm at least the true one); not finite exactly where the row is not."""
    out = []
    for i in range(0, w.shape[0], _NORM_ROWS):
        n64 = torch.linalg.vector_norm(w[i:i + _NORM_ROWS].detach().double(), dim=1)
        n32 = n64.float()
        out.append(torch.where(n32.double() < n64, torch.nextafter(n32, torch.tensor(float("inf"))), n32))
    return torch.cat(out)


def screen_for(model: nn.Module, gemm: str) -> GreedyScreen | None:
    """The screen for ``model.lm_head`` (still an ``nn.Linear``, before packing, in the model's
    dtype), or None where the module docstring's conditions do not hold."""
    head = model.lm_head
    if (gemm != "panel" or type(head) is not nn.Linear or head.bias is not None
            or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32
            or not head.weight.is_contiguous() or head.in_features % 2 or head.in_features >= 1 << 16
            or not native.load() or not native.panel_isa().endswith("-bf16")):
        return None
    norms = row_norms(head.weight)
    if not bool(norms.isfinite().all()):  # a NaN or infinite weight: no bound holds for its row
        return None
    return GreedyScreen(head.weight, norms)


def head_argmax(model: nn.Module, h: Tensor) -> Tensor:
    """Token ids [R]: the argmax of ``model.lm_head(h)``'s float32 logits for the final-normed rows
    ``h`` [R, hidden] (module docstring)."""
    screen = getattr(model, "greedy_screen", None)
    if screen is not None and isinstance(model.lm_head, PanelLinear) and h.dtype == torch.float32:
        return native.panel_argmax(h.reshape(-1, h.shape[-1]), model.lm_head.packed, screen.packed, screen.rows,
                                   screen.norms)
    return argmax(model.lm_head(h).float())
