"""Physical block allocator for the paged KV cache: a free list of block ids.

Invariants:
- Every block id in ``[0, num_blocks)`` is either free or allocated, never both.
- The lowest ids go out first on a fresh pool; freed blocks are reused last-in first-out, so a
  block freed a moment ago (still warm in cache) is the next one handed out.
- Freeing a block twice, or one never allocated, raises ``BlockError``: silent double frees
  would later hand one block to two sequences and corrupt both.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count


class BlockError(RuntimeError):
    """Misuse of the allocator (double free, foreign id, allocation from an empty pool)."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        # Stack: pop() from the end, so reversed ids make block 0 come out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise BlockError(f"asked for {n} blocks but only {len(self._free)} are free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        self.peak_used = max(self.peak_used, len(self._used))
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise BlockError(f"block {b} is not allocated (double free or foreign id)")
            self._used.remove(b)
            self._free.append(b)

    def free_list(self) -> list[int]:
        """Free ids in the order they will be handed out (next first)."""
        return self._free[::-1]


ROOT_SERIAL = 0  # the parent entry of a sequence's first block


class BlockPool:
    """Reference-counted blocks over a ``BlockAllocator``, with optional prefix caching.

    With caching on, every full block may be registered under its key (``block_keys``: a digest
    chained from its parent's key and its own token ids). A block whose last user leaves keeps
    its contents and key and becomes *evictable*: it still counts as free space, but a later
    request with the same prefix can take it back. Fresh blocks are handed out first; only then
    is the least recently released evictable block reused (and its entry forgotten).

    Forks of one request (parallel sampling) take references on their parent's blocks the same
    way; ``fork_refs`` counts the extra references they took that are still held, per block
    (references are interchangeable, so a release lowers it to at most ``ref - 1``).

    A cached block's entry ``(key, parent, tokens, serial)`` says it holds the K/V of ``tokens``
    computed after the prefix that the entry numbered ``parent`` holds (``ROOT_SERIAL``: none).
    Serials are never reused, so an entry whose block was evicted cannot be mistaken for a later
    one. (Entries are plain tuples: a NamedTuple's constructor cost a tenth of admission time.)

    Invariants: ``ref[b] > 0`` exactly for blocks in some table; evictable blocks have ``ref 0``
    and an entry. An entry holds exactly its parent entry's prefix plus its own tokens (a
    sequence registers a block only under the entry that holds its own previous block), and a
    lookup only returns a block whose stored tokens and parent *entry* (not parent key) match
    the query's; so, by induction, a hit holds the query's whole prefix even when keys collide.
    """

    def __init__(self, num_blocks: int, caching: bool = False):
        self.allocator = BlockAllocator(num_blocks)
        self.caching = caching
        self.ref = [0] * num_blocks
        self.key_of: dict[int, tuple[bytes, int, bytes, int]] = {}  # block -> its entry
        self.by_key: dict[bytes, int] = {}  # key -> the block that holds it
        self._serials = count(ROOT_SERIAL + 1)
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.shared_extra = 0  # sum over blocks of max(0, ref - 1)
        self.num_shared = 0  # blocks with ref > 1 (kept with shared_extra: a pool may be large)
        self.fork_refs: dict[int, int] = {}  # block -> extra references taken by forks, still held
        self.peak_active = 0

    @property
    def num_free(self) -> int:
        return self.allocator.num_free + len(self.evictable)

    @property
    def num_active(self) -> int:
        return self.allocator.num_used - len(self.evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise BlockError(f"asked for {n} blocks but only {self.num_free} are free")
        fresh = min(n, self.allocator.num_free)
        out = self.allocator.allocate(fresh) if fresh else []
        while len(out) < n:  # reuse the least recently released cached block
            b, _ = self.evictable.popitem(last=False)
            self._forget(b)
            out.append(b)
        for b in out:
            self.ref[b] = 1
        self.peak_active = max(self.peak_active, self.num_active)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] <= 0:
                raise BlockError(f"block {b} is not held by anyone (double release)")
            self.ref[b] -= 1
            if b in self.fork_refs:
                self.fork_refs[b] = min(self.fork_refs[b], self.ref[b] - 1)
                if self.fork_refs[b] <= 0:
                    del self.fork_refs[b]
            if self.ref[b] >= 1:
                self.shared_extra -= 1
                self.num_shared -= self.ref[b] == 1
            elif b in self.key_of:
                self.evictable[b] = None  # most recently released at the end
            else:
                self.allocator.free([b])

    def share(self, b: int, fork: bool = False) -> None:
        """Take another reference to a cached block (a prefix hit) or to a parent's block (a fork)."""
        if fork:
            self.fork_refs[b] = self.fork_refs.get(b, 0) + 1
        if self.ref[b] == 0:
            del self.evictable[b]
        else:
            self.shared_extra += 1
            self.num_shared += self.ref[b] == 1
        self.ref[b] += 1
        self.peak_active = max(self.peak_active, self.num_active)

    def lookup(self, key: bytes, parent: int, tokens: bytes) -> tuple[int, int] | None:
        """The cached block holding ``tokens`` after entry ``parent``, with its entry's serial."""
        b = self.by_key.get(key)
        if b is None:
            return None
        _, p, toks, serial = self.key_of[b]
        # The key only finds the candidate; comparing the entry itself is what makes a key
        # collision (or a forced one in tests) a miss instead of someone else's K/V.
        return (b, serial) if p == parent and toks == tokens else None

    def register(self, b: int, key: bytes, parent: int, tokens: bytes) -> int | None:
        """Cache block ``b`` as holding ``tokens`` after entry ``parent``. Returns the serial of
        the entry that now holds this content (a new one, or the one already cached under
        ``key``), or None when ``key`` is taken by other content (a collision): the caller's
        chain ends there, since no entry stands for its block to chain later blocks from."""
        if not self.caching:
            return None
        holder = self.by_key.get(key, b)
        e = self.key_of.get(holder)
        if e is None:  # a new key on an unregistered block
            serial = next(self._serials)
            self.key_of[b] = (key, parent, tokens, serial)
            self.by_key[key] = b
            return serial
        # Identical content already cached under another block: keep that one, chain through it.
        k, p, toks, serial = e
        return serial if k == key and p == parent and toks == tokens else None

    def _forget(self, b: int) -> None:
        # Entries that chained from this one keep its serial, which no later entry gets: they
        # become unreachable (and are evicted in turn) rather than extend a different prefix.
        key = self.key_of.pop(b)[0]
        if self.by_key.get(key) == b:
            del self.by_key[key]
