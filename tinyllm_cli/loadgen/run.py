"""The open-loop dispatcher: each planned request is sent at its scheduled time, as its own
task, whether or not the earlier ones have finished (``--max-concurrency`` alone may hold a
request back, and its record shows by how much).

Invariants:
- Every request sent has a record, finished or not; the summary is computed from the records
  alone, so the JSON's records reproduce every figure.
- A failed request is a record with an error. Only a server that stops answering ends a run
  early (``RateResult.gone``), and then every record so far is kept: unfinished ones say so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from .client import ServerGone, auth_headers, body, reachable, send
from .metrics import Sampler, metrics_url
from .records import RequestRecord, summarize
from .schedule import Planned

GONE = "cancelled: the server went away"


@dataclass
class Target:
    """Where the requests go and how."""

    base_url: str  # http://HOST:PORT/v1
    model: str
    chat: bool = False
    api_key: str | None = None
    max_concurrency: int | None = None
    server_metrics: bool = False
    slo: dict = field(default_factory=dict)

    @property
    def headers(self) -> dict:
        return auth_headers(self.api_key)

    @property
    def endpoint_url(self) -> str:
        return self.base_url.rstrip("/") + ("/chat/completions" if self.chat else "/completions")


@dataclass
class RateResult:
    records: list[RequestRecord]
    summary: dict
    gone: str | None = None  # why the run ended early: the server stopped answering


async def run_rate(client: aiohttp.ClientSession, target: Target, planned: Iterable[Planned],
                   on_done: Callable[[RequestRecord], None] = lambda r: None) -> RateResult:
    """Send one schedule and wait for every answer (or for the server to go away)."""
    sampler = Sampler(client, metrics_url(target.base_url), target.headers) if target.server_metrics else None
    if sampler:
        await sampler.start()
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop)) if sampler else None
    records, gone = [], _Gone()
    t0 = time.perf_counter()
    try:
        tasks = await _dispatch(client, target, planned, records, gone, on_done, t0)
        await _wait(tasks, gone)
    finally:
        elapsed = time.perf_counter() - t0
        stop.set()
        if sampling:
            await sampling
    for r in records:
        if r.latency_s is None and r.error is None:
            r.error = GONE
        r.settle()
    summary = summarize(records, elapsed, target.slo)
    if sampler and not gone.why:
        await sampler.finish()
        summary["server"] = sampler.report()
    return RateResult(records, summary, gone.why)


class _Gone:
    def __init__(self):
        self.event = asyncio.Event()
        self.why: str | None = None

    def set(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.event.set()


async def _dispatch(client, target: Target, planned, records, gone: _Gone, on_done, t0: float) -> list:
    sem = asyncio.Semaphore(target.max_concurrency) if target.max_concurrency else None
    tasks = []
    for p in planned:
        delay = t0 + p.at_s - time.perf_counter()
        if delay > 0:
            try:  # sleep until the send time, but wake at once if the server goes away
                await asyncio.wait_for(gone.event.wait(), delay)
            except asyncio.TimeoutError:
                pass
        if gone.why:
            break
        rec = RequestRecord(p.index, p.at_s, prompt_tokens=p.prompt_len)
        records.append(rec)
        tasks.append(asyncio.create_task(_one(client, target, p, rec, sem, gone, on_done, t0)))
    return tasks


async def _one(client, target: Target, p: Planned, rec: RequestRecord, sem, gone: _Gone, on_done, t0) -> None:
    payload = body(p, target.model, target.chat)
    try:
        if sem is None:
            await send(client, target.endpoint_url, target.headers, payload, rec, t0)
        else:
            async with sem:
                await send(client, target.endpoint_url, target.headers, payload, rec, t0)
    except ServerGone as e:
        gone.set(str(e) or "connection refused")
        return
    if rec.error and rec.error.startswith("stream cut short") and not await reachable(client, target.base_url,
                                                                                       target.headers):
        gone.set(rec.error)
        return
    on_done(rec)


async def _wait(tasks: list, gone: _Gone) -> None:
    """Until every task ends, or the server goes away (then the rest are cancelled)."""
    if not tasks:
        return
    everything = asyncio.gather(*tasks, return_exceptions=True)
    waiter = asyncio.create_task(gone.event.wait())
    await asyncio.wait({everything, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if gone.why:
        for t in tasks:
            t.cancel()
    for r in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(r, Exception):  # a bug, not a request's failure (those are records)
            raise r
