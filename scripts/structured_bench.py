"""Structured-output overhead on the default model: a JSON-schema-constrained batch vs the same
prompts unconstrained, at batch 1 and 32, and grammar compile time with and without the cache.

Fair comparison: the constrained run goes first and records each output's length; the
unconstrained run then generates exactly that many tokens per request (ignore_eos), so both runs
do the same forward passes and differ only in the grammar work. Runs are interleaved A/B/C
(constrained with the mask fill overlapping the forward, constrained without overlap,
unconstrained), ``--repeat`` times; the table shows medians.

    python scripts/structured_bench.py --batch 1,32 --repeat 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tinyllm_cli import LLM, SamplingParams
from tinyllm_cli.engine import constraints
from tinyllm_cli.machine import cpu_name

# The first four of the schemas tests/test_structured.py checks outputs against (the same file).
SCHEMAS = [json.loads(line) for line in
           (Path(__file__).resolve().parent.parent / "tests" / "data" / "schemas.jsonl").read_text().splitlines()][:4]


def run(llm: LLM, prompts, params, overlap: bool = True) -> tuple[dict, list]:
    llm.engine.runner.overlap_masks = overlap
    outs = llm.generate(prompts, params, use_tqdm=False)
    return dict(llm.stats), outs


def compile_times(llm: LLM, reps: int) -> dict:
    tok = llm.tokenizer
    vocab = llm.runtime.model_cfg.vocab_size
    t0 = time.perf_counter()
    c = constraints.Compiler(tok, vocab, tok.eos_ids)  # a fresh one: nothing cached
    info_s = time.perf_counter() - t0
    cold, warm = [], []
    for _ in range(reps):
        for s in SCHEMAS:
            key = SamplingParams(json_schema=s).constraint
            c.cache.clear()
            t = time.perf_counter()
            c.get(key)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.get(key)
            warm.append(time.perf_counter() - t)
    return {"tokenizer_info_s": round(info_s, 4), "compile_ms_median": round(statistics.median(cold) * 1e3, 3),
            "cached_ms_median": round(statistics.median(warm) * 1e3, 4), "schemas": len(SCHEMAS), "reps": reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts-at-batch-1", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    with LLM(progress=False, max_num_seqs=32, kv_memory="256MiB") as llm:
        comp = compile_times(llm, a.repeat)
        print(f"compile: {comp}", flush=True)
        for b in [int(x) for x in a.batch.split(",")]:
            n = a.prompts_at_batch_1 if b == 1 else b
            llm.reconfigure(max_num_seqs=b)
            prompts = [f"Describe record {i} as a JSON object." for i in range(n)]
            cons = [SamplingParams(max_new_tokens=a.max_new_tokens, json_schema=SCHEMAS[i % len(SCHEMAS)])
                    for i in range(n)]
            run(llm, prompts[:2], cons[:2])  # warm-up (compiles; first-call costs)
            res: dict[str, list] = {"constrained": [], "constrained_no_overlap": [], "unconstrained": []}
            for r in range(a.repeat):
                st, outs = run(llm, prompts, cons, overlap=True)
                res["constrained"].append(st)
                lens = [len(o.token_ids) for o in outs]
                plain = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in lens]
                res["constrained_no_overlap"].append(run(llm, prompts, cons, overlap=False)[0])
                res["unconstrained"].append(run(llm, prompts, plain)[0])
                print(f"batch {b} rep {r}: " + ", ".join(
                    f"{k} {v[-1]['output_tokens_per_s']:.1f} tok/s" for k, v in res.items()), flush=True)
            med = {k: statistics.median(x["output_tokens_per_s"] for x in v) for k, v in res.items()}
            grammar = statistics.median(x["grammar_s"] / x["elapsed_s"] for x in res["constrained"])
            wait = statistics.median(x["grammar_wait_s"] / x["elapsed_s"] for x in res["constrained"])
            row = {"batch": b, "requests": n, "output_tokens": res["constrained"][0]["output_tokens"],
                   **{f"{k}_tok_s": round(v, 2) for k, v in med.items()},
                   "slowdown": round(1 - med["constrained"] / med["unconstrained"], 4),
                   "slowdown_no_overlap": round(1 - med["constrained_no_overlap"] / med["unconstrained"], 4),
                   "grammar_frac_of_wall": round(grammar, 4), "grammar_wait_frac_of_wall": round(wait, 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"cpu": cpu_name(), "compile": comp, "rows": rows, "repeat": a.repeat}
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
