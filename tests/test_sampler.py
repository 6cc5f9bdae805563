"""The sampler's filters against a plain float64 reference written here (sort the whole
vocabulary, cut, renormalise), on a 50k vocabulary so the top-k candidate shortcut is exercised,
including rows whose top-p mass is spread too thin for it (the full-sort fallback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tinyllm_cli.engine import sampler
from tinyllm_cli.engine.request import SamplingParams

VOCAB = 49152


def _seq(seed: int, **params):
    return SimpleNamespace(request=SimpleNamespace(params=SamplingParams(**params)), seed=seed, num_output=3)


def _reference_probs(row: torch.Tensor, p: SamplingParams, with_before: bool = False):
    x = row.double() / p.temperature
    order = x.argsort(descending=True)
    xs = x[order]
    keep = torch.ones_like(xs, dtype=torch.bool)
    if 0 < p.top_k < len(xs):
        keep[p.top_k:] = False
    probs = torch.where(keep, xs, torch.tensor(float("-inf"), dtype=xs.dtype)).softmax(-1)
    before = probs.cumsum(-1) - probs
    keep &= before < p.top_p
    probs = torch.where(keep, xs, torch.tensor(float("-inf"), dtype=xs.dtype)).softmax(-1)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    out, before_out = torch.zeros_like(probs), torch.zeros_like(probs)
    out[order] = probs / probs.sum()
    before_out[order] = before
    return (out, before_out) if with_before else out


ROWS = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=40), dict(temperature=1.3, top_k=2000, top_p=0.5),
        dict(temperature=0.7, top_p=0.95, min_p=0.05), dict(temperature=1.0, top_p=0.999),
        dict(temperature=1.0, min_p=0.1), dict(temperature=0.9)]


@pytest.mark.parametrize("scale", [6.0, 0.05])  # peaked logits (candidates suffice) and flat ones (fallback)
def test_filters_and_draws_match_a_full_sort_reference(scale):
    g = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(len(ROWS), VOCAB, generator=g) * scale
    seqs = [_seq(100 + i, **r) for i, r in enumerate(ROWS)]
    full = torch.zeros(len(ROWS), VOCAB, dtype=torch.float64)
    for ranked in (False, True):  # the two groups sample() makes
        rows = [i for i, s in enumerate(seqs) if sampler._ranks_tokens(s.request.params, VOCAB) == ranked]
        probs, ids = sampler.filter_logits(logits[rows].clone(), [seqs[i] for i in rows])
        if ids is None:
            full[rows] = probs.double()
        else:
            full[rows] = torch.zeros(len(rows), VOCAB, dtype=torch.float64).scatter_(-1, ids, probs.double())
    full /= full.sum(-1, keepdim=True)
    for i, (row, s) in enumerate(zip(logits, seqs)):
        ref, before = _reference_probs(row, s.request.params, with_before=True)
        # float32 cumsums may move a top-p cut by a token or two whose mass-before sits within
        # 1e-5 of top_p; any other difference in the kept set is a bug.
        differ = (full[i] > 0) != (ref > 0)
        assert ((before[differ] - s.request.params.top_p).abs() < 1e-5).all(), f"row {i}: kept sets differ"
        assert int(differ.sum()) <= 3
        torch.testing.assert_close(full[i][~differ], ref[~differ], rtol=1e-3, atol=1e-6)
    # The draw: the exponential race over the same per-(seed, index) noise as the reference.
    got = sampler.sample(logits.clone(), seqs).tolist()
    for i, s in enumerate(seqs):
        noise = torch.empty(VOCAB).exponential_(
            generator=torch.Generator().manual_seed(sampler.row_seed(s.seed, s.num_output)))
        assert got[i] == int((_reference_probs(logits[i], s.request.params) / noise.double()).argmax())


def test_candidate_shortcut_and_its_fallback():
    peaked = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 6
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=5)]
    vals, _ = sampler._ranked(peaked, params)
    assert vals.shape[-1] == sampler.CANDIDATES  # the shortcut was taken
    flat = peaked / 1000  # the top 1024 tokens hold ~2% of the mass: the cut lies beyond them
    vals, _ = sampler._ranked(flat, params)
    assert vals.shape[-1] == VOCAB
