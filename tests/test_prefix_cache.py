"""Prefix caching: reused K/V must give exactly the tokens of computing everything, and block
reference counts must follow their users exactly."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinyllm_cli.cache.blocks as blocks_mod
from tinyllm_cli.cache.blocks import BlockManager
from tinyllm_cli.cache.storage import KVStorage
from tinyllm_cli.engine.engine import LLMEngine
from tinyllm_cli.engine.request import Request, SamplingParams, Sequence, Status
from tinyllm_cli.engine.scheduler import Scheduler
from tinyllm_cli.model.llama import ModelConfig

from test_block_keys import COLLIDING
from test_engine import reference_greedy


def shared_prefix_requests(seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(3, 320) for _ in range(45)]
    prompts = [
        base[:13] + [7, 8, 9],          # prefix ends inside a block (of 4 and of 8)
        base[:13] + [10, 11],
        base[:24],                      # entirely a prefix of the next ones, block aligned
        base[:24] + [12, 13, 14, 15, 16],
        base[:45],
        base[:31] + [17],
        [rng.randrange(3, 320) for _ in range(9)],  # shares nothing
        base[:24],                      # an exact repeat
    ]
    return [Request(str(i), p, SamplingParams(max_new_tokens=6 + i % 3, ignore_eos=True), index=i)
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def shared(tiny_model):
    reqs = shared_prefix_requests()
    return reqs, [reference_greedy(tiny_model, r.prompt_token_ids, r.params.max_new_tokens) for r in reqs]


def run(model, reqs, *, caching, block_size=4, num_blocks=256, **kw):
    cache = BlockManager(model.cfg, num_blocks, block_size, torch.float32, prefix_caching=caching)
    eng = LLMEngine(model, cache, None, **kw)
    return sorted(eng.run(reqs), key=lambda o: o.index), eng


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_outputs_identical_with_and_without_prefix_cache(tiny_model, shared, block_size, max_num_seqs):
    reqs, refs = shared
    on, eng = run(tiny_model, reqs, caching=True, block_size=block_size, max_num_seqs=max_num_seqs)
    off, _ = run(tiny_model, reqs, caching=False, block_size=block_size, max_num_seqs=max_num_seqs)
    assert [o.token_ids for o in on] == [o.token_ids for o in off] == refs
    s = eng.stats.summary()
    assert s["prefix_cache_hits"] > 0 and 0 < s["prefix_cache_hit_rate"] < 1
    # Skipped prefill tokens are exactly the hits: computed + skipped = every prompt token.
    assert s["prefill_tokens"] + s["prefix_cache_hits"] == sum(len(r.prompt_token_ids) for r in reqs)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill_with_prefix_cache(tiny_model, shared, chunk):
    reqs, refs = shared
    outs, _ = run(tiny_model, reqs, caching=True, max_num_seqs=2, max_prefill_tokens=chunk)
    assert [o.token_ids for o in outs] == refs


def test_preemption_with_prefix_cache(tiny_model, shared):
    reqs, refs = shared
    outs, eng = run(tiny_model, reqs, caching=True, num_blocks=17, max_num_seqs=8)
    s = eng.stats.summary()
    assert [o.token_ids for o in outs] == refs
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0


def test_recompute_after_preemption_reuses_own_blocks(tiny_model):
    # Two long prompts in a pool that holds one and a half: the newer is preempted, and when it
    # comes back its own full blocks are still cached, so it recomputes less than it lost.
    a = Request("a", list(range(3, 43)), SamplingParams(max_new_tokens=30, ignore_eos=True), index=0)
    b = Request("b", list(range(100, 140)), SamplingParams(max_new_tokens=30, ignore_eos=True), index=1)
    outs, eng = run(tiny_model, [a, b], caching=True, num_blocks=27, max_num_seqs=2)
    s = eng.stats.summary()
    assert s["preemptions"] >= 1
    lost_total = sum(o.preemptions for o in outs)
    assert lost_total >= 1 and s["prefix_cache_hits"] > 0
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_model, r.prompt_token_ids, 30) for r in (a, b)]


@pytest.mark.parametrize("mode", sorted(COLLIDING))
def test_forced_key_collisions_keep_outputs_exact(tiny_model, mode):
    # Block keys forced to collide (test_block_keys.COLLIDING): hits are checked against the
    # stored tokens and parent entry, so outputs stay those of computing everything. In blocks
    # of 4, x + w meets x's cached block, then the block y + w cached for w: reusing it would
    # attend to K/V computed after y (what the old hash-chained keys did on a collision).
    rng = random.Random(3)
    x, y, z, w = ([rng.randrange(3, 320) for _ in range(4)] for _ in range(4))  # a block each
    prompts = [x + z + [5], y + w + [6], x + w + [7], x + z + [8], y + w + [9]]
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=5, ignore_eos=True), index=i)
            for i, p in enumerate(prompts)]
    refs = [reference_greedy(tiny_model, p, 5) for p in prompts]
    with mock.patch.object(blocks_mod, "block_key", COLLIDING[mode]):
        outs, _ = run(tiny_model, reqs, caching=True, max_num_seqs=1)
    assert [o.token_ids for o in outs] == refs


CFG = ModelConfig(vocab_size=50, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=8)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), extra=st.integers(0, 10),
       prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 14), st.integers(1, 6)), min_size=1, max_size=9),
       max_num_seqs=st.integers(1, 5), budget=st.integers(1, 30),
       finish=st.lists(st.booleans(), max_size=150))
def test_refcounts_and_no_shared_writes(block_size, extra, prompts, max_num_seqs, budget, finish):
    """Random prompts built from 4 shared stems: refcounts match the tables after every step,
    a block returns to the free space exactly when its last user leaves, shared data is never
    changed, and every sequence's table always shows exactly its own tokens."""
    stems = [[(7 * k + j) % 50 for j in range(16)] for k in range(4)]
    reqs = [stems[k][:p] + [1] * 0 + list(range(1, 1 + tail)) for k, p, tail in prompts]
    longest = max(len(r) + 6 for r in reqs)
    cache = BlockManager(CFG, -(-longest // block_size) + extra + 1, block_size, torch.float32, prefix_caching=True)
    storage = KVStorage(cache, "cpu")
    sched = Scheduler(cache, max_num_seqs, budget)
    for i, toks in enumerate(reqs):
        r = Request(str(i), toks, SamplingParams(max_new_tokens=6))
        sched.add(Sequence(i, r, 0, list(toks), len(toks)))
    draws, steps = iter(finish), 0
    content: dict[int, tuple[int, int]] = {}  # slot -> (token, position) last written there
    while sched.has_work():
        steps += 1
        assert steps < 3000
        plan = sched.schedule()
        writes = [(s, s.num_tokens - 1) for s in plan.decode]
        writes += [(c.seq, p) for c in plan.prefill for p in range(c.start, c.start + c.n)]
        attn = storage.plan_step([s.seq_id for s in plan.decode], [(c.seq.seq_id, c.start, c.n) for c in plan.prefill])
        assert attn.slot_mapping.tolist() == [cache.slots(s.seq_id, p, 1)[0] for s, p in writes]
        for s, p in writes:
            assert p >= s.num_cached  # nobody rewrites what it (or a block it shares) already holds
            content[cache.slots(s.seq_id, p, 1)[0]] = (s.tokens[p], p)
        for s in plan.decode:
            s.num_cached += 1
        for c in plan.prefill:
            c.seq.num_cached = c.start + c.n
        # Every table reads back exactly its own tokens: a write into a block someone else
        # relies on, or a wrong prefix hit, would show up here.
        for s in sched.running:
            for p in range(s.num_cached):
                assert content[cache.slots(s.seq_id, p, 1)[0]] == (s.tokens[p], p)
        for s in plan.decode + [c.seq for c in plan.prefill if c.completes_prompt]:
            s.tokens.append(3)
            s.status = Status.DECODE
            if s.num_output >= 6 or next(draws, False):
                held = list(cache.tables[s.seq_id])
                before = {b: cache.pool.ref[b] for b in held}
                sched.finish(s)
                for b in held:
                    assert cache.pool.ref[b] == before[b] - 1
                    if before[b] == 1:  # its last user left: free space again (maybe still cached)
                        assert b in cache.pool.evictable or b in cache.allocator.free_list()
                    else:
                        assert b not in cache.pool.evictable and b not in cache.allocator.free_list()
        owned = [b for t in cache.tables.values() for b in t]
        for b in range(cache.num_blocks):
            assert cache.pool.ref[b] == owned.count(b)
        assert cache.pool.num_free + cache.pool.num_active == cache.num_blocks
    assert cache.pool.num_active == 0
