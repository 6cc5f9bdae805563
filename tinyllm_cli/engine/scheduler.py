"""Continuous-batching scheduler: decides, each step, who decodes, who prefills, who is preempted.

Invariants:
- ``running`` is in admission order (oldest first); the newest is the preemption victim.
- Preempted sequences go back to the *front* of ``waiting`` (oldest of them first), ahead of new
  arrivals, and are recomputed from all their tokens.
- Admission is first-come first-served: when the head of the queue does not fit, nothing behind
  it jumps ahead. A sequence is admitted only when its tokens plus one fit, and takes blocks for
  its tokens; the block for its first decode comes from the step reservation like any other.
- No step admits new work while it preempts (that would thrash).
- A request with n > 1 enters as its fork 0 carrying the other n - 1 as ``pending``: it is
  admitted only when all n fit (``max_num_seqs`` counts sequences, pending forks included, and
  the cache keeps one block per fork for its first token), and ``fork`` starts them once its
  prompt is computed. After that each fork is an ordinary sequence: preempted alone, recomputed
  from its prompt + its own tokens.
- Progress is guaranteed: the oldest running sequence is preempted only when it is alone and
  cannot grow at all, and then it is failed, not requeued; a head of queue that cannot fit an
  empty pool is failed as well. So the engine never loops forever.
- Speculative decoding (``speculate``) moves a decoding sequence with draft tokens from
  ``decode`` to ``verify``: it stores its last token and its k drafts in one chunk. Drafts come
  after everything else in the step: they spend the prefill token budget that the step left
  and only blocks that are free after the step's own growth, so they never delay an admission
  nor preempt anyone; a sequence gets fewer drafts, or none, instead. A step that preempts
  verifies no drafts (the blocks it freed are not for optimisations).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Sequence, Status


@dataclass
class Chunk:
    """A prefill chunk: ``seq``'s tokens ``[start, start + n)`` are computed and stored this step."""

    seq: Sequence
    start: int
    n: int

    @property
    def completes_prompt(self) -> bool:
        """Whether this chunk reaches the sequence's last token (its last row samples)."""
        return self.start + self.n == self.seq.num_tokens


@dataclass
class Verify:
    """A decoding sequence's last token and its draft tokens, checked in one chunk this step."""

    seq: Sequence
    drafts: list[int]


@dataclass
class Plan:
    """One step's work, as the scheduler decided it (the engine's runner executes it)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)
    recomputed: int = 0  # tokens computed before a preemption that re-admission computes again
    budget: int = 0  # prefill tokens the step left unspent (draft tokens may take them)
    verify: list[Verify] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.verify


class Scheduler:
    def __init__(self, cache, max_num_seqs: int, max_prefill_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_seqs(self) -> int:
        """Sequences running, counting the forks that running prompts will start."""
        return len(self.running) + sum(len(s.pending) for s in self.running)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start ``parent``'s pending forks: they share its blocks and its computed prompt, and
        run right after it (admitted with it, so newer than everything admitted before it)."""
        kids, parent.pending = parent.pending, []
        for c in kids:
            self.cache.fork(parent.seq_id, c.seq_id)
            c.num_cached, c.status = parent.num_cached, parent.status
        at = self.running.index(parent) + 1
        self.running[at:at] = kids
        return kids

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq.seq_id)

    def schedule(self) -> Plan:
        plan = Plan()
        self._reserve(plan)
        budget = self._continue_prefills(plan, self.max_prefill_tokens)
        if not plan.preempted:
            plan.budget = self._admit(plan, budget)  # a step that preempts drafts nothing either
        plan.decode = [s for s in self.running if s.status is Status.DECODE]
        for s in plan.decode:  # this step stores its last token
            self.cache.commit(s.seq_id, s.tokens, s.num_tokens)
        return plan

    def _reserve(self, plan: Plan) -> None:
        # Decoding sequences need room for the token they are about to store; prefilling ones
        # already hold blocks for their whole prompt.
        needs = [(s.seq_id, s.num_tokens if s.status is Status.DECODE else 0) for s in self.running]
        victims = set(self.cache.reserve(needs))
        if not victims:
            return
        by_id = {s.seq_id: s for s in self.running}
        for sid in [n[0] for n in reversed(needs) if n[0] in victims]:  # newest first
            s = by_id[sid]
            self.running.remove(s)
            if not self.cache.fits_alone(s.num_tokens + 1, len(s.pending)):
                plan.failed.append(s)
                continue
            s.status, s.preemptions = Status.WAITING, s.preemptions + 1
            s.lost_tokens, s.num_cached = s.num_cached, 0
            plan.preempted.append(s)
            self.waiting.appendleft(s)  # newest first in, so the oldest ends up in front

    def _continue_prefills(self, plan: Plan, budget: int) -> int:
        for s in self.running:
            if s.status is Status.PREFILL and budget > 0:
                n = min(s.num_tokens - s.num_cached, budget)
                plan.prefill.append(Chunk(s, s.num_cached, n))
                self.cache.commit(s.seq_id, s.tokens, s.num_cached + n)
                budget -= n
        return budget

    def draft_room(self, plan: Plan, wants: list[tuple[Sequence, int]]) -> list[int]:
        """How many draft tokens each ``(decoding seq, want)`` may verify this step, in turn:
        within the token budget the step left and the blocks still free (a check only)."""
        budget, needs = plan.budget, []
        for s, want in wants:
            k = min(want, budget)
            budget -= k
            needs.append((s.seq_id, s.num_tokens, k))
        return self.cache.draft_room(needs)

    def speculate(self, plan: Plan, drafts: list[Verify]) -> None:
        """Verify these decoding sequences' drafts this step (each within its ``draft_room``):
        they leave ``plan.decode`` for ``plan.verify`` and grow to hold their drafts."""
        for v in drafts:
            self.cache.grow(v.seq.seq_id, v.seq.num_tokens + len(v.drafts))
            plan.budget -= len(v.drafts)
        moved = {v.seq.seq_id for v in drafts}
        plan.decode = [s for s in plan.decode if s.seq_id not in moved]
        plan.verify += drafts

    def _admit(self, plan: Plan, budget: int) -> int:
        while self.waiting and budget > 0:
            s = self.waiting[0]
            forks = len(s.pending)
            if self.num_seqs + 1 + forks > self.max_num_seqs:
                break
            scoring = s.group is not None and s.group.scoring_prompt
            cached = self.cache.try_admit(s.seq_id, s.tokens, forks, use_prefix=not scoring)
            if cached is None:
                if not self.running and not self.cache.fits_alone(s.num_tokens + 1, forks):
                    plan.failed.append(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            # What a preemption threw away and the prefix cache could not give back.
            redo = max(0, s.lost_tokens - cached)
            s.recomputed_tokens += redo
            plan.recomputed += redo
            s.lost_tokens = 0
            s.status, s.num_cached = Status.PREFILL, cached
            self.running.append(s)
            n = min(s.num_tokens - cached, budget)
            plan.prefill.append(Chunk(s, cached, n))
            # Registered now, so the next admission in this very step can share these blocks.
            self.cache.commit(s.seq_id, s.tokens, cached + n)
            budget -= n
        return budget
