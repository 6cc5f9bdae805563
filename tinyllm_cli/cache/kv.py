"""Paged and slot KV caches.

The paged cache is virtual memory for K/V. A sequence's *block table* is its page table: logical
block j -> physical block id, and token t lives at ``(table[t // block_size], t % block_size)``.
One table serves every layer (block b holds the same positions in each layer's pool). Blocks are
allocated as a sequence grows, never reserved up front, and all blocks are the same size, so any
free block fits any sequence: no external fragmentation, and at most ``block_size - 1`` unused
slots per sequence (its last, partly filled block).

The slot cache is the same machinery with one block of ``max_model_len`` tokens per sequence,
taken whole at admission: simple, but every sequence pays for the longest one it could become.

Invariants (checked by the property tests):
- free + used blocks = ``num_blocks``; no block is in two tables.
- ``len(table) == ceil(capacity / block_size)`` where capacity >= stored tokens, and unused
  slots per sequence stay below ``block_size`` for the paged cache.
- The scratch block (id ``num_blocks``) is never allocated: padded gather indices point there.
  It is the only part of the pools that is zeroed; every other slot is written before it is read.
  So a new cache may take a closed cache's pools as they are (``PoolMemory``): never two live
  caches at once, and no content carried over is ever read.
- Bookkeeping (tables, lengths, free list) lives on the host as Python lists; the device only
  sees the per-step index tensors built in ``plan_step``, copied once per step, never per row.
- When a decode step needs more blocks than are free, the *newest* sequences are preempted: they
  have done the least work, so recomputing them wastes the least (vLLM's recompute policy).
- Forks (parallel sampling): ``fork`` gives a child the parent's table, taking a reference on
  every block; the first write into a block that is still shared copies it first (copy on write,
  in ``grow``), so **no shared block is ever written**. Only the last, partly filled block can
  need it: full blocks are never written again. Releasing a fork frees only what it alone holds.
- Prefix caching: a prefix hit on block j reuses K/V only when the cached block was computed
  after exactly the query's tokens ``0 .. (j+1) * block_size - 1``. Keys are sha256 digests
  chained through a sequence's *own* earlier blocks and salted with the model and dtype
  (``block_keys``), so a key names one whole prefix of one model; and since a digest is only a
  name, a hit is also checked against the stored tokens and parent entry, so not even a key
  collision can hand one prompt's K/V to another.
- Speculative decoding: a sequence grows past its length for its draft tokens only into room
  that ``draft_room`` found free (never by preempting), and ``truncate`` rolls it back to the
  accepted tokens after the step, freeing the blocks past them; so between steps the table
  invariants above hold as if it had decoded one token at a time. Registered (prefix-cache)
  blocks only ever hold accepted tokens, and ``truncate`` refuses to cut one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..model.llama import ModelConfig
from ..machine import available_memory
from ..transfer import to_device
from .allocator import ROOT_SERIAL, BlockPool
from .block_keys import ROOT, TOKEN_BYTES, as_salt, block_key, encode_tokens, prefix_salt
from .attention import DecodeRows, KernelRows, PrefillSegment, StepAttention, chunk_mask, resolve_attention


class CacheError(ValueError):
    """A cache that cannot be built as asked (too large, too small)."""


def parse_bytes(text: str | int) -> int:
    """'512MiB', '2GB', '1.5GiB', '1TiB', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip()
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
             "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
             "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
    num = s.rstrip("kKmMgGtTiIbB")
    unit = s[len(num):].strip().lower()
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise CacheError(f"cannot read {text!r} as a memory size (examples: 512MiB, 2GiB, 1000000)")
    return int(value * units[unit])


def token_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes across all layers."""
    return cfg.kv_bytes_per_token * torch.tensor([], dtype=dtype).element_size()


class PoolMemory:
    """K/V pool storage handed from a closed cache to the next cache of the same process.

    Why: a new pool is new memory, and each of its pages faults on its first K/V write (on a VM the
    host may have to back it too), inside the run's timed steps. ``LLM.reconfigure``, every
    ``bench`` row and a cluster worker's reset build a new cache on the same model; through this,
    the new cache reuses the closed one's pools instead of faulting in the same bytes again (W1 in
    a fresh process: 186 ms of K/V writes on a new pool, 6 ms on a reused one; 0-4% of whole runs
    in a warm one; docs/performance.md).

    Invariants: at most one spare pair is held, and ``take`` empties it, so no two live caches
    ever share memory; a cache gives its pools back only in ``release_pools`` (its engine's ``close``),
    after which it has no tensors. Contents are not cleared: every slot is written before it is
    read (``PagedKVCache``), and the cache that takes the pools zeroes its own scratch slots.
    """

    def __init__(self) -> None:
        self._spare: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def held_bytes(self) -> int:
        """Bytes of the spare pools (counted as available when a new pool is sized)."""
        return 0 if self._spare is None else 2 * self._spare[0].numel() * self._spare[0].element_size()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The spare flat K and V storage if it holds ``numel`` elements of ``dtype`` on
        ``device``, else None (and a spare that does not fit is dropped, freeing it first)."""
        spare, self._spare = self._spare, None
        if spare is None or spare[0].dtype != dtype or spare[0].device != device or spare[0].numel() < numel:
            return None
        return spare

    def give(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._spare = (k, v)

    def clear(self) -> None:
        self._spare = None


@dataclass
class CacheUsage:
    """A snapshot for stats; cheap (no device work)."""

    blocks_used: int
    blocks_free: int  # includes cached blocks no sequence holds (reusable on a prefix hit)
    tokens_stored: int
    slots_allocated: int
    blocks_cached_free: int = 0
    shared_refs: int = 0  # extra references to shared blocks
    blocks_shared: int = 0  # blocks held by more than one sequence (part of blocks_used)
    fork_shared_blocks: int = 0  # blocks that forks of one request share
    fork_refs: int = 0  # extra references forks hold on them

    @property
    def wasted_slots(self) -> int:
        return self.slots_allocated - self.tokens_stored

    @property
    def utilization(self) -> float:
        return self.tokens_stored / self.slots_allocated if self.slots_allocated else 0.0


class PagedKVCache:
    kind = "paged"

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, scratch_slots: int | None = None, prefix_caching: bool = False,
                 attention: str = "auto", salt: bytes | None = None, tensors: bool = True,
                 memory: PoolMemory | None = None):
        if block_size <= 0 or num_blocks <= 0:
            raise CacheError("block_size and num_blocks must be positive")
        self.cfg, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        self.device, self.dtype = torch.device(device), dtype
        try:  # 'kernel' or 'gather': how a step's attention reads K/V (cache/attention.py)
            self.attention = resolve_attention(attention, self.device)
        except ValueError as e:
            raise CacheError(str(e))
        self.bytes_per_token = token_bytes(cfg, dtype)
        self.kv_bytes = num_blocks * block_size * self.bytes_per_token
        # The scratch block follows the real ones; the slot cache needs only one scratch slot.
        self.scratch_slot = num_blocks * block_size
        total = self.scratch_slot + (block_size if scratch_slots is None else scratch_slots)
        # tensors=False: bookkeeping only (tables, lengths, free list, prefix cache), no K/V
        # pools; the simulator (sim/) drives the same scheduler decisions with it.
        self.k = self.v = None
        self.memory = memory  # where release_pools() hands the pools (and where they may come from)
        self._storage: tuple[torch.Tensor, torch.Tensor] | None = None  # the pools' flat storage
        if tensors:
            self._allocate_tensors(total)
        self.pool = BlockPool(num_blocks, caching=prefix_caching)
        self.allocator = self.pool.allocator
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        # Prefix-cache keys are salted per model and dtype; without a salt, the config and dtype
        # alone still tell models apart deterministically (the runtime adds the model's name).
        self.salt = as_salt(prefix_salt(cfg, dtype) if salt is None else salt)
        # Per sequence, for each full block that is in the prefix cache: (its key, the serial of
        # the pool entry holding it). Built only from the sequence's own tokens; a block that
        # could not be cached (key collision) ends the list and the sequence's caching.
        self.chains: dict[int, list[tuple[bytes, int | None]]] = {}
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of those, tokens whose K/V were reused
        self.forks = 0  # sequences forked from a parent (parallel sampling)
        self.cow_copies = 0  # shared blocks copied before a fork's first write into them

    def _allocate_tensors(self, total: int) -> None:
        cfg = self.cfg
        shape = (cfg.num_layers, total, cfg.num_kv_heads, cfg.head_dim)
        numel = math.prod(shape)
        storage = self.memory.take(numel, self.dtype, self.device) if self.memory is not None else None
        if storage is None:
            need = total * self.bytes_per_token
            if need > available_memory(self.device):
                raise CacheError(
                    f"the KV cache needs {need / 2**20:.0f} MiB but only "
                    f"{available_memory(self.device) / 2**20:.0f} MiB are available on {self.device}")
            # Uninitialised on purpose: a slot is only ever read after this step or an earlier one
            # wrote it, so zeroing the whole pool (0.16 s and every page touched for 1 GiB on CPU)
            # buys nothing; the same holds for pools a closed cache left (PoolMemory).
            storage = tuple(torch.empty(numel, dtype=self.dtype, device=self.device) for _ in range(2))
        self._storage = storage
        self.k, self.v = (t[:numel].view(shape) for t in storage)
        # Only the scratch slots are read unwritten (masked padding), and a masked weight of 0
        # times a NaN left in memory would still be NaN, so they must be finite.
        self.k[:, self.scratch_slot:].zero_()
        self.v[:, self.scratch_slot:].zero_()

    def release_pools(self) -> None:
        """Give the pools to ``memory`` for the next cache (its engine closed); this cache has no
        tensors afterwards. Safe to call twice."""
        if self._storage is not None and self.memory is not None:
            self.memory.give(*self._storage)
        self._storage = None
        self.k = self.v = None

    @property
    def has_tensors(self) -> bool:
        return self.k is not None

    @property
    def prefix_caching(self) -> bool:
        return self.pool.caching

    # ---- sizing -------------------------------------------------------------------------

    @classmethod
    def from_budget(cls, cfg, kv_bytes: int, block_size: int, dtype, device, **kw) -> "PagedKVCache":
        per_block = block_size * token_bytes(cfg, dtype)
        n = kv_bytes // per_block
        if n < 1:
            raise CacheError(f"a KV budget of {kv_bytes} bytes holds no block of {per_block} bytes")
        return cls(cfg, int(n), block_size, dtype, device, **kw)

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def fits_alone(self, n_tokens: int, forks: int = 0) -> bool:
        """Could ``n_tokens`` positions fit if this sequence (and ``forks`` more that will fork
        from it, one block each for their first token) had the whole pool to itself?"""
        return self.blocks_for(n_tokens) + forks <= self.num_blocks

    # ---- check / act pairs for the scheduler -------------------------------------------

    def try_admit(self, seq_id: int, tokens: list[int], forks: int = 0, use_prefix: bool = True) -> int | None:
        """Admit a sequence if its tokens plus one fit, with one more block for each of ``forks``
        sequences that will fork from it (their first token: a new block, or the copy of the
        shared last one); returns how many leading tokens already have K/V (prefix-cache hits,
        whole blocks), or None when it does not fit now. ``use_prefix=False`` computes every
        token (a request that needs the logits of its prompt rows).

        At least one token is always left to compute (the step needs its logits), so a prompt
        that is entirely cached gives up its last block: it is recomputed into a fresh block
        rather than written into a shared one.
        """
        if seq_id in self.tables:
            raise CacheError(f"sequence {seq_id} is already in the cache")
        hits, chain = self._prefix_hits(tokens) if use_prefix else ([], [])
        reclaimed = sum(self.pool.ref[b] == 0 for b in hits)  # evictable hits stop being free
        if self.blocks_for(len(tokens) + 1) + forks - len(hits) > self.pool.num_free - reclaimed:
            return None
        for b in hits:
            self.pool.share(b)
        self.tables[seq_id] = hits + self.pool.allocate(self.blocks_for(len(tokens)) - len(hits))
        self.chains[seq_id] = chain
        cached = len(hits) * self.block_size
        self.lens[seq_id] = cached
        if self.prefix_caching and use_prefix:
            self.prefix_queries += len(tokens)
            self.prefix_hits += cached
        return cached

    def _prefix_hits(self, tokens: list[int]) -> tuple[list[int], list[tuple[bytes, int]]]:
        """The cached blocks holding the longest whole-block prefix of ``tokens`` (leaving at
        least one token to compute), and their chain entries."""
        hits: list[int] = []
        chain: list[tuple[bytes, int]] = []
        if not self.prefix_caching:
            return hits, chain
        n, width = (len(tokens) - 1) // self.block_size, self.block_size * TOKEN_BYTES
        data = encode_tokens(tokens[:n * self.block_size])  # once, not per block
        key, serial = ROOT, ROOT_SERIAL
        for j in range(n):
            toks = data[j * width:(j + 1) * width]
            key = block_key(self.salt, key, toks)
            found = self.pool.lookup(key, serial, toks)
            if found is None:
                break
            b, serial = found
            hits.append(b)
            chain.append((key, serial))
        return hits, chain

    def commit(self, seq_id: int, tokens: list[int], upto: int) -> None:
        """Register the full blocks among positions ``[0, upto)`` (prefix caching).

        Called when a step is *planned*, before its forward: a request admitted later in the
        same step may then share these blocks. That is safe because each layer writes the whole
        step's K/V before any sequence reads (``StepAttention.attend``).

        Each block chains from this sequence's own previous block (its key and pool entry),
        never from whatever block another sequence registered under an equal key.
        """
        if not self.prefix_caching:
            return
        chain, table, bs = self.chains[seq_id], self.tables[seq_id], self.block_size
        first, last = len(chain), upto // bs
        if first >= last or (chain and chain[-1][1] is None):
            return  # nothing new, or the chain was cut by a collision: later blocks stay private
        key, serial = chain[-1] if chain else (ROOT, ROOT_SERIAL)
        data, width = encode_tokens(tokens[first * bs:last * bs]), bs * TOKEN_BYTES
        for i, j in enumerate(range(first, last)):
            toks = data[i * width:(i + 1) * width]
            key = block_key(self.salt, key, toks)
            serial = self.pool.register(table[j], key, serial, toks)
            chain.append((key, serial))
            if serial is None:
                return

    def fork(self, parent: int, child: int) -> None:
        """``child`` starts as a copy of ``parent``'s table, sharing every block by reference."""
        if child in self.tables:
            raise CacheError(f"sequence {child} is already in the cache")
        table = self.tables[parent]
        for b in table:
            self.pool.share(b, fork=True)
        self.tables[child] = list(table)
        self.lens[child] = self.lens[parent]
        self.chains[child] = list(self.chains[parent])
        self.forks += 1

    def blocks_to_grow(self, seq_id: int, n_tokens: int) -> int:
        return max(0, self.blocks_for(n_tokens) - len(self.tables[seq_id]))

    def _shared_target(self, seq_id: int, n_tokens: int) -> int | None:
        """The block that growing to ``n_tokens`` writes first, when another sequence holds it too."""
        start = self.lens[seq_id]
        if n_tokens <= start:
            return None
        table, j = self.tables[seq_id], start // self.block_size
        if j < len(table) and self.pool.ref[table[j]] > 1:
            return table[j]
        return None

    def _blocks_needed(self, needs: list[tuple[int, int]]) -> int:
        """Blocks that growing every ``(seq_id, n_tokens)`` takes, copies on write included: each
        writer of a shared block copies it, except the last when every holder writes (it then
        holds the block alone and writes in place)."""
        need, writers = 0, {}
        for s, n in needs:
            need += self.blocks_to_grow(s, n)
            b = self._shared_target(s, n)
            if b is not None:
                writers[b] = writers.get(b, 0) + 1
        return need + sum(m - (m == self.pool.ref[b]) for b, m in writers.items())

    def grow(self, seq_id: int, n_tokens: int) -> None:
        if self._shared_target(seq_id, n_tokens) is not None:
            self._copy_on_write(seq_id)
        extra = self.blocks_to_grow(seq_id, n_tokens)
        if extra:
            self.tables[seq_id].extend(self.pool.allocate(extra))

    def _copy_on_write(self, seq_id: int) -> None:
        """Give ``seq_id`` its own copy of the shared block it is about to write: the positions
        already stored in it are copied (one device copy per pool, no sync), the reference on the
        shared one is dropped."""
        table, bs = self.tables[seq_id], self.block_size
        j = self.lens[seq_id] // bs
        old, (new,) = table[j], self.pool.allocate(1)
        used = self.lens[seq_id] - j * bs
        for pool in (self.k, self.v) if self.k is not None else ():
            pool[:, new * bs:new * bs + used].copy_(pool[:, old * bs:old * bs + used])
        self.pool.release([old])
        table[j] = new
        self.cow_copies += 1

    def release(self, seq_id: int) -> None:
        # Tail first: cached blocks are evicted least-recently-released first, so a prefix
        # (which other requests and this one's recompute can reuse) outlives its tail.
        self.pool.release(self.tables.pop(seq_id)[::-1])
        del self.lens[seq_id]
        del self.chains[seq_id]

    def reserve(self, needs: list[tuple[int, int]]) -> list[int]:
        """Grow each ``(seq_id, n_tokens)`` (oldest first) to hold ``n_tokens`` positions.

        When the free blocks do not cover every growth, sequences are preempted from the newest
        end (their blocks freed) until the rest fit; returns the preempted ids, newest first.
        A lone sequence that cannot grow is preempted too: the caller decides its fate.
        """
        live = list(needs)
        preempted: list[int] = []
        while live:
            need = self._blocks_needed(live)
            if self.pool.can_allocate(need):
                break
            victim, _ = live.pop()
            self.release(victim)
            preempted.append(victim)
        for s, n in live:
            self.grow(s, n)
        return preempted

    # ---- speculative decoding: room for draft tokens, and the rollback of rejected ones --------

    def draft_room(self, needs: list[tuple[int, int, int]]) -> list[int]:
        """For each ``(seq_id, n_tokens, want)`` in turn: how many positions past ``n_tokens`` (at
        most ``want``) the sequence can also hold with its own blocks and the blocks still free
        after the sequences before it took theirs. A check only: ``grow`` takes them. Growth for
        drafts never preempts anyone (a draft is an optimisation, not progress)."""
        free, out, bs = self.pool.num_free, [], self.block_size
        for s, n, want in needs:
            k = max(0, min(want, (len(self.tables[s]) + free) * bs - n))
            free -= self.blocks_to_grow(s, n + k)
            out.append(k)
        return out

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Roll ``seq_id`` back to its first ``n_tokens`` stored positions (draft tokens that were
        rejected): its length drops and the blocks past them go back to the pool. Those blocks
        are private and unregistered: ``commit`` only ever covers accepted tokens, and a draft
        block was freshly allocated (a sequence's shared blocks all lie below its length)."""
        table = self.tables[seq_id]
        if len(self.chains[seq_id]) * self.block_size > n_tokens:
            raise CacheError(f"sequence {seq_id} cannot roll back to {n_tokens} tokens: a registered block lies past them")
        keep = self.blocks_for(n_tokens)
        if len(table) > keep:
            self.pool.release(table[keep:][::-1])
            del table[keep:]
        self.lens[seq_id] = n_tokens

    # ---- the step ------------------------------------------------------------------------

    def slots(self, seq_id: int, start: int, n: int) -> list[int]:
        table, bs = self.tables[seq_id], self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, start + n)]

    def plan_step(self, decode: list[int], prefill: list[tuple[int, int, int]]) -> StepAttention:
        """Build one step's indices. ``decode``: seq ids appending one token each;
        ``prefill``: ``(seq_id, start, n)`` chunks. Updates stored lengths."""
        slot_mapping: list[int] = []
        for s in decode:
            slot_mapping += self.slots(s, self.lens[s], 1)
        for s, start, n in prefill:
            slot_mapping += self.slots(s, start, n)
        self.advance(decode, prefill)
        mapping = to_device(slot_mapping, self.device)
        if self.attention == "kernel":
            return StepAttention(list(self.k), list(self.v), mapping, len(decode), None, [],
                                 self._kernel_rows(decode, prefill))
        segments, row = [], len(decode)
        for s, start, n in prefill:
            gather = mask = None
            if start > 0:
                gather = to_device(self.slots(s, 0, start + n), self.device)
                mask = chunk_mask(start, n, self.device)
            segments.append(PrefillSegment(row, n, start, gather, mask))
            row += n
        rows = self._decode_rows(decode) if decode else None
        return StepAttention(list(self.k), list(self.v), mapping, len(decode), rows, segments)

    def advance(self, decode: list[int], prefill: list[tuple[int, int, int]]) -> None:
        """The bookkeeping half of ``plan_step``: the step's tokens are stored (lengths grow)."""
        for s in decode:
            self.lens[s] += 1
        for s, start, n in prefill:
            self.lens[s] = start + n

    def _padded_tables(self, seqs: list[int]) -> torch.Tensor:
        nb = max(len(self.tables[s]) for s in seqs)
        pad = self.num_blocks  # the scratch block id; padding is never read
        return to_device([self.tables[s] + [pad] * (nb - len(self.tables[s])) for s in seqs], self.device)

    def _kernel_rows(self, decode: list[int], prefill: list[tuple[int, int, int]]) -> KernelRows:
        """Decode rows see their whole sequence; prefill row at position p sees [0, p] (causal)."""
        row_seq, row_len = list(range(len(decode))), [self.lens[s] for s in decode]
        for i, (s, start, n) in enumerate(prefill, start=len(decode)):
            row_seq += [i] * n
            row_len += range(start + 1, start + n + 1)
        tables = self._padded_tables(decode + [s for s, _, _ in prefill])
        return KernelRows(tables, to_device(row_seq, self.device), to_device(row_len, self.device), self.block_size)

    def _decode_rows(self, decode: list[int]) -> DecodeRows:
        """The flat slot of every (row, position) up to the longest row, padded with scratch."""
        bs, lens = self.block_size, [self.lens[s] for s in decode]
        table, lens_t = self._padded_tables(decode), to_device(lens, self.device)
        pos = torch.arange(max(lens), device=self.device)
        idx = table[:, pos // bs] * bs + pos % bs
        valid = pos[None, :] < lens_t[:, None]
        idx = torch.where(valid, idx, torch.full_like(idx, self.scratch_slot))
        return DecodeRows(idx=idx, mask=valid[:, None, None, :])

    # ---- observation ---------------------------------------------------------------------

    def usage(self) -> CacheUsage:
        """Physical figures: a block shared by several sequences counts once."""
        used, forks = self.pool.num_active, self.pool.fork_refs
        if forks:  # a fork may share a partly filled block: count each block's fill once
            stored = self._stored_per_block()
        else:  # only whole prefix blocks are shared
            stored = sum(self.lens.values()) - self.pool.shared_extra * self.block_size
        return CacheUsage(used, self.pool.num_free, stored, used * self.block_size,
                          len(self.pool.evictable), self.pool.shared_extra, self.pool.num_shared,
                          fork_shared_blocks=len(forks), fork_refs=sum(forks.values()))

    def _stored_per_block(self) -> int:
        fill: dict[int, int] = {}
        bs = self.block_size
        for sid, table in self.tables.items():
            n = self.lens[sid]
            for j, b in enumerate(table):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, n - j * bs)))
        return sum(fill.values())


class SlotKVCache(PagedKVCache):
    """``n_slots`` contiguous reservations of ``max_len`` tokens, one per sequence."""

    kind = "slot"

    def __init__(self, cfg: ModelConfig, n_slots: int, max_len: int, dtype, device, attention: str = "auto",
                 tensors: bool = True, memory: PoolMemory | None = None):
        super().__init__(cfg, n_slots, max_len, dtype, device, scratch_slots=1, attention=attention, tensors=tensors,
                         memory=memory)
        self.max_len = max_len

    @classmethod
    def from_budget(cls, cfg, kv_bytes: int, max_len: int, dtype, device, **kw) -> "SlotKVCache":
        per_slot = max_len * token_bytes(cfg, dtype)
        n = kv_bytes // per_slot
        if n < 1:
            raise CacheError(
                f"a KV budget of {kv_bytes / 2**20:.1f} MiB holds no slot of max_model_len={max_len} "
                f"tokens ({per_slot / 2**20:.1f} MiB); raise kv_memory or lower max_model_len")
        return cls(cfg, int(n), max_len, dtype, device, **kw)

    def blocks_for(self, n_tokens: int) -> int:
        # The whole reservation, whatever the sequence's length (that is the point of comparison).
        if n_tokens > self.max_len:
            raise CacheError(f"{n_tokens} tokens do not fit a slot of {self.max_len}")
        return 1

    def fits_alone(self, n_tokens: int, forks: int = 0) -> bool:
        return n_tokens <= self.max_len and 1 + forks <= self.num_blocks

    def draft_room(self, needs: list[tuple[int, int, int]]) -> list[int]:
        # A slot never grows: drafts fit in what is left of the sequence's own reservation.
        return [max(0, min(want, self.max_len - n)) for _, n, want in needs]

