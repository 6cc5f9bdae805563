"""A read-only snapshot of a paged cache's bookkeeping at one moment: block tables, fill, refs,
the free list and the cached free blocks. Copies, never views: a snapshot taken mid-run stays as
it was while the cache moves on. The one place outside the cache classes that reads their
bookkeeping (``inspect-blocks`` and its pictures read snapshots only)."""

from __future__ import annotations

from dataclasses import dataclass

from .blocks import CacheUsage


@dataclass(frozen=True)
class BlockSnapshot:
    block_size: int
    num_blocks: int  # the scratch block is number ``num_blocks``, never allocated
    tables: dict[int, tuple[int, ...]]  # seq id -> physical blocks, logical order
    lens: dict[int, int]  # seq id -> tokens stored
    refs: tuple[int, ...]  # per block: sequences holding it
    free_list: tuple[int, ...]  # next out first
    cached_free: tuple[int, ...]  # free blocks still holding a cached prefix, evicted oldest first
    prefix_caching: bool
    forks: int
    cow_copies: int
    usage: CacheUsage


def take(cache) -> BlockSnapshot:
    return BlockSnapshot(
        block_size=cache.block_size, num_blocks=cache.num_blocks,
        tables={sid: tuple(t) for sid, t in cache.tables.items()}, lens=dict(cache.lens),
        refs=tuple(cache.pool.ref), free_list=tuple(cache.allocator.free_list()),
        cached_free=tuple(cache.pool.evictable), prefix_caching=cache.prefix_caching, forks=cache.forks,
        cow_copies=cache.cow_copies, usage=cache.usage())
