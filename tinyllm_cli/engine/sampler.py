"""Batched token sampling with per-request parameters.

Invariants:
- Greedy rows take ``argmax`` of the raw logits (after repetition penalty): no randomness.
- A sampled row draws its noise from a generator seeded by ``(seed, token index)``, so the same
  request yields the same tokens alone, in any batch, and after a preemption and recompute.
  Sampling uses the exponential race: ``argmax(p / E)``, with ``E ~ Exp(1)`` from that generator.
- Filtering order follows transformers / vLLM: repetition penalty, temperature, top-k, top-p, min-p.
- One host sync per step: the caller's ``.tolist()`` on the returned tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .request import Sequence

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) pairs over seeds
_MASK = (1 << 63) - 1


def row_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) & _MASK


def apply_repetition_penalty(logits: Tensor, seqs: list[Sequence]) -> None:
    for i, s in enumerate(seqs):
        p = s.request.params.repetition_penalty
        if p != 1.0:
            ids = torch.tensor(sorted(set(s.tokens)), device=logits.device)
            vals = logits[i, ids]
            logits[i, ids] = torch.where(vals > 0, vals / p, vals * p)


def filter_logits(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """Temperature, top-k, top-p, min-p for rows that sample; returns probabilities."""
    params = [s.request.params for s in seqs]
    temp = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    logits = logits / temp
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= torch.tensor(top_k, device=logits.device)[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = probs.cumsum(-1) - probs
        drop |= before >= torch.tensor(top_p, device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device)[:, None]
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs


def draw(probs: Tensor, seqs: list[Sequence]) -> Tensor:
    noise = torch.empty_like(probs)
    for i, s in enumerate(seqs):
        g = torch.Generator(device=probs.device).manual_seed(row_seed(s.seed, s.num_output))
        noise[i].exponential_(generator=g)
    return (probs / noise).argmax(-1)


def sample(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """logits [B, V] float32 for ``seqs`` (same order) -> token ids [B] (on device)."""
    apply_repetition_penalty(logits, seqs)
    tokens = logits.argmax(-1)
    rows = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        sub = [seqs[i] for i in rows]
        tokens[idx] = draw(filter_logits(logits[idx], sub), sub)
    return tokens
