"""``SimEngine``: the real engine loop with the forward pass replaced by a step-cost model.

It holds an ``LLMEngine`` built as a real run builds one, except for what the simulator swaps in
through the engine's public seams: the block manager alone (``cache.blocks.BlockManager`` or its
slot variant: tables, lengths, free list and prefix cache, no K/V storage), a ``CostRunner`` in
place of the model runner, and a ``VirtualClock`` for every timestamp. So the same
``add_request`` checks, ``Scheduler``, failures, forks, observers, stop checks, outputs and
``RunStats`` run as in a real run. The cost runner asks the cost model how long the step takes,
advances the virtual clock by that much, stores the step's tokens in the block manager and
"samples" a synthetic token per row. Requests are greedy with ``ignore_eos``, so a request
finishes exactly at its ``max_new_tokens`` (its trace ``output_len``), as it would in a real run.

Skip-ahead (``skip_ahead=True``): when the next steps can only be decode steps of the same
sequences (nothing prefilling, the head of the queue cannot be admitted, no arrival, no finish,
no copy on write, and the free blocks cover every block the window will take), ``step``
advances k such steps at once instead of calling the engine's ``step``: the same block
allocations in the same order (so block ids agree), the same per-step records
(``LLMEngine.record_step``), the same virtual times; ``tests/test_simulate.py`` checks it against
stepping one by one.

Synthetic tokens: output token p of sequence s is a function of (s, p) only, so a preempted
sequence recomputes the same tokens (and hits its own cached blocks), and no two sequences'
generated blocks collide in the prefix cache.
"""

from __future__ import annotations

import math

import torch

from ..cache.blocks import BlockManager
from ..engine.engine import LLMEngine
from ..engine.request import Request, RequestOutput, Status
from ..engine.runner import RunnerOutput, samplers_of
from ..engine.scheduler import Plan
from ..engine.stats import RunStats, StepRecord
from ..model.llama import ModelConfig
from .cost import CostModel


class _NoModel:
    """What ``LLMEngine`` reads of a model: its config and device."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.device = torch.device("cpu")


class VirtualClock:
    """Simulated seconds: read by calling it, moved on by the cost runner and skip-ahead."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostRunner:
    """The runner of a simulated engine: a step costs what the cost model says, on the virtual
    clock; the block manager stores the step's tokens; each sampler gets a synthetic token."""

    attention = None  # no K/V is read

    def __init__(self, blocks: BlockManager, cost: CostModel, clock: VirtualClock, vocab_size: int,
                 serving: bool = False):
        self.blocks, self.clock = blocks, clock
        self.cost = cost.for_cache(blocks, serving)
        self._span = max(1, vocab_size - 8)

    def token(self, s) -> int:
        """The synthetic token ``s`` generates at its position ``num_tokens``."""
        return 4 + (s.seq_id * 7919 + s.num_tokens * 104729) % self._span

    def run(self, plan: Plan, stats: RunStats) -> RunnerOutput:
        dt = self.cost.step_time(plan)
        samplers = samplers_of(plan)
        self.blocks.take_copies()  # copies on write move K/V, and there is none to move
        self.blocks.advance([s.seq_id for s in plan.decode], [(c.seq.seq_id, c.start, c.n) for c in plan.prefill])
        self.clock.now += dt
        stats.phases["forward"] += dt
        return RunnerOutput(samplers, [self.token(s) for s in samplers], [None] * len(samplers), dt,
                            verified=[])  # the simulator does not speculate

    def close(self) -> None:
        pass


class SimEngine:
    """A simulated engine: ``engine`` (an ``LLMEngine`` on a cost runner and a virtual clock)
    plus skip-ahead. ``add_request``, ``has_unfinished`` and ``num_waiting`` are the engine's;
    ``step`` takes a skip-ahead window when one is certain, else the engine's own step."""

    def __init__(self, model_cfg: ModelConfig, blocks: BlockManager, cost: CostModel, *, max_num_seqs: int = 64,
                 max_prefill_tokens: int = 2048, max_model_len: int | None = None, skip_ahead: bool = True,
                 serving: bool = False):
        self.clock = VirtualClock()
        runner = CostRunner(blocks, cost, self.clock, model_cfg.vocab_size, serving)
        self.engine = LLMEngine(_NoModel(model_cfg), blocks, None, max_num_seqs=max_num_seqs,
                                max_prefill_tokens=max_prefill_tokens, max_model_len=max_model_len, eos_ids=(),
                                seed=0, runner=runner, clock=self.clock)
        self.cost = runner.cost
        self.skip_ahead = skip_ahead
        self.next_arrival = math.inf  # set by the caller: no window may start a step at or after it
        self.skipped_steps = 0  # steps taken in bulk by skip-ahead
        self._token = runner.token

    @property
    def now(self) -> float:
        """The virtual time, in seconds since the engine was built."""
        return self.clock.now

    @now.setter
    def now(self, t: float) -> None:
        self.clock.now = t

    def add_request(self, req: Request) -> RequestOutput | None:
        return self.engine.add_request(req)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def num_waiting(self) -> int:
        return self.engine.num_waiting()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.skip_ahead and not self.engine.observers:
            k = self._window()
            if k > 0:
                self._skip(k)
                return []
        return self.engine.step()

    # ---- skip-ahead --------------------------------------------------------------------------

    def _window(self) -> int:
        """How many of the coming steps are certainly plain decode steps of every running
        sequence with no finish, admission, preemption, copy on write or arrival among them
        (0: step normally)."""
        eng = self.engine
        sch, blocks = eng.scheduler, eng.cache
        run = sch.running
        if not run or self.now >= self.next_arrival:
            return 0
        k = math.inf
        shared = blocks.shares_blocks  # checked per sequence only when a copy on write is possible
        for s in run:
            if s.status is not Status.DECODE or s.pending or (shared and blocks.needs_copy(s.seq_id, s.num_tokens)):
                return 0
            p = s.request.params
            k = min(k, p.max_new_tokens - s.num_output, eng.max_model_len - s.num_tokens)
        k -= 1  # the step that finishes a sequence runs normally
        if k <= 1 or (sch.waiting and self._head_may_enter()):
            return 0
        return self._fit_blocks(int(k))

    def _head_may_enter(self) -> bool:
        """Could the head of the queue be admitted in some step of a decode-only window? Free
        blocks only shrink in it and cached prefixes only get evicted, so: could it now?"""
        sch = self.engine.scheduler
        s = sch.waiting[0]
        forks = len(s.pending)
        if sch.num_seqs + 1 + forks > sch.max_num_seqs:
            return False
        scoring = s.group is not None and s.group.scoring_prompt
        return self.engine.cache.can_admit(s.tokens, forks, use_prefix=not scoring)

    def _allocations(self, k: int) -> list[tuple[int, int]]:
        """(step within the window, running index) of every block the next k decode steps take,
        in the order step-by-step scheduling takes them."""
        blocks = self.engine.cache
        if blocks.kind == "slot":
            return []
        bs, events = blocks.block_size, []
        for i, s in enumerate(self.engine.scheduler.running):
            # step j stores position num_tokens - 1 + j; a new block when it is past the table
            j = len(blocks.tables[s.seq_id]) * bs - s.num_tokens + 1
            while j < k:
                events.append((j, i))
                j += bs
        events.sort()
        return events

    def _fit_blocks(self, k: int) -> int:
        """Shrink k until the window's blocks fit the free pool (so nothing is preempted)."""
        free = self.engine.cache.num_free
        events = self._allocations(k)
        if len(events) > free:
            k = events[free][0]  # the step that would need one block too many
        return k if k > 1 else 0

    def _block_counts(self, run, k: int) -> list[int]:
        """The cost model's decode_blocks feature for each of the window's k steps: step j's
        rows hold num_tokens + j tokens, sum ceil(that / block size) (0 for the slot cache)."""
        bs = self.cost.block_size
        if bs is None:
            return [0] * k
        steps = [0] * k
        for s in run:  # +1 block at each step whose context starts a block
            for j in range((1 - s.num_tokens) % bs or bs, k, bs):
                steps[j] += 1
        total, out = sum(-(-s.num_tokens // bs) for s in run), []
        for j in range(k):
            total += steps[j]
            out.append(total)
        return out

    def _times(self, run, k: int, ctx0: int) -> list[float]:
        """The virtual time at the end of each of the window's steps (``ctx0``: the rows' context
        tokens before the first); fewer than k when a step would start at or after the next
        arrival (the window ends there)."""
        B = len(run)
        blocks = self._block_counts(run, k)
        times, t = [], self.now
        for j in range(k):
            if j and t >= self.next_arrival:
                break
            t += self.cost.decode_time(B, ctx0 + B * j, blocks[j])
            times.append(t)
        return times

    def _skip(self, k: int) -> None:
        eng = self.engine
        blocks, st = eng.cache, eng.stats
        run = list(eng.scheduler.running)
        ctx0 = sum(s.num_tokens for s in run)
        times = self._times(run, k, ctx0)
        k = len(times)
        if k == 0:
            return
        B, bs = len(run), blocks.block_size
        u = blocks.usage()
        fresh0 = blocks.allocator.num_free  # blocks never used; past them, allocation evicts cached ones
        events = self._allocations(k)
        e = 0
        waiting = eng.num_waiting()
        for j in range(k):
            while e < len(events) and events[e][0] == j:
                s = run[events[e][1]]
                blocks.grow(s.seq_id, s.num_tokens + j)  # the one block step j's position needs
                e += 1
            dt = times[j] - (times[j - 1] if j else self.now)
            used = u.blocks_used + e
            evicted = max(0, e - fresh0)
            st.forward_s += dt
            eng.record_step(StepRecord(
                step=eng.step_index, t=round(times[j] - st.start, 6), running=B, waiting=waiting,
                blocks_used=used, blocks_free=u.blocks_free - e, tokens_stored=u.tokens_stored + B * (j + 1),
                slots_allocated=used * bs, prefill_tokens=0, decode_tokens=B, preempted=0,
                forward_s=round(dt, 6), shared_refs=u.shared_refs, cached_free=u.blocks_cached_free - evicted,
                shared_blocks=u.blocks_shared, fork_shared_blocks=u.fork_shared_blocks, fork_refs=u.fork_refs,
                forwards=1, logit_rows=B, attn_pairs=ctx0 + B * j, kv_read_tokens=ctx0 + B * j))  # plan_work's counts
        st.phases["forward"] += times[-1] - self.now
        self.now = times[-1]
        for s in run:
            n = s.num_tokens
            for _ in range(k):
                s.tokens.append(self._token(s))
            blocks.store(s.seq_id, n - 1 + k)
            s.num_cached = n - 1 + k
            blocks.commit(s.seq_id, s.tokens, n - 1 + k)
        self.skipped_steps += k
