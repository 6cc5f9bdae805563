"""The runner: the one room of the engine that calls the model. Given the scheduler's ``Plan``
for a step it packs the step (decode rows, prefill ``Chunk``s, speculative ``Verify`` chunks)
into one flat batch, runs one forward, applies grammar masks, samples, gathers the
log-probabilities asked for and the verify rows' argmax, and hands back a ``RunnerOutput``. The
engine loop (``engine.py``: admit, schedule, append, stop, outputs, stats) calls it through the
``Runner`` interface and knows nothing of tensors; the simulator plugs in a cost runner instead
(``sim/engine.py``). The runner owns the step's K/V storage (``cache.storage.KVStorage``): the
scheduler decides in the block manager, the runner stores into the pools the manager points at.

Invariants:
- ``RunnerOutput.samplers`` is the plan's sampling rows in order: decode rows, then per prefill
  chunk that completes its prompt the sequence and its pending forks (``samplers_of``);
  ``tokens`` and ``logprobs`` line up with it, ``verified`` with ``plan.verify``.
- The storage stores every token the step computes (its K/V) during ``run``, after applying the
  copies on write the scheduler's growth recorded; the runner does not move sequences on
  (``num_cached``): the engine does, after ``run``.
- One host sync per step (the sampled ids and every log-probability asked for, in one readback).
- A step whose every row is greedy with nothing else read from its logits asks the model for the
  argmax alone (``forward(greedy=True)``): the same tokens, without logits.
- Grammar masks fill on a thread during the forward only where the forward leaves the CPU idle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..cache.blocks import BlockManager
from ..cache.storage import KVStorage, storage_for
from ..model.llama import LlamaModel
from ..transfer import to_device
from . import constraints, sampler
from .request import Group, Sequence
from .scheduler import Plan
from .stats import RunStats


@dataclass
class Scoring:
    """A step's prompt rows that report log-probabilities (they follow the sampled rows)."""

    rows: list[int] = field(default_factory=list)  # rows of the packed step
    targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    groups: list[tuple[Group, int]] = field(default_factory=list)  # (group, its rows), in order


@dataclass
class StepBatch:
    """A step packed for the model: token ids and positions (one row per token), the rows whose
    logits are read, the cache's attention plan, and the prompt rows that are scored."""

    samplers: list[Sequence]
    ids: torch.Tensor
    positions: torch.Tensor
    logit_rows: torch.Tensor
    attention: object
    scoring: Scoring


@dataclass
class RunnerOutput:
    """What a step computed: per sampler its token and log-probability entry (None unless
    asked), the forward's seconds, and per ``plan.verify`` entry the argmax at each of its rows."""

    samplers: list[Sequence]
    tokens: list[int]
    logprobs: list
    forward_s: float
    verified: list[list[int]]


class Runner(Protocol):
    """What the engine loop needs of whatever computes its steps. ``attention``: the path its
    attention reads K/V by ('kernel', 'gather'; None when nothing is computed), for the stats."""

    attention: str | None

    def run(self, plan: Plan, stats: RunStats) -> RunnerOutput: ...

    def close(self) -> None: ...


def samplers_of(plan: Plan) -> list[Sequence]:
    """The plan's sampling rows in order: decode rows, then per prefill chunk that completes its
    prompt the sequence and its pending forks (each samples from the prompt's last row)."""
    out = list(plan.decode)
    for c in plan.prefill:
        if c.completes_prompt:
            out += [c.seq] + c.seq.pending
    return out


def scored_span(s: Sequence, start: int, n: int) -> tuple[int, int]:
    """Positions [lo, hi) of chunk ``[start, start + n)`` whose rows score a prompt token (empty
    when lo >= hi): position p predicts token p + 1, skipping tokens already scored and the last
    prompt position, which predicts the sampled first output token."""
    return max(start, len(s.group.prompt_logprobs) - 1), min(start + n, s.num_prompt - 1)


class ModelRunner:
    """Runs steps on a model over the K/V ``storage`` of the block manager ``blocks`` (default:
    new storage for ``blocks`` on the model's device, attention 'auto')."""

    def __init__(self, model: LlamaModel, blocks: BlockManager, storage: KVStorage | None = None):
        self.model = model
        self.storage = storage_for(blocks, model.device, storage)
        self.attention = self.storage.attention
        self._mask_pool = None  # a thread that fills grammar masks during the forward pass
        # Fill grammar masks on a thread during the forward pass only where the forward leaves the
        # CPU idle (a GPU): on the CPU the thread competes with the forward's own threads
        # (scripts/structured_bench.py, batch 32: 7.1% slower than unconstrained with it, 2.0% without).
        self.overlap_masks = model.device.type != "cpu"

    def close(self) -> None:
        """Stop the grammar-mask thread and hand the K/V pools on (``KVStorage.release_pools``)."""
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False)
            self._mask_pool = None
        self.storage.release_pools()

    def run(self, plan: Plan, stats: RunStats) -> RunnerOutput:
        """The step's computation: pack, forward, sample; the storage stores the step's tokens.
        Phase times and grammar figures go to ``stats``."""
        clock = stats.phases
        t1 = time.perf_counter()
        batch = self._prepare(plan)
        samplers, scoring = batch.samplers, batch.scoring
        masks = self._start_masks(samplers)  # grammar masks fill while the forward runs
        # A step whose every row wants only the argmax asks the model for it (no logits): the
        # same tokens, and a float32 head may find them reading half its weights (greedy_head.py).
        greedy = masks is None and not scoring.rows and sampler.argmax_only(samplers)
        t2 = time.perf_counter()
        out = self.model(batch.ids, batch.positions, batch.attention, batch.logit_rows, greedy=greedy)
        t3 = time.perf_counter()
        if greedy:
            both = out.tolist()
            tokens, logprobs, argmax = both[:len(samplers)], [None] * len(samplers), both[len(samplers):]
        else:
            if masks is not None:
                self._apply_masks(out, masks, stats)
            tokens, logprobs, argmax = self._sample(out, samplers, scoring, sum(1 + len(v.drafts) for v in plan.verify))
        t4 = time.perf_counter()
        clock["prepare"] += t2 - t1
        clock["forward"] += t3 - t2
        clock["sample"] += t4 - t3
        verified, at = [], 0
        for v in plan.verify:
            verified.append(argmax[at:at + 1 + len(v.drafts)])
            at += 1 + len(v.drafts)
        return RunnerOutput(samplers, tokens, logprobs, t3 - t2, verified)

    def _prepare(self, plan: Plan) -> StepBatch:
        """Pack the step's tokens. Logit rows: one per sampler, then the prompt rows in
        ``scoring``, then every row of each verify chunk."""
        # Decode rows first (one token each, all sample), then the prefill chunks.
        ids = [s.tokens[-1] for s in plan.decode]
        pos = [s.num_tokens - 1 for s in plan.decode]
        logit_rows = list(range(len(plan.decode)))
        samplers = list(plan.decode)
        scoring = Scoring()
        row = len(plan.decode)
        for c in plan.prefill:
            s, start, n = c.seq, c.start, c.n
            ids += s.tokens[start:start + n]
            pos += range(start, start + n)
            if s.group.scoring_prompt:
                self._score_rows(scoring, s, start, n, row)
            row += n
            if c.completes_prompt:  # the chunk that completes the prompt samples
                logit_rows += [row - 1] * (1 + len(s.pending))  # once per fork, each its own seed
                samplers += [s] + s.pending
        chunks = [(c.seq.seq_id, c.start, c.n) for c in plan.prefill]
        logit_rows += scoring.rows
        for v in plan.verify:  # last token + drafts: a chunk whose every row is checked
            s, start, n = v.seq, v.seq.num_tokens - 1, 1 + len(v.drafts)
            ids += [s.tokens[-1]] + v.drafts
            pos += range(start, start + n)
            chunks.append((s.seq_id, start, n))
            logit_rows += range(row, row + n)
            row += n
        attn = self.storage.plan_step([s.seq_id for s in plan.decode], chunks)
        dev = self.model.device
        return StepBatch(samplers, to_device(ids, dev), to_device(pos, dev), to_device(logit_rows, dev), attn, scoring)

    def _start_masks(self, samplers: list[Sequence]):
        """Start filling the grammar masks of the step's constrained rows (in a thread, so it
        overlaps the forward pass); None when no row is constrained."""
        if all(s.grammar is None for s in samplers):
            return None
        states = [s.grammar for s in samplers]
        vocab = self.model.cfg.vocab_size
        if not self.overlap_masks:
            return _Done(_timed(constraints.fill_masks, states, vocab)), len(states) - states.count(None)
        if self._mask_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="tinyllm-grammar")
        return self._mask_pool.submit(_timed, constraints.fill_masks, states, vocab), len(states) - states.count(None)

    @staticmethod
    def _apply_masks(logits, masks, st: RunStats) -> None:
        """Mask the sampling rows (the first len(samplers) rows of ``logits``) in one pass."""
        job, constrained = masks
        t0 = time.perf_counter()
        bitmask, fill_s = job.result()
        constraints.apply_masks(logits[:bitmask.shape[0]], bitmask)
        st.grammar_s += fill_s + time.perf_counter() - t0  # fill (overlapped) + wait and apply
        st.grammar_wait_s += time.perf_counter() - t0
        st.constrained_tokens += constrained

    @staticmethod
    def _score_rows(scoring: Scoring, s: Sequence, start: int, n: int, row: int) -> None:
        """The rows of chunk ``[start, start + n)`` (at step row ``row``) that predict a prompt
        token not scored yet: position p predicts token p + 1; the last prompt row predicts the
        first output token, which is sampled, not scored."""
        g = s.group
        lo, hi = scored_span(s, start, n)
        if hi > lo:
            scoring.rows += range(row + lo - start, row + hi - start)
            scoring.targets += s.tokens[lo + 1:hi + 1]
            scoring.groups.append((g, hi - lo))

    def _sample(self, logits, samplers: list[Sequence], scoring: Scoring, n_verify: int = 0):
        """Sample the step's tokens, gather the log-probabilities asked for and the argmax of the
        last ``n_verify`` rows (speculative verification): one readback, the step's only host
        sync (on a GPU, queued forward work finishes inside it). Returns (tokens, per-sampler
        (token, logprob, alternatives) or None, the verify rows' argmax)."""
        n, ns = len(samplers), len(scoring.rows)
        tokens = sampler.sample(logits[:n], samplers) if n else None
        rows, k, table = sampler.sampled_logprobs(logits[:n], tokens, samplers) if n else ([], 0, None)
        pk = max((g.request.params.num_prompt_logprobs for g, _ in scoring.groups), default=0)
        ptable = None
        if scoring.rows:
            ptable = sampler.logprob_table(logits[n:n + ns], to_device(scoring.targets, logits.device), pk)
        argmax = sampler.argmax(logits[n + ns:]) if n_verify else None
        if table is None and ptable is None:
            if argmax is None:
                return (tokens.tolist() if n else []), [None] * n, []
            both = (torch.cat([tokens, argmax]) if n else argmax).tolist()
            return both[:n], [None] * n, both[n:]
        parts = [x.flatten().float() for x in (tokens, table, ptable, argmax) if x is not None]
        flat = torch.cat(parts).tolist()
        ids = [int(x) for x in flat[:n]]
        verified = [int(x) for x in flat[len(flat) - n_verify:]]
        at = n
        logprobs: list = [None] * n
        for i in rows:
            logprobs[i] = _entry(ids[i], flat[at:at + 1 + 2 * k], k, samplers[i].request.params.num_logprobs)
            at += 1 + 2 * k
        t = 0
        for g, count in scoring.groups:
            kg = g.request.params.num_prompt_logprobs
            for target in scoring.targets[t:t + count]:
                g.prompt_logprobs.append(_entry(target, flat[at:at + 1 + 2 * pk], pk, kg))
                at += 1 + 2 * pk
            t += count
        return ids, logprobs, verified


class _Done:
    """A finished job, shaped like a Future."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _entry(token: int, vals: list[float], k: int, want: int) -> tuple:
    """(token, its logprob, [(alternative id, logprob)] best first, ``want`` of them) from one
    ``logprob_table`` row read back as floats."""
    return token, vals[0], [(int(vals[1 + k + j]), vals[1 + j]) for j in range(want)]
