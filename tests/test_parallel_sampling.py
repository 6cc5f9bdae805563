"""Parallel sampling (n forks sharing the prompt's blocks) and log-probabilities, against
independent references: a no-cache greedy recompute, the same request run alone with n = 1 and
the derived seed, and transformers' logits."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tinyllm_cli.cache.blocks import BlockManager, SlotBlockManager
from tinyllm_cli.cache.storage import KVStorage
from tinyllm_cli.engine.engine import LLMEngine
from tinyllm_cli.engine.request import Group, Request, SamplingParams, Sequence, Status, fork_seed
from tinyllm_cli.engine.scheduler import Scheduler

from test_cache_props import CFG
from test_cli import cli, jsonl
from test_engine import make_requests, reference_greedy, run
from test_serve import FAST, line, serve

transformers = pytest.importorskip("transformers")


def n_requests(n: int, count: int = 5, seed: int = 0, **params) -> list[Request]:
    """Prompts of 3..21 tokens (some end on a block boundary of 4, most inside a block)."""
    reqs = make_requests(n=count, seed=seed, lens=(3, 21), new=(5, 12), **params)
    for r in reqs:
        r.params.n = n
    return reqs


def completions(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.completions] for o in sorted(outs, key=lambda o: o.index)]


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_greedy_n_copies_equal_one_greedy_run(tiny_model, kind):
    reqs = n_requests(4)
    cache = (BlockManager(tiny_model.cfg, 256, 4, torch.float32) if kind == "paged"
             else SlotBlockManager(tiny_model.cfg, 20, 64, torch.float32))
    outs, eng = run(tiny_model, cache, reqs, max_num_seqs=20)
    for r, comps in zip(reqs, completions(outs)):
        ref = reference_greedy(tiny_model, r.prompt_token_ids, r.params.max_new_tokens)
        assert comps == [ref] * 4
    s = eng.stats.summary()
    assert s["forks"] == 3 * len(reqs) and s["output_tokens"] == 4 * sum(r.params.max_new_tokens for r in reqs)
    # Every prompt ending inside a block makes its forks copy that block (the last writes in place).
    partial = sum(len(r.prompt_token_ids) % cache.block_size != 0 for r in reqs)
    assert s["cow_copies"] >= 3 * partial > 0 and s["peak_fork_shared_blocks"] > 0
    assert cache.pool.num_active == 0 and not cache.pool.fork_refs  # everything given back


def test_completion_i_equals_n1_with_the_derived_seed(tiny_model, prefix_caching=True):
    reqs = n_requests(4, count=2, seed=1, temperature=0.9, top_k=60, top_p=0.95, repetition_penalty=1.1)
    for i, r in enumerate(reqs):
        r.params.seed = 70 + i
    cache = BlockManager(tiny_model.cfg, 256, 4, torch.float32, prefix_caching=prefix_caching)
    outs, _ = run(tiny_model, cache, reqs, max_num_seqs=16)
    got = completions(outs)
    for r, comps in zip(reqs, got):
        alone = []
        for i in range(4):
            one = Request(r.id, r.prompt_token_ids, dataclasses.replace(r.params, n=1, seed=fork_seed(r.params.seed, i)))
            (o,), _ = run(tiny_model, BlockManager(tiny_model.cfg, 64, 4, torch.float32), [one])
            alone.append(o.token_ids)
        assert comps == alone
        assert len({tuple(c) for c in comps}) > 1  # the forks really sample differently
    assert [c.seed for c in sorted(outs, key=lambda o: o.index)[0].completions] == \
        [fork_seed(reqs[0].params.seed, i) for i in range(4)]
    assert fork_seed(123, 0) == 123  # n = 1 keeps the request's own seed (and its old outputs)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n4_under_forced_preemption_equals_no_preemption(tiny_model, prefix_caching):
    reqs = n_requests(4, count=4, seed=2, temperature=0.8)
    for i, r in enumerate(reqs):
        r.params.seed = 5 + i
        r.params.max_new_tokens = 14
    reqs[1].params.temperature = 0.0  # a greedy group too
    big = BlockManager(tiny_model.cfg, 512, 4, torch.float32, prefix_caching=prefix_caching)
    ref, _ = run(tiny_model, big, reqs, max_num_seqs=16)
    # Room for one group's prompt and first tokens, far from four groups growing together.
    small_blocks = max(-(-(len(r.prompt_token_ids) + 14) // 4) for r in reqs) + 4
    small = BlockManager(tiny_model.cfg, small_blocks, 4, torch.float32, prefix_caching=prefix_caching)
    pre, eng = run(tiny_model, small, reqs, max_num_seqs=16)
    assert eng.stats.preemptions > 0 and eng.stats.summary()["forks"] == 12
    assert any(c.preemptions for o in pre for c in o.completions)
    assert completions(pre) == completions(ref)
    assert all(c.finish_reason == "length" for o in pre for c in o.completions)
    assert small.pool.num_active == 0 and not small.pool.fork_refs


def test_a_group_that_exactly_fits_runs_without_preemption(tiny_model):
    # 10 prompt tokens in blocks of 4: two full blocks shared, the partial third copied by three
    # forks while the fourth writes it in place: 2 + 4 = 6 blocks, the whole pool.
    req = Request("x", list(range(20, 30)), SamplingParams(max_new_tokens=2, n=4, ignore_eos=True))
    cache = BlockManager(tiny_model.cfg, 6, 4, torch.float32)
    (out,), eng = run(tiny_model, cache, [req], max_num_seqs=4)
    assert eng.stats.preemptions == 0 and cache.cow_copies == 3 and eng.stats.summary()["peak_blocks_used"] == 6
    assert [c.token_ids for c in out.completions] == [reference_greedy(tiny_model, req.prompt_token_ids, 2)] * 4
    smaller = BlockManager(tiny_model.cfg, 5, 4, torch.float32)
    (refused,), _ = run(tiny_model, smaller, [req], max_num_seqs=4)
    assert "needs 6 KV blocks for its n = 4 completions but the whole pool has 5" in refused.error


# ---- the cache invariant, driven through the real scheduler with a fake sampler -----------------

def check_fork_invariants(cache: BlockManager, storage: KVStorage, sched: Scheduler, history: dict) -> None:
    """Refcounts equal table occurrences; tables cover what is stored; and every position a
    running sequence has stored still holds *its* token history (a shared block written by one
    holder would show up here as another holder's wrong history)."""
    owned = [b for t in cache.tables.values() for b in t]
    for b in range(cache.num_blocks):
        assert cache.pool.ref[b] == owned.count(b)
    assert set(owned) | set(cache.pool.evictable) == cache.allocator._used
    assert cache.num_blocks not in owned
    running = {s.seq_id: s for s in sched.running}
    assert set(cache.tables) == set(running)
    for sid, s in running.items():
        assert cache.lens[sid] == s.num_cached
        assert len(cache.tables[sid]) * cache.block_size >= s.num_cached
        for p, slot in enumerate(cache.slots(sid, 0, s.num_cached)):
            assert storage.k[0, slot, 0, 0].item() == history[tuple(s.tokens[:p + 1])], \
                f"seq {sid} position {p} was overwritten"
    for s in sched.waiting:
        assert s.seq_id not in cache.tables and s.num_cached == 0


def fork_simulation(cache, reqs, max_num_seqs, budget, draws, strict,
                    prompt=lambda i, plen: [t % 7 for t in range(plen)]):
    """As the engine does, with random tokens (so forks diverge). A write stores, in the real K
    pool, the id of the token history whose K/V the slot would hold (so copies on write move
    it like real K/V); ``strict``: no written block has another holder. ``prompt(i, plen)``:
    request i's prompt."""
    sched, storage = Scheduler(cache, max_num_seqs, budget), KVStorage(cache, "cpu")
    ids, rng = iter(range(10_000)), random.Random(draws)
    for i, (plen, new, n) in enumerate(reqs):
        r = Request(str(i), prompt(i, plen), SamplingParams(max_new_tokens=new, n=n))
        seqs = [Sequence(next(ids), r, 0, list(r.prompt_token_ids), plen, fork=j) for j in range(n)]
        g = Group(r, seqs)
        for s in seqs:
            s.group = g
        seqs[0].pending = seqs[1:]
        sched.add(seqs[0])
    history: dict[tuple, int] = {}
    finished, steps = 0, 0
    while sched.has_work():
        steps += 1
        assert steps < 5000, "the scheduler stopped making progress"
        plan = sched.schedule()
        finished += sum(1 + len(s.pending) for s in plan.failed)
        writes = [(s, s.num_cached) for s in plan.decode] + [(c.seq, c.start + j) for c in plan.prefill for j in range(c.n)]
        for s, p in writes:
            (slot,) = cache.slots(s.seq_id, p, 1)
            if strict:
                assert cache.pool.ref[slot // cache.block_size] == 1, "a shared block is written"
            storage.k[0, slot, 0, 0] = history.setdefault(tuple(s.tokens[:p + 1]), len(history))
        storage.plan_step([s.seq_id for s in plan.decode], [(c.seq.seq_id, c.start, c.n) for c in plan.prefill])
        for s in plan.decode:
            s.num_cached += 1
        for c in plan.prefill:
            c.seq.num_cached = c.start + c.n
        samplers = plan.decode + [x for c in plan.prefill if c.completes_prompt for x in [c.seq] + c.seq.pending]
        for s in samplers:
            if s.pending:
                sched.fork(s)
        for s in samplers:
            s.tokens.append(rng.randrange(7))
            s.status = Status.DECODE
            if s.num_output >= s.request.params.max_new_tokens or rng.random() < 0.05:
                sched.finish(s)
                finished += 1
        check_fork_invariants(cache, storage, sched, history)
    assert finished == sum(n for _, _, n in reqs)
    assert cache.pool.num_active == 0 and not cache.pool.fork_refs


def test_the_manager_records_a_copy_on_write_and_the_storage_applies_it_before_the_step():
    """Copy on write is split as vLLM splits it: the block manager decides and records (src, dst,
    positions) while the scheduler grows a fork; the storage copies the K/V when it plans the
    step, before any of the step's tokens are written; the simulator, holding no K/V, drops it."""
    cache = BlockManager(CFG, 8, 4, torch.float32)
    storage = KVStorage(cache, "cpu")
    assert cache.try_admit(0, list(range(6))) == 0
    storage.plan_step([], [(0, 0, 6)])  # the parent stores 6 positions: a full block and 2 more
    for pool in (storage.k, storage.v):
        pool.copy_(torch.randn_like(pool))
    cache.fork(0, 1)
    shared = cache.tables[1][1]
    assert cache.needs_copy(1, 7) and not cache.copies
    cache.grow(1, 7)  # the child's next token goes into the shared, partly filled block
    new = cache.tables[1][1]
    assert new != shared and cache.copies == [(shared, new, 2)] and cache.cow_copies == 1
    assert not cache.needs_copy(0, 7)  # the parent now holds its block alone and writes in place
    before = storage.k[:, new * 4:new * 4 + 2].clone()
    assert not torch.equal(before, storage.k[:, shared * 4:shared * 4 + 2])  # recorded, not applied
    storage.plan_step([1], [])
    for pool in (storage.k, storage.v):
        assert torch.equal(pool[:, new * 4:new * 4 + 2], pool[:, shared * 4:shared * 4 + 2])
    assert cache.take_copies() == [] and cache.lens[1] == 7


@settings(max_examples=50, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 8]), extra_blocks=st.integers(0, 10), prefix_caching=st.booleans(),
       reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(1, 4)), min_size=1, max_size=6),
       max_num_seqs=st.integers(4, 10), budget=st.integers(1, 40), draws=st.integers(0, 2**16))
def test_shared_blocks_are_never_written(block_size, extra_blocks, prefix_caching, reqs, max_num_seqs,
                                         budget, draws):
    # Every group fits alone: its prompt plus one block per fork, and each fork's whole length.
    need = max(max(-(-(p + 1) // block_size) + n - 1, -(-(p + m) // block_size)) for p, m, n in reqs)
    cache = BlockManager(CFG, need + extra_blocks, block_size, torch.float32, prefix_caching=prefix_caching)
    # With prefix caching, requests admitted in the same step may share a block the first of
    # them writes in that step (same tokens, written before anyone reads): only forks are strict.
    fork_simulation(cache, reqs, max_num_seqs, budget, draws, strict=not prefix_caching)


@settings(max_examples=20, deadline=None)
@given(n_slots=st.integers(4, 8), reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(1, 4)),
                                                 min_size=1, max_size=5), draws=st.integers(0, 2**16))
def test_slot_forks_copy_the_prompt_into_their_own_slot(n_slots, reqs, draws):
    fork_simulation(SlotBlockManager(CFG, n_slots, 32, torch.float32), reqs, 8, 64, draws, strict=True)


# ---- log-probabilities against transformers ----------------------------------------------------

@pytest.fixture(scope="module")
def hf_llama(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()


@torch.no_grad()
def hf_log_softmax(hf, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    return (hf(torch.tensor([ids])).logits[0].float() / temperature).log_softmax(-1)


def assert_entries_match(entries: list[dict], ref: torch.Tensor, targets: list[int], k: int) -> None:
    assert len(entries) == len(targets) == len(ref)
    for e, row, t in zip(entries, ref, targets):
        assert e["token_id"] == t
        assert abs(e["logprob"] - row[t].item()) < 1e-4
        vals, top = row.topk(k)
        assert [a["token_id"] for a in e["top_logprobs"]] == top.tolist()  # same ids, same order
        assert max(abs(a["logprob"] - v) for a, v in zip(e["top_logprobs"], vals.tolist())) < 1e-4


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_transformers(tiny_model, hf_llama, temperature):
    reqs = n_requests(2, count=3, seed=4, temperature=temperature, logprobs=5)
    for r in reqs:
        r.params.seed = 11
    outs, _ = run(tiny_model, BlockManager(tiny_model.cfg, 128, 4, torch.float32), reqs)
    for r, o in zip(reqs, sorted(outs, key=lambda o: o.index)):
        p = r.prompt_token_ids
        for c in o.completions:
            ref = hf_log_softmax(hf_llama, p + c.token_ids, temperature or 1.0)[len(p) - 1:-1]
            assert_entries_match(c.logprobs, ref, c.token_ids, 5)
        assert o.to_json()["outputs"][1]["logprobs"] == o.completions[1].logprobs


def test_prompt_logprobs_match_transformers_through_chunks_and_prefix_hits(tiny_model, hf_llama):
    rng = random.Random(5)
    shared = [rng.randrange(3, 320) for _ in range(12)]
    first = Request("warm", shared + [7, 8, 9], SamplingParams(max_new_tokens=3, ignore_eos=True), index=0)
    scored = Request("s", shared + [rng.randrange(3, 320) for _ in range(9)],
                     SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=True, n=2), index=1)
    after = Request("hit", shared + [9, 9, 9, 9], SamplingParams(max_new_tokens=2), index=2)
    cache = BlockManager(tiny_model.cfg, 64, 4, torch.float32, prefix_caching=True)
    eng = LLMEngine(tiny_model, cache, None, max_prefill_tokens=5)  # chunks of 5 rows
    outs = {o.id: o for o in eng.run([first, scored, after])}
    p = scored.prompt_token_ids
    plp = outs["s"].prompt_logprobs
    assert plp[0] is None and len(plp) == len(p)
    assert_entries_match(plp[1:], hf_log_softmax(hf_llama, p)[:-1], p[1:], 3)
    # logprobs: true without top_logprobs is the chosen token only.
    assert all(e["top_logprobs"] == [] for c in outs["s"].completions for e in c.logprobs)
    assert outs["warm"].prompt_logprobs is None and "prompt_logprobs" not in outs["warm"].to_json()
    # The prefix cache held the shared blocks (the last request hit them); the scored one
    # computed every prompt row anyway, and was not counted as a lookup.
    assert cache.prefix_hits == 12 and cache.prefix_queries == len(first.prompt_token_ids) + len(after.prompt_token_ids)


# ---- output shapes and per-request errors through the CLI --------------------------------------

def test_generate_n_logprobs_and_bad_requests(capsys, tmp_path, llama_dir):
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": "n3", "prompt_token_ids": [5, 6, 7, 8, 9], "n": 3, "temperature": 0.8, "seed": 1, "logprobs": 2},
            {"id": "flat", "prompt_token_ids": [5, 6, 7, 8, 9]},
            {"id": "n0", "prompt_token_ids": [5, 6], "n": 0},
            {"id": "huge-n", "prompt_token_ids": [5, 6], "n": 40},
            {"id": "pool-n", "prompt_token_ids": list(range(5, 40)), "n": 12},
            {"id": "lp21", "prompt_token_ids": [5, 6], "logprobs": 21},
            {"id": "plp", "prompt_token_ids": [5, 6], "prompt_logprobs": 99},
            {"id": "top-only", "prompt_token_ids": [5, 6], "top_logprobs": 2}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, out, err = cli(capsys, "generate", "--prompts", prompts, "--model", llama_dir, "--num-blocks", 16,
                         "--block-size", 4, "--max-num-seqs", 16, "--max-new-tokens", 4, "--ignore-eos", "-q")
    assert code == 0, err
    res = {r["id"]: r for r in jsonl(out)}
    assert [r["id"] for r in jsonl(out)] == [r["id"] for r in rows]  # one line per prompt, input order
    n3 = res["n3"]
    assert [c["index"] for c in n3["outputs"]] == [0, 1, 2] and "text" not in n3
    assert all(len(c["token_ids"]) == 4 and len(c["logprobs"]) == 4 for c in n3["outputs"])
    assert all(len(e["top_logprobs"]) == 2 for c in n3["outputs"] for e in c["logprobs"])
    assert n3["num_output_tokens"] == 12
    # n = 1 without logprobs: exactly the flat shape every existing script reads.
    assert list(res["flat"]) == ["id", "prompt", "text", "token_ids", "prompt_token_ids", "finish_reason", "error",
                                 "stop_reason", "seed", "num_prompt_tokens", "num_output_tokens", "metrics"]
    errors = {k: res[k]["error"] for k in ("n0", "huge-n", "pool-n", "lp21", "plp", "top-only")}
    assert all(res[k].get("finish_reason") == "error" for k in ("n0", "lp21", "plp", "top-only"))
    assert [c["finish_reason"] for c in res["pool-n"]["outputs"]] == ["error"] * 12  # the n > 1 shape
    assert "n must be an integer >= 1" in errors["n0"]
    assert "max_num_seqs is 16" in errors["huge-n"]
    assert "whole pool has 16" in errors["pool-n"] and "n = 12" in errors["pool-n"]
    assert "logprobs must be" in errors["lp21"] and "20" in errors["lp21"]
    assert "prompt_logprobs must be" in errors["plp"]
    assert "top_logprobs needs logprobs" in errors["top-only"]
    assert all(". " not in e for e in errors.values())  # one sentence each
    code, out, err = cli(capsys, "generate", "--prompts", prompts, "--model", llama_dir, "--logprobs", 21)
    assert code == 2 and "sampling.logprobs" in err and not out


def test_serve_batch_n_choices_and_logprobs(capsys, tmp_path, llama_dir):
    lines = [line("c", prompt=[1, 5, 6, 7], n=3, max_tokens=3, ignore_eos=True, temperature=1.0, seed=2, logprobs=2),
             line("chat-like", prompt=[1, 5, 6], max_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=1)]
    results, _ = serve(capsys, tmp_path, lines, "--model", str(llama_dir), *FAST, "-q")
    body = {r["custom_id"]: r["response"]["body"] for r in results}
    c = body["c"]
    assert [ch["index"] for ch in c["choices"]] == [0, 1, 2]
    assert c["usage"]["completion_tokens"] == 9 and c["usage"]["total_tokens"] == 13
    lp = c["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 3 and all(len(t) <= 2 for t in lp["top_logprobs"])
    (one,) = body["chat-like"]["choices"]
    assert len(one["logprobs"]["token_logprobs"]) == 2


def test_bench_n_rows_show_fork_sharing(capsys, llama_dir):
    code, out, err = cli(capsys, "bench", "--model", llama_dir, "--n", "1,3", "--cache", "paged,slot",
                         "--num-prompts", 3, "--input-len", 10, "--output-len", 4, "--kv-memory", "400KiB",
                         "--max-model-len", 32, "--no-warmup", "--json", "-", "-q")
    assert code == 0, err
    rows = {(r["cache_kind"], r["n"]): r for r in json.loads(out)}
    assert rows[("paged", 3)]["forks"] == rows[("slot", 3)]["forks"] == 6
    assert rows[("paged", 1)]["forks"] == 0
    assert rows[("paged", 3)]["output_tokens"] == 3 * rows[("paged", 1)]["output_tokens"]
