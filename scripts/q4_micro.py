"""The 4-bit matmuls of ``quant: gguf`` in process: one pass over every 4-bit layer of a GGUF
model (the default model's 30 layers: 66 MB of codes, read from memory) at several row counts,
with bfloat16 activations (``q4_linear``) and int8 activations (``q4_q8_linear``), interleaved
round by round; then its int8 output matrix the same way (``int8_linear`` against
``int8_q8_linear``, on AVX512-VNNI); medians, ratios and GFLOP/s on stderr, the CPU named.

Usage (from the repository root):
  .venv/bin/python scripts/q4_micro.py                       # default model, rows 1,4,16,32,256
  .venv/bin/python scripts/q4_micro.py --rows 1,16 --repeat 9 --model FILE.gguf

Read ratios, not absolutes: these machines are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def one_pass(layers, xs, int8: bool) -> float:
    """Seconds for one call of every layer on its input, with the activation mode set."""
    for m in layers:
        m.int8 = int8
    t = time.perf_counter()
    for m, x in zip(layers, xs):
        m(x)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a GGUF file with 4-bit layers (default: the default model)")
    p.add_argument("--rows", default="1,4,16,32,256", help="comma-separated row counts")
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds per row count (median)")
    a = p.parse_args()

    import torch
    from tinyllm_cli.model.checkpoint import load_checkpoint
    from tinyllm_cli.model.llama import build_model
    from tinyllm_cli.model.quant import Q4Linear, q4_usable

    if not q4_usable(torch.device("cpu")):
        print("tinyllm's 4-bit kernel does not run here (no kernels, or no AVX2 / AVX-512)", file=sys.stderr)
        return 1
    ck = load_checkpoint(a.model, False, "gguf")
    model = build_model(ck.config, ck.weights, torch.bfloat16, "cpu")
    layers = [m for m in model.modules() if isinstance(m, Q4Linear)]
    flops_per_row = 2 * sum(m.in_features * m.out_features for m in layers)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {len(layers)} 4-bit layers "
          f"({sum(m.packed.numel() for m in layers) / 1e6:.0f} MB packed), q4_isa "
          f"{torch.ops.tinyllm.q4_isa()!r}, q4_q8_isa {torch.ops.tinyllm.q4_q8_isa()!r}", file=sys.stderr)
    print("| rows | bf16 activations, ms (GFLOP/s) | int8 activations, ms (GFLOP/s) | ratio |", file=sys.stderr)
    print("|---|---|---|---|", file=sys.stderr)
    with torch.inference_mode():
        for rows in (int(r) for r in a.rows.split(",")):
            xs = [torch.randn(rows, m.in_features).bfloat16() for m in layers]
            one_pass(layers, xs, False), one_pass(layers, xs, True)  # warm-up: scratch buffers, threads
            times = {False: [], True: []}
            for _ in range(a.repeat):
                for int8 in (False, True):
                    times[int8].append(one_pass(layers, xs, int8))
            f, q = statistics.median(times[False]), statistics.median(times[True])
            rate = lambda s: flops_per_row * rows / s / 1e9  # noqa: E731
            print(f"| {rows} | {f * 1e3:.1f} ({rate(f):.0f}) | {q * 1e3:.1f} ({rate(q):.0f}) | {f / q:.2f}x |",
                  file=sys.stderr)
        head_table(model, a)
    return 0


def head_table(model, a) -> None:
    """The int8 output matrix (the tied embedding), bf16 activations (``int8_linear``) against int8
    ones (``int8_q8_linear``), where the latter runs (AVX512-VNNI)."""
    import torch
    from tinyllm_cli.model.quant import Int8Embedding, Int8Rows, int8_head_packs

    emb = model.embed
    if not isinstance(emb, Int8Embedding) or not int8_head_packs(tuple(emb.q.shape)):
        print("(no int8 output matrix with int8 activations here: needs AVX512-VNNI)", file=sys.stderr)
        return
    w = Int8Rows(emb.q, emb.scale.float())
    heads = {False: Int8Embedding(w), True: Int8Embedding(w, int8=True)}
    heads[False].native = True
    n, k = w.shape
    print(f"\nthe int8 output matrix ({n} x {k}, {n * k / 1e6:.0f} MB):", file=sys.stderr)
    print("| rows | bf16 activations, ms (GFLOP/s) | int8 activations, ms (GFLOP/s) | ratio |", file=sys.stderr)
    print("|---|---|---|---|", file=sys.stderr)
    with torch.inference_mode():
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            times = {False: [], True: []}
            for _ in range(a.repeat + 1):  # the first round is a warm-up
                for int8 in (False, True):
                    t = time.perf_counter()
                    heads[int8].linear(x)
                    times[int8].append(time.perf_counter() - t)
            f, q = statistics.median(times[False][1:]), statistics.median(times[True][1:])
            rate = lambda s: 2 * n * k * rows / s / 1e9  # noqa: E731
            print(f"| {rows} | {f * 1e3:.2f} ({rate(f):.0f}) | {q * 1e3:.2f} ({rate(q):.0f}) | {f / q:.2f}x |",
                  file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
