"""The server's Prometheus ``/metrics``, read with ``prometheus_client``'s own text parser.

Counters are read before and after a run and reported as differences; gauges (KV cache usage,
running and waiting requests) are sampled during it and reported at their peak, since their
value at the end says nothing about the run. Names are vLLM's (``vllm:...``), which
``tinyllm serve`` uses too; a server without them (or without ``/metrics``) gives an empty report
with a note, never an error.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .client import ServerGone, get_text

COUNTERS = {"preemptions": "vllm:num_preemptions_total",
            "prefix_cache_queries": "vllm:prefix_cache_queries_total",
            "prefix_cache_hits": "vllm:prefix_cache_hits_total",
            "server_prompt_tokens": "vllm:prompt_tokens_total",
            "server_generation_tokens": "vllm:generation_tokens_total"}
GAUGES = {"peak_kv_cache_usage": "vllm:kv_cache_usage_perc",
          "peak_running": "vllm:num_requests_running",
          "peak_waiting": "vllm:num_requests_waiting"}


def metrics_url(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p/metrics`` (the server's root, where vLLM serves it)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    return root + "/metrics"


def parse(text: str) -> dict[str, float]:
    """Every sample's value by sample name, summed over label sets (e.g. per model)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def scrape(client: aiohttp.ClientSession, url: str, headers: dict) -> dict[str, float] | None:
    """One scrape; None when the server has no readable /metrics."""
    try:
        status, text = await get_text(client, url, headers)
        return parse(text) if status == 200 else None
    except (ServerGone, aiohttp.ClientError, ValueError):
        return None


class Sampler:
    """Scrapes before, every ``interval_s`` during, and after a run; ``report`` gives the
    counters' differences and the gauges' peaks."""

    def __init__(self, client: aiohttp.ClientSession, url: str, headers: dict, interval_s: float = 0.5):
        self.client, self.url, self.headers, self.interval_s = client, url, headers, interval_s
        self.before: dict | None = None
        self.after: dict | None = None
        self.peaks: dict[str, float] = {}
        self.samples = 0

    async def start(self) -> None:
        self.before = await scrape(self.client, self.url, self.headers)
        self._note(self.before)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                self._note(await scrape(self.client, self.url, self.headers))

    async def finish(self) -> None:
        self.after = await scrape(self.client, self.url, self.headers)
        self._note(self.after)

    def _note(self, m: dict | None) -> None:
        if m is None:
            return
        self.samples += 1
        for key, name in GAUGES.items():
            if name in m:
                self.peaks[key] = max(self.peaks.get(key, 0.0), m[name])

    def report(self) -> dict:
        if self.before is None or self.after is None:
            return {"note": f"no readable Prometheus metrics at {self.url}"}
        out: dict = {}
        for key, name in COUNTERS.items():
            if name in self.before and name in self.after:
                out[key] = round(self.after[name] - self.before[name], 6)
        if out.get("prefix_cache_queries"):
            out["prefix_cache_hit_rate"] = round(out.get("prefix_cache_hits", 0) / out["prefix_cache_queries"], 4)
        out |= {k: round(v, 4) for k, v in self.peaks.items()}
        out["metrics_samples"] = self.samples
        return out
