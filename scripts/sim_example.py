"""The worked example of docs/simulate.md: a capacity question answered by a `simulate` sweep,
then checked by real runs of the same trace at a few of the sweep's points.

    python scripts/sim_example.py [--check 48,128] [--json docs/sim-example-check.json]

1. ``tinyllm simulate`` on a seeded decode-heavy batch (32 requests, 32 in / 128 out mean,
   ``max_num_seqs`` 16) sweeping ``num_blocks``; writes the sweep JSON and plot and the trace
   under docs/ (the commands are printed, so the docs show exactly what ran).
2. For each ``--check`` point: the same trace through a real engine (``LLM.run``, what
   ``generate`` runs: greedy, EOS ignored, each request exactly its ``output_len``) with that
   pool, and the simulated figures for the same point, side by side.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tinyllm_cli import LLM
from tinyllm_cli.config import flat_overrides, load_config
from tinyllm_cli.machine import cpu_name
from tinyllm_cli.sim.trace import to_requests
from tinyllm_cli.traces import read_trace

DOCS = Path(__file__).resolve().parent.parent / "docs"
SWEEP = [16, 24, 32, 48, 64, 96, 128]
SETTINGS = dict(max_num_seqs=16, block_size=16)


def run_sweep() -> list[dict]:
    cmd = ["tinyllm", "simulate", "--num-prompts", "32", "--input-len", "32", "--output-len", "128",
           "--workload-seed", "1", "--max-num-seqs", "16", "--sweep", "num_blocks=" + ",".join(map(str, SWEEP)),
           "--json", str(DOCS / "sim-example-sweep.json"), "--plot", str(DOCS / "sim-example-sweep.png"),
           "--save-trace", str(DOCS / "sim-example-trace.jsonl"), "-q"]
    print("$ " + " ".join(cmd), file=sys.stderr)
    subprocess.run([sys.executable, "-m", "tinyllm_cli", *cmd[1:]], check=True)
    return json.loads((DOCS / "sim-example-sweep.json").read_text())


def real_point(num_blocks: int) -> dict:
    cfg = load_config(None, flat_overrides(SETTINGS | {"num_blocks": num_blocks}))
    items = list(read_trace(str(DOCS / "sim-example-trace.jsonl")))
    with LLM(config=cfg, progress=False) as llm:
        reqs = list(to_requests(items, llm.runtime.model_cfg.vocab_size))
        list(llm.run(reqs[:2]))  # warm-up
        llm.reconfigure(config=cfg)
        for _ in llm.run(reqs):
            pass
        return dict(llm.stats)


def row(label: str, s: dict) -> str:
    return (f"| {label} | {s['output_tokens_per_s']:.1f} | {s['ttft_s']['p50']:.3g} / {s['ttft_s']['p99']:.3g} | "
            f"{s['tpot_s']['p50']:.3g} / {s['tpot_s']['p99']:.3g} | {s['preemptions']} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", default="48,128")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = run_sweep()
    print("| num_blocks | out tok/s | TTFT p50 / p99 s | TPOT p50 / p99 s | preemptions |\n|---|---|---|---|---|")
    for r in rows:
        print(row(r["sweep"].split("=")[1], r))
    checks = []
    print(f"\nreal vs simulated ({cpu_name()}):\n\n| point | out tok/s | TTFT p50 / p99 s | TPOT p50 / p99 s | preemptions |\n|---|---|---|---|---|")
    for nb in map(int, a.check.split(",")):
        sim = next(r for r in rows if r["sweep"] == f"num_blocks={nb}")
        real = real_point(nb)
        print(row(f"{nb} blocks, real", real))
        print(row(f"{nb} blocks, simulated", sim))
        checks.append({"num_blocks": nb, "real": real, "sim": sim})
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu_name(), "checks": checks}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
