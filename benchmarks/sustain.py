"""The serving comparison's arithmetic: whether a rate's run is valid and meets the SLO, and the
highest request rate a server sustains.

A run (one offered rate, ``tinyllm load``'s JSON for it) meets the SLO when its p90 TTFT and p90
TPOT are within their limits (by default 2 s and 200 ms: ``SLO``). Its *SLO ratio* is the larger
of p90 / limit over the two, so at most 1 is a pass.

The sustainable rate is interpolated, not bisected: between the highest rate that passed below
the first rate that failed, linearly in the SLO ratio (the rate at which the ratio would reach 1
on the straight line through the two runs). When every rate passed, the highest one is a lower
bound; when the lowest failed, there is none.

Invariants: a run with any failed request, or any request whose prompt or output token count
differs from what was asked, is invalid (a server that stops early, or ignores ``ignore_eos``
and ``max_tokens``, does less work than the others), and an invalid run never counts as a pass.
"""

from __future__ import annotations

from dataclasses import dataclass

SLO = {"ttft_s": 2.0, "tpot_s": 0.2}  # p90 limits in seconds (the 135M model's)


def problems(records: list[dict], input_len: int, output_len: int) -> list[str]:
    """Why a run's records make it invalid: failures, and requests whose token counts differ from
    the ``input_len`` / ``output_len`` asked for; empty when valid."""
    out = []
    ok = [r for r in records if not r.get("error") and r.get("latency_s") is not None]
    if len(ok) < len(records):
        first = next(r for r in records if r.get("error") or r.get("latency_s") is None)
        out.append(f"{len(records) - len(ok)} of {len(records)} requests failed ({first.get('error') or 'no answer'})")
    short = [r["output_tokens"] for r in ok if r.get("output_tokens") != output_len]
    if short:
        out.append(f"{len(short)} of {len(ok)} answers had other than {output_len} output tokens "
                   f"(from {min(short)} to {max(short)})")
    wrong_in = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") not in (None, input_len)]
    if wrong_in:
        out.append(f"{len(wrong_in)} prompts were counted at other than {input_len} tokens "
                   f"(from {min(wrong_in)} to {max(wrong_in)})")
    return out


def slo_ratio(summary: dict, slo: dict[str, float] = SLO) -> float | None:
    """max over the SLO's metrics of p90 / limit (None when a metric has no p90: nothing completed)."""
    ratios = []
    for key, limit in slo.items():
        p90 = (summary.get(key) or {}).get("p90")
        if p90 is None:
            return None
        ratios.append(p90 / limit)
    return max(ratios)


@dataclass(frozen=True)
class Point:
    """One offered rate's outcome: its SLO ratio (None: nothing completed) and whether it was valid."""
    rate: float
    ratio: float | None
    valid: bool = True

    @property
    def passed(self) -> bool:
        return self.valid and self.ratio is not None and self.ratio <= 1.0


@dataclass(frozen=True)
class Sustained:
    """The highest sustainable rate: ``rate`` (None when the lowest rate failed), ``how`` it was
    found (``interpolated``, ``at least``: every rate passed, ``below``: the lowest failed) and the
    two rates it lies between."""
    rate: float | None
    how: str
    between: tuple[float, float] | None = None

    def to_json(self) -> dict:
        return {"rate": self.rate, "how": self.how, "between": list(self.between) if self.between else None}


def sustainable(points: list[Point]) -> Sustained:
    """The highest rate that meets the SLO (see the module docstring)."""
    if not points:
        raise ValueError("no rates were run")
    pts = sorted(points, key=lambda p: p.rate)
    first_fail = next((i for i, p in enumerate(pts) if not p.passed), None)
    if first_fail is None:
        return Sustained(pts[-1].rate, "at least")
    if first_fail == 0:
        return Sustained(None, "below", (0.0, pts[0].rate))
    lo, hi = pts[first_fail - 1], pts[first_fail]
    if hi.ratio is None or not hi.valid or hi.ratio <= lo.ratio:
        # Nothing to draw a line through (no latencies, an invalid run, or a ratio that did not
        # grow): the rate that passed is all that is known.
        return Sustained(lo.rate, "at least", (lo.rate, hi.rate))
    rate = lo.rate + (1.0 - lo.ratio) * (hi.rate - lo.rate) / (hi.ratio - lo.ratio)
    return Sustained(rate, "interpolated", (lo.rate, hi.rate))


def should_stop(points: list[Point], after_fails: int = 2) -> bool:
    """A sweep (rates in rising order) stops once ``after_fails`` rates in a row have failed: past
    saturation a higher rate only queues more."""
    tail = points[-after_fails:]
    return len(tail) == after_fails and not any(p.passed for p in tail)
