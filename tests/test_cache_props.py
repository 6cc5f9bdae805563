"""Property tests of the allocator and the paged cache, driven through the real scheduler:
random arrivals, lengths, finishes and pool sizes, with the invariants checked after every step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tinyllm_cli.cache.allocator import BlockAllocator, BlockError
from tinyllm_cli.cache.blocks import BlockManager, CacheError, SlotBlockManager
from tinyllm_cli.cache.storage import KVStorage
from tinyllm_cli.engine.request import Request, SamplingParams, Sequence, Status
from tinyllm_cli.engine.scheduler import Scheduler, Verify
from tinyllm_cli.model.llama import ModelConfig

CFG = ModelConfig(vocab_size=50, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=8)


def test_allocator_order_and_errors():
    a = BlockAllocator(5)
    assert a.allocate(3) == [0, 1, 2]  # lowest ids first
    a.free([1])
    a.free([0])
    assert a.allocate(1) == [0]  # LIFO: the last freed comes back first
    assert a.allocate(1) == [1]
    assert a.peak_used == 3 and a.num_free == 2
    with pytest.raises(BlockError):
        a.free([4])  # never allocated
    a.free([2])
    with pytest.raises(BlockError):
        a.free([2])  # double free
    with pytest.raises(BlockError):
        a.allocate(10)


@given(st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(1, 4)),
                          st.tuples(st.just("free"), st.integers(0, 30))), max_size=60))
def test_allocator_never_hands_out_a_block_twice(ops):
    a = BlockAllocator(12)
    held: list[int] = []
    for op, n in ops:
        if op == "alloc" and a.can_allocate(n):
            got = a.allocate(n)
            assert not set(got) & set(held)
            held += got
        elif op == "free" and held:
            b = held.pop(n % len(held))
            a.free([b])
        assert a.num_free + a.num_used == 12 and a.num_used == len(held)
        assert set(a.free_list()).isdisjoint(held)


def check_invariants(cache: BlockManager, sched: Scheduler, shared_ok: bool = False) -> None:
    """``shared_ok``: prefix caching may put one block in several tables (counted by its refs)."""
    owned = [b for t in cache.tables.values() for b in t]
    assert shared_ok or len(owned) == len(set(owned)), "a block is in two tables"
    evictable = set(cache.pool.evictable)
    assert evictable.isdisjoint(owned) and set(owned) | evictable == cache.allocator._used
    for b in range(cache.num_blocks):  # a block is referenced exactly by the tables holding it
        assert cache.pool.ref[b] == owned.count(b)
    assert cache.allocator.num_free + cache.allocator.num_used == cache.num_blocks
    assert cache.num_blocks not in owned  # the scratch block is never handed out
    running = {s.seq_id: s for s in sched.running}
    assert set(cache.tables) == set(running)
    for sid, s in running.items():
        stored, table = cache.lens[sid], cache.tables[sid]
        assert stored == s.num_cached
        assert len(table) * cache.block_size >= stored
        if s.status is Status.DECODE and cache.kind == "paged":
            assert len(table) == cache.blocks_for(stored)  # waste < block_size
            assert len(table) * cache.block_size - stored < cache.block_size
    for s in sched.waiting:
        assert s.seq_id not in cache.tables and s.num_cached == 0


def simulate(cache, reqs, max_num_seqs, budget, finish_draws):
    """Drive scheduler + cache exactly as the engine does, with a fake sampler."""
    sched, storage = Scheduler(cache, max_num_seqs, budget), KVStorage(cache, "cpu")
    for i, (plen, new) in enumerate(reqs):
        r = Request(str(i), list(range(plen)), SamplingParams(max_new_tokens=new))
        sched.add(Sequence(i, r, 0, list(r.prompt_token_ids), plen))
    done, steps, draws = 0, 0, iter(finish_draws)
    total = len(reqs)
    while sched.has_work():
        steps += 1
        assert steps < 5000, "the scheduler stopped making progress"
        plan = sched.schedule()
        for s in plan.failed:
            done += 1
        storage.plan_step([s.seq_id for s in plan.decode], [(c.seq.seq_id, c.start, c.n) for c in plan.prefill])
        for s in plan.decode:
            s.num_cached += 1
        for c in plan.prefill:
            c.seq.num_cached = c.start + c.n
        samplers = plan.decode + [c.seq for c in plan.prefill if c.completes_prompt]
        for s in samplers:
            s.tokens.append(1)
            s.status = Status.DECODE
            if s.num_output >= s.request.params.max_new_tokens or next(draws, False):
                sched.finish(s)
                done += 1
        check_invariants(cache, sched)
    assert done == total
    assert cache.allocator.num_used == 0


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 8]), extra_blocks=st.integers(0, 12),
       reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=10),
       max_num_seqs=st.integers(1, 8), budget=st.integers(1, 40),
       finish_draws=st.lists(st.booleans(), max_size=200))
def test_paged_cache_invariants_under_random_workloads(block_size, extra_blocks, reqs, max_num_seqs,
                                                       budget, finish_draws):
    longest = max(p + n for p, n in reqs)
    num_blocks = -(-longest // block_size) + extra_blocks  # every request fits alone
    cache = BlockManager(CFG, num_blocks, block_size, torch.float32)
    simulate(cache, reqs, max_num_seqs, budget, finish_draws)


@settings(max_examples=25, deadline=None)
@given(n_slots=st.integers(1, 4), reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=8),
       finish_draws=st.lists(st.booleans(), max_size=100))
def test_slot_cache_invariants(n_slots, reqs, finish_draws):
    cache = SlotBlockManager(CFG, n_slots, 40, torch.float32)
    simulate(cache, reqs, 8, 64, finish_draws)


def test_preemption_picks_newest():
    cache = BlockManager(CFG, 7, 2, torch.float32)
    sched = Scheduler(cache, 8, 100)
    for i in range(4):
        r = Request(str(i), [1, 2, 3, 4], SamplingParams(max_new_tokens=50))
        sched.add(Sequence(i, r, 0, [1, 2, 3, 4], 4))
    plan = sched.schedule()  # each needs 3 free blocks to enter and takes 2: three get in
    assert len(plan.prefill) == 3 and cache.allocator.num_free == 1
    cache.advance([], [(c.seq.seq_id, c.start, c.n) for c in plan.prefill])
    for c in plan.prefill:
        s = c.seq
        s.num_cached = c.start + c.n
        s.tokens.append(1)
        s.status = Status.DECODE
    plan = sched.schedule()  # each needs a third block, one is free: the newest (2) must go
    assert [s.seq_id for s in plan.preempted] == [2]
    assert [s.seq_id for s in sched.waiting] == [2, 3]  # requeued at the front, ahead of 3
    assert [s.seq_id for s in plan.decode] == [0, 1] and not plan.prefill  # no admission while preempting
    assert sched.waiting[0].lost_tokens == 4 and sched.waiting[0].num_cached == 0  # counted on re-admission


# ---- the block pool under drafts and rejections --------------------------------------------------

def speculative_simulation(cache, reqs, max_num_seqs, budget, draws, k):
    """Drive scheduler + cache as the engine does, with random drafts and random acceptance,
    checking the pool after every step."""
    sched, storage = Scheduler(cache, max_num_seqs, budget), KVStorage(cache, "cpu")
    for i, (plen, new) in enumerate(reqs):
        r = Request(str(i), [(i * 7 + j) % 5 for j in range(plen)], SamplingParams(max_new_tokens=new))
        sched.add(Sequence(i, r, 0, list(r.prompt_token_ids), plen))
    draws, steps, done = iter(draws), 0, 0
    while sched.has_work():
        steps += 1
        assert steps < 5000
        plan = sched.schedule()
        done += len(plan.failed)
        wants = [(s, min(k, s.request.params.max_new_tokens - s.num_output - 1)) for s in plan.decode]
        caps = sched.draft_room(plan, wants)
        sched.speculate(plan, [Verify(s, [1] * c) for (s, _), c in zip(wants, caps) if c > 0])
        for v in plan.verify:  # the granted room is really there, no preemption needed
            assert len(cache.tables[v.seq.seq_id]) * cache.block_size >= v.seq.num_tokens + len(v.drafts)
        storage.plan_step([s.seq_id for s in plan.decode],
                          [(c.seq.seq_id, c.start, c.n) for c in plan.prefill] +
                          [(v.seq.seq_id, v.seq.num_tokens - 1, 1 + len(v.drafts)) for v in plan.verify])
        for s in plan.decode:
            s.num_cached += 1
        for c in plan.prefill:
            c.seq.num_cached = c.start + c.n
        emits = [(s, 1) for s in plan.decode] + [(c.seq, 1) for c in plan.prefill if c.completes_prompt]
        for v in plan.verify:
            s, d = v.seq, v.drafts
            a = next(draws, 0) % (len(d) + 1)  # a random number of drafts accepted
            s.num_cached = s.num_tokens + a
            cache.truncate(s.seq_id, s.num_cached)
            emits.append((s, a + 1))
        for s, m in emits:
            s.tokens += [(s.num_tokens + j) % 5 for j in range(m)]
            s.status = Status.DECODE
            if s.num_output >= s.request.params.max_new_tokens or next(draws, 0) % 7 == 0:
                sched.finish(s)
                done += 1
        check_invariants(cache, sched, shared_ok=cache.prefix_caching)
        for s in sched.running:  # a registered block only ever holds accepted tokens
            assert len(cache.chains[s.seq_id]) * cache.block_size <= s.num_tokens
    assert done == len(reqs)
    assert cache.pool.num_active == 0 and all(r == 0 for r in cache.pool.ref)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 8]), extra_blocks=st.integers(0, 12), prefix=st.booleans(),
       reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 16)), min_size=1, max_size=8),
       max_num_seqs=st.integers(1, 6), budget=st.integers(1, 40), k=st.integers(1, 6),
       draws=st.lists(st.integers(0, 100), max_size=300))
def test_paged_pool_invariants_hold_with_drafts_and_rejections(block_size, extra_blocks, prefix, reqs, max_num_seqs,
                                                              budget, k, draws):
    longest = max(p + n for p, n in reqs)
    cache = BlockManager(CFG, -(-longest // block_size) + extra_blocks, block_size, torch.float32, prefix_caching=prefix)
    speculative_simulation(cache, reqs, max_num_seqs, budget, draws, k)


@settings(max_examples=20, deadline=None)
@given(n_slots=st.integers(1, 4), reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=6),
       k=st.integers(1, 6), draws=st.lists(st.integers(0, 100), max_size=200))
def test_slot_pool_invariants_hold_with_drafts_and_rejections(n_slots, reqs, k, draws):
    speculative_simulation(SlotBlockManager(CFG, n_slots, 40, torch.float32), reqs, 8, 64, draws, k)


def test_truncate_refuses_to_cut_a_registered_block():
    cache = BlockManager(CFG, 8, 2, torch.float32, prefix_caching=True)
    cache.try_admit(0, [1, 2, 3, 4, 5])
    cache.commit(0, [1, 2, 3, 4, 5], 5)  # blocks 0 and 1 registered (positions 0..3)
    cache.advance([], [(0, 0, 5)])

    with pytest.raises(CacheError, match="registered block"):
        cache.truncate(0, 3)
    cache.truncate(0, 4)
    assert len(cache.tables[0]) == 2 and cache.pool.num_active == 2


def test_a_runner_and_a_drafter_refuse_storage_of_another_block_manager():
    """The K/V storage a model runner or a draft model is handed must hold its own block manager's
    pools: the scheduler's tables would point into another pool."""
    from types import SimpleNamespace
    from tinyllm_cli.engine.runner import ModelRunner
    from tinyllm_cli.engine.speculative import ModelDrafter
    mine, other = BlockManager(CFG, 4, 2, torch.float32), BlockManager(CFG, 4, 2, torch.float32)
    model = SimpleNamespace(device=torch.device("cpu"))
    for build in (ModelRunner, ModelDrafter):
        with pytest.raises(ValueError, match="another block manager"):
            build(model, mine, KVStorage(other, "cpu"))
        assert build(model, mine, KVStorage(mine, "cpu")).storage.blocks is mine
        assert build(model, mine).storage.blocks is mine
