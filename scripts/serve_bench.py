"""What ``tinyllm serve`` costs over the engine itself, on the same requests and settings.

    python scripts/serve_bench.py [--rounds 3] [--model default] [--json out.json]

Interleaved rounds (the host's noise hits both sides alike); medians and ratios:
- saturation: W2-shaped prompts (32 of 32-64 random ids, 64 new tokens, EOS ignored) all sent
  at once over HTTP (``/v1/completions``, token-id prompts) against ``LLM.generate`` of the same
  requests in this process; total tok/s each.
- low load: one request at a time (a 48-id prompt, 32 new tokens): time to first token through
  HTTP (first streamed chunk, seen by the client) against the engine's own TTFT in this process;
  end-to-end streamed against whole.
- overhead: HTTP/JSON cost per request (a 1-token request over HTTP minus in process) and per
  streamed chunk ((streamed - whole) / chunks).
The server runs as a subprocess (as users start it); this process runs the in-process engine
only while the server is idle, so the two never share the cores at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serving_util import ServerProc  # noqa: E402

from tinyllm_cli import LLM, SamplingParams  # noqa: E402
from tinyllm_cli.workload import random_prompts  # noqa: E402


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), platform.processor())


async def http_batch(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=len(prompts))) as c:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[c.post(url, json={"prompt": p, "max_tokens": max_tokens, "ignore_eos": True})
                                    for p in prompts])
        wall = time.perf_counter() - t0
    toks = sum(r.json()["usage"]["total_tokens"] for r in rs)
    return wall, toks


def http_one(url: str, prompt: list[int], max_tokens: int, stream: bool) -> tuple[float, float, int]:
    """(ttft, e2e, chunks) of one request seen by the client."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    t0 = time.perf_counter()
    ttft, chunks = None, 0
    with httpx.stream("POST", url, json=body, timeout=3600) as r:
        if not stream:
            r.read()
        else:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    ttft = ttft or time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    return (ttft or e2e), e2e, chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    settings = dict(max_num_seqs=32, seed=0)
    llm = LLM(a.model, progress=False, **settings)
    sat_prompts = random_prompts(llm.runtime.model_cfg, 32, 48, 0.33, seed=1)
    one_prompt = random_prompts(llm.runtime.model_cfg, 1, 48, 0.0, seed=2)[0]
    sat_params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    rows = {k: [] for k in ("engine_tok_s", "serve_tok_s", "engine_ttft", "http_ttft", "whole_e2e", "stream_e2e",
                            "engine_1tok_e2e", "http_1tok_e2e", "chunks")}
    with ServerProc("--model", a.model, "--max-num-seqs", settings["max_num_seqs"], "--seed", 0, "-q") as s:
        url = s.v1 + "/completions"
        http_one(url, one_prompt, 4, True)  # warm both
        llm.generate([one_prompt], SamplingParams(max_new_tokens=4), use_tqdm=False)
        for r in range(a.rounds):
            print(f"round {r + 1}/{a.rounds}", file=sys.stderr)
            t0 = time.perf_counter()
            outs = llm.generate(sat_prompts, sat_params, use_tqdm=False)
            wall = time.perf_counter() - t0
            rows["engine_tok_s"].append(sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs) / wall)
            wall, toks = asyncio.run(http_batch(url, sat_prompts, 64))
            rows["serve_tok_s"].append(toks / wall)
            for _ in range(3):
                o = llm.generate([one_prompt], SamplingParams(max_new_tokens=32, ignore_eos=True), use_tqdm=False)[0]
                rows["engine_ttft"].append(o.ttft_s)
                ttft, e2e, chunks = http_one(url, one_prompt, 32, True)
                rows["http_ttft"].append(ttft)
                rows["stream_e2e"].append(e2e)
                rows["chunks"].append(chunks)
                rows["whole_e2e"].append(http_one(url, one_prompt, 32, False)[1])
                t1 = time.perf_counter()
                llm.generate([one_prompt], SamplingParams(max_new_tokens=1), use_tqdm=False)
                rows["engine_1tok_e2e"].append(time.perf_counter() - t1)
                rows["http_1tok_e2e"].append(http_one(url, one_prompt, 1, False)[1])
    llm.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    res = {
        "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "rounds": a.rounds, "model": a.model,
        "saturation_engine_tok_s": round(med["engine_tok_s"], 1), "saturation_serve_tok_s": round(med["serve_tok_s"], 1),
        "saturation_ratio": round(med["serve_tok_s"] / med["engine_tok_s"], 3),
        "engine_ttft_ms": round(med["engine_ttft"] * 1e3, 2), "http_ttft_ms": round(med["http_ttft"] * 1e3, 2),
        "ttft_gap_ms": round((med["http_ttft"] - med["engine_ttft"]) * 1e3, 2),
        "whole_e2e_ms": round(med["whole_e2e"] * 1e3, 2), "stream_e2e_ms": round(med["stream_e2e"] * 1e3, 2),
        "stream_over_whole": round(med["stream_e2e"] / med["whole_e2e"], 4),
        "http_overhead_us_per_request": round((med["http_1tok_e2e"] - med["engine_1tok_e2e"]) * 1e6, 1),
        "stream_overhead_us_per_chunk": round((med["stream_e2e"] - med["whole_e2e"]) / med["chunks"] * 1e6, 1),
        "raw": rows,
    }
    print(json.dumps({k: v for k, v in res.items() if k != "raw"}, indent=2))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
