"""Speculative decoding: guess k tokens cheaply, verify them in the step's one forward pass.

A decoding sequence with drafts ``d1..dk`` feeds its last token and the drafts as one chunk over
its cached context (a prefill chunk at a nonzero start), gets logits at all k + 1 positions and
keeps the longest prefix of drafts equal to the greedy argmax there, plus the argmax after that
prefix (the correction, or a bonus token when every draft was right): 1 to k + 1 tokens for one
forward row each. Two drafters:

- ``NgramDrafter`` (prompt lookup): the latest n tokens (n from ``hi`` down to ``lo``) are looked
  up in the sequence's earlier tokens, prompt and output; the k tokens that followed their most
  recent earlier occurrence are the draft. Input-grounded outputs (summaries, rewrites,
  extraction, code edits) copy long runs of their prompt, so it pays there. No second model.
- ``ModelDrafter``: a small model with the target's tokenizer drafts greedily, k steps, batched
  over the step's speculating sequences, on its own paged block manager and K/V storage.

Invariants:
- Greedy output is the output of plain decoding: every emitted token is the target's argmax
  after exactly the tokens before it (drafts only decide how many positions one step checks).
  Only greedy requests without repetition penalty, log-probabilities or a grammar speculate
  (``can_speculate``); the others decode one token per step as before, in the same batch.
- Stop conditions are checked per emitted token by the engine, so nothing past a stop is kept.
- The draft model's cache only ever holds the K/V of accepted tokens: each ``propose`` catches
  up on the tokens accepted since the last one, drafts, then rolls its cache back to them.
- A drafter keeps no state a preemption or a fork could make stale: the n-gram index lives on
  the ``Sequence`` (its tokens only ever grow), the draft cache is keyed by sequence id and
  released once the sequence is finished.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.blocks import BlockManager
from ..cache.storage import KVStorage, storage_for
from ..model.llama import LlamaModel
from ..transfer import to_device
from .request import Sequence, Status
from .sampler import argmax_only


def can_speculate(s: Sequence) -> bool:
    """Greedy, unpenalised, unconstrained, no log-probabilities: verification by argmax is exact."""
    return argmax_only([s]) and s.grammar is None


def accepted_prefix(drafts: list[int], argmax: list[int]) -> int:
    """How many leading drafts the target agrees with (``argmax[i]`` follows ``drafts[:i]``)."""
    a = 0
    while a < len(drafts) and drafts[a] == argmax[a]:
        a += 1
    return a


@dataclass
class Speculation:
    """What the engine needs: the method (for stats), k, and the drafter."""

    method: str
    num_tokens: int
    drafter: "NgramDrafter | ModelDrafter"


# ---- prompt lookup ----------------------------------------------------------------------------

class NgramIndex:
    """Per sequence: every n-gram (lo <= n <= hi) of its tokens that has a next token -> where
    that next token is, for the latest such occurrence. Updated with the new tokens only."""

    def __init__(self, lo: int, hi: int):
        self.sizes = range(lo, hi + 1)
        self.after: dict[tuple[int, ...], int] = {}
        self.next_pos = 1  # the first position whose preceding n-grams are not indexed yet

    def update(self, tokens: list[int]) -> None:
        after = self.after
        for e in range(self.next_pos, len(tokens)):
            for n in self.sizes:
                if n <= e:
                    after[tuple(tokens[e - n:e])] = e
        self.next_pos = max(self.next_pos, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix that has one."""
        self.update(tokens)
        for n in reversed(self.sizes):
            if n < len(tokens):
                e = self.after.get(tuple(tokens[-n:]))
                if e is not None:
                    return tokens[e:e + k]
        return []


class NgramDrafter:
    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def propose(self, seqs: list[Sequence], caps: list[int]) -> list[list[int]]:
        out = []
        for s, k in zip(seqs, caps):
            if s.draft_state is None:
                s.draft_state = NgramIndex(self.lo, self.hi)
            out.append(s.draft_state.lookup(s.tokens, k))
        return out


# ---- draft model ------------------------------------------------------------------------------

class ModelDrafter:
    """Greedy drafts from ``model`` (the target's vocabulary) on its own ``cache`` (a block
    manager) and its K/V ``storage`` (default: new storage for ``cache`` on the model's device).

    One ``propose`` = one forward that catches every sequence up on its accepted tokens and
    drafts its first token, then one decode forward per further draft token for the sequences
    that still want more (sorted by cap, so they are a prefix of the batch). Draft ids stay on
    the device between steps; one readback at the end."""

    def __init__(self, model: LlamaModel, cache: BlockManager, storage: KVStorage | None = None):
        self.model, self.cache = model, cache
        self.storage = storage_for(cache, model.device, storage)
        self.seqs: dict[int, Sequence] = {}  # sequences with K/V in the draft cache

    def propose(self, seqs: list[Sequence], caps: list[int]) -> list[list[int]]:
        self._release(lambda s: s.status is Status.FINISHED)
        order = sorted(range(len(seqs)), key=lambda i: -caps[i])
        live = [i for i in order if self._room(seqs[i], caps[i], {seqs[j].seq_id for j in order})]
        out: list[list[int]] = [[] for _ in seqs]
        if not live:
            return out
        steps = self._draft([seqs[i] for i in live], [caps[i] for i in live])
        flat = torch.cat(steps).tolist()  # the one host sync
        at = 0
        for step in steps:  # step j holds draft j of the first len(step) sequences of ``live``
            for r in range(step.shape[0]):
                out[live[r]].append(flat[at + r])
            at += step.shape[0]
        for i in live:  # keep only accepted tokens' K/V: the drafts are rolled back
            self.cache.truncate(seqs[i].seq_id, seqs[i].num_tokens)
        return out

    def _draft(self, seqs: list[Sequence], caps: list[int]) -> list[torch.Tensor]:
        cache, dev = self.cache, self.model.device
        ids, pos, rows, chunks = [], [], [], []
        for s in seqs:  # catch up on the tokens accepted since the last proposal
            start, n = min(cache.lens[s.seq_id], s.num_tokens - 1), s.num_tokens  # >= 1 row for its logits
            ids += s.tokens[start:n]
            pos += range(start, n)
            rows.append(len(ids) - 1)
            chunks.append((s.seq_id, start, n - start))
        attn = self.storage.plan_step([], chunks)
        tok = self.model(to_device(ids, dev), to_device(pos, dev), attn, to_device(rows, dev), greedy=True)
        steps = [tok]
        for j in range(1, caps[0]):
            m = sum(c > j for c in caps)
            sids = [s.seq_id for s in seqs[:m]]
            pos = [s.num_tokens + j - 1 for s in seqs[:m]]
            attn = self.storage.plan_step(sids, [])
            tok = self.model(tok[:m], to_device(pos, dev), attn, greedy=True)
            steps.append(tok)
        return steps

    def _room(self, s: Sequence, cap: int, batch: set[int]) -> bool:
        """Blocks for the sequence's tokens and cap - 1 drafts; sequences outside this batch give
        theirs up (they recompute later) before ``s`` goes without."""
        cache, need = self.cache, s.num_tokens + cap - 1
        if cap <= 0 or not cache.fits_alone(need):
            return False
        if s.seq_id not in cache.tables:
            if not cache.pool.can_allocate(1):
                self._release(lambda o: o.seq_id not in batch)
            if cache.try_admit(s.seq_id, [], use_prefix=False) is None:
                return False
            self.seqs[s.seq_id] = s
        if cache.blocks_to_grow(s.seq_id, need) > cache.pool.num_free:
            self._release(lambda o: o.seq_id not in batch)
        if cache.blocks_to_grow(s.seq_id, need) > cache.pool.num_free:
            return False
        cache.grow(s.seq_id, need)
        return True

    def _release(self, which) -> None:
        for sid in [sid for sid, s in self.seqs.items() if which(s)]:
            self.cache.release(sid)
            del self.seqs[sid]
