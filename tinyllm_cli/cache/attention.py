"""Attention over a packed step: what the model calls once per layer.

A step packs decode rows first (one query token each) and then prefill segments (a run of a
sequence's prompt tokens, possibly a chunk that follows tokens already cached). Every token has a
*flat slot*: ``block_id * block_size + offset`` in the layer's pool, viewed as
``[total_slots, n_kv_heads, head_dim]``. Both cache kinds reduce to that: a slot cache is a pool
whose one "block" per sequence is ``max_model_len`` long.

Invariants:
- ``attend`` writes this step's K/V to ``slot_mapping`` before it reads, so a decode row sees its
  own token and a prefill chunk sees itself.
- Gather indices past a row's length point at the scratch slot, which no sequence owns; the
  additive mask hides them, so padding never changes a result.
- Nothing here syncs with the device: indices and masks were built once per step, before the
  first layer, and every layer reuses them.
- A step takes one of two paths (``resolve_attention``), with the same results: ``kernel``
  (CPU) serves every row, decode and prefill, in one call that reads K/V in place through the
  block tables (``tinyllm_cli/kernels``); ``gather`` copies each decode row's K/V into a padded
  batch for SDPA and runs SDPA per prefill segment (any device; the reference in the tests).
- On a CUDA device SDPA runs inside ``sdpa_scope``: never cuDNN's backend, which builds a graph
  for every new shape (each prompt length, each decode context length).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import kernels as native


@dataclass
class PrefillSegment:
    """Tokens ``[start, start + n)`` of one sequence, at rows ``[row, row + n)`` of the step."""

    row: int
    n: int
    start: int
    gather_idx: Tensor | None  # flat slots of positions [0, start + n) when start > 0
    mask: Tensor | None = None  # [n, start + n] bool, causal from position ``start``, when start > 0


ATTENTION_PATHS = ("auto", "kernel", "gather")


@dataclass
class DecodeRows:
    """The gather path's view of the decode rows: flat slots padded with the scratch slot, and
    their mask."""

    idx: Tensor  # [B, L] flat slots
    mask: Tensor  # [B, 1, 1, L] bool


@dataclass
class KernelRows:
    """The kernel path's view of every row of the step: row t attends to positions
    ``[0, row_len[t])`` of the sequence whose block table is ``tables[row_seq[t]]``."""

    tables: Tensor  # [S, max blocks] int64, padded with a block id that is never read
    row_seq: Tensor  # [T] int64
    row_len: Tensor  # [T] int64: a decode row's whole length; a prefill row at position p: p + 1
    block_size: int


def resolve_attention(name: str, device: torch.device) -> str:
    """'auto' -> 'kernel' on a CPU where the kernel builds, else 'gather'. An explicit 'kernel'
    that cannot run is a ValueError naming why."""
    if name not in ATTENTION_PATHS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, not {name!r}")
    if name == "gather":
        return "gather"
    if device.type != "cpu":
        if name == "kernel":
            raise ValueError(f"attention 'kernel' runs on the CPU only (here: {device}); use 'gather' or 'auto'")
        return "gather"
    if native.load():
        return "kernel"
    if name == "kernel":
        raise ValueError(f"attention 'kernel' is unavailable: it did not build ({native.load_error()})")
    _note_fallback(native.load_error())
    return "gather"


@lru_cache(maxsize=1)
def _note_fallback(reason: str | None) -> None:
    print(f"note: tinyllm's CPU kernels did not build ({reason}); attention and the layer ops run on "
          f"the slower PyTorch ops and gather path (and quant: gguf on torch's int4 / int8 matmuls)",
          file=sys.stderr)


# Every SDPA backend but cuDNN's, which PyTorch tries first for bfloat16 on recent GPUs: it builds
# a graph per new shape, and a step's shapes are new all the time (each prompt length, each decode
# context length). On an H200 a bench's first bfloat16 W1 run took 10.2 s against 0.56 s once its
# shapes had been seen (float32, which cuDNN's backend does not take, 0.90 vs 0.58 s).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_scope(device: torch.device):
    """The context a forward on ``device`` runs its SDPA calls in (a no-op off CUDA)."""
    return sdpa_kernel(SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def chunk_mask(start: int, n: int, device) -> Tensor:
    """Causal mask of queries at positions [start, start+n) over keys [0, start+n)."""
    qpos = torch.arange(start, start + n, device=device)
    return torch.arange(start + n, device=device)[None, :] <= qpos[:, None]


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [B, H, D]; k, v [B, L, Hkv, D]; mask [B, 1, 1, L] bool (True = attend).

    Grouped-query heads ride in SDPA's query-length axis ([B, Hkv, G, D]), so K/V are never
    repeated per query head.
    """
    b, h, d = q.shape
    hkv = k.shape[2]
    qg = q.view(b, hkv, h // hkv, d)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.reshape(b, h, d)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """One sequence: q [n, H, D]; k, v [s, Hkv, D]. Without ``mask`` the queries are the whole
    sequence (s == n, plain causal); with it (``chunk_mask``) they follow s - n cached tokens."""
    h, hkv = q.shape[1], k.shape[1]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = hkv != h  # SDPA maps query heads onto K/V heads itself: no repeated copies of K/V
    if mask is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)


class StepAttention:
    """Per-step attention state over a cache's K/V pools (one flat pool per layer). ``kernel``
    set: one kernel call serves every row; otherwise decode rows use ``decode`` (gather) and
    each prefill segment its own SDPA call."""

    def __init__(
        self,
        k_pools: list[Tensor],
        v_pools: list[Tensor],
        slot_mapping: Tensor,
        n_decode: int,
        decode: DecodeRows | None,
        segments: list[PrefillSegment],
        kernel: KernelRows | None = None,
    ):
        self.k_pools, self.v_pools = k_pools, v_pools
        self.slot_mapping = slot_mapping
        self.n_decode = n_decode
        self.decode = decode
        self.segments = segments
        # On the kernel path the model's one-call layers (``model/fused.run_stack``) write and read
        # every layer's K/V themselves from these fields: pools, slot mapping and ``kernel``'s rows.
        self.kernel = kernel

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kp, vp = self.k_pools[layer], self.v_pools[layer]
        kp.index_copy_(0, self.slot_mapping, k)
        vp.index_copy_(0, self.slot_mapping, v)
        r = self.kernel
        if r is not None:
            return native.paged_attention(q, kp, vp, r.tables, r.row_seq, r.row_len, r.block_size,
                                          q.shape[-1] ** -0.5)
        outs = []
        nd = self.n_decode
        if nd:
            d = self.decode
            b, l = d.idx.shape
            flat = d.idx.reshape(-1)
            kc = kp.index_select(0, flat).view(b, l, *kp.shape[1:])
            vc = vp.index_select(0, flat).view(b, l, *vp.shape[1:])
            outs.append(decode_attention(q[:nd], kc, vc, d.mask))
        for seg in self.segments:
            rows = slice(seg.row, seg.row + seg.n)
            if seg.gather_idx is None:  # fresh prompt: its own K/V are all there is
                outs.append(causal_attention(q[rows], k[rows], v[rows]))
            else:
                kc, vc = kp.index_select(0, seg.gather_idx), vp.index_select(0, seg.gather_idx)
                outs.append(causal_attention(q[rows], kc, vc, seg.mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class NoCacheAttention:
    """The reference: full causal attention over packed whole sequences, nothing stored."""

    def __init__(self, seq_lens: list[int]):
        self.seq_lens = seq_lens

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        outs, row = [], 0
        for n in self.seq_lens:
            outs.append(causal_attention(q[row : row + n], k[row : row + n], v[row : row + n]))
            row += n
        return torch.cat(outs)
