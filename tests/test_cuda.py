"""The CUDA path, checked where a CUDA device exists (``.ci/gpu-check`` runs this file there);
on a machine without one every test here is skipped, and nothing else depends on them.

What must hold on a GPU: the same logits as transformers, the same greedy tokens as a no-cache
recompute through the paged and slot caches and through the Python API, a reconfigured LLM that
reuses the closed engine's device pools without reading what they held, a bf16 run that works,
no blocking host sync in a step beyond the one readback of the sampled ids, and a bench peak
measured on the GPU itself (never the host CPU's kernels).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tinyllm_cli.cache.attention import NoCacheAttention
from tinyllm_cli.cache.blocks import BlockManager, SlotBlockManager
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
        cache = BlockManager(model.cfg, preempting_blocks(reqs), 4, torch.float32)
    else:
        cache = SlotBlockManager(model.cfg, 3, 128, torch.float32)
    eng = LLMEngine(model, cache, None, max_num_seqs=7, max_prefill_tokens=16)
    outs = sorted(eng.run(reqs), key=lambda o: o.index)
    assert [o.token_ids for o in outs] == refs
    if kind == "paged":
        assert eng.stats.summary()["preemptions"] > 0


def test_bf16_engine_runs_on_cuda(llama_dir):
    model = _model(llama_dir, torch.bfloat16)
    eng = LLMEngine(model, BlockManager(model.cfg, 256, 16, torch.bfloat16), None, max_num_seqs=8)
    outs = list(eng.run(make_requests()))
    assert len(outs) == 7 and all(o.finish_reason == "length" and o.token_ids for o in outs)


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_forks_match_no_cache_reference_on_cuda(llama_dir, tiny_model, kind):
    model = _model(llama_dir)
    reqs = make_requests(n=4, lens=(3, 21), new=(5, 12))
    for r in reqs:
        r.params.n = 3
    refs = [[reference_greedy(tiny_model, r.prompt_token_ids, r.params.max_new_tokens)] * 3 for r in reqs]
    cache = (BlockManager(model.cfg, 24, 4, torch.float32) if kind == "paged"
             else SlotBlockManager(model.cfg, 6, 64, torch.float32))
    eng = LLMEngine(model, cache, None, max_num_seqs=12, max_prefill_tokens=16)
    outs = sorted(eng.run(reqs), key=lambda o: o.index)
    assert [[c.token_ids for c in o.completions] for o in outs] == refs
    assert eng.stats.summary()["cow_copies"] > 0


@pytest.mark.parametrize("requests", [mixed_requests, logprob_requests])
def test_no_blocking_sync_on_cuda(llama_dir, requests):
    model = _model(llama_dir, torch.bfloat16)
    cache = BlockManager(model.cfg, 64, 4, torch.bfloat16)
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


def test_llm_on_cuda_matches_no_cache_reference_and_reuses_its_pools(llama_dir, tiny_model):
    from tinyllm_cli import LLM, SamplingParams

    prompts = [r.prompt_token_ids for r in make_requests()]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=12, ignore_eos=True, logprobs=2)
    # float32: dtype 'auto' is bfloat16 on a GPU, and the reference computes in float32
    settings = dict(device=CUDA, dtype="float32", block_size=4, kv_memory="2MiB", seed=3, progress=False)
    with LLM(str(llama_dir), **settings) as fresh:
        assert fresh.engine.runner.storage.k.device.type == "cuda"
        got = fresh.generate(prompts, greedy, use_tqdm=False)
        assert [o.token_ids for o in got] == [reference_greedy(tiny_model, p, 9) for p in prompts]
        fresh.reconfigure()  # the seed restarts with the new engine, as in the LLM below
        want = fresh.generate(prompts, sampled, use_tqdm=False)
    with LLM(str(llama_dir), **settings) as llm:
        llm.generate(prompts[:3], sampled, use_tqdm=False)
        old = llm.engine.runner.storage
        k_ptr = old.k.data_ptr()
        old.k.fill_(float("nan"))
        old.v.fill_(float("nan"))
        llm.reconfigure()
        assert not old.has_tensors and llm.engine.runner.storage.k.data_ptr() == k_ptr
        got = llm.generate(prompts, sampled, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


def test_the_bench_peak_on_cuda_is_the_gpu_s(tmp_path, monkeypatch):
    import tinyllm_cli.kernels as native
    from tinyllm_cli import roofline as rl

    monkeypatch.setenv("TINYLLM_PEAK_CACHE", str(tmp_path / "peak.json"))
    monkeypatch.setattr(native, "load", lambda: pytest.fail("a GPU peak built or loaded the CPU kernels"))
    p = rl.measure_peak(torch.bfloat16, (576, 1536), seconds=0.2, device=CUDA)
    assert p["device"] == f"cuda: {torch.cuda.get_device_name()}" and p["threads"] is None
    assert p["gemm"] == "torch" and set(p["gflops"]["torch"]) == {"1", "32", "256"}
    assert p["gemm_gflops"] > 0 and p["bandwidth_gbps"] > 0 and not p["cached"]
    assert rl.measure_peak(torch.bfloat16, (576, 1536), device=CUDA)["cached"]


def test_engine_steps_never_run_cudnn_attention(llama_dir, monkeypatch):
    """cuDNN's SDPA backend builds a graph per new shape (seconds of a bench's first bf16 run);
    every SDPA call of a step must run with it disabled."""
    import torch.nn.functional as F
    from tinyllm_cli.cache import attention

    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*a, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    model = _model(llama_dir, torch.bfloat16)
    eng = LLMEngine(model, BlockManager(model.cfg, 64, 4, torch.bfloat16), None, max_num_seqs=4)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert len(list(eng.run(make_requests(n=3)))) == 3
    assert seen and not any(seen) and torch.backends.cuda.cudnn_sdp_enabled() == before  # restored
