"""Per-request records and per-rate summaries, under the names a run's ``--stats-json`` uses
where the meaning is the same (``num_requests``, ``num_failed``, ``ttft_s``, ``tpot_s``,
``latency_s``, ``output_tokens_per_s``, ...), so a live run, an offline run and a simulation
line up column for column.

Definitions (vLLM's ``bench serve``, which the engine's own stats follow too):
- TTFT: send to the first chunk carrying text; ITL: the gaps between successive text chunks;
  TPOT: (latency - TTFT) / (output tokens - 1), none for a single token; latency: send to the
  stream's end. Latency figures are over the requests that completed.
- Percentiles interpolate linearly between ranks, as the engine's ``stats.percentiles`` does.
- Goodput (DistServe): completed requests meeting *every* SLO given, per second of the run;
  a request with no TPOT (one token) meets a TPOT SLO. SLO attainment: their share of all
  requests sent.
- Send lag: actual minus scheduled send time; its p99 says how faithfully the schedule was kept.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "latency_s"}


@dataclass(slots=True)
class RequestRecord:
    index: int
    scheduled_s: float  # send time the schedule asked for, from the run's start
    sent_s: float | None = None  # when it was actually sent
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency_s is not None

    def settle(self) -> None:
        """Round every time to the microsecond, once the request is over, so the JSON holds
        exactly the values the summary was computed from."""
        for k in ("sent_s", "ttft_s", "tpot_s", "latency_s"):
            v = getattr(self, k)
            if v is not None:
                setattr(self, k, round(v, 6))
        self.itl_s = [round(x, 6) for x in self.itl_s]

    def to_json(self) -> dict:
        return asdict(self)


def percentiles(xs, ps=(50, 90, 99)) -> dict[str, float | None]:
    """p50/p90/p99 and the mean, interpolated linearly between ranks; all None for no values."""
    if not xs:
        return {f"p{p}": None for p in ps} | {"mean": None}
    s = sorted(xs)
    out = {}
    for p in ps:
        k = (len(s) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        out[f"p{p}"] = round(s[lo] + (s[hi] - s[lo]) * (k - lo), 6)
    out["mean"] = round(statistics.fmean(s), 6)
    return out


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (milliseconds) -> ``{"ttft_s": 0.5, "tpot_s": 0.05}``; raises
    ``ValueError`` with one sentence on a bad item."""
    out: dict[str, float] = {}
    for spec in specs or ():
        for item in spec.replace(",", " ").split():
            name, _, ms = item.partition(":")
            if name not in SLO_KEYS:
                raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_KEYS)}, not {item!r}")
            try:
                v = float(ms)
            except ValueError:
                raise ValueError(f"--goodput {name} needs a number of milliseconds, not {ms!r}")
            if not v > 0 or v == float("inf"):
                raise ValueError(f"--goodput {name} must be a positive number of milliseconds, not {ms!r}")
            out[SLO_KEYS[name]] = v / 1000
    return out


def meets(r: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a request counts toward goodput: completed, and within every SLO given."""
    if not r.ok:
        return False
    for key, limit in slo.items():
        v = getattr(r, key)
        if v is not None and v > limit:
            return False
        if v is None and key != "tpot_s":
            return False
    return True


def summarize(records: list[RequestRecord], elapsed_s: float, slo: dict[str, float] | None = None) -> dict:
    """One rate's summary from its records (the records are the only input)."""
    done = [r for r in records if r.ok]
    el = max(round(elapsed_s, 6), 1e-6)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    out = sum(r.output_tokens for r in done)
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    s = {
        "num_requests": len(records), "num_completed": len(done), "num_failed": len(records) - len(done),
        "prompt_tokens": prompt, "output_tokens": out, "elapsed_s": el,
        "requests_per_s": round(len(done) / el, 4),
        "output_tokens_per_s": round(out / el, 2), "total_tokens_per_s": round((prompt + out) / el, 2),
        "ttft_s": percentiles([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_s": percentiles([x for r in done for x in r.itl_s]),
        "latency_s": percentiles([r.latency_s for r in done]),
        "send_lag_s": percentiles(lags),
        "errors": _error_counts(records),
    }
    if slo:
        good = sum(meets(r, slo) for r in records)
        s["slo"] = dict(slo) | {"num_good": good, "goodput_req_per_s": round(good / el, 4),
                                "slo_attainment": round(good / max(len(records), 1), 4)}
    return s


def _error_counts(records: list[RequestRecord], top: int = 5) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.ok:
            counts[r.error or "unfinished"] = counts.get(r.error or "unfinished", 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:top])
