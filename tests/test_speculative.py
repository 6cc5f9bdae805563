"""Speculative decoding: greedy output is plain decoding's, token for token, whatever drafts.

The reference is the same engine with speculation off (itself checked against a cache-free
recompute and against transformers in test_engine / test_default_model). Covered: n-gram and
draft-model drafting, paged and slot caches, a pool tight enough to preempt, prefix caching with
shared prefixes, n > 1, sampled and logprob requests mixed in (they do not speculate and must
not change), stops landing inside an accepted run, and the block pool after it all (the pool's
invariants after every random rejection are property tests in test_cache_props).
"""

from __future__ import annotations

import random

import pytest
import torch

from tinyllm_cli.cache.blocks import BlockManager, SlotBlockManager
from tinyllm_cli.cache.storage import KVStorage
from tinyllm_cli.engine.engine import LLMEngine
from tinyllm_cli.engine.request import Request, SamplingParams
from tinyllm_cli.engine.runner import ModelRunner
from tinyllm_cli.engine.speculative import ModelDrafter, NgramDrafter, NgramIndex, Speculation, accepted_prefix
from tinyllm_cli.errors import UsageError
from tinyllm_cli.model.checkpoint import load_checkpoint
from tinyllm_cli.model.llama import build_model



@pytest.fixture(scope="module")
def draft_model(llama_dir):
    """The target's weights with noise added: a draft that agrees with it often, not always."""
    ck = load_checkpoint(str(llama_dir), progress=False)
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + NOISE * v.float().std() * torch.randn(v.shape, generator=g) if v.dim() >= 2 else v
             for k, v in ck.weights.items()}
    return build_model(ck.config, noisy, torch.float32, "cpu")


NOISE = 0.05


def grounded_requests(count=6, rng_seed=0, new=(8, 40), **params) -> list[Request]:
    """Prompts that repeat themselves (so prompt lookup finds drafts), of mixed lengths."""
    rng = random.Random(rng_seed)
    reqs = []
    for i in range(count):
        base = [rng.randrange(3, 320) for _ in range(rng.randint(3, 12))]
        prompt = base * rng.randint(2, 3) + base[:rng.randint(0, 3)]
        p = SamplingParams(max_new_tokens=rng.randint(*new), ignore_eos=True, **params)
        reqs.append(Request(str(i), prompt, p, index=i))
    return reqs


def copy(reqs):
    return [Request(r.id, list(r.prompt_token_ids), r.params, index=r.index) for r in reqs]


def paged(model, blocks=256, bs=4, prefix=True):
    return BlockManager(model.cfg, blocks, bs, torch.float32, prefix_caching=prefix)


def ngram(k=4, lo=1, hi=3):
    return Speculation("ngram", k, NgramDrafter(lo, hi))


def drafted(model, k=4, blocks=256):
    return Speculation("draft", k, ModelDrafter(model, BlockManager(model.cfg, blocks, 4, torch.float32)))


def run(model, cache, reqs, spec=None, attention="auto", **kw):
    runner = ModelRunner(model, cache, KVStorage(cache, model.device, attention=attention))
    eng = LLMEngine(model, cache, None, speculation=spec, runner=runner, **kw)
    outs = sorted(eng.run(copy(reqs)), key=lambda o: o.index)
    return outs, eng


def ids(outs):
    return [[c.token_ids for c in o.completions] for o in outs]


def pool_empty(cache):
    assert not cache.tables and cache.pool.num_active == 0
    assert all(r == 0 for r in cache.pool.ref)


def cache_maker(model, kind: str, slots: int = 8):
    """(a maker of new block managers, the attention path): paged / slot with the default path
    (the CPU kernel here), paged-gather with PyTorch's (the path on a GPU): verify chunks go
    through both."""
    if kind == "slot":
        return (lambda: SlotBlockManager(model.cfg, slots, 200, torch.float32)), "auto"
    attention = "gather" if kind == "paged-gather" else "auto"
    return (lambda: BlockManager(model.cfg, 256, 4, torch.float32, prefix_caching=True)), attention


@pytest.mark.parametrize("method", ["ngram", "draft-same", "draft-other"])
@pytest.mark.parametrize("kind", ["paged", "slot", "paged-gather"])
def test_greedy_output_equals_plain_decoding(tiny_model, draft_model, method, kind):
    reqs = grounded_requests()
    make, attention = cache_maker(tiny_model, kind)
    plain, plain_eng = run(tiny_model, make(), reqs, attention=attention)
    spec = {"ngram": ngram(), "draft-same": drafted(tiny_model), "draft-other": drafted(draft_model)}[method]
    outs, eng = run(tiny_model, make(), reqs, spec, attention=attention)
    assert ids(outs) == ids(plain)
    st_ = eng.stats.summary()
    assert st_["spec_method"] == spec.method and st_["spec_verifications"] > 0
    assert st_["spec_drafted_tokens"] >= st_["spec_accepted_tokens"] > 0
    if method == "draft-same":  # the target drafting for itself: every draft is its own argmax
        assert st_["spec_acceptance_rate"] == 1.0
        assert eng.stats.totals.steps < plain_eng.stats.totals.steps / 2
    else:
        assert st_["spec_acceptance_rate"] < 1.0  # rejections happened, and were rolled back
    if kind != "slot":
        pool_empty(eng.cache)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("prefix", [False, True])
def test_tight_pool_preempts_and_output_stays_equal(tiny_model, draft_model, method, prefix):
    reqs = grounded_requests(count=8, rng_seed=1, new=(20, 40))
    longest = max(len(r.prompt_token_ids) + r.params.max_new_tokens for r in reqs)
    blocks = longest // 4 + 3
    plain, _ = run(tiny_model, paged(tiny_model, blocks, prefix=prefix), reqs)
    spec = ngram() if method == "ngram" else drafted(draft_model, blocks=blocks)
    outs, eng = run(tiny_model, paged(tiny_model, blocks, prefix=prefix), reqs, spec)
    assert eng.stats.preemptions > 0
    assert ids(outs) == ids(plain)
    pool_empty(eng.cache)


def test_shared_prefixes_hit_the_cache_and_output_stays_equal(tiny_model):
    rng = random.Random(3)
    system = [rng.randrange(3, 320) for _ in range(24)]
    reqs = []
    for i in range(6):
        tail = [rng.randrange(3, 320) for _ in range(rng.randint(2, 9))]
        reqs.append(Request(str(i), system + tail * 2, SamplingParams(max_new_tokens=30, ignore_eos=True), index=i))
    plain, _ = run(tiny_model, paged(tiny_model), reqs, max_num_seqs=2)
    outs, eng = run(tiny_model, paged(tiny_model), reqs, ngram(), max_num_seqs=2)
    assert ids(outs) == ids(plain)
    assert eng.cache.prefix_hits > 0 and eng.stats.spec_accepted_tokens > 0
    # Every registered block holds accepted tokens only: a rerun of each output as a prompt
    # hits the cache and still continues exactly as plain decoding does.
    again = [Request(str(i), o.prompt_token_ids + o.token_ids[:12], SamplingParams(max_new_tokens=10, ignore_eos=True),
                     index=i) for i, o in enumerate(plain)]
    ref, _ = run(tiny_model, paged(tiny_model, prefix=False), again)
    hits_before = eng.cache.prefix_hits
    got = sorted(eng.run(copy(again)), key=lambda o: o.index)
    assert ids(got) == ids(ref) and eng.cache.prefix_hits > hits_before


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_n_groups_and_sampled_requests_are_unaffected(tiny_model, kind):
    """Greedy n = 3 forks speculate on their own; sampled and logprob requests do not speculate,
    and draw exactly what they draw without speculation (seeded)."""
    reqs = grounded_requests(count=3, rng_seed=5, n=3)
    reqs += grounded_requests(count=3, rng_seed=6, temperature=0.8, top_p=0.9, seed=11)
    reqs += grounded_requests(count=2, rng_seed=7, logprobs=2)
    reqs += grounded_requests(count=2, rng_seed=8, n=2, temperature=1.0, seed=3)
    for i, r in enumerate(reqs):
        r.index, r.id = i, str(i)
    make, attention = cache_maker(tiny_model, kind, slots=16)
    plain, _ = run(tiny_model, make(), reqs, attention=attention)
    outs, eng = run(tiny_model, make(), reqs, ngram(), attention=attention)
    assert ids(outs) == ids(plain)
    assert [o.logprobs for o in outs] == [o.logprobs for o in plain]
    assert eng.stats.spec_accepted_tokens > 0
    assert all(len(o.completions) == o.n for o in outs)
    if kind != "slot":
        pool_empty(eng.cache)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stops_inside_an_accepted_run_emit_nothing_past_them(tiny_model, method):
    reqs = grounded_requests(count=6, rng_seed=2, new=(30, 40))
    plain, _ = run(tiny_model, paged(tiny_model), reqs)
    stopped = []
    for r, o in zip(reqs, plain):  # a stop token from the middle of each plain output
        tok = o.token_ids[len(o.token_ids) // 2]
        stopped.append(Request(r.id, r.prompt_token_ids, SamplingParams(max_new_tokens=r.params.max_new_tokens,
                                                                        stop_token_ids=[tok]), index=r.index))
    for new in (1, 2, 3, 5, 7):
        stopped.append(Request(f"m{new}", reqs[0].prompt_token_ids, SamplingParams(max_new_tokens=new, ignore_eos=True),
                               index=len(stopped)))
    ref, _ = run(tiny_model, paged(tiny_model), stopped)
    spec = ngram() if method == "ngram" else drafted(tiny_model)  # same weights: every draft accepted
    outs, eng = run(tiny_model, paged(tiny_model), stopped, spec)
    assert ids(outs) == ids(ref)
    assert [(o.finish_reason, o.stop_reason) for o in outs] == [(o.finish_reason, o.stop_reason) for o in ref]
    for o, r in zip(outs, stopped):
        assert len(o.token_ids) <= r.params.max_new_tokens
    pool_empty(eng.cache)


def test_generation_stops_at_max_model_len_while_speculating(tiny_model):
    reqs = grounded_requests(count=3, rng_seed=4, new=(60, 60))
    plain, _ = run(tiny_model, paged(tiny_model), reqs, max_model_len=48)
    outs, eng = run(tiny_model, paged(tiny_model), reqs, drafted(tiny_model), max_model_len=48)
    assert ids(outs) == ids(plain)
    assert all(len(o.prompt_token_ids) + len(o.token_ids) <= 48 for o in outs)


def test_draft_cache_holds_only_accepted_tokens_and_lets_finished_go(tiny_model, draft_model):
    spec = drafted(draft_model, blocks=64)
    reqs = grounded_requests(count=4, rng_seed=9)
    outs, eng = run(tiny_model, paged(tiny_model), reqs, spec)
    dc = spec.drafter.cache
    for sid, s in spec.drafter.seqs.items():  # left from the last proposals, not yet released
        assert dc.lens[sid] <= s.num_tokens
    spec.drafter.propose([], [])  # releases the finished ones
    assert not dc.tables and dc.pool.num_active == 0


def test_small_draft_pool_drafts_less_but_output_stays_equal(tiny_model, draft_model):
    reqs = grounded_requests(count=6, rng_seed=10)
    plain, _ = run(tiny_model, paged(tiny_model), reqs)
    spec = drafted(draft_model, blocks=12)  # room for about one sequence's tokens at a time
    outs, eng = run(tiny_model, paged(tiny_model), reqs, spec)
    assert ids(outs) == ids(plain)
    assert eng.stats.spec_verifications > 0


# ---- the drafters -------------------------------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    idx = NgramIndex(1, 3)
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    # "5 6" last occurred at 5..6, followed by 7 1 2 5: the longest suffix that occurred wins.
    assert idx.lookup(toks, 4) == [7, 1, 2, 5]
    assert idx.lookup(toks + [3], 2) == []  # 3 never occurred before
    toks2 = toks + [7, 8]
    assert idx.lookup(toks2, 3) == [9, 5, 6]  # "6 7 8" at 1..3, followed by 9 5 6
    assert NgramIndex(2, 2).lookup([1, 2, 3, 2], 2) == []  # "3 2" is new; 1-grams not tried
    assert NgramIndex(1, 1).lookup([4, 4], 3) == [4]  # the continuation is what exists


def test_accepted_prefix():
    assert accepted_prefix([1, 2, 3], [1, 2, 9, 4]) == 2
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_prefix([1], [0, 4]) == 0


# ---- configuration, front door, stats ----------------------------------------------------------

def test_config_keys_are_validated():
    from tinyllm_cli.config import build_config
    with pytest.raises(UsageError, match="did you mean 'speculative.num_tokens'"):
        build_config({"speculative": {"num_token": 3}})
    with pytest.raises(UsageError, match="must be one of none, ngram, draft"):
        build_config({"speculative": {"method": "medusa"}})
    with pytest.raises(UsageError, match="needs speculative.draft_model"):
        build_config({"speculative": {"method": "draft"}})
    with pytest.raises(UsageError, match="from 1 to 16"):
        build_config({}, overrides={"speculative.num_tokens": 0})
    with pytest.raises(UsageError, match="prompt_lookup_min"):
        build_config({"speculative": {"prompt_lookup_min": 4, "prompt_lookup_max": 2}})
    cfg = build_config({"speculative": {"method": "ngram", "num_tokens": 6}})
    assert cfg.speculative.method == "ngram" and cfg.speculative.num_tokens == 6
    with pytest.raises(UsageError, match="speculative.draft_quant .*must be one of none, gguf, not 'q4'"):
        build_config({"speculative": {"method": "draft", "draft_model": "default", "draft_quant": "q4"}})
    # int8 activations apply to 4-bit matmuls: a 4-bit draft has them even where the target has none
    with pytest.raises(UsageError, match="quant_activations .*applies to quant: gguf only"):
        build_config({"quant_activations": "int8", "speculative": {"method": "draft", "draft_model": "default"}})
    cfg = build_config({"quant_activations": "int8",
                        "speculative": {"method": "draft", "draft_model": "default", "draft_quant": "gguf"}})
    assert cfg.speculative.draft_quant == "gguf" and cfg.quant == "none"


def test_llm_front_door_ngram_and_draft(llama_dir, qwen2_dir):
    from tinyllm_cli import LLM
    prompts = [r.prompt_token_ids for r in grounded_requests(count=4, rng_seed=12)]
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    with LLM(str(llama_dir), progress=False, num_blocks=64) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
        keys = set(llm.stats)
        assert llm.stats.spec_method == "none" and llm.stats.spec_drafted_tokens == 0
        llm.reconfigure(speculative="ngram", num_speculative_tokens=3)
        assert [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)] == plain
        assert set(llm.stats) == keys and llm.stats.spec_method == "ngram"
        assert llm.stats.spec_tokens_per_verify > 1
        llm.reconfigure(speculative="draft", draft_model=str(llama_dir))
        assert [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)] == plain
        assert llm.stats.spec_acceptance_rate == 1.0
        with pytest.raises(UsageError, match="does not share the tokenizer"):
            llm.reconfigure(speculative="draft", draft_model=str(qwen2_dir))
        with pytest.raises(UsageError, match="speculative.draft_model: model .* not found"):
            llm.reconfigure(speculative="draft", draft_model=str(qwen2_dir / "nothing-here"))


def test_cluster_merge_sums_the_speculative_counters():
    from tinyllm_cli.cluster import merge_worker_summaries
    from tinyllm_cli.engine.stats import RunStats
    sums = []
    for drafted, accepted in ((10, 5), (30, 25)):
        s = RunStats("paged", 16, 8, 1024, 4, spec_method="ngram")
        s.spec_drafted_tokens, s.spec_accepted_tokens, s.spec_verifications, s.spec_emitted_tokens = drafted, accepted, 5, 12
        sums.append(s.summary())
    out = merge_worker_summaries(sums, 1.0)
    assert out["spec_method"] == "ngram" and out["spec_drafted_tokens"] == 40 and out["spec_accepted_tokens"] == 30
    assert out["spec_acceptance_rate"] == 0.75 and out["spec_tokens_per_verify"] == 2.4
    assert {k for k in sums[0] if k.startswith("spec_")} <= set(out)


def test_simulate_refuses_speculation():
    from tinyllm_cli.config import build_config
    from tinyllm_cli.sim.cost import CostModel, default_profile_path
    from tinyllm_cli.sim.run import Simulation
    cfg = build_config({"speculative": {"method": "ngram"}})
    with pytest.raises(UsageError, match="simulate does not model speculative decoding"):
        Simulation(cfg, CostModel.load(default_profile_path()))


# ---- the real default model ----------------------------------------------------------------------

PASSAGE = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. After two hours of "
           "debate, the council voted 5 to 2 to fund the project, which will cost 1.2 million dollars and should "
           "be finished by next spring. Residents who opposed the plan said it would remove 40 parking spaces.")


@pytest.mark.parametrize("task", ["Summarize this text in one sentence:\n\n",
                                  "Extract the vote count, the cost and the finish date from this text:\n\n"])
def test_default_model_input_grounded_prompt_equals_plain_greedy(default_model, default_checkpoint, task):
    tok = default_checkpoint.tokenizer
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": task + PASSAGE}]))
    req = [Request("0", prompt, SamplingParams(max_new_tokens=48, stop=["\n\n"]), index=0)]

    def go(spec):
        cache = BlockManager(default_model.cfg, 64, 16, torch.float32, prefix_caching=True)
        eng = LLMEngine(default_model, cache, tok, eos_ids=tok.eos_ids, speculation=spec)
        return list(eng.run(copy(req)))[0], eng

    plain, _ = go(None)
    out, eng = go(ngram())
    assert out.token_ids == plain.token_ids and out.text == plain.text
    assert (out.finish_reason, out.stop_reason) == (plain.finish_reason, plain.stop_reason)
    assert eng.stats.spec_accepted_tokens > 0
    pool_empty(eng.cache)


def test_default_model_float32_target_with_its_own_4bit_blocks_drafting(default_checkpoint):
    """``draft_quant: gguf``: the default GGUF's 4-bit blocks (bfloat16, int8 activations where the
    kernel has them) draft for the same file dequantized to float32. The output is plain float32
    greedy decoding's; the draft, the same weights in another arithmetic, agrees most of the time."""
    from tinyllm_cli import LLM
    from tinyllm_cli.model.quant import Int4Linear, Q4Linear
    tok = default_checkpoint.tokenizer
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": task + PASSAGE}]))
               for task in ("Summarize this text in one sentence:\n\n", "Rewrite this text in simpler words:\n\n")]
    p = SamplingParams(max_new_tokens=40)
    with LLM("default", dtype="float32", progress=False, num_blocks=64, quant_activations="auto") as llm:
        plain = [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
        llm.reconfigure(speculative="draft", draft_model="default", draft_quant="gguf")
        out = [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
        assert out == plain
        assert llm.stats.spec_acceptance_rate > 0.5 and llm.stats.spec_tokens_per_verify > 2
        (draft,) = llm.runtime.drafts.values()
        assert llm.runtime.dtype == torch.float32 and draft.dtype == torch.bfloat16
        assert any(isinstance(m, (Q4Linear, Int4Linear)) for m in draft.modules())
