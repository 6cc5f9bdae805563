"""Physical block allocator for the paged KV cache: a free list of block ids.

Invariants:
- Every block id in ``[0, num_blocks)`` is either free or allocated, never both.
- The lowest ids go out first on a fresh pool; freed blocks are reused last-in first-out, so a
  block freed a moment ago (still warm in cache) is the next one handed out.
- Freeing a block twice, or one never allocated, raises ``BlockError``: silent double frees
  would later hand one block to two sequences and corrupt both.
"""

from __future__ import annotations


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
