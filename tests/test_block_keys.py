"""Prefix-cache block keys: what a key depends on (all earlier tokens, the salt, nothing else),
and that no key collision, forced at any block depth, ever serves one prefix's K/V to another."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinyllm_cli.cache.blocks as blocks_mod
from tinyllm_cli.cache import block_keys
from tinyllm_cli.cache.allocator import ROOT_SERIAL, BlockPool
from tinyllm_cli.cache.block_keys import ROOT, prefix_salt
from tinyllm_cli.cache.blocks import BlockManager
from tinyllm_cli.config import Config
from tinyllm_cli.runtime import Runtime, make_blocks, pool_size

from conftest import wait_s
from test_cache_props import CFG
from test_parallel_sampling import fork_simulation

REAL = block_keys.block_key
OTHER = b"\x01" * block_keys.KEY_BYTES  # a constant key that is not ROOT

# Ways to make the digest collide, each standing for a different attack on the chain:
COLLIDING = {
    "constant": lambda salt, parent, toks: OTHER,  # every block, every depth
    "first_block": lambda salt, parent, toks: OTHER if parent == ROOT else REAL(salt, parent, toks),
    "no_parent": lambda salt, parent, toks: REAL(salt, ROOT, toks),  # equal blocks after any prefix
    "two_bits": lambda salt, parent, toks: bytes([REAL(salt, parent, toks)[0] & 3]) * 32,  # random
}


def chain_keys(cache: BlockManager, tokens: list[int], seq_id: int = 0) -> list[bytes]:
    """Keys of every full block of ``tokens``, as the cache registers them."""
    cache.try_admit(seq_id, tokens, use_prefix=False)
    cache.commit(seq_id, tokens, len(tokens))
    keys = [k for k, _ in cache.chains[seq_id]]
    cache.release(seq_id)
    return keys


def cache(block_size=4, num_blocks=64, dtype=torch.float32, cfg=CFG, **kw) -> BlockManager:
    return BlockManager(cfg, num_blocks, block_size, dtype, prefix_caching=True, **kw)


# ---- what a key depends on ----------------------------------------------------------------------

@settings(max_examples=80)
@given(block_size=st.sampled_from([1, 2, 4, 8]), tokens=st.lists(st.integers(0, 49), min_size=1, max_size=40),
       at=st.integers(0, 39), delta=st.integers(1, 49))
def test_key_of_block_j_depends_on_exactly_tokens_up_to_its_end(block_size, tokens, at, delta):
    at %= len(tokens)
    changed = list(tokens)
    changed[at] = (changed[at] + delta) % 50
    c = cache(block_size)
    a, b = chain_keys(c, tokens), chain_keys(c, changed)
    assert len(a) == len(b) == len(tokens) // block_size
    for j, (ka, kb) in enumerate(zip(a, b)):
        assert (ka == kb) == ((j + 1) * block_size <= at), f"block {j}, token {at} changed"


def test_salt_separates_models_and_dtypes_and_is_deterministic():
    toks = list(range(3, 19))
    other_cfg = dataclasses.replace(CFG, num_layers=2)
    keys = {
        "base": chain_keys(cache(), toks),
        "again": chain_keys(cache(), toks),  # a fresh cache of the same model: the same keys
        "dtype": chain_keys(cache(dtype=torch.bfloat16), toks),
        "config": chain_keys(cache(cfg=other_cfg), toks),
        "name": chain_keys(cache(salt=prefix_salt(CFG, torch.float32, "other-model")), toks),
    }
    assert keys["base"] == keys["again"]
    firsts = [k[0] for name, k in keys.items() if name != "again"]
    assert len(set(firsts)) == len(firsts)  # no two models / dtypes share even a first block
    every = [x for name, k in keys.items() if name != "again" for x in k]
    assert len(set(every)) == len(every)


def test_keys_do_not_depend_on_the_process():
    # Python's hash() of str / bytes / tuples holding them is randomised per process (and the
    # salt is built from strings); keys must not be.
    code = ("import torch; from tinyllm_cli.cache.blocks import BlockManager; "
            "from tinyllm_cli.model.llama import ModelConfig; "
            f"c = BlockManager(ModelConfig(**{dataclasses.asdict(CFG)!r}), 8, 4, torch.float32, "
            "prefix_caching=True); t = list(range(3, 19)); c.try_admit(0, t, use_prefix=False); "
            "c.commit(0, t, len(t)); print(b''.join(k for k, _ in c.chains[0]).hex())")
    # Both processes at once: each spends its time importing torch, which a second core overlaps.
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in ("1", "2")]
    try:
        results = [p.communicate(timeout=wait_s(120)) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    outs = {out.strip() for out, _ in results}
    assert outs == {b"".join(chain_keys(cache(), list(range(3, 19)))).hex()}


@pytest.mark.parametrize("num_blocks", [8, None])  # sized in blocks, or from kv_memory
def test_runtime_salts_caches_with_the_model_name(num_blocks):
    def rt(name):
        return Runtime(CFG, None, name, torch.device("cpu"), torch.float32, "torch", "none", False, 0.0)

    cfg = Config()
    cfg.cache.prefix_caching, cfg.cache.num_blocks, cfg.cache.block_size = True, num_blocks, 4
    cfg.cache.kv_memory = "4KiB"
    a, b, a2 = (make_blocks(cfg, r, pool_size(cfg, r)) for r in (rt("model-a"), rt("model-b"), rt("model-a")))
    assert a.salt == a2.salt != b.salt
    assert chain_keys(a, list(range(8))) != chain_keys(b, list(range(8)))


# ---- forced collisions never give a false hit ----------------------------------------------------

@pytest.mark.parametrize("mode", sorted(COLLIDING))
def test_collision_on_a_parent_does_not_adopt_another_prefix(mode):
    # A = X + Z and B = Y + W are cached; Q = X + W matches A's first block and B's second
    # block's tokens, but B's second block holds W's K/V after Y: Q may reuse X only.
    bs = 2
    x, y, z, w = [1, 2], [3, 4], [5, 6], [7, 8]
    with mock.patch.object(blocks_mod, "block_key", COLLIDING[mode]):
        c = cache(bs)
        for sid, toks in enumerate([x + z + [9], y + w + [9]]):
            c.try_admit(sid, toks)
            c.commit(sid, toks, len(toks))
        assert c.try_admit(2, x + w + [9]) <= bs  # never B's second block
        for sid in (0, 1):  # a chain cut by a collision registers nothing from the cut on
            serials = [s for _, s in c.chains[sid]]
            cut = serials.index(None) if None in serials else len(serials)
            assert len(serials) in (cut, cut + 1)
            assert not any(b in c.pool.key_of for b in c.tables[sid][cut:])
        if mode in ("constant", "first_block"):  # these always cut B's chain at its first block
            assert c.chains[1] and c.chains[1][0][1] is None
        if mode != "constant":  # an exact repeat still hits wherever its keys are distinct
            assert c.try_admit(3, x + z + [9]) >= bs


def test_an_evicted_entry_is_not_mistaken_for_its_successor():
    # b1 holds Z after X (block b0). b0 is evicted and reused for Y under the same key (a
    # collision): Y + Z must not find b1, though its parent *key* and tokens both match.
    pool = BlockPool(2, caching=True)
    b0, b1 = pool.allocate(2)
    x, y, z = (block_keys.encode_tokens(t) for t in ([1, 2], [3, 4], [5, 6]))
    k0, k1 = OTHER, REAL(OTHER, OTHER, z)
    first = pool.register(b0, k0, ROOT_SERIAL, x)
    pool.register(b1, k1, first, z)
    assert pool.lookup(k1, first, z) == (b1, pool.key_of[b1][3])
    pool.release([b0])
    pool.release([b1])
    (again,) = pool.allocate(1)
    assert again == b0 and b1 in pool.key_of  # the parent went, its child stayed cached
    second = pool.register(again, k0, ROOT_SERIAL, y)
    assert pool.lookup(k0, ROOT_SERIAL, y) == (again, second)
    assert pool.lookup(k1, second, z) is None


@settings(max_examples=60)
@given(mode=st.sampled_from(sorted(COLLIDING)), block_size=st.sampled_from([1, 2, 4]),
       extra_blocks=st.integers(0, 8),
       reqs=st.lists(st.tuples(st.integers(1, 16), st.integers(1, 8), st.integers(1, 3)), min_size=1, max_size=7),
       max_num_seqs=st.integers(3, 8), budget=st.integers(1, 24), draws=st.integers(0, 2**16))
def test_forced_collisions_never_serve_another_prefix(mode, block_size, extra_blocks, reqs, max_num_seqs,
                                                      budget, draws):
    """The scheduler and cache run random requests from a 3-token alphabet (equal blocks after
    different prefixes everywhere), with forks, preemption and eviction, while the digest is
    forced to collide. After every step, every position every running sequence has stored holds
    K/V written for exactly that sequence's token history up to it (``check_fork_invariants``):
    so every prefix hit was a hit on that sequence's whole prefix."""
    rng = random.Random(draws)
    stems = [[rng.randrange(3) for _ in range(16)] for _ in range(2)]

    def prompt(i, plen):  # a shared stem, then tokens of its own
        cut = rng.randint(0, plen)
        return stems[i % 2][:cut] + [rng.randrange(3) for _ in range(plen - cut)]

    need = max(max(-(-(p + 1) // block_size) + n - 1, -(-(p + m) // block_size)) for p, m, n in reqs)
    c = cache(block_size, need + extra_blocks)
    with mock.patch.object(blocks_mod, "block_key", COLLIDING[mode]):
        fork_simulation(c, reqs, max_num_seqs, budget, draws, strict=False, prompt=prompt)
