"""Serving-comparison results stored as data (``benchmarks/results/serving/*.json``) and the
markdown rendered from them (``python -m benchmarks.report`` puts it between docs/performance.md's
serving markers).

A result file (kind ``serving``, schema 1) holds ``recorded`` (UTC time), ``commit``, ``cpu`` (as
results.py's, with its ``cpu_class``), ``versions``, ``settings`` (the command, the workload, the
SLO, threads, KV per server, the rates asked for, the lock), ``sweeps`` (one per server run, in the
order run: its command, load averages, greedy texts and their agreement with the reference, every
rate's figures, the sustainable rate) and ``notes`` (why a server did not run).

Invariants: a file is never rewritten (a new run is a new file); ``load`` refuses a file that
breaks the schema, naming it; a ratio is only ever taken between sweeps of one file.
"""

from __future__ import annotations

import json
from datetime import timezone
from pathlib import Path

from .machine import cpu_class
from .results import RESULTS_DIR, ResultError, _parses, write_new
from .servers import SERVERS
from .sustain import SLO

SERVING_DIR = RESULTS_DIR / "serving"
SCHEMA = 1
KIND = "serving"
GOALS = {"vllm": 1.3, "llamacpp": 1.2}  # tinyllm's sustainable rate over each other server's
SERVER_NAMES = {"tinyllm": "tinyllm serve", "vllm": "vLLM CPU (OpenAI server)", "llamacpp": "llama-server"}
BEGIN = "<!-- serving: rendered by python -m benchmarks.report from benchmarks/results/serving; do not edit by hand -->"
END = "<!-- end of serving -->"


# ---- writing ---------------------------------------------------------------------------------

def comparable(text: str) -> str:
    """A greedy text as compared across servers: without U+FFFD. A token that is part of a UTF-8
    character (a random-weight model emits many) is rendered as U+FFFD by one server and held back
    or dropped by another, so the same tokens can stream as different text."""
    return text.replace("\ufffd", "")


def agreement(sweeps: list[dict]) -> None:
    """Mark each sweep with how many of its greedy texts equal the reference sweep's (the first
    tinyllm sweep, else the first; compared as ``comparable`` texts): ``agree`` is ``[equal,
    compared]``, ``agree_with`` names it
    (None on the reference itself)."""
    if not sweeps:
        return
    ref = next((s for s in sweeps if s["engine"] == "tinyllm"), sweeps[0])
    for s in sweeps:
        pairs = list(zip(ref["greedy"], s["greedy"]))
        s["agree"] = [sum(comparable(x["text"]) == comparable(y["text"]) for x, y in pairs), len(pairs)]
        s["agree_with"] = None if s is ref else ref["engine"]


def record(a, argv: list[str], now, commit: str | None, cpu: dict, versions: dict, spec, kv: dict,
           sweeps: list[dict], notes: dict) -> dict:
    agreement(sweeps)
    settings = {"command": " ".join(["python -m benchmarks.serving", *argv]),
                "workload": {"input_len": a.input_len, "output_len": a.output_len, "range_ratio": 0,
                             "duration_s": a.duration, "arrivals": "Poisson", "ignore_eos": True},
                "slo": {"percentile": 90, **SLO}, "threads": spec.threads, "max_model_len": spec.max_model_len,
                "kv": kv, "rates": a.rates, "lock": str(a.lock) if a.lock else None,
                "sustainable": "interpolated linearly in the SLO ratio between the bracketing rates"}
    return {"kind": KIND, "schema": SCHEMA, "recorded": now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit, "cpu": cpu | {"cpu_class": cpu_class(cpu)}, "versions": versions, "settings": settings,
            "sweeps": sweeps, "notes": [f"{k}: {v}" for k, v in notes.items()]}


def write(rec: dict, directory: Path = SERVING_DIR) -> Path:
    """Store a record as a new file (never over an existing one)."""
    validate(rec, "the record")
    return write_new(rec, directory)


# ---- reading ---------------------------------------------------------------------------------

def validate(data: dict, where: str) -> None:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ResultError(f"{where}: {what}")
    need(isinstance(data, dict), "not a JSON object")
    need(data.get("kind") == KIND and data.get("schema") == SCHEMA, f"not a {KIND} result of schema {SCHEMA}")
    missing = [k for k in ("recorded", "commit", "cpu", "versions", "settings", "sweeps", "notes") if k not in data]
    need(not missing, f"no {', '.join(missing)}")
    need(isinstance(data["recorded"], str) and _parses(data["recorded"]), f"recorded {data['recorded']!r}")
    need(bool(data["cpu"].get("cpu_class")) and isinstance(data["cpu"].get("cores"), int), "no cpu class or cores")
    need(isinstance(data["sweeps"], list) and bool(data["sweeps"]), "no sweeps")
    for i, s in enumerate(data["sweeps"]):
        need(s.get("engine") in SERVERS, f"sweep {i}: unknown server {s.get('engine')!r}")
        need(bool(s.get("rates")), f"sweep {i}: no rates")
        need(isinstance(s.get("sustainable"), dict) and "rate" in s["sustainable"], f"sweep {i}: no sustainable rate")
        for r in s["rates"]:
            need(r.get("rate", 0) > 0 and "valid" in r and "slo_ratio" in r, f"sweep {i}: a rate without its figures")


def load(directory: Path = SERVING_DIR) -> list[dict]:
    """Every stored serving result, oldest first."""
    out = []
    for path in sorted(directory.glob("*.json")) if directory.exists() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ResultError(f"{path.name}: not readable JSON ({e})") from None
        validate(data, path.name)
        out.append(data | {"_file": path.name})
    return sorted(out, key=lambda d: (d["recorded"], d["_file"]))


# ---- rendering -------------------------------------------------------------------------------

def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f}"


def rate_text(s: dict) -> str:
    sus = s["sustainable"]
    if sus["rate"] is None:
        return f"< {sus['between'][1]:g}"
    return (f"≥ {sus['rate']:.2f}" if sus["how"] == "at least" else f"{sus['rate']:.2f}")


def labels(sweeps: list[dict]) -> list[str]:
    """Server names, numbered where one ran more than once (1st, 2nd: the order run)."""
    counts = {e: sum(s["engine"] == e for s in sweeps) for e in SERVERS}
    seen: dict[str, int] = {}
    out = []
    for s in sweeps:
        seen[s["engine"]] = seen.get(s["engine"], 0) + 1
        name = SERVER_NAMES[s["engine"]]
        out.append(f"{name} (run {seen[s['engine']]})" if counts[s["engine"]] > 1 else name)
    return out


def tinyllm_rate(sweeps: list[dict]) -> float | None:
    """tinyllm's sustainable rate for the ratios: the lowest of its sweeps (the conservative one);
    None when a sweep has none."""
    rates = [s["sustainable"]["rate"] for s in sweeps if s["engine"] == "tinyllm"]
    return None if not rates or None in rates else min(rates)


def ratio_text(mine: float | None, s: dict) -> str:
    theirs = s["sustainable"]["rate"]
    if s["engine"] == "tinyllm" or mine is None or theirs is None:
        return "-"
    r = mine / theirs
    goal = GOALS.get(s["engine"])
    bound = "≤ " if s["sustainable"]["how"] == "at least" else ""
    verdict = "" if goal is None or bound else (" (goal met)" if r >= goal else f" (goal {goal}x missed)")
    return f"{bound}{r:.2f}x{verdict}"


def render_run(d: dict) -> str:
    sweeps, st = d["sweeps"], d["settings"]
    wl, slo = st["workload"], st["slo"]
    names, mine = labels(sweeps), tinyllm_rate(sweeps)
    head = (f"### {d['cpu']['cpu_class']}\n\nRecorded {d['recorded'].replace('T', ' ').replace('Z', ' UTC')}, "
            f"commit {d['commit'] or 'not recorded'}; CPU: {d['cpu']['cores']} cores of {d['cpu']['model_name']}. "
            f"Workload: Poisson arrivals for {wl['duration_s']:g} s per rate, {wl['input_len']} prompt tokens "
            f"(token ids) and exactly {wl['output_len']} output tokens each (`ignore_eos`), greedy. SLO: "
            f"p{slo['percentile']} TTFT ≤ {slo['ttft_s']:g} s and p{slo['percentile']} TPOT ≤ "
            f"{slo['tpot_s'] * 1000:g} ms. Sustainable rate: {st['sustainable']}.\n")
    lines = [head, "| server | sustainable req/s | between | tinyllm / it | greedy agreement | load avg before → after "
                   "| host read GB/s before → after |", "|---|---|---|---|---|---|---|"]
    for name, s in zip(names, sweeps):
        between = "-" if not s["sustainable"]["between"] else " and ".join(f"{x:g}" for x in s["sustainable"]["between"])
        agree = f"{s['agree'][0]}/{s['agree'][1]} with {s['agree_with']}" if s["agree_with"] else "reference"
        load = f"{s['loadavg_before'][0]:.2f} → {s['loadavg_after'][0]:.2f}"
        gbps = (f"{s['read_gbps_before']:.0f} → {s['read_gbps_after']:.0f}" if "read_gbps_before" in s
                else "not recorded")
        lines.append(f"| {name} | {rate_text(s)} | {between} | {ratio_text(mine, s)} | {agree} | {load} | {gbps} |")
    lines += ["", "| server | offered req/s | completed / failed | req/s | output tok/s | TTFT p50 / p90 ms | "
                  "TPOT p50 / p90 ms | SLO ratio | valid |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in zip(names, sweeps):
        for r in s["rates"]:
            ratio = "n/a" if r["slo_ratio"] is None else f"{r['slo_ratio']:.2f}"
            valid = "yes" if r["valid"] else "no: " + "; ".join(r["problems"])
            lines.append(f"| {name} | {r['rate']:g} | {r['num_completed']} / {r['num_failed']} | "
                         f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {ms(r['ttft_s']['p50'])} / "
                         f"{ms(r['ttft_s']['p90'])} | {ms(r['tpot_s']['p50'])} / {ms(r['tpot_s']['p90'])} | {ratio} | "
                         f"{valid} |")
    kv = st["kv"]
    lines += ["", f"Each server's command (threads {st['threads']}, float32 weights and KV, longest sequence "
                  f"{st['max_model_len']} tokens; the comparison: `{st['command']}`):", ""]
    for name, s in zip(names, sweeps):
        k = kv.get(s["engine"], {})
        lines.append(f"- {name}: `{s['command']}` (KV {k.get('tokens')} tokens, {k.get('bytes', 0) / 2**30:.3f} GiB: "
                     f"{k.get('how')}; answered after {s['ready_s']} s)")
    versions = ", ".join(f"{k} {v}" for k, v in d["versions"].items() if v)
    lines += ["", f"Versions: {versions}."]
    notes = list(d["notes"]) + [f"{n}: {s['error']}" for n, s in zip(names, sweeps) if s.get("error")]
    if notes:
        lines.append("Notes: " + " ".join(n.rstrip(".") + "." for n in notes))
    return "\n".join(lines) + "\n"


def render(results: list[dict]) -> str:
    """The latest serving run of each CPU class, the most recent class first."""
    latest: dict[str, dict] = {}
    for d in results:  # oldest first: a later run replaces an earlier one of its class
        latest[d["cpu"]["cpu_class"]] = d
    runs = sorted(latest.values(), key=lambda d: d["recorded"], reverse=True)
    return "\n".join(render_run(d) for d in runs) if runs else "No serving comparison is stored yet.\n"


def block(results: list[dict]) -> str:
    return f"{BEGIN}\n\n{render(results)}\n{END}"

