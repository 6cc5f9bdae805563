"""Host-side cost of prefix caching at admission: ``try_admit`` (key every full block until the
first miss, look it up) plus ``commit`` (key and register the blocks the request computes), for
N prompts of L tokens, with no model and no K/V work (a 1-layer, 4-wide cache config).

Uses only ``BlockManager``'s public methods (no K/V storage is built).

  PYTHONPATH=. .venv/bin/python scripts/bench_prefix_admission.py
  PYTHONPATH=. .venv/bin/python scripts/bench_prefix_admission.py --prompts 1000 --len 512

Workloads (seeded): distinct = no prompt shares a block with another (one lookup, L / bs
registrations each); shared = a common first 3/4, then tokens of its own (hits, then
registrations); repeat = one prompt again and again (all hits). Prints the best of --repeat
runs (thread CPU time), and the CPU.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tinyllm_cli.cache.blocks import BlockManager
from tinyllm_cli.model.llama import ModelConfig
from tinyllm_cli.machine import cpu_name

CFG = ModelConfig(vocab_size=32000, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=8)


def prompts(kind: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    rand = lambda k: [rng.randrange(32000) for _ in range(k)]  # noqa: E731
    if kind == "distinct":
        return [rand(length) for _ in range(n)]
    if kind == "shared":
        stem = rand(length * 3 // 4)
        return [stem + rand(length - len(stem)) for _ in range(n)]
    one = rand(length)
    return [list(one) for _ in range(n)]


def admit_all(reqs: list[list[int]], block_size: int) -> float:
    blocks = sum(-(-len(p) // block_size) for p in reqs) + 1
    cache = BlockManager(CFG, blocks, block_size, torch.float32, prefix_caching=True)
    # CPU time of this thread: the loop is single-threaded Python, and on a shared host wall
    # time mostly measures the neighbours.
    t0 = time.thread_time()
    for i, p in enumerate(reqs):
        cached = cache.try_admit(i, p)
        assert cached is not None
        cache.commit(i, p, len(p))  # as the scheduler does once the prompt's chunk is planned
    return time.thread_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{cpu_name()}; {args.prompts} prompts x {args.len} tokens, blocks of {args.block_size}")
    for kind in ("distinct", "shared", "repeat"):
        reqs = prompts(kind, args.prompts, args.len)
        best = min(admit_all(reqs, args.block_size) for _ in range(args.repeat))
        print(f"  {kind:9s} {best * 1e3:8.1f} ms  ({best / args.prompts * 1e6:6.1f} us per prompt)")


if __name__ == "__main__":
    main()
