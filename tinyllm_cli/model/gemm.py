"""How the model's weight matmuls run: plain ``F.linear``, oneDNN with pre-packed weights, or
tinyllm's own ``panel_linear`` kernel.

Why: on CPU, ``F.linear`` in float32 goes to MKL, and MKL picks its kernels by CPU vendor. On AMD
EPYC it runs a path 2-3x slower than the machine allows (measured on Zen 5, 2 cores: 76 vs 266
GFLOP/s at 16 rows, 229 vs 515 at 1536 rows on SmolLM2's shapes). oneDNN picks kernels by ISA,
and with the weight reordered once into its blocked layout it skips the per-call reorder too.

bfloat16 on a CPU without bfloat16 instructions (no AVX512-BF16 or AMX: AMD before Zen 4, Intel
before Cooper Lake): oneDNN has no bfloat16 matmul there and ``F.linear`` falls back to ATen's
generic loop, about 16 GFLOP/s on two Zen 3 cores against oneDNN's ~120 in float32. There the
weights are packed in float32 (``onednn-f32``: the bfloat16 values exactly, twice the memory) and
each matmul widens its bfloat16 input, accumulates in float32 and rounds the output once to
bfloat16, which is what a bfloat16 matmul with float32 accumulation computes.

``panel`` (tinyllm's kernel, ``kernels/matmul_panels.cpp``): weights stored once, in column panels
of float32 or bfloat16, read sequentially once per step. A decode step multiplies a few rows by
every weight and is bound by reading them; oneDNN's packed matmul streams weights at about a third
of the memory bandwidth at 1-16 rows, this kernel most of it. With AVX2 (measured on Zen 3, 2
cores): 1.3-1.7x oneDNN at 1-32 rows, level at 256, 6% behind at 1024; a bfloat16 model keeps
bfloat16 panels (half the bytes of ``onednn-f32``), widened exactly to float32. With AVX-512 an
8-row x 48-output tile runs float32 FMAs, and bfloat16 weights in it run on AVX512-BF16's dot
products (vdpbf16ps: two exact products per float32 lane and instruction) or, without them, as
pairs widened to float32 in registers (one instruction per 16 weights) into the same FMAs.
Measured on Zen 4 (2 cores, the 135M model's fused layers): float32 1.25-1.4x oneDNN at 1-32
rows, 1.04-1.14x at 64-1460; bfloat16 1.1-1.3x at 1-64 rows and level at 256-1460. On Ice Lake
(AVX-512 without BF16, 2 cores, the 135M model's 30 layers): oneDNN's bfloat16 matmul runs 8-56
GFLOP/s at 1-256 rows, below its own float32, and the widening tile 14-175, 3-4x it. So ``auto``
picks the panel kernel wherever it runs; ``gemm: onednn`` (or ``torch``) still selects the others.

Invariants:
- ``PanelLinear(x)`` equals ``F.linear(x, weight, bias)`` computed in float32 and rounded once to
  x's dtype, up to float32 summation order (bfloat16 dot products also flush subnormals to zero).
  A row's output does not depend on the rows beside it.
- ``PackedLinear(x)`` equals ``F.linear(x, weight, bias)`` up to float32 summation order; the
  tests compare whole models against transformers to 1e-4 with packing on.
- Packing is CPU-only and only for float32 and bfloat16; everything else keeps ``nn.Linear``.
- A panel weight has the weight's shape and dtype but not its element order: only
  ``panel_linear`` reads it.
- A widened ``PackedLinear`` takes and returns the model's dtype like any other linear.
- A packed weight is an opaque oneDNN tensor: the model cannot be moved or saved after packing
  (it is packed as the last step of loading).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels as native

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


def panel_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """True when ``panel_linear`` runs here: CPU, float32 or bfloat16, kernels built with AVX2 or AVX-512."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and native.load() and bool(native.panel_isa())


def _why_no_panel(dtype: torch.dtype, device: torch.device) -> str:
    if device.type != "cpu":
        return f"it runs on the CPU only, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it computes float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if not native.load():
        return f"tinyllm's CPU kernels did not build ({native.load_error()})"
    return "tinyllm's CPU kernels were built for a CPU without AVX2 or AVX-512"


def resolve_gemm(name: str, dtype: torch.dtype, device: torch.device) -> str:
    """'auto' -> 'panel' wherever it runs, else 'onednn' where usable; for bfloat16 where only float32
    oneDNN runs, 'onednn-f32' (module docstring); else 'torch'. An explicit 'onednn' or 'panel' that
    cannot run is an error."""
    if name == "torch":
        return "torch"
    if name in ("panel", "auto") and panel_usable(dtype, device):
        return "panel"
    if name == "panel":
        raise ValueError(f"gemm 'panel' cannot run here: {_why_no_panel(dtype, device)}")
    if onednn_usable(dtype, device):
        return "onednn"
    if dtype == torch.bfloat16 and onednn_usable(torch.float32, device):
        return "onednn-f32"
    if name == "onednn":
        raise ValueError(f"gemm 'onednn' needs a CPU torch build with oneDNN and float32 or bfloat16 "
                         f"(here: {device.type}, {str(dtype).removeprefix('torch.')})")
    return "torch"


class PackedLinear(nn.Module):
    """``F.linear`` through oneDNN, with the weight reordered once into oneDNN's blocked layout.
    ``widen``: the weight is packed in float32 and each call computes in float32, returning the
    input's dtype (``onednn-f32``)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, widen: bool = False):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.widen = widen
        store = (lambda t: t.detach().float().contiguous()) if widen else (lambda t: t.detach().contiguous())
        self.packed = torch.ops.mkldnn._reorder_linear_weight(store(weight), _ROWS_HINT)
        self.bias = None if bias is None else store(bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.widen:
            return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias, "none", [], "").to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn{'-f32' if self.widen else ''}"


class PanelLinear(nn.Module):
    """``F.linear`` through ``panel_linear``, the weight (float32 or bfloat16) laid out in column
    panels once; each call computes in float32 and returns the input's dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = native.panel_pack(weight.detach().contiguous())  # unregistered, as PackedLinear's
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        return native.panel_linear(x.reshape(-1, self.in_features), self.packed, self.bias).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panel"


def linear_for(gemm: str, weight: Tensor, bias: Tensor | None) -> nn.Module:
    """The module that runs ``F.linear(x, weight, bias)`` on the resolved ``gemm`` path."""
    if gemm == "panel":
        return PanelLinear(weight, bias)
    if gemm in ("onednn", "onednn-f32"):
        return PackedLinear(weight, bias, widen=gemm == "onednn-f32")
    raise ValueError(f"gemm {gemm!r} has no packed linear")


def pack_linears(model: nn.Module, gemm: str) -> None:
    """Replace every ``nn.Linear`` in ``model`` with the packed linear of the resolved ``gemm``
    ('panel', 'onednn' or 'onednn-f32'; 'torch' keeps them)."""
    if gemm == "torch":
        return
    # (parent, name) pairs, not the modules: each nn.Linear (and its weight, where nothing else
    # holds it) is freed as soon as its packed replacement is in, not after the last one.
    targets = [(parent, name) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name in targets:
        child = getattr(parent, name)
        setattr(parent, name, linear_for(gemm, child.weight, child.bias))
        del child
