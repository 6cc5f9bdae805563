"""Interleaved A/B of tinyllm's CPU kernels: one loaded model, the same seeded workload through
three paths, round robin in one process, medians and ratios, the CPU named (stderr table).

  pytorch    cache.attention 'gather' and PyTorch ops for norm / RoPE / SwiGLU (the path every
             other device runs, and what TINYLLM_KERNELS=0 gives)
  attention  the paged-attention kernel, PyTorch dense ops
  kernels    everything: one decoder_stack call per step (the default on CPU)

Usage (from the repository root):
  .venv/bin/python scripts/kernels_ab.py                                  # default model, W1/W2, fp32 + bf16
  .venv/bin/python scripts/kernels_ab.py --workloads single --config configs/fast.yaml
  .venv/bin/python scripts/kernels_ab.py --model DIR --dtypes bfloat16 --repeat 5 --json ab.json

W1 = 16 prompts of 64-127 random ids -> 32 new; W2 = 32 of 32-63 -> 64 new (`tinyllm bench`'s
seeded prompts; total tok/s); single = one prompt, 128 new tokens (decode tok/s = 1 / TPOT).
Greedy, EOS ignored. Read ratios, not absolutes: these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORKLOADS = {"W1": (16, 96, 0.333, 32), "W2": (32, 48, 0.333, 64), "single": (1, 37, 0.0, 128)}
PATHS = {"pytorch": ("gather", "torch"), "attention": ("kernel", "torch"), "kernels": ("kernel", "fused")}


def set_path(model, dense: str) -> None:
    from tinyllm_cli.model.llama import use_native_ops
    use_native_ops(model, dense == "fused")


def run(llm, prompts, new_tokens, attention: str, dense: str) -> dict:
    """One run on a fresh engine (new pool) with this attention path and dense path."""
    from tinyllm_cli import SamplingParams
    set_path(llm.runtime.model, dense)
    llm.reconfigure(attention=attention)
    llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    s = llm.stats
    tpot = s["tpot_s"]["p50"] if isinstance(s.get("tpot_s"), dict) else None
    return {"total_tok_s": s["total_tokens_per_s"], "decode_tok_s": 1 / tpot if tpot else None,
            "elapsed_s": s["elapsed_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the config's model, else the default model")
    p.add_argument("--config", type=Path, default=None, help="tinyllm config (model and dtype flags win)")
    p.add_argument("--dtypes", default=None, help="comma list (default: the config's dtype, else float32,bfloat16)")
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from benchmarks.machine import cpu_info, cpu_label  # the same CPU facts as the engine comparison
    from tinyllm_cli import kernels
    from tinyllm_cli import LLM
    from tinyllm_cli.workload import random_prompts

    if not kernels.load():
        print(f"the kernels did not build ({kernels.load_error()}); nothing to compare", file=sys.stderr)
        return 1
    cpu = cpu_label(cpu_info())
    rows, runs = [], []
    dtypes = a.dtypes.split(",") if a.dtypes else ["config"] if a.config else ["float32", "bfloat16"]
    for dtype in dtypes:
        over = {"device": "cpu"} | ({"model": a.model} if a.model else {}) | ({} if dtype == "config" else {"dtype": dtype})
        llm = LLM(config=a.config, progress=False, **over)
        rt = llm.runtime
        for w in a.workloads.split(","):
            n, length, ratio, new = WORKLOADS[w]
            prompts = random_prompts(rt.model_cfg, n, length, ratio, 0)
            run(llm, prompts[:2], 4, "kernel", "fused")  # first-call costs stay out
            got: dict[str, list[float]] = {name: [] for name in PATHS}
            for r in range(a.repeat):
                for name, (attention, dense) in PATHS.items():
                    res = run(llm, prompts, new, attention, dense)
                    value = res["decode_tok_s"] if w == "single" else res["total_tok_s"]
                    got[name].append(value)
                    runs.append({"workload": w, "dtype": str(rt.dtype).removeprefix("torch."), "path": name,
                                 "round": r} | res)
                    print(f"[ab] {w} {dtype} round {r + 1}/{a.repeat}: {name} {value:.1f}", file=sys.stderr)
            med = {k: statistics.median(v) for k, v in got.items()}
            rows.append((w, str(rt.dtype).removeprefix("torch."), rt.quant, med))
        set_path(rt.model, "fused")
        llm.close()
    t = Table(title=f"tinyllm's CPU kernels, interleaved A/B · {cpu} · median of {a.repeat}")
    for col in ("workload", "dtype", "unit", *PATHS, "attention / pytorch", "kernels / pytorch"):
        t.add_column(col)
    for w, dtype, quant, med in rows:
        unit = "decode tok/s" if w == "single" else "total tok/s"
        t.add_row(w, dtype + (" + int4" if quant != "none" else ""), unit, *(f"{med[k]:.1f}" for k in PATHS),
                  f"{med['attention'] / med['pytorch']:.2f}x", f"{med['kernels'] / med['pytorch']:.2f}x")
    Console(stderr=True, width=160).print(t)
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu, "runs": runs, "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
