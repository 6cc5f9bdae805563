"""The block pool's bookkeeping: which blocks hold which sequence's tokens. No tensors here.

The paged cache is virtual memory for K/V. A sequence's *block table* is its page table: logical
block j -> physical block id, and token t lives at ``(table[t // block_size], t % block_size)``.
One table serves every layer (block b holds the same positions in each layer's pool). Blocks are
allocated as a sequence grows, never reserved up front, and all blocks are the same size, so any
free block fits any sequence: no external fragmentation, and at most ``block_size - 1`` unused
slots per sequence (its last, partly filled block).

``BlockManager`` is everything the scheduler asks of the cache (admission, growth, preemption
sizing, forks, prefix hits, rollback, usage), as host lists and counters; the engine's scheduler
and the simulator talk only to it. The K/V tensors and each step's attention plan are
``storage.KVStorage``'s, which reads the tables and lengths kept here. ``SlotBlockManager`` is a
policy variant: one block of ``max_len`` tokens per sequence, taken whole at admission.

Invariants (checked by the property tests):
- free + used blocks = ``num_blocks``; no block is in two tables except by a counted reference
  (a prefix hit or a fork).
- ``len(table) == ceil(capacity / block_size)`` where capacity >= stored tokens, and unused
  slots per sequence stay below ``block_size`` for the paged cache.
- Block id ``num_blocks`` is never allocated: the storage keeps its scratch slots there.
- When a decode step needs more blocks than are free, the *newest* sequences are preempted: they
  have done the least work, so recomputing them wastes the least (vLLM's recompute policy).
- Forks (parallel sampling): ``fork`` gives a child the parent's table, taking a reference on
  every block; the first write into a block that is still shared gives the writer its own copy
  first (copy on write, decided in ``grow``), so **no shared block is ever written**. Only the
  last, partly filled block can need it: full blocks are never written again. The copy of the
  contents is the storage's: ``grow`` records ``(src, dst, positions)`` and the storage applies
  the pending copies (``take_copies``) before the step's forward. Until then ``src`` is still
  held by the sequences that share it, so it is neither freed nor rewritten in between.
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
from .allocator import ROOT_SERIAL, BlockPool
from .block_keys import ROOT, TOKEN_BYTES, as_salt, block_key, encode_tokens, prefix_salt


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


class BlockManager:
    """Block tables, lengths and prefix chains of a paged KV pool of ``num_blocks`` blocks of
    ``block_size`` tokens of ``cfg``'s K/V in ``dtype`` (which only size it: no tensors here)."""

    kind = "paged"

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 prefix_caching: bool = False, salt: bytes | None = None):
        if block_size <= 0 or num_blocks <= 0:
            raise CacheError("block_size and num_blocks must be positive")
        self.cfg, self.num_blocks, self.block_size, self.dtype = cfg, num_blocks, block_size, dtype
        self.bytes_per_token = token_bytes(cfg, dtype)
        self.kv_bytes = num_blocks * block_size * self.bytes_per_token
        self.sizing: str | None = None  # how the pool's size was chosen (runtime.kv_budget), for stats
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
        self.copies: list[tuple[int, int, int]] = []  # copies on write not applied yet: (src, dst, positions)
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of those, tokens whose K/V were reused
        self.forks = 0  # sequences forked from a parent (parallel sampling)
        self.cow_copies = 0  # shared blocks copied before a fork's first write into them

    @property
    def prefix_caching(self) -> bool:
        return self.pool.caching

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now (cached blocks no sequence holds included)."""
        return self.pool.num_free

    # ---- sizing -------------------------------------------------------------------------

    @staticmethod
    def blocks_in(cfg: ModelConfig, kv_bytes: int, block_size: int, dtype: torch.dtype) -> int:
        """How many blocks of ``block_size`` tokens a budget of ``kv_bytes`` holds (a CacheError
        when not one): the pool's size, computed before anything is built."""
        per_block = block_size * token_bytes(cfg, dtype)
        n = kv_bytes // per_block
        if n < 1:
            raise CacheError(f"a KV budget of {kv_bytes} bytes holds no block of {per_block} bytes")
        return int(n)

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def fits_alone(self, n_tokens: int, forks: int = 0) -> bool:
        """Could ``n_tokens`` positions fit if this sequence (and ``forks`` more that will fork
        from it, one block each for their first token) had the whole pool to itself?"""
        return self.blocks_for(n_tokens) + forks <= self.num_blocks

    # ---- check / act pairs for the scheduler -------------------------------------------

    def can_admit(self, tokens: list[int], forks: int = 0, use_prefix: bool = True) -> bool:
        """Whether ``try_admit`` would admit these tokens now (a check only)."""
        return self._admission(tokens, forks, use_prefix) is not None

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
        found = self._admission(tokens, forks, use_prefix)
        if found is None:
            return None
        hits, chain = found
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

    def _admission(self, tokens: list[int], forks: int, use_prefix: bool):
        """(prefix hits, their chain entries) when ``tokens`` plus one, and ``forks`` first
        tokens, fit now; else None."""
        hits, chain = self._prefix_hits(tokens) if use_prefix else ([], [])
        reclaimed = sum(self.pool.ref[b] == 0 for b in hits)  # evictable hits stop being free
        if self.blocks_for(len(tokens) + 1) + forks - len(hits) > self.pool.num_free - reclaimed:
            return None
        return hits, chain

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

    @property
    def shares_blocks(self) -> bool:
        """Whether any block has more than one holder (while none has, no growth copies)."""
        return self.pool.num_shared > 0

    def needs_copy(self, seq_id: int, n_tokens: int) -> bool:
        """Whether growing ``seq_id`` to ``n_tokens`` first writes a block another sequence holds
        (so ``grow`` copies it on write)."""
        return self._shared_target(seq_id, n_tokens) is not None

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
        """Give ``seq_id`` its own block in place of the shared one it is about to write, drop its
        reference on the shared one, and record the copy of the positions already stored in it
        (the storage applies it before the step's forward)."""
        table, bs = self.tables[seq_id], self.block_size
        j = self.lens[seq_id] // bs
        old, (new,) = table[j], self.pool.allocate(1)
        self.copies.append((old, new, self.lens[seq_id] - j * bs))
        self.pool.release([old])
        table[j] = new
        self.cow_copies += 1

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The copies on write recorded since the last call, ``(src, dst, positions)`` in order;
        the caller applies them (``KVStorage``) or, holding no K/V, drops them (the simulator)."""
        out, self.copies = self.copies, []
        return out

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
        """Flat slots (``block * block_size + offset``) of positions ``[start, start + n)``."""
        table, bs = self.tables[seq_id], self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, start + n)]

    def advance(self, decode: list[int], prefill: list[tuple[int, int, int]]) -> None:
        """The step's tokens are stored: each ``decode`` id one more, each ``(seq_id, start, n)``
        chunk up to ``start + n`` (their tables already hold those positions)."""
        for s in decode:
            self.lens[s] += 1
        for s, start, n in prefill:
            self.lens[s] = start + n

    def store(self, seq_id: int, n_tokens: int) -> None:
        """``seq_id`` now stores ``n_tokens`` positions (several decode steps at once: the
        simulator's skip-ahead); its table must already hold them."""
        if self.blocks_for(n_tokens) > len(self.tables[seq_id]):
            raise CacheError(f"sequence {seq_id} has no blocks for {n_tokens} tokens")
        self.lens[seq_id] = n_tokens

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


class SlotBlockManager(BlockManager):
    """``n_slots`` contiguous reservations of ``max_len`` tokens, one per sequence: the same
    bookkeeping with one block of ``max_len`` tokens, taken whole at admission, so every
    sequence pays for the longest one it could become."""

    kind = "slot"

    def __init__(self, cfg: ModelConfig, n_slots: int, max_len: int, dtype: torch.dtype):
        super().__init__(cfg, n_slots, max_len, dtype)
        self.max_len = max_len

    @staticmethod
    def blocks_in(cfg: ModelConfig, kv_bytes: int, max_len: int, dtype: torch.dtype) -> int:
        """How many slots of ``max_len`` tokens a budget of ``kv_bytes`` holds (a CacheError when
        not one)."""
        per_slot = max_len * token_bytes(cfg, dtype)
        n = kv_bytes // per_slot
        if n < 1:
            raise CacheError(
                f"a KV budget of {kv_bytes / 2**20:.1f} MiB holds no slot of max_model_len={max_len} "
                f"tokens ({per_slot / 2**20:.1f} MiB); raise kv_memory or lower max_model_len")
        return int(n)

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
