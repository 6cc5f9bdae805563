"""Prometheus metrics for ``tinyllm serve``, under vLLM's names and meanings so that existing
dashboards read them (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ...), plus a
few of tinyllm's own (``tinyllm:kv_blocks_used``, ...).

Invariants:
- The gauges and the engine's counters are read at scrape time from a snapshot the engine thread
  takes after every step (``Engine.load()``: the same scheduler, cache and ``RunStats`` figures
  the run table reads), never from the live engine: a scrape never races a step.
- Latency histograms are observed by the front as each request's events arrive: TTFT and
  end-to-end from the request's arrival at the server, inter-token latency per step that gave the
  request new tokens (as vLLM observes it per iteration).
- One registry per server (no process-global state), so tests can run several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's bucket edges (seconds), so histogram panels line up with a vLLM server's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)

# Engine.load() key -> (metric name, help, kind)
LOAD_METRICS = (
    ("running", "vllm:num_requests_running", "Requests in the running batch.", "gauge"),
    ("waiting", "vllm:num_requests_waiting", "Requests queued, not yet running (preempted ones included).", "gauge"),
    ("kv_usage", "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "gauge"),
    ("blocks_used", "tinyllm:kv_blocks_used", "KV blocks held by sequences.", "gauge"),
    ("blocks_free", "tinyllm:kv_blocks_free", "KV blocks free (cached prefix blocks included).", "gauge"),
    ("preemptions", "vllm:num_preemptions", "Sequences preempted (recomputed later).", "counter"),
    ("prefix_cache_queries", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter"),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter"),
    ("prompt_tokens", "vllm:prompt_tokens", "Prompt tokens of finished requests.", "counter"),
    ("output_tokens", "vllm:generation_tokens", "Generated tokens of finished requests.", "counter"),
)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        self.snapshot: dict = {}  # the engine's last load(), replaced whole by the engine thread
        self.registry.register(_LoadCollector(self))
        names = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", names,
                              buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's successive steps' tokens.",
                             names, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", names,
                             buckets=E2E_BUCKETS, registry=reg).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               names + ["finished_reason"], registry=reg)
        self.rejected = Counter("tinyllm:requests_rejected", "Requests refused with 429 (waiting room full).",
                                names, registry=reg).labels(model_name)

    def finished(self, reason: str) -> None:
        self.success.labels(self.labels["model_name"], reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LoadCollector:
    """Yields the engine snapshot's figures at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        snap = self.metrics.snapshot
        labels = self.metrics.labels
        for key, name, doc, kind in LOAD_METRICS:
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=list(labels))
            fam.add_metric(list(labels.values()), float(snap.get(key, 0)))
            yield fam
