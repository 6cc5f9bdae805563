"""Weights kept quantized (``quant: gguf``): GGUF 4-bit blocks run through a 4-bit matmul.

Why: one decode step of one sequence streams every weight once. Kept in its file's 4-bit blocks a
model is about a third of its bfloat16 bytes (a sixth of float32), and a single stream runs as
fast as memory delivers those bytes (llama.cpp's approach).

What each form computes (the same math as the dequantized weights, up to stated rounding):
- Q4_0 / Q4_1 / Q4_K blocks share a scale ``d`` (and a minimum ``m``) per group of 32 weights
  along K: ``w = d*q + m`` with q in 0..15 (Q4_0: ``m = -8d``; Q4_K's 6-bit sub-block scales
  multiply out to the same per-32 form). ``QuantWeight`` holds exactly that, in float32.
- Two 4-bit matmuls hold it, and a model uses one of them (one copy of each weight):
  ``Q4Linear`` (tinyllm's kernel, ``kernels/quant4.cpp``: ``scale`` and ``min`` in float16,
  exact for Q4_0 / Q4_1), wherever the kernels are built with a vector path (``q4_isa()``):
  bfloat16 dot products summed in float32 where the CPU has AVX512-BF16 (AMD Zen 4 and later,
  Intel Cooper Lake / Sapphire Rapids and later), else each weight decoded to float32 and
  float32 FMAs (AVX2, or AVX-512 without BF16, where that still beats torch's int4 matmul);
  otherwise ``Int4Linear`` (torch's CPU int4 matmul, ``w = (q - 8)*s + z`` with
  ``s = d``, ``z = m + 8d`` stored in bfloat16, its one extra rounding).
- Q8_0 (the default model's tied embedding / output matrix) has one scale per 32 int8 values;
  torch's int8 matmul takes one scale per row, so those rows are requantized to int8 with a
  per-row scale (round to nearest): the largest change to a weight is half a step of its row.
  The same int8 rows serve the embedding lookup and the output projection: one copy.
- The activation dtype is bfloat16 (both 4-bit kernels' inputs); everything that is not a
  quantized matmul (norms, attention, K/V) runs as in the dequantized model.
- ``quant_activations: int8`` (or ``auto``, wherever the kernel has an integer vector path:
  ``int8_activations``) has ``Q4Linear`` quantize each row of its input per group of 32, as
  llama.cpp's Q8_0 does (``d = max|x| / 127``), for integer dot products (``q4_q8_linear``: AVX2
  vpmaddubsw, or AVX512-VNNI vpdpbusd): the dequantized weight times the dequantized row, faster
  than both the float32 and the bfloat16 dot paths once a few rows share each weight read, at the
  accuracy cost of rounding each activation to 1/127 of its group's largest (the figures are in
  docs/performance.md).
  With int8 activations the Q8_0 output matrix quantizes its input the same way
  (``int8_q8_linear``: the int8 weight against the Q8_0 codes, integer dot products on AVX2 or
  AVX512-VNNI with the same bits, about 2x its bfloat16-input kernel at 16-32 rows and level at
  one); where neither is built its input stays bfloat16.
- Many rows at once (a prefill of ``DEQUANT_ROWS`` tokens or more, on AVX512-BF16 hosts:
  ``big_step``): with AMX, in either activation mode, ``Q4Linear`` unpacks its weight to bfloat16
  for that call (transient, never kept) and runs oneDNN's bfloat16 matmul; without AMX and with
  bfloat16 activations ``q4_wide_linear`` decodes one panel block at a time to bfloat16 in cache
  for tinyllm's AVX-512 bfloat16 tile (no whole-weight copy); with int8 activations the VNNI
  tile runs every step.
  The 4-bit kernel's bf16 dot products win when few rows share each weight read (decoding); with
  many rows a matmul is compute-bound, and a bfloat16 tile (oneDNN's on AMX, tinyllm's wide one
  without) outruns them by more than unpacking the weight costs. ``DEQUANT_ROWS`` is set past the
  row count where that holds on both kinds of host. Both round each weight to bfloat16 once more,
  so a prompt's prefill may differ from the 4-bit kernel's by bfloat16 rounding (the
  configuration is not token-exact anyway).

Invariants: a ``QuantWeight`` is the only copy of its weight once the model is built (no float
copy is kept); ``Q4Linear(x)`` and ``Int4Linear(x)`` equal ``F.linear(x, dequantize())`` up to
bfloat16 rounding (tests compare them), or with int8 activations ``F.linear(q8(x), dequantize())``;
below the unpacked path, a row of ``Q4Linear(x)`` does not depend on the other rows of ``x``
(bitwise: each row is quantized alone and its sums run in one fixed order); 4-bit
forms want ``K`` a multiple of 32 and ``N`` a multiple of 16 (checked when a tensor is read, so
an odd shape stays dequantized instead of failing).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor, nn

from .. import kernels as native
from ..machine import has_amx

GROUP = 32
ACT_DTYPE = torch.bfloat16


@dataclass
class QuantWeight:
    """A [N, K] weight as 4-bit codes in groups of 32 along K: ``w = scale * q + min``."""

    codes: Tensor  # uint8 [N, K], values 0..15
    scale: Tensor  # float32 [N, K // 32]
    min: Tensor  # float32 [N, K // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> Tensor:
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP, GROUP).float()
        return (q * self.scale[..., None] + self.min[..., None]).view(n, k)

    def rows(self, fn) -> "QuantWeight":
        """The same weight with ``fn`` applied to its row axis (e.g. llama.cpp's Q/K permutation)."""
        return QuantWeight(fn(self.codes), fn(self.scale), fn(self.min))

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Stack along N (rows), as fusing q/k/v or gate/up does."""
        return QuantWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                           torch.cat([p.min for p in parts]))


@dataclass
class Int8Rows:
    """A [N, K] weight as int8 with one scale per row: ``w = q * scale``."""

    q: Tensor  # int8 [N, K]
    scale: Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale[:, None]


def is_quantized(t) -> bool:
    return isinstance(t, (QuantWeight, Int8Rows))


# ---- reading GGUF blocks -------------------------------------------------------------------------
#
# In torch, not numpy: the same bit operations and float32 products, but vectorized over every
# thread; single-threaded numpy made these functions most of a large file's load time.

def as_torch(data: np.ndarray) -> Tensor:
    """``data`` (a GGUF tensor's bytes in the file's read-only mapping, or any array) as a torch
    view of the same memory, to read from: torch warns on read-only arrays, and every caller copies
    what it keeps (a write through the view would fault on the mapping)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _f16(raw: Tensor, col: int) -> Tensor:
    """The float16 at byte ``col`` of every block row of ``raw`` [rows, blocks, bytes], as float32."""
    return raw[..., col:col + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: Tensor) -> Tensor:
    """ggml's 4-bit layout: byte j of a block holds weight j (low nibble) and j + 16 (high)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _k4_scales(sc: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's 12 bytes of 6-bit (scale, min) pairs for its 8 sub-blocks (ggml's get_scale_min_k4)."""
    lo = sc[..., :4] & 63, sc[..., 4:8] & 63
    hi = ((sc[..., 8:] & 15) | ((sc[..., :4] >> 6) << 4), (sc[..., 8:] >> 4) | ((sc[..., 4:8] >> 6) << 4))
    return torch.cat([lo[0], hi[0]], -1), torch.cat([lo[1], hi[1]], -1)


def gguf_form(kind: str, n: int, k: int) -> str | None:
    """The form ``from_gguf`` reads a [n, k] GGUF tensor of type ``kind`` into: 'int8', 'int4',
    or None where this module has no exact int4 / int8 form for the type or shape."""
    if k % GROUP or n % 16:
        return None
    if kind == "Q8_0":
        return "int8"
    if kind in ("Q4_0", "Q4_1") or (kind == "Q4_K" and k % 256 == 0):
        return "int4"
    return None


def held_bytes(kind: str, n: int, k: int) -> int | None:
    """Bytes ``from_gguf``'s result holds (None where it returns None), computed from the shape
    alone so the loader can weigh a model before reading it: int8 codes plus a float32 scale per
    row; 4-bit codes one per uint8 plus a float32 scale and min per group of 32."""
    form = gguf_form(kind, n, k)
    if form == "int8":
        return n * k + 4 * n
    if form == "int4":
        return n * k + 2 * 4 * n * (k // GROUP)
    return None


def from_gguf(raw: np.ndarray, kind: str, n: int, k: int) -> QuantWeight | Int8Rows | None:
    """Read a GGUF tensor's raw blocks (uint8 [n, bytes per row], e.g. a view of the file's
    read-only mapping, which is only read) into a quantized form, or None where this module has
    no exact int4 / int8 form for the type or shape (``gguf_form``)."""
    if gguf_form(kind, n, k) is None:
        return None
    raw = as_torch(np.asarray(raw, dtype=np.uint8))
    if kind == "Q8_0":
        b = raw.reshape(n, k // 32, 34)
        w = (_f16(b, 0)[..., None] * b[..., 2:].contiguous().view(torch.int8).float()).reshape(n, k)
        scale = w.abs().amax(1).clamp_min(1e-12) / 127
        return Int8Rows(torch.round(w / scale[:, None]).to(torch.int8), scale)
    if kind in ("Q4_0", "Q4_1"):
        width = 18 if kind == "Q4_0" else 20
        b = raw.reshape(n, k // 32, width)
        d = _f16(b, 0)
        codes = _nibbles(b[..., width - 16:])
        low = -8 * d if kind == "Q4_0" else _f16(b, 2)
        return QuantWeight(codes.reshape(n, k), d.contiguous(), low.contiguous())
    if kind == "Q4_K":
        b = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k4_scales(b[..., 4:16])
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 weights: 32 low, 32 high nibbles
        codes = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, k)
        scale = (d[..., None] * sc).reshape(n, k // 32)
        low = (-dmin[..., None] * mn).reshape(n, k // 32)
        return QuantWeight(codes, scale.contiguous(), low.contiguous())
    raise AssertionError(f"gguf_form admitted {kind}")  # the two functions must list the same types


# ---- modules -----------------------------------------------------------------------------------

def int4_usable(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4Linear(nn.Module):
    """``F.linear`` with a 4-bit weight in torch's CPU int4 layout (packed once at load)."""

    def __init__(self, w: QuantWeight, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = w.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        zero = w.min + 8 * w.scale  # torch's kernel computes (q - 8) * s + z
        sz = torch.stack([w.scale, zero], dim=-1).transpose(0, 1).contiguous().to(ACT_DTYPE)
        self.register_buffer("scales_zeros", sz)  # [K / 32, N, 2]
        self.bias = None if bias is None else bias.to(ACT_DTYPE)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, GROUP, self.scales_zeros)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP}"


def q4_usable(device: torch.device) -> bool:
    """tinyllm's 4-bit kernel: built with a vector path (AVX2 or AVX-512; else torch's int4 matmul serves)."""
    return torch.device(device).type == "cpu" and native.load() and bool(torch.ops.tinyllm.q4_isa())


# Rows from which a step is big (see the module docstring): past the break-even of unpacking on
# AMX hosts, and past the row counts where the wide tile passes the VNNI and bfloat16 dot tiles
# on AVX512-BF16-only ones, so a prompt of this size is clearly past both (docs/performance.md).
DEQUANT_ROWS = 1024


def big_step(rows: int, int8: bool) -> str | None:
    """How ``Q4Linear`` runs a step of ``rows`` rows when it leaves its own 4-bit tiles: from
    ``DEQUANT_ROWS`` rows, where the kernel's path is the bfloat16 dot product (AVX512-BF16),
    'unpack' where oneDNN has AMX (the weight unpacked to bfloat16 for oneDNN's matmul; rows stay
    bfloat16 in either activation mode), else, with bfloat16 activations (``int8`` False), 'wide'
    (``q4_wide_linear``: each panel decoded to bfloat16 in cache for the AVX-512 tile, which
    outruns the bfloat16 dot tile at prompt sizes). None: the 4-bit tiles. That is fewer rows;
    the float32 path on AVX2 / AVX-512 without BF16, which reaches the float32 matmul's rate at
    many rows where oneDNN has no bfloat16 matmul; and int8 activations without AMX, where the
    VNNI tile (with its vectorized quantizer) outruns the wide one at prompt sizes, so int8
    activations mean int8 rows on every step there, as on CPUs without AVX512-BF16 and in
    llama.cpp."""
    if rows < DEQUANT_ROWS or not _bf16_dot():
        return None
    if has_amx():
        return "unpack"
    return None if int8 else "wide"


@lru_cache(maxsize=None)
def _bf16_dot() -> bool:
    return native.load() and torch.ops.tinyllm.q4_isa() == "avx512-bf16"


def q4_unpack(packed: Tensor, dtype: torch.dtype = ACT_DTYPE) -> Tensor:
    """``q4_pack``'s [N/16, K/32, 320] layout back to the [N, K] weight ``scale * q + min``
    (computed in float32 with the float16 scale and min the kernel uses, then cast)."""
    nb, groups, _ = packed.shape
    b = packed[..., :256].reshape(nb, groups, 4, 16, 4)  # [row block, group, vector i, row j, byte]
    lo, hi = b & 15, b >> 4
    # Input 8i + r of row j: bytes 0..3 hold (q0|q2), (q4|q6), (q1|q3), (q5|q7), low nibble first.
    q = torch.stack([lo[..., 0], lo[..., 2], hi[..., 0], hi[..., 2], lo[..., 1], lo[..., 3], hi[..., 1], hi[..., 3]], -1)
    q = q.permute(0, 3, 1, 2, 4).reshape(nb * 16, groups, 32)  # row = block * 16 + j, input = 32 g + 8 i + r

    def per_row(col: int) -> Tensor:  # [N, groups, 1] float32
        h = packed[..., col:col + 32].contiguous().view(torch.float16).reshape(nb, groups, 16)
        return h.permute(0, 2, 1).reshape(nb * 16, groups, 1).float()
    w = torch.addcmul(per_row(288), q.float(), per_row(256))
    return w.reshape(nb * 16, groups * 32).to(dtype)


def int8_activations(setting: str, device: torch.device | str) -> bool:
    """Whether the 4-bit matmuls quantize their input to int8 (``quant_activations``): 'int8'
    always, 'bfloat16' (the default) never, 'auto' wherever tinyllm's 4-bit kernel runs with an
    integer vector path (AVX2, or AVX512-VNNI: ``q4_q8_isa()``): integer dot products beat the
    float32 FMAs of AVX2 hosts and the bfloat16 dot products of AVX512-BF16 ones once a few rows
    share each weight read, at the accuracy cost of rounding each activation. Raises
    ValueError for 'int8' where tinyllm's kernel does not run (torch's int4 matmul takes bfloat16)."""
    usable = q4_usable(device)
    if setting == "int8" and not usable:
        raise ValueError("quant_activations int8 needs tinyllm's 4-bit kernel, which this process does not have "
                         "(kernels not built, TINYLLM_KERNELS=0, or a CPU without AVX2); use bfloat16 or auto")
    return setting == "int8" or (setting == "auto" and usable and bool(torch.ops.tinyllm.q4_q8_isa()))


class Q4Linear(nn.Module):
    """``F.linear`` with a 4-bit weight in tinyllm's layout (``q4_pack``, packed once at load).
    With ``int8``, x is quantized per group of 32 (``q4_q8_linear``); else x stays bfloat16
    (``q4_linear``). A ``big_step`` runs oneDNN's bfloat16 matmul over the weight unpacked for the
    call (AMX), or ``q4_wide_linear``."""

    def __init__(self, w: QuantWeight, bias: Tensor | None, int8: bool = False):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.register_buffer("packed", torch.ops.tinyllm.q4_pack(w.codes, w.scale, w.min))
        self.bias = None if bias is None else bias.to(ACT_DTYPE)
        self.int8 = int8

    def forward(self, x: Tensor) -> Tensor:
        big = big_step(x.shape[0], self.int8)
        if big == "unpack":  # oneDNN's AMX matmul wins here
            return torch.nn.functional.linear(x, q4_unpack(self.packed), self.bias)
        if big == "wide":
            return torch.ops.tinyllm.q4_wide_linear(x, self.packed, self.bias)
        if self.int8:
            return torch.ops.tinyllm.q4_q8_linear(x, self.packed, self.bias)
        return torch.ops.tinyllm.q4_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        acts = ", int8 activations" if self.int8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of {GROUP}{acts}"


def int4_linear(w: QuantWeight, bias: Tensor | None, device: torch.device | str, int8: bool = False) -> nn.Module:
    """The 4-bit module for this machine: tinyllm's kernel where it runs fast, else torch's
    (``int8`` activations need tinyllm's: ``int8_activations`` says so before anything loads)."""
    return Q4Linear(w, bias, int8) if q4_usable(device) else Int4Linear(w, bias)


def int8_head_packs(shape: tuple[int, int]) -> bool:
    """Whether an int8 [N, K] output matrix runs with int8 activations (``int8_q8_linear``): where
    the integer tiles are built (AVX2 or AVX512-VNNI: ``q4_q8_isa()``), N a multiple of 16 and K of
    32. Elsewhere its input stays bfloat16."""
    n, k = shape
    return native.load() and bool(torch.ops.tinyllm.q4_q8_isa()) and n % 16 == 0 and k % 32 == 0


class Int8Embedding(nn.Module):
    """An int8 [vocab, hidden] matrix serving both the embedding lookup and (tied) output matmul.
    With ``int8`` activations (where ``int8_head_packs``) the rows are held in ``int8_pack``'s
    order instead, [N/16, K/4, 16, 4] (one copy still: the lookup reads them there), and the
    output matmul quantizes its input per group of 32 as the 4-bit matmuls do."""

    def __init__(self, w: Int8Rows, int8: bool = False):
        super().__init__()
        self.int8 = int8 and int8_head_packs(w.shape)
        self.register_buffer("q", torch.ops.tinyllm.int8_pack(w.q) if self.int8 else w.q)
        self.register_buffer("scale", w.scale.to(ACT_DTYPE))
        self.native = False  # set by llama.use_native_ops: the output projection runs tinyllm's int8 kernel

    def rows(self, ids: Tensor) -> Tensor:
        """The int8 rows ``ids`` [n] -> [n, K], from whichever order they are held in."""
        if self.int8:
            return self.q[ids // 16, :, ids % 16, :].reshape(ids.numel(), -1)
        return self.q.index_select(0, ids)

    def forward(self, ids: Tensor) -> Tensor:
        return self.rows(ids).to(ACT_DTYPE).mul_(self.scale.index_select(0, ids)[:, None])

    def linear(self, x: Tensor) -> Tensor:
        # tinyllm's kernels return float32 (they sum in float32 anyway): logits rounded to bfloat16
        # tie tokens that float32 tells apart. torch's kernel (the fallback) returns bfloat16.
        if self.int8:
            return torch.ops.tinyllm.int8_q8_linear(x, self.q, self.scale)
        if self.native and self.q.shape[1] % 16 == 0:
            return native.int8_linear(x, self.q, self.scale, float32_out=True)
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)


class Int8Head(nn.Module):
    """The output projection over an ``Int8Embedding``'s rows: a tied model's embedding itself
    (no copy), or an untied Q8_0 output matrix."""

    def __init__(self, embed: Int8Embedding):
        super().__init__()
        self._embed = [embed]  # a list, so the module is not registered (and counted) twice

    def forward(self, x: Tensor) -> Tensor:
        return self._embed[0].linear(x)
