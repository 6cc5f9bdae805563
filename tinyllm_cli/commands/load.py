"""``tinyllm load``: open-loop load against any OpenAI-compatible server (``loadgen/``), one run
per request rate; a table per rate on stderr, every record and summary in ``--json``, a figure
with ``--plot``. Imports no engine code: it talks HTTP only.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import TinyLLMError, UsageError
from ..loadgen.client import ServerGone, auth_headers, first_model, new_session
from ..loadgen.run import RateResult, Target, run_rate
from ..loadgen.schedule import Prompts, Workload, plan
from ..report import load_rate_table, load_sweep_table, stderr_console


@dataclass
class LoadSpec:
    """The flags, checked: what to send, when, and where."""

    url: str
    model: str | None
    api_key: str | None
    rates: list[float | None]  # None: a trace's own arrival times
    burstiness: float
    max_concurrency: int | None
    num_requests: int | None
    duration_s: float | None
    time_scale: float
    seed: int
    workload: Workload
    slo: dict
    server_metrics: bool


def parse_rates(text: str | None) -> list[float]:
    """``"1,2.5,inf"`` -> ``[1.0, 2.5, inf]``; one sentence on anything else."""
    vals = []
    for x in (text or "").split(","):
        x = x.strip()
        if not x:
            continue
        try:
            v = float(x)
        except ValueError:
            v = -1.0
        if not v > 0 or math.isnan(v):
            raise UsageError(f"--request-rate takes a comma list of positive request rates or inf, not {text!r}")
        vals.append(v)
    if not vals:
        raise UsageError(f"--request-rate takes a comma list of positive request rates or inf, not {text!r}")
    return vals


def check(spec: LoadSpec) -> LoadSpec:
    """Usage errors, before anything is sent."""
    if not spec.url.startswith(("http://", "https://")):
        raise UsageError(f"--url must be an http:// or https:// address of an OpenAI-compatible API, not {spec.url!r}")
    w = spec.workload
    if w.trace and w.prompts_file:
        raise UsageError("give --trace or --prompts, not both")
    if w.chat and not w.prompts_file:
        raise UsageError("--endpoint chat needs text prompts: give --prompts FILE (the random workload and "
                         "traces send token ids, which only the completions endpoint takes)")
    if spec.num_requests is not None and spec.duration_s is not None:
        raise UsageError("give --num-requests or --duration, not both")
    for name, v in (("--num-requests", spec.num_requests), ("--max-concurrency", spec.max_concurrency),
                    ("--duration", spec.duration_s), ("--time-scale", spec.time_scale),
                    ("--burstiness", spec.burstiness), ("--input-len", w.input_len),
                    ("--output-len", w.output_len), ("--vocab-size", w.vocab_size)):
        if v is not None and not v > 0:
            raise UsageError(f"{name} must be positive, not {v}")
    if not 0 <= w.range_ratio < 1:
        raise UsageError(f"--range-ratio must be in [0, 1), not {w.range_ratio}")
    if w.prefix_len < 0 or w.num_prefixes < 1:
        raise UsageError("--prefix-len must be >= 0 and --num-prefixes >= 1")
    if spec.duration_s is not None and any(r is not None and math.isinf(r) for r in spec.rates):
        raise UsageError("--duration needs finite request rates (inf sends everything at once)")
    return spec


def run_load(spec: LoadSpec, json_out: Path | None, plot_out: Path | None, quiet: bool) -> int:
    spec = check(spec)
    if json_out is not None and str(json_out) != "-" and not Path(json_out).parent.is_dir():
        raise UsageError(f"--json {str(json_out)!r}: its folder does not exist")
    report = {"kind": "load", "url": spec.url, "endpoint": "chat" if spec.workload.chat else "completions",
              "model": spec.model, "settings": _settings(spec), "runs": []}
    console = None if quiet else stderr_console()
    try:
        asyncio.run(_sweep(spec, report, json_out, console))
    except BaseException:
        if str(json_out) != "-":  # a failed run keeps its records; stdout stays empty
            write_report(report, json_out)
        raise
    write_report(report, json_out, final=True)
    if plot_out is not None:
        from ..plot import draw
        draw("load", report, plot_out)
    if console and len(report["runs"]) > 1:
        console.print(load_sweep_table(report))
    return 0


async def _sweep(spec: LoadSpec, report: dict, json_out: Path | None, console) -> None:
    async with new_session() as client:
        try:
            model = spec.model or await first_model(client, spec.url, auth_headers(spec.api_key))
        except ServerGone as e:
            raise TinyLLMError(f"no server answers at {spec.url} ({_reason(e)}); start one (tinyllm serve) or "
                               f"check --url")
        except LookupError as e:
            raise TinyLLMError(str(e))
        report["model"] = model
        target = Target(spec.url, model, spec.workload.chat, spec.api_key, spec.max_concurrency, spec.server_metrics,
                        spec.slo)
        prompts = Prompts(spec.workload)
        for rate in spec.rates:
            res = await _one_rate(client, target, spec, prompts, rate, console)
            report["runs"].append(_run_entry(rate, spec, res))
            write_report(report, json_out)  # each finished rate is on disk before the next starts
            if console:
                console.print(load_rate_table(report["runs"][-1], report))
            if res.gone:
                kept = f"; the records so far are in {json_out}" if json_out and str(json_out) != "-" else ""
                raise TinyLLMError(f"the server at {spec.url} went away after {res.summary['num_completed']} of "
                                   f"{res.summary['num_requests']} requests sent at rate {_rate_label(rate)} "
                                   f"({res.gone}){kept}")


async def _one_rate(client, target: Target, spec: LoadSpec, prompts: Prompts, rate, console) -> RateResult:
    planned = plan(prompts, rate, spec.burstiness, spec.seed, spec.num_requests, spec.duration_s,
                   spec.time_scale)
    if console is None:
        return await run_rate(client, target, planned)
    from rich.progress import Progress
    with Progress(console=console, transient=True) as prog:
        total = spec.num_requests
        task = prog.add_task(f"rate {_rate_label(rate)}", total=total)
        return await run_rate(client, target, planned, on_done=lambda r: prog.advance(task))


def _run_entry(rate, spec: LoadSpec, res: RateResult) -> dict:
    label = "trace" if rate is None else _rate_label(rate)
    return {"request_rate": label, "burstiness": spec.burstiness, "max_concurrency": spec.max_concurrency,
            "summary": {"request_rate": label} | res.summary, "records": [r.to_json() for r in res.records]}


def _rate_label(rate) -> str:
    return "trace" if rate is None else ("inf" if math.isinf(rate) else f"{rate:g}")


def _reason(e: Exception) -> str:
    return str(e) or "connection refused"


def _settings(spec: LoadSpec) -> dict:
    s = {k: v for k, v in asdict(spec).items() if k not in ("api_key", "workload", "rates")}
    s["rates"] = [_rate_label(r) for r in spec.rates]
    return s | {"workload": asdict(spec.workload)}


def write_report(report: dict, path: Path | None, final: bool = False) -> None:
    """The whole report as JSON into ``path`` (rewritten after every rate; ``-``: stdout, once,
    at the end)."""
    if path is None or (str(path) == "-" and not final):
        return
    text = json.dumps(report) + "\n"
    try:
        if str(path) == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            Path(path).write_text(text)
    except OSError as e:
        raise TinyLLMError(f"cannot write {path}: {e.strerror}")
