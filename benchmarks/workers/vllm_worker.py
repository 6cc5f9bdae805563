"""vLLM side of ``python -m benchmarks.compare``; runs under the vLLM venv's Python, never imports tinyllm.

Two modes:
- ``serve``: build one ``vllm.LLM`` and answer requests read as JSON lines on stdin, so every
  timed run finds vLLM warm (compiled, KV cache allocated). Each request is
  ``{"prompts": [[ids...], ...], "max_tokens": N}``; each answer is one stdout line
  ``@@RESULT {"elapsed_s": ..., "token_ids": [[...], ...]}``. vLLM logs to stdout too, so the
  marker is what the caller reads; every other line is log. The ready line carries
  ``isa_facts``: which build of vLLM's compiled ops its processes mapped (``compare --isa``).
- ``oneshot``: the end-to-end job: build the engine, generate once, write the token ids and
  its own phase times (import, engine init, generate, and the wall-clock time generate
  started) to a JSON file, exit. The caller times the whole process (cold start included).

Prompts are token ids (``skip_tokenizer_init=True``): no tokenizer is loaded and every engine
sees the same ids. Greedy (temperature 0), ``ignore_eos``, exactly ``max_tokens`` new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MARKER = "@@RESULT "


def build_llm(args):
    from vllm import LLM
    # Prefix caching off, as for every engine here: each round repeats the same prompts, and a
    # prompt longer than a block (the long workload's 2000 ids) would otherwise be served from the
    # round before's blocks (4.5x "faster" from the second round on).
    return LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, block_size=args.block_size,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=0,
               max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)


def generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux /proc; just ``pid`` elsewhere)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def isa_facts() -> dict:
    """Which of the wheel's builds of vLLM's compiled ops (``_C``, ``_C_AVX512``, ``_C_AVX2``) the
    worker's processes (vLLM's engine core is a child) have mapped, and what torch detects."""
    import torch
    libs = set()
    for pid in process_tree(os.getpid()):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        libs |= {Path(line.split()[-1]).name for line in maps.splitlines() if "/vllm/_C" in line}
    return {"vllm_c_libs": sorted(libs), "torch_avx512_probe": torch.cpu._is_avx512_supported(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def serve(args) -> None:
    llm = build_llm(args)
    generate(llm, [[5, 6, 7, 8]] * 2, 4)  # first-call costs stay out of every timed run
    print(MARKER + json.dumps({"ready": True, "isa_facts": isa_facts()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        elapsed, ids = generate(llm, req["prompts"], req["max_tokens"])
        print(MARKER + json.dumps({"elapsed_s": elapsed, "token_ids": ids}), flush=True)


def oneshot(args) -> None:
    """Times its own phases too (from its first line of Python), so start-up can be split."""
    t0 = time.perf_counter()
    with open(args.prompts) as fh:
        prompts = json.load(fh)
    import vllm  # noqa: F401  (timed on its own: the import is a large part of the cold start)
    t1 = time.perf_counter()
    llm = build_llm(args)
    t2, started = time.perf_counter(), time.time()
    gen_s, ids = generate(llm, prompts, args.max_tokens)
    with open(args.output, "w") as fh:
        json.dump({"token_ids": ids, "import_s": t1 - t0, "init_s": t2 - t1, "generate_s": gen_s,
                   "generate_started": started}, fh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("serve", "oneshot"))
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--prompts", help="oneshot: JSON file with a list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output", help="oneshot: where the generated ids go (JSON)")
    args = p.parse_args()
    serve(args) if args.mode == "serve" else oneshot(args)


if __name__ == "__main__":
    main()
