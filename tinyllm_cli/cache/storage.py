"""K/V storage: the pools that hold a block pool's K and V, and each step's attention plan.

``KVStorage`` owns the tensors of one ``BlockManager`` (``blocks.py``): one flat pool per layer
for K and one for V, ``[total_slots, n_kv_heads, head_dim]``, where block b's positions are the
slots ``b * block_size ..`` (a slot manager's one "block" per sequence is ``max_len`` long). It
reads the manager's tables and lengths and never changes a table: allocation, sharing and every
copy-on-write decision are the manager's; applying those copies to the K/V is this module's.
The runner (``engine/runner.py``) and the draft model talk to it; the simulator never builds one.

Invariants:
- The scratch slots follow the real blocks (from slot ``num_blocks * block_size``); no sequence
  owns them, so padded gather indices and inactive rows point there. They are the only part of
  the pools that is zeroed; every other slot is written before it is read. So new storage may
  take a closed one's pools as they are (``PoolMemory``): never two live owners at once, and no
  content carried over is ever read.
- ``plan_step`` first applies the copies on write the manager recorded since the last step
  (``BlockManager.take_copies``), so a fork's new block holds the shared one's positions before
  the step's forward writes past them; then it stores the step's tokens in the manager
  (``advance``) and builds the step's index tensors, copied to the device once per step, never
  per row.
- Pool memory is checked against ``machine.available_memory`` before it is allocated
  (``check_room``, which a caller may also run before it builds the block manager's tables): a
  pool that does not fit is a ``CacheError`` naming both sizes, not an out-of-memory kill.
"""

from __future__ import annotations

import math

import torch

from ..machine import available_memory
from ..model.llama import ModelConfig
from ..transfer import to_device
from .attention import DecodeRows, KernelRows, PrefillSegment, StepAttention, chunk_mask, resolve_attention
from .blocks import BlockManager, CacheError, token_bytes


class PoolMemory:
    """K/V pool storage handed from closed storage to the next storage of the same process.

    Why: a new pool is new memory, and each of its pages faults on its first K/V write (on a VM the
    host may have to back it too), inside the run's timed steps. ``LLM.reconfigure``, every
    ``bench`` row and a cluster worker's reset build a new pool on the same model; through this,
    the new storage reuses the closed one's pools instead of faulting in the same bytes again
    (docs/performance.md).

    Invariants: at most one spare pair is held, and ``take`` empties it, so no two live storages
    ever share memory; storage gives its pools back only in ``release_pools`` (its engine's
    ``close``), after which it has no tensors. Contents are not cleared: every slot is written
    before it is read, and the storage that takes the pools zeroes its own scratch slots.
    """

    def __init__(self) -> None:
        self._spare: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def held_bytes(self) -> int:
        """Bytes of the spare pools (counted as available when a new pool is sized)."""
        return 0 if self._spare is None else 2 * self._spare[0].numel() * self._spare[0].element_size()

    def fits(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the spare holds ``numel`` elements of ``dtype`` on ``device``."""
        spare = self._spare
        return spare is not None and spare[0].dtype == dtype and spare[0].device == device and spare[0].numel() >= numel

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The spare flat K and V storage if it ``fits``, else None (and a spare that does not
        fit is dropped, freeing it first)."""
        fits = self.fits(numel, dtype, device)
        spare, self._spare = self._spare, None
        return spare if fits else None

    def give(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._spare = (k, v)

    def clear(self) -> None:
        self._spare = None


def pool_shape(cfg: ModelConfig, kind: str, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """``[layers, slots, kv heads, head dim]`` of each of the K and V pools: the blocks, then the
    scratch slots (a slot pool pads with single positions; a paged one needs a whole block)."""
    total = num_blocks * block_size + (1 if kind == "slot" else block_size)
    return cfg.num_layers, total, cfg.num_kv_heads, cfg.head_dim


def check_room(cfg: ModelConfig, kind: str, num_blocks: int, block_size: int, dtype: torch.dtype,
               device: torch.device, memory: PoolMemory | None = None) -> None:
    """A CacheError unless the pools fit: in the spare pools of ``memory``, or in the memory
    available on ``device`` (a spare that does not fit is freed first, so it counts as free)."""
    shape = pool_shape(cfg, kind, num_blocks, block_size)
    if memory is not None and memory.fits(math.prod(shape), dtype, device):
        return
    need = shape[1] * token_bytes(cfg, dtype)
    avail = available_memory(device) + (memory.held_bytes if memory is not None else 0)
    if need > avail:
        raise CacheError(f"the KV cache needs {need / 2**20:.0f} MiB but only {avail / 2**20:.0f} MiB "
                         f"are available on {device}")


def storage_for(blocks: BlockManager, device: torch.device | str, storage: "KVStorage | None" = None) -> "KVStorage":
    """``storage`` when given (it must hold ``blocks``' pools), else new storage for ``blocks`` on
    ``device`` (attention 'auto'): what a model runner and a draft model each compute over."""
    if storage is None:
        return KVStorage(blocks, device)
    if storage.blocks is not blocks:
        raise ValueError("the K/V storage given belongs to another block manager")
    return storage


class KVStorage:
    """The K/V pools of ``blocks`` on ``device``, and the per-step attention plan over them.

    ``attention``: 'auto', 'kernel' or 'gather', how a step's attention reads K/V
    (``cache/attention.py``); ``memory``: where ``release_pools`` hands the pools, and where
    they may come from."""

    def __init__(self, blocks: BlockManager, device: torch.device | str, attention: str = "auto",
                 memory: PoolMemory | None = None):
        self.blocks, self.device, self.dtype = blocks, torch.device(device), blocks.dtype
        try:
            self.attention = resolve_attention(attention, self.device)
        except ValueError as e:
            raise CacheError(str(e))
        self.scratch_slot = blocks.num_blocks * blocks.block_size
        self.memory = memory
        self._storage: tuple[torch.Tensor, torch.Tensor] | None = None  # the pools' flat storage
        self.k = self.v = None
        self._allocate(pool_shape(blocks.cfg, blocks.kind, blocks.num_blocks, blocks.block_size))

    def _allocate(self, shape: tuple[int, int, int, int]) -> None:
        numel = math.prod(shape)
        storage = self.memory.take(numel, self.dtype, self.device) if self.memory is not None else None
        if storage is None:
            b = self.blocks
            check_room(b.cfg, b.kind, b.num_blocks, b.block_size, self.dtype, self.device)
            # Uninitialised on purpose: a slot is only ever read after this step or an earlier one
            # wrote it, so zeroing the whole pool (every page touched) buys nothing; the same
            # holds for pools a closed storage left (PoolMemory).
            storage = tuple(torch.empty(numel, dtype=self.dtype, device=self.device) for _ in range(2))
        self._storage = storage
        self.k, self.v = (t[:numel].view(shape) for t in storage)
        # Only the scratch slots are read unwritten (masked padding), and a masked weight of 0
        # times a NaN left in memory would still be NaN, so they must be finite.
        self.k[:, self.scratch_slot:].zero_()
        self.v[:, self.scratch_slot:].zero_()

    def release_pools(self) -> None:
        """Give the pools to ``memory`` for the next storage (its engine closed); this storage
        has no tensors afterwards. Safe to call twice."""
        if self._storage is not None and self.memory is not None:
            self.memory.give(*self._storage)
        self._storage = None
        self.k = self.v = None

    @property
    def has_tensors(self) -> bool:
        return self.k is not None

    # ---- the step ------------------------------------------------------------------------

    def apply_copies(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first ``positions`` slots of block ``src`` into block ``dst``, in every layer
        of both pools (device copies, no sync), in the order the manager recorded them."""
        bs = self.blocks.block_size
        for src, dst, n in copies:
            for pool in (self.k, self.v):
                pool[:, dst * bs:dst * bs + n].copy_(pool[:, src * bs:src * bs + n])

    def plan_step(self, decode: list[int], prefill: list[tuple[int, int, int]]) -> StepAttention:
        """Apply the pending copies on write, store the step's tokens in the manager and build
        the step's indices. ``decode``: seq ids appending one token each; ``prefill``:
        ``(seq_id, start, n)`` chunks."""
        blocks = self.blocks
        self.apply_copies(blocks.take_copies())
        slot_mapping: list[int] = []
        for s in decode:
            slot_mapping += blocks.slots(s, blocks.lens[s], 1)
        for s, start, n in prefill:
            slot_mapping += blocks.slots(s, start, n)
        blocks.advance(decode, prefill)
        mapping = to_device(slot_mapping, self.device)
        if self.attention == "kernel":
            return StepAttention(list(self.k), list(self.v), mapping, len(decode), None, [],
                                 self._kernel_rows(decode, prefill))
        segments, row = [], len(decode)
        for s, start, n in prefill:
            gather = mask = None
            if start > 0:
                gather = to_device(blocks.slots(s, 0, start + n), self.device)
                mask = chunk_mask(start, n, self.device)
            segments.append(PrefillSegment(row, n, start, gather, mask))
            row += n
        rows = self._decode_rows(decode) if decode else None
        return StepAttention(list(self.k), list(self.v), mapping, len(decode), rows, segments)

    def _padded_tables(self, seqs: list[int]) -> torch.Tensor:
        tables = self.blocks.tables
        nb = max(len(tables[s]) for s in seqs)
        pad = self.blocks.num_blocks  # the scratch block id; padding is never read
        return to_device([tables[s] + [pad] * (nb - len(tables[s])) for s in seqs], self.device)

    def _kernel_rows(self, decode: list[int], prefill: list[tuple[int, int, int]]) -> KernelRows:
        """Decode rows see their whole sequence; prefill row at position p sees [0, p] (causal)."""
        lens = self.blocks.lens
        row_seq, row_len = list(range(len(decode))), [lens[s] for s in decode]
        for i, (s, start, n) in enumerate(prefill, start=len(decode)):
            row_seq += [i] * n
            row_len += range(start + 1, start + n + 1)
        tables = self._padded_tables(decode + [s for s, _, _ in prefill])
        return KernelRows(tables, to_device(row_seq, self.device), to_device(row_len, self.device),
                          self.blocks.block_size)

    def _decode_rows(self, decode: list[int]) -> DecodeRows:
        """The flat slot of every (row, position) up to the longest row, padded with scratch."""
        bs, lens = self.blocks.block_size, [self.blocks.lens[s] for s in decode]
        table, lens_t = self._padded_tables(decode), to_device(lens, self.device)
        pos = torch.arange(max(lens), device=self.device)
        idx = table[:, pos // bs] * bs + pos % bs
        valid = pos[None, :] < lens_t[:, None]
        idx = torch.where(valid, idx, torch.full_like(idx, self.scratch_slot))
        return DecodeRows(idx=idx, mask=valid[:, None, None, :])
