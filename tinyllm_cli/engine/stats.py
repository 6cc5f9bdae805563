"""Run statistics: one small record per step, one per finished request, and a summary.

Recording is cheap enough to leave on: host integers already known to the scheduler and cache,
no device work. Reports only read these objects.

Memory stays flat however long the run (an endless ``serve-batch`` stream):
- The summary's step figures (steps, peaks, means, token sums) are running aggregates updated
  by ``record_step``; they are exact for any run length.
- ``timeline()`` (inspect-blocks, the pictures) comes from a ``Timeline`` of at most
  ``TIMELINE_POINTS`` records that always covers the whole run: every step is kept until it is
  full, then neighbouring pairs are merged (halving it; each point then stands for twice as many
  steps) and so on. A merged point keeps its first step's ``step`` and ``t``, the max of the
  gauges (running, waiting, blocks used, tokens stored, slots allocated, shared/cached/fork
  counts), the min of ``blocks_free``, and the sums of the per-step counts (prefill and decode
  tokens, preempted, forward_s, and the work counts below); ``span`` is how many engine steps it covers (1 until the first
  merge), so the first point starts at step 0 and the last one ends at the last step. Runs under
  ``TIMELINE_POINTS`` steps keep every step exactly as recorded.
- Each record carries the step's model work as counts (``WORK_COUNTS``: forwards, rows through
  the output projection, causal attention query-key pairs, K/V positions read; see
  ``engine.plan_work``). They are sums, so any merged record, the whole timeline and the
  summary's ``work_counts`` all add up to the same run totals; ``roofline.py`` turns them into
  FLOPs and bytes with the model's shape.
- ``preemption_steps`` is a ``Thinned`` sample of at most ``TIMELINE_POINTS`` step numbers
  (every one until it fills, then every 2nd, 4th, ...); the count, ``preemptions``, stays exact.
- TTFT / TPOT / latency percentiles are ``Quantiles``: exact (the values kept, as before) up to
  ``EXACT_VALUES`` values, then a DDSketch (DataDog's ``ddsketch``: every quantile within
  ``RELATIVE_ACCURACY`` of the true value at that rank, a bounded number of bins); the mean is
  always exact.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, fields

TIMELINE_POINTS = 4096  # most records the timeline (and preemption_steps) holds; even
EXACT_VALUES = 4096  # per-request figures kept exactly up to this many, then sketched
RELATIVE_ACCURACY = 0.01  # the sketch's guarantee: |estimate - true| <= 1% of the true value
SKETCH_BINS = 2048  # the sketch's bin limit (lowest bins collapse first: high quantiles stay exact)


class RunSummary(dict):
    """A run's figures: exactly the keys of ``--stats-json`` and the run table, readable as
    attributes too (``summary.output_tokens_per_s``, ``summary.ttft_s["p99"]``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"a run summary has no {name!r}; its keys: {', '.join(self)}") from None


@dataclass(slots=True)
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
    span: int = 1  # engine steps this record covers (more than 1 once the timeline is downsampled)
    forwards: int = 0  # forward passes (1 for a step that ran the model; 0 for an empty step)
    logit_rows: int = 0  # rows through the output projection
    attn_pairs: int = 0  # query-key pairs of causal attention, summed over the step's rows
    kv_read_tokens: int = 0  # K/V token positions attention read

    @property
    def utilization(self) -> float:
        return self.tokens_stored / self.slots_allocated if self.slots_allocated else 0.0


_MAX = ("running", "waiting", "blocks_used", "tokens_stored", "slots_allocated", "shared_refs", "cached_free",
        "shared_blocks", "fork_shared_blocks", "fork_refs")
WORK_COUNTS = ("forwards", "logit_rows", "attn_pairs", "kv_read_tokens")
_SUM = ("prefill_tokens", "decode_tokens", "preempted", "span", *WORK_COUNTS)


def merge_records(a: StepRecord, b: StepRecord) -> StepRecord:
    """One record for ``a`` followed by ``b`` (the rules are in the module docstring)."""
    out = StepRecord(**{f.name: getattr(a, f.name) for f in fields(StepRecord)})
    for k in _MAX:
        setattr(out, k, max(getattr(a, k), getattr(b, k)))
    for k in _SUM:
        setattr(out, k, getattr(a, k) + getattr(b, k))
    out.blocks_free = min(a.blocks_free, b.blocks_free)
    out.forward_s = round(a.forward_s + b.forward_s, 6)
    return out


class Timeline:
    """At most ``cap`` records covering every step recorded so far (see the module docstring)."""

    def __init__(self, cap: int | None = None):
        self.cap = cap or TIMELINE_POINTS
        if self.cap < 2 or self.cap % 2:
            raise ValueError(f"a timeline holds an even number (>= 2) of points, not {self.cap}")
        self.points: list[StepRecord] = []
        self.stride = 1  # engine steps per full point
        self.pending: StepRecord | None = None  # the point being filled (fewer than stride steps)

    def add(self, rec: StepRecord) -> None:
        self.pending = rec if self.pending is None else merge_records(self.pending, rec)
        if self.pending.span < self.stride:
            return
        self.points.append(self.pending)
        self.pending = None
        if len(self.points) >= self.cap:
            p = self.points
            self.points = [merge_records(p[i], p[i + 1]) for i in range(0, len(p), 2)]
            self.stride *= 2

    def records(self) -> list[StepRecord]:
        return self.points + ([self.pending] if self.pending is not None else [])

    def __len__(self) -> int:
        return len(self.points) + (self.pending is not None)


class Thinned:
    """Step numbers, at most ``cap`` of them: all until full, then every 2nd, 4th, ... one
    (always including the first); iterate it like the list it replaces."""

    def __init__(self, cap: int | None = None):
        self.cap = cap or TIMELINE_POINTS
        self.items: list[int] = []
        self.stride, self.seen = 1, 0

    def append(self, x: int) -> None:
        if self.seen % self.stride == 0:
            self.items.append(x)
            if len(self.items) >= self.cap:
                self.items = self.items[::2]
                self.stride *= 2
        self.seen += 1

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Quantiles:
    """Streaming percentiles of non-negative values: exact up to ``EXACT_VALUES`` values, then a
    DDSketch with ``RELATIVE_ACCURACY``; the count, sum and so the mean are always exact."""

    def __init__(self, exact_limit: int | None = None):
        self.exact_limit = EXACT_VALUES if exact_limit is None else exact_limit
        self.values: list[float] | None = []
        self.sketch = None
        self.count, self.total = 0, 0.0

    def add(self, v: float) -> None:
        self.count += 1
        self.total += v
        if self.values is not None:
            self.values.append(v)
            if len(self.values) > self.exact_limit:
                self._spill()
        else:
            self.sketch.add(max(v, 0.0))

    def _spill(self) -> None:
        from ddsketch import LogCollapsingLowestDenseDDSketch
        self.sketch = LogCollapsingLowestDenseDDSketch(RELATIVE_ACCURACY, bin_limit=SKETCH_BINS)
        for x in self.values:
            self.sketch.add(max(x, 0.0))
        self.values = None

    def __len__(self) -> int:
        return self.count

    def percentiles(self, ps=(50, 90, 99)) -> dict[str, float | None]:
        if self.values is not None:
            return percentiles(self.values, ps)
        out = {f"p{p}": round(self.sketch.get_quantile_value(p / 100), 6) for p in ps}
        out["mean"] = round(self.total / self.count, 6)
        return out


def percentiles(xs, ps=(50, 90, 99)) -> dict[str, float | None]:
    """Exact percentiles (linear interpolation between ranks) of a list, or a ``Quantiles``'s."""
    if isinstance(xs, Quantiles):
        return xs.percentiles(ps)
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
class StepTotals:
    """The summary's step figures, kept as running aggregates (exact for any run length)."""

    steps: int = 0
    peak_running: int = 0
    peak_blocks_used: int = 0
    used_steps: int = 0  # steps with slots allocated (the utilization figures are over these)
    util_sum: float = 0.0
    peak_util: float = 0.0
    wasted_sum: int = 0
    peak_wasted: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    peak_shared_refs: int = 0
    peak_fork_shared_blocks: int = 0
    peak_fork_refs: int = 0
    work: dict = field(default_factory=lambda: dict.fromkeys(WORK_COUNTS, 0))

    def add(self, s: StepRecord) -> None:
        self.steps += 1
        self.peak_running = max(self.peak_running, s.running)
        self.peak_blocks_used = max(self.peak_blocks_used, s.blocks_used)
        if s.slots_allocated:
            u, w = s.utilization, s.slots_allocated - s.tokens_stored
            self.used_steps += 1
            self.util_sum += u
            self.peak_util = max(self.peak_util, u)
            self.wasted_sum += w
            self.peak_wasted = max(self.peak_wasted, w)
        self.prefill_tokens += s.prefill_tokens
        self.decode_tokens += s.decode_tokens
        self.peak_shared_refs = max(self.peak_shared_refs, s.shared_refs)
        self.peak_fork_shared_blocks = max(self.peak_fork_shared_blocks, s.fork_shared_blocks)
        self.peak_fork_refs = max(self.peak_fork_refs, s.fork_refs)
        for k in WORK_COUNTS:
            self.work[k] += getattr(s, k)


@dataclass
class RunStats:
    cache_kind: str
    block_size: int
    num_blocks: int
    kv_bytes: int
    max_num_seqs: int
    cache: object = None  # the block manager, read for prefix-cache counters at summary time
    attention: str | None = None  # the path attention read K/V by ('kernel', 'gather'; None: simulated)
    history: Timeline = field(default_factory=Timeline)
    totals: StepTotals = field(default_factory=StepTotals)
    start: float = field(default_factory=time.perf_counter)
    end: float | None = None
    num_requests: int = 0
    num_failed: int = 0
    num_aborted: int = 0  # dropped by ``abort`` (a client that went away): no output
    prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    ttft: Quantiles = field(default_factory=Quantiles)
    tpot: Quantiles = field(default_factory=Quantiles)
    latency: Quantiles = field(default_factory=Quantiles)
    preemption_steps: Thinned = field(default_factory=Thinned)
    forward_s: float = 0.0
    # Structured output: mask fill + apply + token accept (fill overlaps the forward pass, so
    # grammar_wait_s is what the step actually waited for), compile time and cache hits.
    grammar_s: float = 0.0
    grammar_wait_s: float = 0.0
    grammar_compile_s: float = 0.0
    grammar_cache_hits: int = 0
    constrained_tokens: int = 0
    # Speculative decoding: drafts proposed and accepted, verifications (one per sequence and
    # step that verified drafts), tokens those emitted (accepted drafts + the target's next
    # token, up to a stop), and the drafters' time (part of the "prepare" phase).
    spec_method: str = "none"
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    spec_emitted_tokens: int = 0
    spec_draft_s: float = 0.0
    phases: dict = field(default_factory=lambda: dict.fromkeys(
        ("schedule", "prepare", "forward", "sample", "postprocess"), 0.0))
    # The run's clock: wall time, or a simulator's virtual time (then ``start`` is on it too).
    clock: object = field(default=time.perf_counter, repr=False, compare=False)

    def record_step(self, rec: StepRecord) -> None:
        self.totals.add(rec)
        self.history.add(rec)

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
                xs.add(v)

    def elapsed(self) -> float:
        return (self.end if self.end is not None else self.clock()) - self.start

    def summary(self) -> dict:
        el = max(self.elapsed(), 1e-9)
        t = self.totals
        n = t.used_steps
        return {
            "num_requests": self.num_requests, "num_failed": self.num_failed, "num_aborted": self.num_aborted,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "elapsed_s": round(el, 4),
            "output_tokens_per_s": round(self.output_tokens / el, 2),
            "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / el, 2),
            "cache_kind": self.cache_kind, "block_size": self.block_size, "num_blocks": self.num_blocks,
            "attention": self.attention,
            "kv_sizing": getattr(self.cache, "sizing", None),
            "kv_bytes": self.kv_bytes, "max_num_seqs": self.max_num_seqs,
            "steps": t.steps,
            "peak_running": t.peak_running,
            "peak_blocks_used": t.peak_blocks_used,
            "mean_block_utilization": round(t.util_sum / n, 4) if n else 0.0,
            "peak_block_utilization": round(t.peak_util, 4) if n else 0.0,
            "mean_wasted_slots": round(t.wasted_sum / n, 2) if n else 0.0,
            "peak_wasted_slots": t.peak_wasted,
            "preemptions": self.preemptions, "recomputed_tokens": self.recomputed_tokens,
            "prefill_tokens": t.prefill_tokens,
            **self._prefix_summary(), **self._fork_summary(),
            "decode_tokens": t.decode_tokens,
            "work_counts": dict(t.work) | {"tokens": t.prefill_tokens + t.decode_tokens},
            "forward_s": round(self.forward_s, 4),
            # Everything in the run's wall time that is not the model's forward pass: scheduling,
            # packing, sampling, stop checks, and the caller's reading and writing.
            "engine_overhead_frac": round(max(0.0, 1 - self.forward_s / el), 4),
            "phases_s": {k: round(v, 4) for k, v in self.phases.items()} | {
                "outside_engine": round(max(0.0, el - sum(self.phases.values())), 4)},
            "constrained_tokens": self.constrained_tokens, "grammar_s": round(self.grammar_s, 4),
            "grammar_wait_s": round(self.grammar_wait_s, 4), "grammar_compile_s": round(self.grammar_compile_s, 4),
            "grammar_cache_hits": self.grammar_cache_hits,
            **self._spec_summary(),
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
                "peak_shared_refs": self.totals.peak_shared_refs}

    def _fork_summary(self) -> dict:
        return {"forks": getattr(self.cache, "forks", 0), "cow_copies": getattr(self.cache, "cow_copies", 0),
                "peak_fork_shared_blocks": self.totals.peak_fork_shared_blocks,
                "peak_fork_refs": self.totals.peak_fork_refs}

    def _spec_summary(self) -> dict:
        return spec_summary(self.spec_method, self.spec_drafted_tokens, self.spec_accepted_tokens,
                            self.spec_verifications, self.spec_emitted_tokens, self.spec_draft_s)

    def timeline(self) -> list[dict]:
        """At most ``TIMELINE_POINTS`` points over the whole run (every step for shorter runs)."""
        return [asdict(s) | {"utilization": round(s.utilization, 4)} for s in self.history.records()]


SPEC_COUNTS = ("spec_drafted_tokens", "spec_accepted_tokens", "spec_verifications", "spec_emitted_tokens",
               "spec_draft_s")


def spec_summary(method: str, drafted: int, accepted: int, verifications: int, emitted: int, draft_s: float) -> dict:
    """The speculative-decoding keys of a summary (one place, so workers' counts merge the same)."""
    return {"spec_method": method, "spec_drafted_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "spec_verifications": verifications, "spec_emitted_tokens": emitted,
            "spec_tokens_per_verify": round(emitted / verifications, 3) if verifications else 0.0,
            "spec_draft_s": round(draft_s, 4)}


GRAMMAR_KEYS = ("constrained_tokens", "grammar_s", "grammar_wait_s", "grammar_compile_s", "grammar_cache_hits")


def merge_worker_summaries(sums: list[dict], elapsed: float) -> dict:
    """Cache and scheduler figures over all workers (each worker has its own pool)."""
    def total(k):
        return sum(x[k] for x in sums)

    def most(k):
        return max(x[k] for x in sums)

    first = sums[0]
    q, h = total("prefix_cache_queries"), total("prefix_cache_hits")
    forward = total("forward_s")
    return {
        "cache_kind": first["cache_kind"], "block_size": first["block_size"], "num_blocks": first["num_blocks"],
        "kv_bytes": first["kv_bytes"], "steps": total("steps"), "peak_running": total("peak_running"),
        "peak_blocks_used": most("peak_blocks_used"),
        "mean_block_utilization": round(sum(x["mean_block_utilization"] for x in sums) / len(sums), 4),
        "peak_block_utilization": most("peak_block_utilization"),
        "mean_wasted_slots": round(sum(x["mean_wasted_slots"] for x in sums) / len(sums), 2),
        "peak_wasted_slots": most("peak_wasted_slots"),
        "preemptions": total("preemptions"), "recomputed_tokens": total("recomputed_tokens"),
        "prefill_tokens": total("prefill_tokens"), "decode_tokens": total("decode_tokens"),
        "work_counts": {k: sum(x["work_counts"][k] for x in sums) for k in sums[0]["work_counts"]},
        "prefix_caching": first["prefix_caching"], "prefix_cache_queries": q, "prefix_cache_hits": h,
        "prefix_cache_hit_rate": round(h / q, 4) if q else 0.0, "prefill_tokens_skipped": h,
        "peak_shared_refs": most("peak_shared_refs"), "forward_s": round(forward, 4),
        # Wall time of all workers together that was not a forward pass (dispatch, transfers, idling).
        "engine_overhead_frac": round(max(0.0, 1 - forward / max(elapsed * len(sums), 1e-9)), 4),
        **{k: round(sum(x.get(k, 0) for x in sums), 4) for k in GRAMMAR_KEYS},
        **spec_summary(first.get("spec_method", "none"), *(sum(x.get(k, 0) for x in sums) for k in SPEC_COUNTS)),
    }
