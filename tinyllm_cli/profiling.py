"""Where a run's time goes: one engine run under ``torch.profiler``, its operators summed into a
few categories (``bench --torch-profile``).

Invariants:
- Categories partition the profiled wall time: each operator's *self* time lands in exactly one
  category, and "outside any operator" is the wall time no operator accounts for (Python:
  scheduling, bookkeeping, dispatch). Shares therefore add up to 100%.
- The profiled run is an extra run, never one of the timed rows: the profiler slows every
  operator down a little, so read shares, not absolute times.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

# First match wins; matched against the operator name, e.g. "mkldnn::_linear_pointwise".
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("weight matmuls", ("linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "pack_mm")),
    ("attention kernels", ("scaled_dot_product", "flash_attention", "softmax", "paged_attention")),
    ("KV cache write / gather", ("index_copy", "index_select", "index_put", "write_kv")),
    ("sampling", ("argmax", "topk", "sort", "multinomial", "cumsum", "exponential")),
]
OTHER = "other tensor ops (norms, RoPE, SiLU, adds, copies; tinyllm's fused kernels)"
OUTSIDE = "outside any operator (Python: schedule, bookkeeping, dispatch)"


def category(op_name: str) -> str:
    for label, needles in CATEGORIES:
        if any(n in op_name for n in needles):
            return label
    return OTHER


def profile_run(run: Callable[[], object], device: torch.device) -> dict:
    """Run ``run()`` once under the profiler; seconds and share of wall time per category."""
    activities = [ProfilerActivity.CPU]
    cuda = device.type == "cuda"
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    seconds: dict[str, float] = {label: 0.0 for label, _ in CATEGORIES} | {OTHER: 0.0}
    for e in prof.key_averages():
        self_us = e.self_device_time_total if cuda else e.self_cpu_time_total
        seconds[category(e.key)] += self_us / 1e6
    # On CUDA, kernels overlap the host, so the remainder is host time not hidden behind kernels.
    seconds[OUTSIDE] = max(wall - sum(seconds.values()), 0.0)
    return {"wall_s": round(wall, 4),
            "categories": {k: {"s": round(v, 4), "share": round(v / wall, 4)} for k, v in seconds.items()}}
