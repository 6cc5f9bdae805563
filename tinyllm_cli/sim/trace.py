"""Simulation traces: the trace format (``tinyllm_cli.traces``) as engine requests, and the
arrival times serve-batch's ``--request-rate`` gives a trace."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from ..engine.request import Request, SamplingParams
from ..errors import UsageError
from ..traces import TokenMaker, TraceItem


def to_requests(items, vocab: int, index0: int = 0, salt: int = 0) -> Iterator[Request]:
    """Greedy ``ignore_eos`` requests that generate exactly ``output_len`` tokens each; prompts
    given by length get ``TokenMaker(vocab, salt)``'s ids."""
    maker = TokenMaker(vocab, salt)
    params: dict[int, SamplingParams] = {}
    for i, it in enumerate(items, index0):
        p = params.get(it.output_len)
        if p is None:
            p = params[it.output_len] = SamplingParams(max_new_tokens=it.output_len, ignore_eos=True)
        yield Request(it.id, maker.tokens(it), p, index=i, arrival=it.arrival_s)


def serve_arrivals(items, rate: float, seed: int) -> Iterator[TraceItem]:
    """The items with the arrival times ``serve-batch --request-rate rate --seed seed`` gives
    the same lines when it reads them all at once: the first at 0, then Poisson gaps from the
    same seeded generator (``workload.poisson_gaps``). The trace's own ``arrival_s`` is replaced."""
    from ..workload import poisson_gaps
    if not rate > 0:
        raise UsageError(f"--request-rate must be positive, not {rate}")
    gaps, t = poisson_gaps(rate, seed), None
    for it in items:
        t = 0.0 if t is None else t + next(gaps)
        yield replace(it, arrival_s=t)
