"""Validate `tinyllm simulate` against real runs on this machine: three workloads (offline
prefill-heavy, offline decode-heavy, Poisson arrivals through `tinyllm serve-batch`) x two caches
(paged with a tight pool that preempts, slot); prints predicted vs measured throughput, p50 TTFT /
TPOT, preemptions, and whether the block-usage timeline is identical (offline workloads).

    python scripts/sim_validate.py [--profile FILE] [--scale 1.0] [--rounds 1] [--json out.json]

- Offline workloads: the real run is ``LLM.run`` on the trace's requests (what ``generate``
  runs), then ``Simulation`` on the same trace in this process.
- Poisson: the trace's requests are written as serve-batch input lines (token-id prompts,
  ``max_tokens`` = output_len, ``ignore_eos``) and ``tinyllm serve-batch --request-rate R --seed S
  --stats-json`` runs them in a subprocess (the real command, model load included); the simulator
  replays the same trace with ``simulate``'s ``--request-rate R --seed S`` arrivals
  (``serve_arrivals``: the times that serve-batch gives those lines).
- ``--rounds N``: each real run N times (interleaved), the median of each figure is compared.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tinyllm_cli import LLM
from tinyllm_cli.config import flat_overrides, load_config
from tinyllm_cli.machine import cpu_name
from tinyllm_cli.sim.cost import CostModel, default_profile_path
from tinyllm_cli.sim.run import Simulation
from tinyllm_cli.sim.trace import serve_arrivals, to_requests
from tinyllm_cli.traces import generate_trace

RATE, SEED = 2.0, 0
CACHES = {"paged tight": dict(cache="paged", num_blocks=48, block_size=16, max_num_seqs=16),
          "slot": dict(cache="slot", kv_memory=str(8 * 1024 * 46080), max_model_len=1024, max_num_seqs=16)}
FLAGS = {"cache": "--cache", "num_blocks": "--num-blocks", "block_size": "--block-size", "max_num_seqs": "--max-num-seqs",
         "kv_memory": "--kv-memory", "max_model_len": "--max-model-len", "max_prefill_tokens": "--max-prefill-tokens"}


def workloads(scale: float) -> dict:
    return {
        "offline prefill-heavy (384 in / 16 out)": dict(num=int(32 * scale), input_len=384, output_len=16, arrivals="offline"),
        "offline decode-heavy (32 in / 128 out)": dict(num=int(32 * scale), input_len=32, output_len=128, arrivals="offline"),
        f"Poisson {RATE:g} req/s via serve-batch (128 in / 48 out)": dict(num=int(64 * scale), input_len=128, output_len=48,
                                                                           arrivals="offline"),
    }


def figures(s: dict) -> dict:
    return {"tok_s": s["total_tokens_per_s"], "ttft_p50": s["ttft_s"]["p50"], "tpot_p50": s["tpot_s"]["p50"],
            "preemptions": s["preemptions"]}


def real_offline(llm, items) -> tuple[dict, list]:
    reqs = list(to_requests(items, llm.runtime.model_cfg.vocab_size))
    for _ in llm.run(reqs):
        pass
    return figures(llm.stats), [(r["blocks_used"], r["running"]) for r in llm.engine.stats.timeline()]


def real_serve(items, vocab: int, cfg_over: dict, work: Path) -> dict:
    inp, out, stats = work / "in.jsonl", work / "out.jsonl", work / "stats.json"
    with inp.open("w") as f:
        for r in to_requests(items, vocab):
            f.write(json.dumps({"custom_id": r.id, "url": "/v1/completions", "body": {
                "prompt": r.prompt_token_ids, "max_tokens": r.params.max_new_tokens, "ignore_eos": True,
                "temperature": 0}}) + "\n")
    cmd = [sys.executable, "-m", "tinyllm_cli", "serve-batch", "--input", str(inp), "--output", str(out),
           "--request-rate", str(RATE), "--seed", str(SEED), "--stats-json", str(stats), "-q"]
    for k, v in cfg_over.items():
        cmd += [FLAGS[k], str(v)]
    subprocess.run(cmd, check=True)
    return figures(json.loads(stats.read_text()))


def simulated(cfg, cost, items) -> tuple[dict, list]:
    sim = Simulation(cfg, cost, workers=1)
    for _ in sim.run(items):
        pass
    return figures(sim.summary()), [(r["blocks_used"], r["running"]) for r in sim.engines[0].engine.stats.timeline()]


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=str(default_profile_path()))
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    cost = CostModel.load(a.profile)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cname, c in CACHES.items():
            over = c | {"max_prefill_tokens": 2048}
            cfg = load_config(None, flat_overrides(over))
            with LLM(config=cfg, progress=False) as llm:
                vocab = llm.runtime.model_cfg.vocab_size
                list(llm.run(list(to_requests(generate_trace(4, 32, 4, seed=9), vocab))))  # warm-up
                for wname, w in workloads(a.scale).items():
                    items = list(generate_trace(seed=1, **w))
                    timed = "Poisson" in wname
                    if timed:
                        items = list(serve_arrivals(items, RATE, SEED))
                    runs, rtl = [], None
                    for _ in range(a.rounds):
                        if timed:
                            runs.append(real_serve(items, vocab, over, Path(tmp)))
                        else:
                            llm.reconfigure(config=cfg)
                            fig, rtl = real_offline(llm, items)
                            runs.append(fig)
                    real = median_of(runs)
                    sim, stl = simulated(cfg, cost, items)
                    row = {"workload": wname, "cache": cname, "real": real, "sim": sim,
                           "err": {k: (sim[k] - real[k]) / real[k] if real[k] else None for k in ("tok_s", "ttft_p50", "tpot_p50")},
                           "timeline_identical": None if timed else rtl == stl, "real_runs": runs}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    if a.json:
        import os
        import time
        commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        Path(a.json).write_text(json.dumps({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit,
                                            "load_avg_at_end": os.getloadavg(), "profile": a.profile, "profile_cpu": cost.cpu,
                                            "scale": a.scale, "rounds": a.rounds, "rows": rows}, indent=2) + "\n")
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    out = ["| workload | cache | total tok/s real / sim (err) | p50 TTFT s real / sim (err) | p50 TPOT s real / sim (err) "
           "| preemptions real / sim | block timeline identical |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        def cell(k):
            return f"{r['real'][k]:.3g} / {r['sim'][k]:.3g} ({r['err'][k]:+.0%})"
        tl = "(timed)" if r["timeline_identical"] is None else ("yes" if r["timeline_identical"] else "**no**")
        out.append(f"| {r['workload']} | {r['cache']} | {cell('tok_s')} | {cell('ttft_p50')} | {cell('tpot_p50')} | "
                   f"{r['real']['preemptions']:g} / {r['sim']['preemptions']} | {tl} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
