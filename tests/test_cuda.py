"""The CUDA path, checked where a CUDA device exists (``.ci/gpu-check`` runs this file there);
on a machine without one every test here is skipped, and nothing else depends on them.

What must hold on a GPU: the same logits as transformers, the same greedy tokens as a no-cache
recompute through the paged and slot caches, a bf16 run that works, and no blocking host sync
in a step beyond the one readback of the sampled ids.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tinyllm_cli.cache.attention import NoCacheAttention
from tinyllm_cli.cache.kv import PagedKVCache, SlotKVCache
from tinyllm_cli.engine.engine import LLMEngine
from tinyllm_cli.model.checkpoint import load_checkpoint
from tinyllm_cli.model.llama import build_model

from test_engine import make_requests, preempting_blocks, reference_greedy
from test_host_sync import logprob_requests, mixed_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = "cuda"


def _model(path, dtype=torch.float32):
    ck = load_checkpoint(str(path), progress=False)
    return build_model(ck.config, ck.weights, dtype, CUDA)


def test_logits_match_transformers_on_cuda(llama_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    model = _model(llama_dir)
    assert model.gemm == "torch" and model.device.type == "cuda"
    prompt = torch.randint(3, model.cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0]
        got = model(prompt.to(CUDA), torch.arange(29, device=CUDA), NoCacheAttention([29])).cpu()
    # TF32 is off for float32 matmuls by default, so only summation order differs.
    assert (got - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_engine_matches_no_cache_reference_on_cuda(llama_dir, tiny_model, kind):
    model = _model(llama_dir)
    reqs = make_requests()
    refs = [reference_greedy(tiny_model, r.prompt_token_ids, r.params.max_new_tokens) for r in reqs]
    if kind == "paged":
        cache = PagedKVCache(model.cfg, preempting_blocks(reqs), 4, torch.float32, CUDA)
    else:
        cache = SlotKVCache(model.cfg, 3, 128, torch.float32, CUDA)
    eng = LLMEngine(model, cache, None, max_num_seqs=7, max_prefill_tokens=16)
    outs = sorted(eng.run(reqs), key=lambda o: o.index)
    assert [o.token_ids for o in outs] == refs
    if kind == "paged":
        assert eng.stats.summary()["preemptions"] > 0


def test_bf16_engine_runs_on_cuda(llama_dir):
    model = _model(llama_dir, torch.bfloat16)
    eng = LLMEngine(model, PagedKVCache(model.cfg, 256, 16, torch.bfloat16, CUDA), None, max_num_seqs=8)
    outs = list(eng.run(make_requests()))
    assert len(outs) == 7 and all(o.finish_reason == "length" and o.token_ids for o in outs)


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_forks_match_no_cache_reference_on_cuda(llama_dir, tiny_model, kind):
    model = _model(llama_dir)
    reqs = make_requests(n=4, lens=(3, 21), new=(5, 12))
    for r in reqs:
        r.params.n = 3
    refs = [[reference_greedy(tiny_model, r.prompt_token_ids, r.params.max_new_tokens)] * 3 for r in reqs]
    cache = (PagedKVCache(model.cfg, 24, 4, torch.float32, CUDA) if kind == "paged"
             else SlotKVCache(model.cfg, 6, 64, torch.float32, CUDA))
    eng = LLMEngine(model, cache, None, max_num_seqs=12, max_prefill_tokens=16)
    outs = sorted(eng.run(reqs), key=lambda o: o.index)
    assert [[c.token_ids for c in o.completions] for o in outs] == refs
    assert eng.stats.summary()["cow_copies"] > 0


@pytest.mark.parametrize("requests", [mixed_requests, logprob_requests])
def test_no_blocking_sync_on_cuda(llama_dir, requests):
    model = _model(llama_dir, torch.bfloat16)
    cache = PagedKVCache(model.cfg, 64, 4, torch.bfloat16, CUDA)
    eng = LLMEngine(model, cache, None, max_num_seqs=4, max_prefill_tokens=16)
    for r in requests():
        eng.add_request(r)
    eng.step()  # first-call set-up (cuBLAS handles, generators) may synchronise
    steps = 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while eng.has_unfinished():
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                eng.step()
            steps += 1
            syncs = [str(w.message) for w in seen if "synchroniz" in str(w.message)]
            assert len(syncs) <= 1, f"step {steps}: {syncs}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps > 3


def test_to_device_on_cuda_is_pinned_and_exact():
    from tinyllm_cli.transfer import to_device

    for _ in range(50):  # host blocks are recycled: values must survive reuse
        values = torch.randint(0, 1 << 40, (1000,)).tolist()
        t = to_device(values, CUDA)
        assert t.device.type == "cuda" and t.tolist() == values
