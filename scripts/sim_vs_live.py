"""`tinyllm simulate` against a live `tinyllm serve` on the same trace: throughput, p50 / p90 TTFT,
p50 TPOT and preemptions side by side, with the relative error of each.

    python scripts/sim_vs_live.py [--rates 1,3,6] [--num-requests 60] [--input-len 128] [--output-len 32]
                                  [--caches paged,slot] [--cost-profile P.json] [--serving] [--repeat 3]
                                  [--model default] [--json out.json] [--live earlier.json]

For each cache setting (paged with a tight pool that preempts; slot) one `tinyllm serve` is
started on 127.0.0.1 (a subprocess, as users start it) and warmed up with a few requests; then
for each rate a seeded Poisson trace (`simulate`'s format) is written and
- `tinyllm load --trace T --server-metrics --json L.json` sends it to the server (the client's
  TTFT, TPOT and throughput; preemptions from the server's /metrics), and
- `tinyllm simulate --trace T --stats-json S.json` runs it with the same model shape and
  settings (the same flags as the server) and the given cost profile (with ``--serving``, its
  serving section too: serve's HTTP cost a step, a request and a streamed token),
both as subprocesses, one after the other (never sharing the cores). Both report the same keys
(`output_tokens_per_s`, `ttft_s`, `tpot_s`, preemptions); the table goes to stderr, the rows (with
the load average and the host's read bandwidth before and after each live run) to `--json`.
`--repeat N` sends every trace N times, each pass through freshly started servers (a server that
had seen a trace would find its prompts in its prefix cache), the passes one after another so
that they meet the host at different moments: a row's live figures are then the medians, the
error is against them, and the live runs' range is shown beside them (a simulation cannot be
expected closer to one live run than two live runs of the same trace are to each other). The
simulation is deterministic and runs once per trace.
`--live FILE` takes the live rows of an earlier `--json` instead of starting servers (its
workload, caches and rates; the other workload flags are ignored) and simulates the same traces
with this run's profile: two profiles or two cost models compared on one live measurement.
Timed: run it under the measurement lock on a quiet machine. The bandwidth is beside the
profile's own (``read_gbps``, measured around its calibration) because a few-row step streams
the weights: where the two differ, so do the step times, whatever the cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serving_util import ServerProc  # noqa: E402

from tinyllm_cli.machine import cpu_name  # noqa: E402
from tinyllm_cli.roofline import read_bandwidth  # noqa: E402
from tinyllm_cli.sim.cost import CostModel, bandwidth_words  # noqa: E402
from tinyllm_cli.traces import generate_trace, write_trace  # noqa: E402

CACHES = {  # as scripts/sim_validate.py: a paged pool that preempts, and slots
    "paged tight": ["--cache", "paged", "--num-blocks", "48", "--block-size", "16", "--max-num-seqs", "16"],
    "slot": ["--cache", "slot", "--kv-memory", str(8 * 1024 * 46080), "--max-model-len", "1024",
             "--max-num-seqs", "16"],
}
FIGURES = (("out tok/s", "output_tokens_per_s", None), ("TTFT p50 s", "ttft_s", "p50"),
           ("TTFT p90 s", "ttft_s", "p90"), ("TPOT p50 s", "tpot_s", "p50"))


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tinyllm_cli", *args]


def run(cmd: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        raise SystemExit(f"error: {' '.join(cmd[2:5])} ... failed (exit {p.returncode}): "
                         f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")


def figures(summary: dict, preemptions) -> dict:
    out = {name: (summary[key] if sub is None else summary[key][sub]) for name, key, sub in FIGURES}
    return out | {"preemptions": preemptions, "num_failed": summary["num_failed"]}


def rate_trace(path: Path, workload: dict, rate: float) -> Path:
    """Write one rate's seeded Poisson trace (``workload``: the JSON's num_requests, input_len,
    output_len and seed) to ``path``: the live run and every replay of it simulate the same one."""
    write_trace(generate_trace(workload["num_requests"], workload["input_len"], workload["output_len"],
                               arrivals="poisson", rate=rate, seed=workload["seed"]), str(path))
    return path


def live(server: ServerProc, trace: Path, tmp: Path) -> dict:
    out = tmp / "load.json"
    run(cli("load", "--url", server.v1, "--trace", str(trace), "--server-metrics", "--json", str(out), "-q"))
    s = json.loads(out.read_text())["runs"][0]["summary"]
    return figures(s, int(s["server"]["preemptions"]))


def simulated(flags: list[str], model: str, profile: str | None, serving: bool, trace: Path, tmp: Path) -> dict:
    out = tmp / "sim.json"
    prof = (["--cost-profile", profile] if profile else []) + (["--serving"] if serving else [])
    run(cli("simulate", "--trace", str(trace), "--model", model, *flags, *prof, "--stats-json", str(out), "-q"))
    s = json.loads(out.read_text())
    return figures(s, s["preemptions"])


def errors(live_f: dict, sim_f: dict) -> dict:
    return {name: None if not live_f[name] else round(sim_f[name] / live_f[name] - 1, 4) for name, _, _ in FIGURES}


def median_runs(runs: list[dict]) -> tuple[dict, dict]:
    """The live figures of repeated runs of one trace: each figure's median, and its [min, max]."""
    keys = [name for name, _, _ in FIGURES] + ["preemptions", "num_failed"]
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    return med, {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in keys}


def table(rows: list[dict]) -> str:
    head = (["cache", "req/s"] + [f"{n} live / sim (err)" for n, _, _ in FIGURES]
            + ["preempt live / sim", "load avg before / after", "host read GB/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        spread = r.get("live_range")  # repeated live runs: their [min, max] beside the median
        span = (lambda k, f: f" [{f(spread[k][0])}-{f(spread[k][1])}]") if spread else (lambda k, f: "")
        cells = [r["cache"], f"{r['rate']:g}"]
        for name, _, _ in FIGURES:
            e = r["err"][name]
            cells.append(f"{r['live'][name]:.4g}{span(name, lambda x: f'{x:.3g}')} / {r['sim'][name]:.4g} "
                         f"({'-' if e is None else f'{e:+.0%}'})")
        cells.append(f"{r['live']['preemptions']:g}{span('preemptions', lambda x: f'{x:g}')} / {r['sim']['preemptions']}")
        cells.append(f"{min(r['load_before']):.2f} / {max(r['load_after']):.2f}")
        cells.append(f"{min(r['read_gbps']):.0f}-{max(r['read_gbps']):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rates", default="1,3,6")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--cost-profile")
    ap.add_argument("--serving", action="store_true", help="simulate --serving: charge the profile's serving section")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeat", type=int, default=1, help="live runs of each trace (fresh servers each pass); rows show their medians and range")
    ap.add_argument("--live", type=Path, help="simulate the traces of this earlier --json's live rows; start no server")
    a = ap.parse_args()
    if a.repeat < 1:
        raise SystemExit("error: --repeat must be at least 1")
    if a.live:
        return replay(a)
    rates = [float(x) for x in a.rates.split(",")]
    caches = [c.strip() for c in a.caches.split(",")]
    if unknown := [c for c in caches if c not in CACHES]:
        raise SystemExit(f"error: unknown cache setting {unknown[0]!r}; one of {', '.join(CACHES)}")
    profile_gbps = (CostModel.load(a.cost_profile).read_gbps or None) if a.cost_profile else None
    rows = []
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    workload = {"num_requests": a.num_requests, "input_len": a.input_len, "output_len": a.output_len,
                "arrivals": "poisson", "seed": a.seed}
    runs: dict[tuple[str, float], list[tuple[dict, dict]]] = {}  # (cache, rate): each pass's figures, conditions
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        traces = {rate: rate_trace(tmp / f"trace-{rate:g}.jsonl", workload, rate) for rate in rates}
        warm = tmp / "warm.jsonl"
        write_trace(generate_trace(6, a.input_len, a.output_len, seed=a.seed + 999), str(warm))
        for n in range(a.repeat):
            for cache in caches:
                with ServerProc("--model", a.model, *CACHES[cache], "-q") as server:
                    run(cli("load", "--url", server.v1, "--trace", str(warm), "-q"))  # first-call costs
                    for rate in rates:
                        before, gbps = os.getloadavg(), read_bandwidth()
                        lv = live(server, traces[rate], tmp)
                        cond = {"load_before": before[0], "load_after": os.getloadavg()[0],
                                "read_gbps": [gbps, read_bandwidth()]}
                        runs.setdefault((cache, rate), []).append((lv, cond))
                        print(f"pass {n + 1}/{a.repeat} {cache} {rate:g} req/s: live "
                              + ", ".join(f"{k} {v:.4g}" for k, v in lv.items()), file=sys.stderr, flush=True)
        for (cache, rate), passes in runs.items():
            flags = CACHES[cache]
            lv, spread = median_runs([p for p, _ in passes])
            sm = simulated(flags, a.model, a.cost_profile, a.serving, traces[rate], tmp)
            row = {"cache": cache, "rate": rate, "live": lv, "sim": sm, "err": errors(lv, sm),
                   "load_before": [c["load_before"] for _, c in passes], "load_after": [c["load_after"] for _, c in passes],
                   "read_gbps": [g for _, c in passes for g in c["read_gbps"]]}
            if a.repeat > 1:
                row |= {"live_runs": [p for p, _ in passes], "live_range": spread}
            if a.serving:  # and what the offline model alone says, to show the term's share
                off = simulated(flags, a.model, a.cost_profile, False, traces[rate], tmp)
                row |= {"sim_offline_model": off, "err_offline_model": errors(lv, off)}
            rows.append(row)
    print(table(rows), file=sys.stderr)
    if profile_gbps:
        print(f"the profile's host read bandwidth: {bandwidth_words(profile_gbps)}", file=sys.stderr)
    if a.json:
        a.json.write_text(json.dumps({
            "kind": "sim_vs_live", "cpu": cpu_name(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
            "commit": commit, "model": a.model, "cost_profile": a.cost_profile or "shipped default",
            "cost_profile_read_gbps": profile_gbps, "serving": a.serving,
            "workload": workload, "repeat": a.repeat,
            "caches": {c: CACHES[c] for c in caches}, "command": " ".join(sys.argv), "rows": rows}, indent=2) + "\n")


def replay(a) -> None:
    """``--live``: the earlier run's live rows beside this profile's simulation of their traces."""
    before = json.loads(a.live.read_text())
    w = before["workload"]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in before["rows"]:
            if "repeat" not in before:  # a file from before --repeat: one pass, the load average's three figures
                r = r | {"load_before": r["load_before"][:1], "load_after": r["load_after"][:1]}
            trace = rate_trace(tmp / "trace.jsonl", w, r["rate"])
            sm = simulated(before["caches"][r["cache"]], before["model"], a.cost_profile, a.serving, trace, tmp)
            rows.append({k: v for k, v in r.items() if k not in ("sim_offline_model", "err_offline_model")}
                        | {"sim": sm, "err": errors(r["live"], sm)})
    print(table(rows), file=sys.stderr)
    if a.json:
        a.json.write_text(json.dumps(before | {
            "cost_profile": a.cost_profile or "shipped default", "serving": a.serving,
            "cost_profile_read_gbps": (CostModel.load(a.cost_profile).read_gbps or None) if a.cost_profile else None,
            "live_from": str(a.live), "command": " ".join(sys.argv), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
