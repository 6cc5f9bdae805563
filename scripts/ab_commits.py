"""Interleaved A/B of ``tinyllm bench`` between two checkouts: the W1 and W2 workloads (as
docs/performance.md defines them), in float32 and bfloat16 weights, before vs after.

    python scripts/ab_commits.py ../wt-before . --rounds 4 --json ab.json

Each run is its own process, ``python -m tinyllm_cli bench`` with ``PYTHONPATH`` set to the
checkout, so each side runs its own code (and its own kernels build). Round r runs every
(workload, dtype) pair on both sides back to back, before first in even rounds and after first
in odd ones, so drift on a shared host lands on both sides alike. The table on stdout shows each
side's median total tok/s over the rounds, the after/before ratio of the medians, and the
spread of the per-round ratios; the load average is read before every run and recorded.

Invariants:
- Both sides get the same command line, settings and seeded prompt ids: only the tree differs.
- With ``--lock FILE`` (e.g. /work/notes/measure.lock) each pair of runs (one before, one after)
  holds an exclusive ``flock`` on FILE, released between pairs so that others can measure too.
- Results (the table) go to stdout; progress and each run's figure go to stderr. A checkout that
  is not there, or a bench run that fails, is one sentence on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# docs/performance.md, "How to measure" and "Rows": W1 = 16 prompts of 64-127 ids, 32 new;
# W2 = 32 prompts of 32-63 ids, 64 new; KV memory 1 GiB.
WORKLOADS = {
    "W1": ["--num-prompts", "16", "--input-len", "96", "--output-len", "32", "--range-ratio", "0.333",
           "--max-model-len", "256"],
    "W2": ["--num-prompts", "32", "--input-len", "48", "--output-len", "64", "--range-ratio", "0.333"],
}
COMMON = ["--kv-memory", "1GiB", "--no-roofline", "--quiet", "--repeat", "1"]
METRIC = "total_tokens_per_s"


class RunFailed(Exception):
    pass


def bench_cmd(python: str, workload: str, dtype: str, cache: str, out: Path) -> list[str]:
    return [python, "-m", "tinyllm_cli", "bench", *WORKLOADS[workload], *COMMON, "--cache", cache,
            "--dtype", dtype, "--json", str(out)]


def run_side(tree: Path, python: str, workload: str, dtype: str, cache: str) -> dict:
    """One bench process in ``tree``: its first row's figures and the load average before it."""
    with tempfile.TemporaryDirectory(prefix="ab_commits_") as tmp:
        out = Path(tmp) / "rows.json"
        env = os.environ | {"PYTHONPATH": str(tree)}
        load = os.getloadavg()[0]
        proc = subprocess.run(bench_cmd(python, workload, dtype, cache, out), cwd=tree, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RunFailed(f"bench in {tree} ({workload}, {dtype}) exited {proc.returncode}: {last}")
        row = json.loads(out.read_text())[0]
    return {"tok_s": row[METRIC], "output_tok_s": row.get("output_tokens_per_s"), "elapsed_s": row["elapsed_s"],
            "load1": round(load, 2)}


@contextlib.contextmanager
def held(lock: Path | None):
    """An exclusive flock on ``lock`` (waits for it), or nothing when no lock is given."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def rounds(sides: dict[str, Path], args) -> list[dict]:
    """Every run, in the order it ran: round, workload, dtype, side and its figures."""
    runs = []
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for workload in args.workloads:
            for dtype in args.dtypes:
                with held(args.lock):
                    for side in order:
                        got = run_side(sides[side], args.python, workload, dtype, args.cache)
                        runs.append({"round": r, "workload": workload, "dtype": dtype, "side": side} | got)
                        print(f"ab_commits: round {r} {workload} {dtype} {side}: {got['tok_s']:.1f} tok/s "
                              f"(load {got['load1']})", file=sys.stderr, flush=True)
    return runs


def summary(runs: list[dict], workloads: list[str], dtypes: list[str]) -> list[dict]:
    rows = []
    for w in workloads:
        for d in dtypes:
            mine = [x for x in runs if (x["workload"], x["dtype"]) == (w, d)]
            by = {s: [x["tok_s"] for x in mine if x["side"] == s] for s in ("before", "after")}
            per_round = [a["tok_s"] / b["tok_s"] for a in mine if a["side"] == "after"
                         for b in mine if b["side"] == "before" and b["round"] == a["round"]]
            med = {s: statistics.median(v) for s, v in by.items()}
            rows.append({"workload": w, "dtype": d, "before_median": round(med["before"], 1),
                         "after_median": round(med["after"], 1), "ratio": round(med["after"] / med["before"], 3),
                         "round_ratio_min": round(min(per_round), 3), "round_ratio_max": round(max(per_round), 3),
                         "rounds": len(per_round), "before_runs": by["before"], "after_runs": by["after"]})
    return rows


def table(rows: list[dict], runs: list[dict]) -> str:
    loads = [x["load1"] for x in runs]
    out = [f"| workload | dtype | before tok/s | after tok/s | after/before | per-round ratios | rounds |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['workload']} | {r['dtype']} | {r['before_median']} | {r['after_median']} | {r['ratio']:.3f} | "
            f"{r['round_ratio_min']:.3f}-{r['round_ratio_max']:.3f} | {r['rounds']} |" for r in rows]
    out.append(f"\ntotal tok/s (prompt + output) / wall, medians over rounds; load average (1 min) before "
               f"each run: {min(loads):.2f}-{max(loads):.2f}, median {statistics.median(loads):.2f}")
    return "\n".join(out)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path, help="the older checkout")
    ap.add_argument("after", type=Path, help="the newer checkout")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (each runs every pair on both sides)")
    ap.add_argument("--workloads", default="W1,W2", help="comma list of W1, W2")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list of weight dtypes")
    ap.add_argument("--cache", default="paged", help="the cache kind (or bench's comma list)")
    ap.add_argument("--lock", type=Path, help="flock this file around each pair of runs")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs bench")
    ap.add_argument("--json", type=Path, help="write every run and the summary here")
    args = ap.parse_args()
    args.workloads = args.workloads.split(",")
    args.dtypes = args.dtypes.split(",")
    bad = [w for w in args.workloads if w not in WORKLOADS]
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    missing = [str(p) for p in sides.values() if not (p / "tinyllm_cli" / "__init__.py").is_file()]
    if bad or missing or args.rounds < 1:
        why = (f"unknown workload {bad[0]!r} (W1 or W2)" if bad else f"{missing[0]} is not a tinyllm checkout"
               if missing else "--rounds must be at least 1")
        print(f"ab_commits: {why}", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    commits = {s: commit(p) for s, p in sides.items()}  # before the run: a commit made meanwhile is not measured
    try:
        runs = rounds(sides, args)
    except RunFailed as e:
        print(f"ab_commits: {e}", file=sys.stderr)
        return 1
    rows = summary(runs, args.workloads, args.dtypes)
    print(f"{cpu_model()}; before {commits['before']}, after {commits['after']}; {started}; "
          f"{args.cache} cache\n")
    print(table(rows, runs))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "started": started, "cache": args.cache,
                                         "commits": commits,
                                         "summary": rows, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
