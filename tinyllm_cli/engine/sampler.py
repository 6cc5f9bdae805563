"""Batched token sampling with per-request parameters.

Invariants:
- Greedy rows take ``argmax`` of the raw logits (after repetition penalty): no randomness.
- A sampled row draws its noise from a generator seeded by ``(seed, token index)``, so the same
  request yields the same tokens alone, in any batch, and after a preemption and recompute.
  Sampling uses the exponential race: ``argmax(p / E)``, with ``E ~ Exp(1)`` from that generator.
- Filtering order follows transformers / vLLM: repetition penalty, temperature, top-k, top-p, min-p.
- Log-probabilities (``logprobs``) are those of the distribution the sampler drew from *before*
  its filters: log_softmax of the logits after repetition penalty and temperature (temperature 0
  counts as 1), not renormalised over what top-k / top-p / min-p keep. Prompt log-probabilities
  are the model's raw log_softmax (no penalty, no temperature: they score a given text).
- One host sync per step: the caller's ``.tolist()`` on the returned tokens (on CPU, the top-p
  candidate check reads a few floats back too, which costs nothing there). Decisions are taken
  from the request parameters on the host, never from device values, and parameter tensors go
  to the device through ``to_device`` (no blocking copy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..model.greedy_head import argmax
from ..transfer import to_device
from .request import Sequence

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) pairs over seeds
_MASK = (1 << 63) - 1


def row_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) & _MASK


def apply_repetition_penalty(logits: Tensor, seqs: list[Sequence]) -> None:
    for i, s in enumerate(seqs):
        p = s.request.params.repetition_penalty
        if p != 1.0:
            ids = to_device(sorted(set(s.tokens)), logits.device)
            vals = logits[i, ids]
            logits[i, ids] = torch.where(vals > 0, vals / p, vals * p)


def _ranks_tokens(p, vocab: int) -> bool:
    """Whether a row's filters need the tokens in order of likelihood (top-k or top-p)."""
    return 0 < p.top_k < vocab or p.top_p < 1.0


# Candidates for top-k / top-p: top-p's kept set almost always lies among the few hundred most
# likely tokens of a 50k vocabulary, and a top-k of 1024 costs 0.2 ms where sorting the whole
# vocabulary costs 2.7 ms (per row, on this CPU). Exact: a step falls back to the full sort
# whenever the candidates might not hold every row's kept set.
CANDIDATES = 1024
_MASS_MARGIN = 1e-4  # float slack between the candidates' mass and the cumsum that cuts top-p


def _ranked(logits: Tensor, params) -> tuple[Tensor, Tensor]:
    """(logits, token ids) best first, covering every token top-k / top-p can keep."""
    vocab = logits.shape[-1]
    k = min(vocab, max([CANDIDATES] + [p.top_k for p in params if 0 < p.top_k < vocab]))
    if k < vocab and logits.device.type == "cpu":  # the check reads back the mass: free on CPU only
        vals, ids = logits.topk(k, dim=-1)
        mass = (vals - logits.logsumexp(-1, keepdim=True)).exp().sum(-1).tolist()
        if all(0 < p.top_k <= k or (p.top_p < 1.0 and m >= p.top_p + _MASS_MARGIN)
               for p, m in zip(params, mass)):
            return vals, ids
    return logits.sort(dim=-1, descending=True)


def filter_logits(logits: Tensor, seqs: list[Sequence]) -> tuple[Tensor, Tensor | None]:
    """Temperature, top-k, top-p, min-p for rows that sample. Returns ``(probs, ids)``: the
    probability of token ``ids[r, j]`` is ``probs[r, j]``; ``ids`` None means the whole
    vocabulary in order (no row has top-k or top-p)."""
    params = [s.request.params for s in seqs]
    temp = to_device([p.temperature for p in params], logits.device, torch.float32)[:, None]
    logits = logits / temp
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    ids = None
    if any(_ranks_tokens(p, vocab) for p in params):
        full_lse = logits.logsumexp(-1)
        logits, ids = _ranked(logits, params)
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        top_k_t = to_device(top_k, logits.device)
        drop = ranks >= top_k_t[:, None]
        # top-p's mass is over the top-k survivors, or over the whole vocabulary when there is no
        # top-k: so normalise by the full vocabulary's sum there, not by the candidates'.
        masked = logits.masked_fill(drop, float("-inf"))
        norm = torch.where(top_k_t < vocab, masked.logsumexp(-1), full_lse)
        probs = (masked - norm[:, None]).exp()
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = probs.cumsum(-1) - probs
        drop |= before >= to_device(top_p, logits.device, torch.float32)[:, None]
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], logits.device, torch.float32)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs, ids


def draw(probs: Tensor, ids: Tensor | None, seqs: list[Sequence], vocab: int) -> Tensor:
    """The exponential race. Noise is drawn over the whole vocabulary in token order whatever
    the candidates, so a token's draw does not depend on which other tokens were kept."""
    noise = torch.empty(len(seqs), vocab, device=probs.device)
    for i, s in enumerate(seqs):
        g = torch.Generator(device=probs.device).manual_seed(row_seed(s.seed, s.num_output))
        noise[i].exponential_(generator=g)
    if ids is None:
        return (probs / noise).argmax(-1)
    best = (probs / noise.gather(-1, ids)).argmax(-1, keepdim=True)
    return ids.gather(-1, best)[:, 0]


def argmax_only(seqs: list[Sequence]) -> bool:
    """Whether ``sample`` would take every row's token as the plain argmax of its logits, and
    nothing else reads them: greedy, no repetition penalty, no log-probabilities. Such a step can
    ask the model for the argmax alone (``LlamaModel.forward(greedy=True)``)."""
    return all(p.greedy and p.repetition_penalty == 1.0 and p.num_logprobs is None
               for p in (s.request.params for s in seqs))


def sample(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """logits [B, V] float32 for ``seqs`` (same order) -> token ids [B] (on device). Sampled rows
    go in two groups, so rows that rank tokens never force a sort on rows that do not."""
    apply_repetition_penalty(logits, seqs)
    tokens = argmax(logits)
    sampled = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
    for ranked in (False, True):
        rows = [i for i in sampled if _ranks_tokens(seqs[i].request.params, logits.shape[-1]) == ranked]
        if rows:
            idx = to_device(rows, logits.device)
            sub = [seqs[i] for i in rows]
            probs, ids = filter_logits(logits[idx], sub)
            tokens[idx] = draw(probs, ids, sub, logits.shape[-1])
    return tokens


def logprob_table(logits: Tensor, chosen: Tensor, k: int) -> Tensor:
    """[R, 1 + 2k] float32 on the device: each row's log-probability of ``chosen``, then its top-k
    log-probabilities (best first), then their token ids (exact in float32 below 2**24)."""
    lp = logits.float().log_softmax(-1)
    cols = [lp.gather(-1, chosen[:, None])]
    if k:
        vals, ids = lp.topk(k, dim=-1)
        cols += [vals, ids.float()]
    return torch.cat(cols, 1)


def sampled_logprobs(logits: Tensor, tokens: Tensor, seqs: list[Sequence]) -> tuple[list[int], int, Tensor | None]:
    """Log-probabilities for the rows whose request asked: (those rows, k, table) where the
    table is ``logprob_table`` over the logits as the sampler saw them (``logits`` already holds
    the repetition penalty: ``sample`` applies it in place) divided by the temperature."""
    rows = [i for i, s in enumerate(seqs) if s.request.params.num_logprobs is not None]
    if not rows:
        return rows, 0, None
    k = max(seqs[i].request.params.num_logprobs for i in rows)
    idx = to_device(rows, logits.device)
    temps = [seqs[i].request.params for i in rows]
    temp = to_device([1.0 if p.greedy else p.temperature for p in temps], logits.device, torch.float32)
    return rows, k, logprob_table(logits[idx] / temp[:, None], tokens[idx], k)
