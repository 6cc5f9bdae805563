"""Validate `tinyllm simulate` against real runs on this machine: three workloads (offline
prefill-heavy, offline decode-heavy, Poisson arrivals) x two caches (paged with a tight pool that
preempts, slot); prints predicted vs measured throughput, p50 TTFT / TPOT, preemptions, and
whether the block-usage timeline is identical (offline workloads).

    python scripts/sim_validate.py [--profile FILE] [--scale 1.0] [--json out.json]

The Poisson workload is fed to the real engine with the trace's arrival times (wall clock), as
serve-batch feeds a rate-limited stream.
"""

import argparse
import json
import time

from tinyllm_cli import LLM
from tinyllm_cli.config import flat_overrides, load_config
from tinyllm_cli.sim.cost import CostModel, default_profile_path
from tinyllm_cli.sim.run import Simulation
from tinyllm_cli.sim.trace import generate_trace, to_requests

ap = argparse.ArgumentParser()
ap.add_argument("--profile", default=str(default_profile_path()))
ap.add_argument("--scale", type=float, default=1.0)
ap.add_argument("--json")
a = ap.parse_args()
cost = CostModel.load(a.profile)
S = a.scale
WORKLOADS = {
    "offline prefill-heavy": dict(num=int(32 * S), input_len=384, output_len=16, arrivals="offline"),
    "offline decode-heavy": dict(num=int(32 * S), input_len=32, output_len=128, arrivals="offline"),
    "poisson 2 req/s": dict(num=int(32 * S), input_len=128, output_len=48, arrivals="poisson", rate=2.0),
}
CACHES = {"paged tight": dict(cache="paged", num_blocks=48, block_size=16, max_num_seqs=16),
          "slot": dict(cache="slot", kv_memory=str(8 * 1024 * 46080), max_model_len=1024, max_num_seqs=16)}


def real_run(llm, items):
    reqs = list(to_requests(items, llm.runtime.model_cfg.vocab_size))
    eng = llm.engine
    eng.reset_stats()
    timed = reqs[0].arrival_s is not None
    if not timed:
        list(eng.run(reqs))
    else:
        t0 = eng.stats.start
        i = 0
        while i < len(reqs) or eng.has_unfinished():
            now = time.perf_counter() - t0
            while i < len(reqs) and reqs[i].arrival_s <= now:
                r = reqs[i]
                eng.add_request(r)
                # the engine stamps arrival at add time; the trace's arrival is what a client saw
                i += 1
            if eng.has_unfinished():
                eng.step()
            elif i < len(reqs):
                time.sleep(max(0.0, reqs[i].arrival_s - (time.perf_counter() - t0)))
        eng.stats.end = time.perf_counter()
    return eng.stats.summary(), [(r["blocks_used"], r["running"]) for r in eng.stats.timeline()]


rows = []
for cname, c in CACHES.items():
    cfg = load_config(None, flat_overrides(c | {"max_prefill_tokens": 2048}))
    with LLM(config=cfg, progress=False) as llm:
        list(llm.run(list(to_requests(generate_trace(4, 32, 4, seed=9), 49152))))  # warm-up
        for wname, w in WORKLOADS.items():
            items = list(generate_trace(seed=1, **w))
            real, rtl = real_run(llm, items)
            sim = Simulation(llm.config, cost, workers=1)
            list(sim.run(items))
            s = sim.summary()
            stl = [(r["blocks_used"], r["running"]) for r in sim.engines[0].stats.timeline()]

            def err(k, sub=None):
                m = real[k] if sub is None else real[k][sub]
                p = s[k] if sub is None else s[k][sub]
                return m, p, (p - m) / m if m else None
            row = {"workload": wname, "cache": cname,
                   "tok_s": err("total_tokens_per_s"), "ttft_p50": err("ttft_s", "p50"), "tpot_p50": err("tpot_s", "p50"),
                   "preemptions": (real["preemptions"], s["preemptions"]),
                   "timeline_identical": rtl == stl if w["arrivals"] == "offline" else None}
            rows.append(row)
            print(json.dumps(row))
if a.json:
    open(a.json, "w").write(json.dumps({"cpu": cost.cpu, "profile": a.profile, "rows": rows}, indent=2))
print("\n| workload | cache | total tok/s real / sim (err) | p50 TTFT s real / sim (err) | p50 TPOT s real / sim (err) | preemptions real / sim | block timeline identical |")
print("|---|---|---|---|---|---|---|")
f = lambda t: f"{t[0]:.3g} / {t[1]:.3g} ({t[2]:+.0%})" if t[2] is not None else f"{t[0]} / {t[1]}"
for r in rows:
    print(f"| {r['workload']} | {r['cache']} | {f(r['tok_s'])} | {f(r['ttft_p50'])} | {f(r['tpot_p50'])} | "
          f"{r['preemptions'][0]} / {r['preemptions'][1]} | {'-' if r['timeline_identical'] is None else r['timeline_identical']} |")
