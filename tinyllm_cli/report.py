"""Rich rendering of run stats, bench rows and block maps. Reads stats objects; computes nothing
the engine did not record. Everything here prints to stderr: stdout is for results."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"


def stderr_console() -> Console:
    # Logs and pipes get a wide fixed width: rich's 80-column fallback would squash the tables.
    width = None if sys.stderr.isatty() else 200
    return Console(stderr=True, highlight=False, width=width)


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f} MiB"


def run_table(s: dict, title: str = "run") -> Table:
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests (failed)", f"{s['num_requests']} ({s['num_failed']})"),
        ("prompt / output tokens", f"{s['prompt_tokens']} / {s['output_tokens']}"),
        ("elapsed", f"{s['elapsed_s']:.2f} s"),
        ("output tok/s", f"{s['output_tokens_per_s']:.1f}"),
        ("total tok/s", f"{s['total_tokens_per_s']:.1f}"),
        ("cache", f"{s['cache_kind']}  {s['num_blocks']} x {s['block_size']} tok  ({_mib(s['kv_bytes'])})"),
        ("KV pool sized by", s.get("kv_sizing") or "-"),
        ("peak running seqs", str(s["peak_running"])),
        ("peak blocks used", f"{s['peak_blocks_used']} / {s['num_blocks']}"),
        ("block utilization mean / peak", f"{s['mean_block_utilization']:.1%} / {s['peak_block_utilization']:.1%}"),
        ("wasted slots mean / peak", f"{s['mean_wasted_slots']:.0f} / {s['peak_wasted_slots']}"),
        ("preemptions (recomputed tok)", f"{s['preemptions']} ({s['recomputed_tokens']})"),
        ("prefix cache", (f"{s['prefix_cache_hits']} of {s['prefix_cache_queries']} prompt tok hit "
                          f"({s['prefix_cache_hit_rate']:.1%}), peak {s['peak_shared_refs']} shared refs")
         if s.get("prefix_caching") else "off"),
        ("prefill tokens computed / skipped", f"{s['prefill_tokens']} / {s['prefill_tokens_skipped']}"),
        ("engine overhead", f"{s['engine_overhead_frac']:.1%} of wall time"),
    ]
    if s.get("forks"):  # only runs with n > 1 requests: other tables keep their rows
        rows.insert(-2, ("parallel sampling (forks)",
                         f"{s['forks']} forks, {s['cow_copies']} copy-on-write block copies, peak "
                         f"{s['peak_fork_shared_blocks']} blocks shared by forks ({s['peak_fork_refs']} extra refs)"))
    if s.get("constrained_tokens"):  # only runs with structured-output requests
        rows.insert(-1, ("structured output", (
            f"{s['constrained_tokens']} masked tok; grammar {s['grammar_s']:.2f} s "
            f"({s['grammar_s'] / max(s['elapsed_s'], 1e-9):.1%} of wall, {s['grammar_wait_s']:.2f} s not overlapped); "
            f"compile {s['grammar_compile_s']:.2f} s, {s['grammar_cache_hits']} cache hits")))
    if s.get("spec_method", "none") != "none":  # only runs that speculate: other tables keep their rows
        rows.insert(-1, ("speculative decoding", (
            f"{s['spec_method']}: {s['spec_accepted_tokens']} of {s['spec_drafted_tokens']} draft tok accepted "
            f"({s['spec_acceptance_rate']:.1%}), {s['spec_tokens_per_verify']:.2f} tok per verify "
            f"({s['spec_verifications']} verifies), drafting {s['spec_draft_s']:.2f} s")))
    for name, v in rows:
        t.add_row(name, v)
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("latency_s", "latency")):
        p = s[key]
        t.add_row(f"{label} p50 / p90 / p99 (ms)", f"{_ms(p['p50'])} / {_ms(p['p90'])} / {_ms(p['p99'])}")
    return t


BENCH_COLUMNS = [
    ("cache", "cache_kind", str), ("block", "block_size", str),
    ("prefix", "prefix_caching", lambda v: "on" if v else "off"),
    ("prefill tok", "prefill_tokens", str), ("hit rate", "prefix_cache_hit_rate", "{:.0%}"),
    ("elapsed s", "elapsed_s", "{:.2f}"), ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("total tok/s", "total_tokens_per_s", "{:.1f}"), ("peak seqs", "peak_running", str),
    ("util mean", "mean_block_utilization", "{:.1%}"), ("util peak", "peak_block_utilization", "{:.1%}"),
    ("wasted", "mean_wasted_slots", "{:.0f}"), ("preempt", "preemptions", str),
    ("recomp tok", "recomputed_tokens", str), ("KV MiB", "kv_bytes", lambda b: f"{b / 2**20:.1f}"),
]


def _or_dash(fmt: str):
    return lambda v: "-" if v is None else fmt.format(v)


# Where the limit is (bench's in-process rows, ``roofline.py``): achieved rates and their
# fractions of the measured peak; "-" where a row has none (Ray workers, --no-roofline).
ROOFLINE_COLUMNS = [
    ("GFLOP/s", "achieved_gflops", _or_dash("{:.0f}")), ("% peak", "roofline_frac", _or_dash("{:.0%}")),
    ("GB/s", "achieved_gbps", _or_dash("{:.1f}")), ("% BW", "bandwidth_frac", _or_dash("{:.0%}")),
]


def print_worker_table(s: dict) -> None:
    """With Ray workers (``cluster.py``): one row per worker under the run table."""
    if "workers" in s:
        stderr_console().print(worker_table(s))


def worker_table(s: dict) -> Table:
    failed = ", ".join(f"{w['worker']} ({w['error']})" for w in s["workers"] if w["status"] != "ok")
    t = Table(title=f"{s['num_workers']} Ray workers · {s['retried_requests']} requests retried on another "
                    f"worker · failed: {failed or 'none'}", header_style="bold")
    cols = [("worker", "worker", str), ("host", "host", str), ("pid", "pid", str), ("threads", "threads", str),
            ("requests", "requests", str), ("failed", "failed_requests", str),
            ("out tokens", "output_tokens", str), ("out tok/s", "output_tokens_per_s", "{:.1f}".format),
            ("peak blocks", "peak_blocks_used", str), ("preempt", "preemptions", str),
            ("retried elsewhere", "retried_elsewhere", str), ("status", "status", str)]
    for name, _, _ in cols:
        t.add_column(name, justify="right")
    for w in s["workers"]:
        t.add_row(*("-" if w[k] is None else fmt(w[k]) for _, k, fmt in cols))
    return t


# Shown when some row asks for several completions per prompt (``bench --n``).
FORK_COLUMNS = [("n", "n", str), ("peak blocks", "peak_blocks_used", str), ("forks", "forks", str),
                ("CoW copies", "cow_copies", str), ("fork-shared peak", "peak_fork_shared_blocks", str)]


def bench_table(rows: list[dict], title: str = "bench") -> Table:
    t = Table(title=title, header_style="bold")
    parallel = any("workers" in r for r in rows)
    if parallel:
        t.add_column("workers", justify="right")
    columns = (BENCH_COLUMNS + (FORK_COLUMNS if any(r.get("n", 1) > 1 for r in rows) else [])
               + (ROOFLINE_COLUMNS if any(r.get("achieved_gflops") is not None for r in rows) else []))
    for name, _, _ in columns:
        t.add_column(name, justify="right")
    t.add_column("TTFT p50 ms", justify="right")
    t.add_column("TPOT p50 ms", justify="right")
    if parallel:
        t.add_column("scaling", justify="right")
    for r in rows:
        cells = []
        for _, key, fmt in columns:
            v = r[key]
            cells.append(fmt(v) if callable(fmt) and not isinstance(fmt, str) else
                         (fmt.format(v) if isinstance(fmt, str) and "{" in fmt else str(v)))
        cells += [_ms(r["ttft_s"]["p50"]), _ms(r["tpot_s"]["p50"])]
        if parallel:
            cells = [str(r["workers"])] + cells + ["-" if r.get("scaling") is None else f"{r['scaling']:.2f}x"]
        t.add_row(*cells)
    return t


def sparkline(values: list[float], width: int = 60, lo: float | None = None, hi: float | None = None) -> str:
    if not values:
        return ""
    step = max(1, -(-len(values) // width))
    pts = [max(values[i:i + step]) for i in range(0, len(values), step)]
    lo = min(pts) if lo is None else lo
    hi = max(pts) if hi is None else hi
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in pts)


def marks_line(n_steps: int, events: list[int], width: int = 60) -> str:
    if not n_steps:
        return ""
    step = max(1, -(-n_steps // width))
    cells = [" "] * (-(-n_steps // step))
    for e in events:
        cells[min(len(cells) - 1, e // step)] = "!"
    return "".join(cells)


PALETTE = ["red", "green", "yellow", "blue", "magenta", "cyan", "bright_red", "bright_green",
           "bright_yellow", "bright_blue", "bright_magenta", "bright_cyan"]


CELL = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRTUVWXYZ"  # no 'S': that is scratch


def moment(at: str, snap: dict) -> str:
    """Which moment an inspect-blocks snapshot shows, in words (map titles, here and in plots)."""
    if at == "peak":
        return f"first step at peak blocks used, {snap['blocks_used']} of {snap['num_blocks']}"
    if at == "end":
        return "last step with sequences running"
    return "asked for with --at"


def block_map(owner: list[int | None], refs: list[int] | None = None, cached: set[int] = frozenset(),
              width: int = 64) -> Text:
    """One cell per physical block, a character and colour per owning sequence (seq id mod 61),
    '·' free, 'S' the scratch block (last). Readable without colour too (logs, pipes)."""
    text = Text()
    for i, o in enumerate(owner):
        if i and i % width == 0:
            text.append("\n")
        if o is None:
            text.append("○" if i in cached else "·", style="dim")
        elif refs and refs[i] > 1:
            text.append(str(refs[i]) if refs[i] < 10 else "+", style="bold reverse")
        elif o == -1:
            text.append("S", style="bold white on black")
        else:
            text.append(CELL[o % len(CELL)], style=f"bold {PALETTE[o % len(PALETTE)]}")
    return text


# ---- tinyllm load ---------------------------------------------------------------------------

LOAD_LATENCIES = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E latency", "latency_s"))


def load_rate_table(run: dict, report: dict) -> Table:
    """One rate of a ``tinyllm load`` run: counts, throughput, latency percentiles (ms), how
    faithfully the schedule was kept, goodput, and the server's own metrics when read."""
    s = run["summary"]
    t = Table(title=f"tinyllm load · {report.get('model')} · {report.get('endpoint')} · rate {run['request_rate']}"
                    + (f" · burstiness {run['burstiness']:g}" if run.get("burstiness", 1) != 1 else "")
                    + (f" · max concurrency {run['max_concurrency']}" if run.get("max_concurrency") else ""),
              show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    for name, key in LOAD_LATENCIES + (("send lag", "send_lag_s"),):
        p = s[key]
        t.add_row(f"{name} ms, mean / p50 / p90 / p99", " / ".join(_ms(p[k]) for k in ("mean", "p50", "p90", "p99")))
    t.add_row("requests", f"{s['num_completed']} completed, {s['num_failed']} failed of {s['num_requests']} "
                          f"in {s['elapsed_s']:.2f} s")
    t.add_row("throughput", f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s, "
                            f"{s['total_tokens_per_s']:.1f} total tok/s")
    slo = s.get("slo")
    if slo:
        limits = ", ".join(f"{k.removesuffix('_s')} <= {slo[k] * 1000:g} ms" for k in ("ttft_s", "tpot_s", "latency_s")
                           if k in slo)
        t.add_row("goodput", f"{slo['goodput_req_per_s']:.2f} req/s ({slo['slo_attainment']:.1%} of requests "
                             f"within {limits})")
    for err, n in (s.get("errors") or {}).items():
        t.add_row("failed", f"{n} x {err}")
    server = s.get("server")
    if server:
        t.add_row("server", ", ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k}: {v}"
                                      for k, v in server.items()))
    return t


def load_sweep_table(report: dict) -> Table:
    """Every rate of a ``tinyllm load`` run, one row each."""
    t = Table(title=f"tinyllm load · {report.get('model')} · rate sweep", header_style="bold")
    cols = ("rate", "done/failed", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
            "E2E p50/p99 ms", "lag p99 ms", "goodput req/s")
    for col in cols:
        t.add_column(col, justify="right")
    for run in report["runs"]:
        s = run["summary"]
        g = (s.get("slo") or {}).get("goodput_req_per_s")
        t.add_row(str(run["request_rate"]), f"{s['num_completed']}/{s['num_failed']}", f"{s['requests_per_s']:.2f}",
                  f"{s['output_tokens_per_s']:.1f}", *(f"{_ms(s[k]['p50'])} / {_ms(s[k]['p99'])}"
                                                       for k in ("ttft_s", "tpot_s", "latency_s")),
                  _ms(s["send_lag_s"]["p99"]), "-" if g is None else f"{g:.2f}")
    return t
