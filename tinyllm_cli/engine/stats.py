"""Run statistics: one small record per step, one per finished request, and a summary.

Recording is cheap enough to leave on: host integers already known to the scheduler and cache,
no device work. Reports only read these objects.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field


class RunSummary(dict):
    """A run's figures: exactly the keys of ``--stats-json`` and the run table, readable as
    attributes too (``summary.output_tokens_per_s``, ``summary.ttft_s["p99"]``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"a run summary has no {name!r}; its keys: {', '.join(self)}") from None


@dataclass
class StepRecord:
    step: int
    t: float  # seconds since the run started
    running: int
    waiting: int
    blocks_used: int
    blocks_free: int
    tokens_stored: int
    slots_allocated: int
    prefill_tokens: int
    decode_tokens: int
    preempted: int
    forward_s: float
    shared_refs: int = 0  # extra references to shared (prefix-cached) blocks
    cached_free: int = 0  # free blocks that still hold a cached prefix
    shared_blocks: int = 0  # blocks held by more than one sequence (counted once in blocks_used)
    fork_shared_blocks: int = 0  # blocks shared by forks of one request (parallel sampling)
    fork_refs: int = 0  # extra references the forks hold on them

    @property
    def utilization(self) -> float:
        return self.tokens_stored / self.slots_allocated if self.slots_allocated else 0.0


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    if not xs:
        return {f"p{p}": None for p in ps}
    s = sorted(xs)
    out = {}
    for p in ps:
        k = (len(s) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        out[f"p{p}"] = round(s[lo] + (s[hi] - s[lo]) * (k - lo), 6)
    out["mean"] = round(statistics.fmean(s), 6)
    return out


@dataclass
class RunStats:
    cache_kind: str
    block_size: int
    num_blocks: int
    kv_bytes: int
    max_num_seqs: int
    cache: object = None  # read for prefix-cache counters at summary time
    steps: list[StepRecord] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    end: float | None = None
    num_requests: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    preemption_steps: list[int] = field(default_factory=list)
    forward_s: float = 0.0
    phases: dict = field(default_factory=lambda: dict.fromkeys(
        ("schedule", "prepare", "forward", "sample", "postprocess"), 0.0))
    # The run's clock: wall time, or a simulator's virtual time (then ``start`` is on it too).
    clock: object = field(default=time.perf_counter, repr=False, compare=False)

    def record_step(self, rec: StepRecord) -> None:
        self.steps.append(rec)

    def record_request(self, out) -> None:
        self.num_requests += 1
        if out.finish_reason == "error":  # refused, or cut short (its partial tokens still count)
            self.num_failed += 1
        if not out.num_output_tokens:
            return
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += out.num_output_tokens  # every completion of an n > 1 request
        for xs, v in ((self.ttft, out.ttft_s), (self.tpot, out.tpot_s), (self.latency, out.latency_s)):
            if v is not None:
                xs.append(v)

    def elapsed(self) -> float:
        return (self.end if self.end is not None else self.clock()) - self.start

    def summary(self) -> dict:
        el = max(self.elapsed(), 1e-9)
        used = [s for s in self.steps if s.slots_allocated]
        util = [s.utilization for s in used]
        return {
            "num_requests": self.num_requests, "num_failed": self.num_failed,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "elapsed_s": round(el, 4),
            "output_tokens_per_s": round(self.output_tokens / el, 2),
            "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / el, 2),
            "cache_kind": self.cache_kind, "block_size": self.block_size, "num_blocks": self.num_blocks,
            "attention": getattr(self.cache, "attention", None),
            "kv_bytes": self.kv_bytes, "max_num_seqs": self.max_num_seqs,
            "steps": len(self.steps),
            "peak_running": max((s.running for s in self.steps), default=0),
            "peak_blocks_used": max((s.blocks_used for s in self.steps), default=0),
            "mean_block_utilization": round(statistics.fmean(util), 4) if util else 0.0,
            "peak_block_utilization": round(max(util), 4) if util else 0.0,
            "mean_wasted_slots": round(statistics.fmean(s.slots_allocated - s.tokens_stored for s in used), 2) if used else 0.0,
            "peak_wasted_slots": max((s.slots_allocated - s.tokens_stored for s in used), default=0),
            "preemptions": self.preemptions, "recomputed_tokens": self.recomputed_tokens,
            "prefill_tokens": sum(s.prefill_tokens for s in self.steps),
            **self._prefix_summary(), **self._fork_summary(),
            "decode_tokens": sum(s.decode_tokens for s in self.steps),
            "forward_s": round(self.forward_s, 4),
            # Everything in the run's wall time that is not the model's forward pass: scheduling,
            # packing, sampling, stop checks, and the caller's reading and writing.
            "engine_overhead_frac": round(max(0.0, 1 - self.forward_s / el), 4),
            "phases_s": {k: round(v, 4) for k, v in self.phases.items()} | {
                "outside_engine": round(max(0.0, el - sum(self.phases.values())), 4)},
            "ttft_s": percentiles(self.ttft), "tpot_s": percentiles(self.tpot),
            "latency_s": percentiles(self.latency),
        }

    def _prefix_summary(self) -> dict:
        c = self.cache
        q = getattr(c, "prefix_queries", 0)
        h = getattr(c, "prefix_hits", 0)
        return {"prefix_caching": bool(getattr(c, "prefix_caching", False)),
                "prefix_cache_queries": q, "prefix_cache_hits": h,
                "prefix_cache_hit_rate": round(h / q, 4) if q else 0.0,
                "prefill_tokens_skipped": h,
                "peak_shared_refs": max((s.shared_refs for s in self.steps), default=0)}

    def _fork_summary(self) -> dict:
        return {"forks": getattr(self.cache, "forks", 0), "cow_copies": getattr(self.cache, "cow_copies", 0),
                "peak_fork_shared_blocks": max((s.fork_shared_blocks for s in self.steps), default=0),
                "peak_fork_refs": max((s.fork_refs for s in self.steps), default=0)}

    def timeline(self) -> list[dict]:
        return [asdict(s) | {"utilization": round(s.utilization, 4)} for s in self.steps]
