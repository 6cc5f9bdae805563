"""The machine a comparison runs on: lscpu's model name, the core generation read from the CPU's
family and model, the instruction sets that decide bfloat16 speed, and the memory available.

Results are grouped by ``cpu_class`` (core generation plus those instruction sets): figures are
comparable within a class, never across classes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def cpu_info() -> dict:
    """lscpu's model name and the CPU features that decide bf16 speed."""
    name = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), name)
    except (OSError, subprocess.SubprocessError):
        pass
    fields: dict[str, str] = {}
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = ln.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {"model_name": name, "cores": os.cpu_count(), "amx": bool({"amx_bf16", "amx_tile"} & flags),
            "avx512_bf16": "avx512_bf16" in flags, "avx512f": "avx512f" in flags,
            "family": fields.get("cpu family"), "model": fields.get("model"), "vendor": fields.get("vendor_id"),
            "uarch": uarch(fields.get("vendor_id"), fields.get("cpu family"), fields.get("model"))}


def uarch(vendor: str | None, family: str | None, model: str | None) -> str | None:
    """The core generation from family/model, for the server parts we meet (a VM's model name
    often says just "AMD EPYC"); None where unknown."""
    try:
        fam, mod = int(family or ""), int(model or "")
    except ValueError:
        return None
    if vendor == "GenuineIntel" and fam == 6:
        return {0x55: "Skylake-SP / Cascade Lake / Cooper Lake", 0x6A: "Ice Lake-SP", 0x8F: "Sapphire Rapids",
                0xCF: "Emerald Rapids", 0xAD: "Granite Rapids"}.get(mod)
    if vendor == "AuthenticAMD":
        if fam == 0x1A:
            return "Zen 5"
        if fam == 0x19:
            return "Zen 4" if 0x10 <= mod <= 0x1F or 0x60 <= mod <= 0xAF else "Zen 3"
        if fam == 0x17:
            return "Zen 2" if mod >= 0x30 else "Zen / Zen+"
    return None


def cpu_features(c: dict) -> str:
    """The instruction sets that decide bfloat16 and int8 speed, as one label."""
    feats = [f for f, on in (("AVX-512", c["avx512f"]), ("AVX512-BF16", c["avx512_bf16"]), ("AMX", c["amx"])) if on]
    return (" + ".join(feats) if feats else "no AVX-512") + ("" if c["amx"] else ", no AMX")


def cpu_class(c: dict) -> str:
    """What results are grouped by: the core generation (lscpu's model name where it is unknown)
    and the instruction sets, e.g. "Zen 4 · AVX-512 + AVX512-BF16, no AMX"; a run capped to an
    instruction set (``isa_cap``, compare --isa) is a class of its own, e.g. "Zen 5 · AVX2 + FMA
    paths on an AVX-512 + AVX512-BF16, no AMX host"."""
    if c.get("isa_cap") == "avx2":
        return f"{c.get('uarch') or c['model_name']} · AVX2 + FMA paths on an {cpu_features(c)} host"
    return f"{c.get('uarch') or c['model_name']} · {cpu_features(c)}"


def cpu_label(c: dict) -> str:
    family = f" (family {c['family']} model {c['model']}" + (f", {c['uarch']}" if c.get("uarch") else "") + ")" \
        if c.get("family") else ""
    return f"{c['model_name']}{family}, {c['cores']} cores, {cpu_features(c)}"


def mem_available() -> int | None:
    try:
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None
