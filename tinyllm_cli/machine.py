"""What machine this is: the CPU's name for performance tables and profiles (every table names
its CPU), with the platform's word where /proc/cpuinfo has none, an accelerator's name where a
run is on one, and the CPU's feature flags for choices that depend on them (the kernels' build
key, AMX), how much memory a load or a KV pool can still take (the checkpoint loader in
``model/`` and the pool in ``cache/`` both ask here), and which optional modules (the extras)
are installed. Imports nothing of the package, and torch
only inside the functions that need it.

Invariants:
- ``host_available_memory`` never raises: None where the platform cannot say.
- ``available_memory(device)`` is the GPU's free memory on CUDA, else the host's, and unbounded
  (``1 << 62``) where the host cannot say, so an unknown figure never refuses a pool."""

from __future__ import annotations

import os
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


def installed(module: str) -> bool:
    """Whether ``module`` (a top-level name) is installed, found without importing it: an extra's
    check runs before any model loads, and some extras act on import (Ray reads its environment)."""
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec, a broken parent
        return False


# ---- memory ---------------------------------------------------------------------------------

def host_available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes this process can still allocate without swapping, or None where unknown. Linux's
    MemAvailable counts reclaimable page cache (the checkpoint file's own pages among it);
    ``SC_AVPHYS_PAGES`` elsewhere counts free pages only, so it errs on the low side."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB and means KiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform (macOS, Windows)
        return None
    return pages * size if pages > 0 and size > 0 else None


def available_memory(device: torch.device) -> int:
    """Bytes a pool on ``device`` can take: the GPU's free memory, or the host's
    (``host_available_memory``; unbounded where the platform cannot say)."""
    if device.type == "cuda":
        import torch
        return torch.cuda.mem_get_info(device)[0]
    host = host_available_memory()
    return 1 << 62 if host is None else host
