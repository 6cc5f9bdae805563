"""What machine this is: the CPU's name for performance tables and profiles (every table names
its CPU), with the platform's word where /proc/cpuinfo has none, an accelerator's name where a
run is on one, and the CPU's feature flags for choices that depend on them (the kernels' build
key, AMX)."""

from __future__ import annotations

import platform
from functools import lru_cache


@lru_cache(maxsize=None)
def cpu_flags_line() -> str:
    """/proc/cpuinfo's flags line (x86) or Features line (Arm); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return ""


def has_amx() -> bool:
    """Whether the CPU has AMX tiles for bfloat16 (Intel Sapphire Rapids and later), which
    oneDNN's bfloat16 matmul uses."""
    return {"amx_tile", "amx_bf16"} <= set(cpu_flags_line().split())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device) -> str:
    """What a run on ``device`` runs on, for tables and cache keys: the CPU's name, or the
    accelerator's as its backend reports it (``cuda: NVIDIA H200``)."""
    import torch  # here, not at the top: the CPU's name and flags are read without loading torch
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_name()
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return str(device)

