"""The engine reads device values back to the host once per step (the sampled ids) and never
decides anything from a device value. On CPU a readback is free, so this is checked by counting
the tensor methods that read back; on a CUDA machine ``test_cuda.py`` checks the real thing with
PyTorch's sync debug mode."""

from __future__ import annotations

import pytest
import torch

from tinyllm_cli.cache.blocks import BlockManager
from tinyllm_cli.engine.engine import LLMEngine
from tinyllm_cli.engine.request import Request, SamplingParams

READBACKS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")


def mixed_requests(n=6):
    """Greedy rows and sampled rows with every filter that does not rank tokens (top-k / top-p
    rank, and on CPU only they read the candidates' mass back on purpose: see sampler.py)."""
    kinds = [dict(), dict(temperature=0.8, seed=1), dict(temperature=1.2, min_p=0.05, seed=2),
             dict(repetition_penalty=1.3), dict(temperature=0.7, repetition_penalty=1.1, seed=3)]
    return [Request(str(i), [5 + i, 9, 17, 3 + i] * (i + 1), SamplingParams(max_new_tokens=5 + i, ignore_eos=True,
                                                                     **kinds[i % len(kinds)]), index=i)
            for i in range(n)]


def logprob_requests():
    """The same mix with parallel sampling, per-token and prompt log-probabilities: all of it
    rides in the step's one readback."""
    reqs = mixed_requests()
    for i, r in enumerate(reqs):
        r.params.n = 1 + i % 3
        r.params.logprobs = [None, 3, True][i % 3]
        r.params.prompt_logprobs = 2 if i % 2 else None
    return reqs


@pytest.mark.parametrize("requests", [mixed_requests, logprob_requests])
def test_one_readback_per_step(tiny_model, monkeypatch, requests):
    cache = BlockManager(tiny_model.cfg, 64, 4, torch.float32)
    eng = LLMEngine(tiny_model, cache, None, max_num_seqs=4, max_prefill_tokens=16)
    calls: list[str] = []
    for name in READBACKS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            calls.append(_name)
            return _original(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    for r in requests():
        eng.add_request(r)
    steps = 0
    while eng.has_unfinished():
        before = len(calls)
        eng.step()
        steps += 1
        # A step whose prefill chunks all end mid-prompt samples nothing and reads nothing back.
        assert calls[before:] in ([], ["tolist"]), f"step {steps} read back {calls[before:]}"
    monkeypatch.undo()
    assert steps > 5 and calls.count("tolist") >= steps - 3
