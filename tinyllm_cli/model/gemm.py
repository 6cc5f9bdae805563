"""How the model's weight matmuls run: plain ``F.linear`` or oneDNN with pre-packed weights.

Why: on CPU, ``F.linear`` in float32 goes to MKL, and MKL picks its kernels by CPU vendor. On AMD
EPYC it runs a path 2-3x slower than the machine allows (measured on Zen 5, 2 cores: 76 vs 266
GFLOP/s at 16 rows, 229 vs 515 at 1536 rows on SmolLM2's shapes). oneDNN picks kernels by ISA,
and with the weight reordered once into its blocked layout it skips the per-call reorder too.

Invariants:
- ``PackedLinear(x)`` equals ``F.linear(x, weight, bias)`` up to float32 summation order; the
  tests compare whole models against transformers to 1e-4 with packing on.
- Packing is CPU-only and only for float32 and bfloat16; everything else keeps ``nn.Linear``.
- A packed weight is an opaque oneDNN tensor: the model cannot be moved or saved after packing
  (it is packed as the last step of loading).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# oneDNN's reorder takes an expected row count; any hint >= 16 gave the same speed from 1 to
# 1536 rows, while a hint of 1 was up to 2x slower at 16-32 rows.
_ROWS_HINT = 128


@lru_cache(maxsize=None)  # the answer cannot change within a process; load_runtime and build_model both ask
def onednn_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """True when pre-packed oneDNN linears exist here and give F.linear's answer."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        w, x = torch.randn(24, 16).to(dtype), torch.randn(3, 16).to(dtype)
        y = PackedLinear(w, None)(x)
    except (RuntimeError, NotImplementedError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(y.float(), F.linear(x, w).float(), atol=tol, rtol=tol))


def resolve_gemm(name: str, dtype: torch.dtype, device: torch.device) -> str:
    """'auto' -> 'onednn' where usable, else 'torch'. An explicit 'onednn' that cannot run is an error."""
    if name == "torch":
        return "torch"
    usable = onednn_usable(dtype, device)
    if name == "onednn" and not usable:
        raise ValueError(f"gemm 'onednn' needs a CPU torch build with oneDNN and float32 or bfloat16 "
                         f"(here: {device.type}, {str(dtype).removeprefix('torch.')})")
    return "onednn" if usable else "torch"


class PackedLinear(nn.Module):
    """``F.linear`` through oneDNN, with the weight reordered once into oneDNN's blocked layout."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` in ``model`` with a ``PackedLinear``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
