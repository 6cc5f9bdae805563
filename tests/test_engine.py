"""Engine equivalence: the paged and slot caches, at every block size, under preemption and
chunked prefill, must give exactly the tokens of a no-cache full recompute."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tinyllm_cli.cache.attention import NoCacheAttention
from tinyllm_cli.cache.blocks import BlockManager, SlotBlockManager
from tinyllm_cli.cache.storage import KVStorage
from tinyllm_cli.engine.engine import LLMEngine
from tinyllm_cli.engine.runner import ModelRunner
from tinyllm_cli.engine.request import Request, SamplingParams
from conftest import wait_s


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """No cache at all: recompute the whole sequence for every new token."""
    cur, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor(cur), torch.arange(len(cur)), NoCacheAttention([len(cur)]),
                           torch.tensor([len(cur) - 1]))
            t = int(logits.argmax(-1))
            cur.append(t)
            out.append(t)
    return out


def make_requests(n=7, seed=0, vocab=320, lens=(3, 40), new=(4, 24), **params):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*lens))]
        p = SamplingParams(max_new_tokens=rng.randint(*new), ignore_eos=True, **params)
        reqs.append(Request(str(i), prompt, p, index=i))
    return reqs


def preempting_blocks(reqs, block_size: int = 4) -> int:
    """A pool size where any one request fits alone, far from all of them together."""
    longest = max(len(r.prompt_token_ids) + r.params.max_new_tokens for r in reqs)
    return longest // block_size + 2


def run(model, cache, reqs, attention="auto", **kw):
    """Run ``reqs`` to the end on an engine over block manager ``cache`` (with new K/V storage
    on the ``attention`` path unless a ``runner`` is given); (outputs in input order, engine)."""
    if "runner" not in kw:
        kw["runner"] = ModelRunner(model, cache, KVStorage(cache, model.device, attention=attention))
    eng = LLMEngine(model, cache, None, **kw)
    outs = sorted(eng.run(reqs), key=lambda o: o.index)
    return outs, eng


@pytest.fixture(scope="module")
def workload(tiny_model):
    reqs = make_requests()
    refs = [reference_greedy(tiny_model, r.prompt_token_ids, r.params.max_new_tokens) for r in reqs]
    return reqs, refs


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_paged_matches_no_cache_reference(tiny_model, workload, block_size):
    reqs, refs = workload
    cache = BlockManager(tiny_model.cfg, 4096 // block_size + 8, block_size, torch.float32)
    outs, eng = run(tiny_model, cache, reqs, max_num_seqs=4)
    assert [o.token_ids for o in outs] == refs
    assert all(o.finish_reason == "length" for o in outs)
    s = eng.stats.summary()
    assert s["preemptions"] == 0 and s["output_tokens"] == sum(map(len, refs))
    assert cache.allocator.num_used == 0  # everything released


def test_slot_matches_no_cache_reference(tiny_model, workload):
    reqs, refs = workload
    cache = SlotBlockManager(tiny_model.cfg, 3, 128, torch.float32)
    outs, eng = run(tiny_model, cache, reqs, max_num_seqs=8)
    assert [o.token_ids for o in outs] == refs
    assert eng.stats.summary()["peak_running"] == 3  # a slot per sequence, no more


def test_staggered_finishes_stream_out_early(tiny_model, workload):
    reqs, refs = workload
    cache = BlockManager(tiny_model.cfg, 256, 8, torch.float32)
    eng = LLMEngine(tiny_model, cache, None, max_num_seqs=8)
    order = [o.index for o in eng.run(reqs)]
    lengths = [reqs[i].params.max_new_tokens for i in order]
    # All start together and decode one token per step, so they must come out shortest first.
    assert lengths == sorted(lengths) and order != list(range(len(reqs)))


def test_preemption_keeps_outputs_identical(tiny_model, workload):
    reqs, refs = workload
    num_blocks = preempting_blocks(reqs)
    cache = BlockManager(tiny_model.cfg, num_blocks, 4, torch.float32)
    outs, eng = run(tiny_model, cache, reqs, max_num_seqs=7)
    assert [o.token_ids for o in outs] == refs
    s = eng.stats.summary()
    assert s["preemptions"] >= 3
    assert s["recomputed_tokens"] > 0
    assert sum(o.preemptions for o in outs) == s["preemptions"]
    assert s["peak_blocks_used"] <= num_blocks


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_matches(tiny_model, workload, chunk):
    reqs, refs = workload
    cache = BlockManager(tiny_model.cfg, 512, 4, torch.float32)
    outs, _ = run(tiny_model, cache, reqs, max_num_seqs=4, max_prefill_tokens=chunk)
    assert [o.token_ids for o in outs] == refs


def test_request_larger_than_pool_fails_alone(tiny_model):
    reqs = make_requests(n=4, lens=(5, 10), new=(5, 8))
    big = Request("big", list(range(3, 3 + 200)), SamplingParams(max_new_tokens=4), index=4)
    cache = BlockManager(tiny_model.cfg, 16, 4, torch.float32)  # 64 tokens in all
    t0 = time.perf_counter()
    outs, _ = run(tiny_model, cache, reqs + [big], max_num_seqs=4)
    assert time.perf_counter() - t0 < wait_s(30)  # a requeue loop would never end
    bad = [o for o in outs if o.id == "big"][0]
    assert bad.finish_reason == "error" and "pool" in bad.error and not bad.token_ids
    assert all(o.finish_reason == "length" and o.error is None for o in outs if o.id != "big")


def test_prompt_longer_than_max_model_len_fails(tiny_model):
    cache = BlockManager(tiny_model.cfg, 64, 4, torch.float32)
    reqs = [Request("long", list(range(3, 43)), SamplingParams(), index=0),
            Request("ok", [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True), index=1)]
    outs, _ = run(tiny_model, cache, reqs, max_model_len=32)
    assert outs[0].finish_reason == "error" and "max_model_len" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 3


def test_generation_stops_at_max_model_len(tiny_model):
    cache = BlockManager(tiny_model.cfg, 64, 4, torch.float32)
    req = Request("r", list(range(3, 13)), SamplingParams(max_new_tokens=100, ignore_eos=True), index=0)
    (out,), _ = run(tiny_model, cache, [req], max_model_len=16)
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_lone_sequence_outgrowing_pool_stops_without_looping(tiny_model):
    cache = BlockManager(tiny_model.cfg, 4, 4, torch.float32)  # 16 tokens
    req = Request("r", list(range(3, 9)), SamplingParams(max_new_tokens=100, ignore_eos=True), index=0)
    (out,), eng = run(tiny_model, cache, [req])
    # 16 positions hold the prompt and 10 generated tokens; the 11th is sampled from them and
    # would need a 17th position only to go on.
    assert out.finish_reason == "error" and "pool" in out.error and len(out.token_ids) == 11
    assert out.token_ids == reference_greedy(tiny_model, req.prompt_token_ids, 11)


def test_stop_token_ids_and_eos(tiny_model, workload):
    reqs, refs = workload
    r, ref = reqs[0], refs[0]
    stop_tok = ref[2]
    cut = ref.index(stop_tok) + 1
    cache = BlockManager(tiny_model.cfg, 64, 4, torch.float32)
    req = Request("s", r.prompt_token_ids, SamplingParams(max_new_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True))
    (out,), _ = run(tiny_model, cache, [req])
    assert out.finish_reason == "stop" and out.token_ids == ref[:cut] and out.stop_reason == stop_tok
    # The same token as the model's EOS stops too, unless ignore_eos.
    cache = BlockManager(tiny_model.cfg, 64, 4, torch.float32)
    eng = LLMEngine(tiny_model, cache, None, eos_ids=[stop_tok])
    req = Request("e", r.prompt_token_ids, SamplingParams(max_new_tokens=30))
    (out,) = list(eng.run([req]))
    assert out.finish_reason == "stop" and out.token_ids == ref[:cut]


def test_seeded_sampling_is_batch_and_preemption_invariant(tiny_model):
    reqs = make_requests(n=8, seed=3, new=(12, 12), temperature=0.9, top_k=50, top_p=0.95)
    for i, r in enumerate(reqs):
        r.params.seed = 1000 + i
    big = BlockManager(tiny_model.cfg, 512, 4, torch.float32)
    batch, _ = run(tiny_model, big, reqs, max_num_seqs=8)
    alone = []
    for r in reqs:
        cache = BlockManager(tiny_model.cfg, 512, 4, torch.float32)
        (o,), _ = run(tiny_model, cache, [r])
        alone.append(o.token_ids)
    assert [o.token_ids for o in batch] == alone
    small = BlockManager(tiny_model.cfg, 16, 4, torch.float32)
    pre, eng = run(tiny_model, small, reqs, max_num_seqs=8)
    assert eng.stats.preemptions > 0
    assert [o.token_ids for o in pre] == alone
    # Different seeds really give different streams (the test above could not pass vacuously).
    assert len({tuple(t) for t in alone}) > 1


def test_sampling_filters(tiny_model):
    prompt = [5, 9, 11, 13]
    def sample(**kw):
        cache = BlockManager(tiny_model.cfg, 64, 4, torch.float32)
        r = Request("x", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True, **kw))
        (o,), _ = run(tiny_model, cache, [r])
        return o.token_ids[0]
    greedy = reference_greedy(tiny_model, prompt, 1)[0]
    # top_k=1 and a tiny top_p both collapse sampling to the argmax.
    assert {sample(temperature=1.5, top_k=1, seed=s) for s in range(6)} == {greedy}
    assert {sample(temperature=1.5, top_p=1e-6, seed=s) for s in range(6)} == {greedy}
    assert {sample(temperature=1.0, min_p=0.999, seed=s) for s in range(6)} == {greedy}
    assert len({sample(temperature=5.0, seed=s) for s in range(12)}) > 1


def test_repetition_penalty_changes_greedy(tiny_model):
    prompt = [5, 9, 11, 13]
    def gen(penalty):
        cache = BlockManager(tiny_model.cfg, 64, 4, torch.float32)
        r = Request("x", prompt, SamplingParams(max_new_tokens=30, ignore_eos=True, repetition_penalty=penalty))
        (o,), _ = run(tiny_model, cache, [r])
        return o.token_ids
    plain, penalised = gen(1.0), gen(3.0)
    assert plain == reference_greedy(tiny_model, prompt, 30)
    assert penalised != plain and len(set(penalised)) > len(set(plain))


def _poisoned(storage):
    """Pools are allocated uninitialised; fill every slot but the scratch ones with NaN, the
    worst garbage memory can hold, so any read of a slot before it is written shows up."""
    for pool in (storage.k, storage.v):
        pool[:, : storage.scratch_slot].fill_(float("nan"))
    return storage


@pytest.mark.parametrize("case", ["preempt", "chunked", "prefix", "slot"])
def test_unwritten_slots_are_never_read(tiny_model, workload, case):
    reqs, refs = workload
    cfg, f32 = tiny_model.cfg, torch.float32
    if case == "preempt":
        cache, kw = BlockManager(cfg, preempting_blocks(reqs), 4, f32), {"max_num_seqs": 7}
    elif case == "chunked":
        cache, kw = BlockManager(cfg, 512, 4, f32), {"max_num_seqs": 4, "max_prefill_tokens": 5}
    elif case == "prefix":  # repeated prompts hit cached blocks
        reqs = reqs + [Request(f"r{r.id}", r.prompt_token_ids, r.params, index=len(reqs) + i)
                       for i, r in enumerate(reqs)]
        refs = refs + refs
        cache, kw = BlockManager(cfg, 512, 4, f32, prefix_caching=True), {"max_num_seqs": 3}
    else:
        cache, kw = SlotBlockManager(cfg, 3, 128, f32), {"max_num_seqs": 8}
    runner = ModelRunner(tiny_model, cache, _poisoned(KVStorage(cache, "cpu")))
    outs, eng = run(tiny_model, cache, reqs, runner=runner, **kw)
    assert [o.token_ids for o in outs] == refs
    s = eng.stats.summary()
    if case == "preempt":
        assert s["preemptions"] >= 3
    if case == "prefix":
        assert s["prefix_cache_hits"] > 0


def test_scratch_slots_are_zeroed_even_on_reused_memory(tiny_model):
    # Free a NaN-filled buffer of the pools' size first, so the allocator likely hands its memory
    # back to the pools: the scratch slots must still come out zero (and finite).
    shape = (tiny_model.cfg.num_layers, 8 * 4 + 4, tiny_model.cfg.num_kv_heads, tiny_model.cfg.head_dim)
    for _ in range(3):
        garbage = [torch.full(shape, float("nan")) for _ in range(2)]
        del garbage
        storage = KVStorage(BlockManager(tiny_model.cfg, 8, 4, torch.float32), "cpu")
        for pool in (storage.k, storage.v):
            assert pool.shape == shape
            assert torch.equal(pool[:, storage.scratch_slot:], torch.zeros_like(pool[:, storage.scratch_slot:]))


def test_runner_seam_rows_agree_with_the_plan(tiny_model, workload):
    """The engine drives whatever runner it is given through ``Runner.run``; the model runner's
    sampling rows are ``samplers_of(plan)``, the rule the simulator's cost runner answers by, and
    the outputs stay the no-cache reference under preemption and chunked prefill."""
    from tinyllm_cli.engine.runner import samplers_of

    reqs, refs = workload
    checked = []

    class Checking(ModelRunner):
        def run(self, plan, stats):
            expected = [s.seq_id for s in samplers_of(plan)]
            out = super().run(plan, stats)
            assert [s.seq_id for s in out.samplers] == expected
            assert len(out.tokens) == len(out.logprobs) == len(expected)
            assert len(out.verified) == len(plan.verify)
            checked.append(len(expected))
            return out

    cache = BlockManager(tiny_model.cfg, preempting_blocks(reqs), 4, torch.float32)
    outs, eng = run(tiny_model, cache, reqs, max_prefill_tokens=16, runner=Checking(tiny_model, cache))
    assert [o.token_ids for o in outs] == refs
    assert eng.stats.preemptions > 0 and sum(checked) >= sum(r.params.max_new_tokens for r in reqs)
