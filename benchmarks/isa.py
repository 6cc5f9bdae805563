"""Capping every engine of a comparison to one instruction set (``--isa``): the AVX2 + FMA paths
that AVX2-only CPUs take, measured on an AVX-512 host.

``native`` changes nothing. ``avx2`` gives each engine what caps it, and each cap is recorded
with the result (``settings.isa``) together with how it was obtained and what was verified:

- tinyllm (and transformers, the agreement reference, in the same process): its kernels built
  with ``TINYLLM_KERNELS_MARCH=haswell``; torch's ATen kernels capped with
  ``ATEN_CPU_CAPABILITY=avx2``, its oneDNN with ``ONEDNN_MAX_CPU_ISA=AVX2`` and its MKL with
  ``MKL_ENABLE_INSTRUCTIONS=AVX2``. They are read when torch loads, so compare re-executes itself
  with them (``reexec_env``); verified in the process that runs tinyllm: ``kernels.panel_isa()
  == 'avx2'`` and torch's CPU capability AVX2, and by workers/torch_isa_probe.py in the same
  environment: the ISA oneDNN reports (MKL names no ISA on an AMD CPU: its line is recorded).
- OpenVINO GenAI: ``ONEDNN_MAX_CPU_ISA=AVX2`` caps the oneDNN fork inside its CPU plugin (its
  jit and brgemm primitives); what does not go through oneDNN's dispatcher (MLAS's sgemm, the
  plugin's own RMS and attention kernels, which test the CPU themselves) is not capped, and the
  worker's probe (workers/openvino_worker.py ``probe``) records the primitive type of every node
  of the compiled model after one inference, so the result says which ran what.
- vLLM CPU: torch capped as for tinyllm, and its compiled ops forced to the wheel's AVX2 build
  (``_C_AVX2``) through ``workers/isa_site/sitecustomize.py``, which makes torch's AVX-512/AMX
  probes answer False in every process of the worker (vLLM picks ``_C`` / ``_C_AVX512`` /
  ``_C_AVX2`` and its attention ISA from them); verified from the library its engine process
  has mapped and oneDNN's reported ISA (``vllm_worker.py probe``).
- llama.cpp: a build of its own (venvs.LLAMACPP_BUILDS["avx2"]: GGML_NATIVE off, AVX/AVX2/FMA/
  F16C/BMI2 on, every AVX-512 and AMX option off), verified from the system_info of the library
  its tools run on (``llama_print_system_info``: AVX2 and FMA listed, no AVX512*, AVX_VNNI or
  AMX; a feature the build lacks is not listed at all).

Invariant: an engine whose cap cannot be verified in a run is still measured, and its figures
carry the reason in the record (``isa.engines[<engine>].verified`` false, ``uncapped`` saying
what ran wider); nothing here is a guess written as a fact.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ISAS = ("native", "avx2")
ISA_SITE = Path(__file__).resolve().parent / "workers" / "isa_site"
# torch's three CPU libraries: ATen's own kernels, oneDNN, and MKL (its f32 GEMM).
TORCH_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
TORCH_PROBE = Path(__file__).resolve().parent / "workers" / "torch_isa_probe.py"


# Engines that ``compare --uncapped`` may leave on their native paths under a cap (tinyllm and the
# transformers reference share compare's process, so they are always capped with it).
UNCAPPABLE = ("openvino", "vllm", "llamacpp")


def engine_isa(isa: str, engine: str, uncapped) -> str:
    """The ISA one engine runs under: the run's, or native for an engine left ``uncapped``."""
    return "native" if engine in uncapped else isa


def tinyllm_env(isa: str) -> dict:
    """What the process running tinyllm (compare itself, and its ``tinyllm generate`` children)
    needs in its environment before torch loads."""
    return TORCH_AVX2 | {"TINYLLM_KERNELS_MARCH": "haswell"} if isa == "avx2" else {}


def openvino_env(isa: str) -> dict:
    return {"ONEDNN_MAX_CPU_ISA": "AVX2"} if isa == "avx2" else {}


def vllm_env(isa: str, base: dict | None = None) -> dict:
    """vLLM's worker: torch capped, and the site hook first on PYTHONPATH (``base`` is the
    environment it will be merged into, for the PYTHONPATH already there)."""
    if isa != "avx2":
        return {}
    path = (base if base is not None else os.environ).get("PYTHONPATH")
    return TORCH_AVX2 | {"TINYLLM_BENCH_ISA": "avx2",
                         "PYTHONPATH": str(ISA_SITE) + (os.pathsep + path if path else "")}


def llamacpp_build(isa: str) -> str:
    """The llama.cpp build each ISA runs (a key of venvs.LLAMACPP_BUILDS)."""
    return "avx2" if isa == "avx2" else "native"


REEXEC_MARK = "TINYLLM_COMPARE_ISA"  # set by reexec_env: compare's caps are its own, not the user's


def reexec_env(isa: str, environ: dict) -> dict | None:
    """The environment compare must re-execute itself with so torch loads capped, or None when
    ``environ`` already has it."""
    need = tinyllm_env(isa)
    if all(environ.get(k) == v for k, v in need.items()):
        return None
    return dict(environ) | need | {REEXEC_MARK: isa}


def worker_env(environ: dict, engine_isa: str) -> dict:
    """The environment a worker starts from: compare's own, less the torch caps compare set for
    itself (reexec_env) when this engine is left uncapped, so they do not reach it."""
    if engine_isa != "native" or REEXEC_MARK not in environ:
        return dict(environ)
    mine = set(tinyllm_env(environ[REEXEC_MARK])) | {REEXEC_MARK}
    return {k: v for k, v in environ.items() if k not in mine}


UNCAPPED_HOW = "not capped (compare --uncapped): its native paths, AVX-512 on this host, with the capped CPU's precisions"

# How each engine is capped, as recorded with the results (the verification is added per run).
HOW = {
    "tinyllm": "kernels built with TINYLLM_KERNELS_MARCH=haswell; torch capped with ATEN_CPU_CAPABILITY=avx2, "
               "ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 (set before torch loads: compare "
               "re-executes itself with them)",
    "hf": "the same process as tinyllm: ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2",
    "openvino": "ONEDNN_MAX_CPU_ISA=AVX2 in the worker (caps the CPU plugin's oneDNN primitives only)",
    "vllm": "ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 in the worker; "
            "its ops from the wheel's _C_AVX2 build (workers/isa_site/sitecustomize.py makes torch's AVX-512/AMX probes answer False)",
    "llamacpp": "a build of its own: GGML_NATIVE=OFF, AVX, AVX2, FMA, F16C, BMI2 on, every AVX-512 and AMX "
                "option off",
}


def capped_cpu(cpu: dict, isa: str) -> dict:
    """The CPU as the capped engines see it: under avx2, no AVX-512, AVX512-BF16 or AMX (what
    decides, e.g., OpenVINO's precisions: engines.openvino.ov_precision)."""
    return cpu | {"avx512f": False, "avx512_bf16": False, "amx": False} if isa == "avx2" else cpu


def torch_probe(py: Path, env: dict) -> dict:
    """workers/torch_isa_probe.py under ``py`` with ``env``: the ISA torch's libraries pick there."""
    try:
        out = subprocess.run([str(py), str(TORCH_PROBE)], capture_output=True, text=True, env=dict(env), timeout=600)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"error": f"the torch probe failed: {type(e).__name__}: {e}"}


def torch_ok(probe: dict) -> list[str]:
    """What in a torch probe is not capped to AVX2 (empty when it all is)."""
    wide = []
    if probe.get("torch_cpu_capability") != "AVX2":
        wide.append(f"ATen kernels {probe.get('torch_cpu_capability')}")
    if "AVX-512" in (probe.get("onednn_isa") or "") or probe.get("onednn_isa") is None:
        wide.append(f"oneDNN {probe.get('onednn_isa')}")
    return wide


def tinyllm_check(probe: dict) -> dict:
    """The verification in the process that runs tinyllm (its panel kernels' ISA and torch's),
    with ``probe`` (torch_probe in the same environment)."""
    import torch

    from tinyllm_cli import kernels
    panel = kernels.panel_isa() if kernels.load() else f"not loaded: {kernels.load_error()}"
    cap = torch.backends.cpu.get_cpu_capability()
    wide = ([f"tinyllm's panel kernels {panel}"] if panel != "avx2" else []) + (
        [f"ATen kernels {cap}"] if cap != "AVX2" else []) + torch_ok(probe)
    return {"panel_isa": panel, "torch_cpu_capability": cap, "torch_probe": probe, "ok": not wide} | (
        {"uncapped": "; ".join(dict.fromkeys(wide))} if wide else {})


def vllm_check(facts: dict, probe: dict) -> dict:
    """vLLM's worker report (``vllm_c_libs``: the ``_C`` builds its processes mapped) and a torch
    probe under its environment: capped when only ``_C_AVX2`` is mapped and torch is capped."""
    libs = facts.get("vllm_c_libs") or []
    wide = ([f"vLLM ops from {', '.join(libs) or 'no _C library'}"] if libs != ["_C_AVX2.abi3.so"] else []) \
        + torch_ok(probe)
    return facts | {"torch_probe": probe, "ok": not wide} | ({"uncapped": "; ".join(wide)} if wide else {})


SYSTEM_INFO = re.compile(r"\b([A-Z][A-Z0-9_]*)\s*=\s*(\d+)")
# Wider than the AVX2 + FMA of a Haswell-to-Zen 3 core (AVX-VNNI came with Alder Lake).
WIDER = ("AVX512", "AMX", "AVX_VNNI")


def llamacpp_features(bindir: Path) -> str:
    """``llama_print_system_info()`` of the libllama in ``bindir`` (in a child process, so that
    library never loads beside torch here): ``CPU : SSE3 = 1 | ... | AVX2 = 1 | FMA = 1 | ...``."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.llama_print_system_info.restype = "
            "ctypes.c_char_p; print(lib.llama_print_system_info().decode())")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(bindir / "libllama.so")], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout


def llamacpp_system_info(text: str) -> dict:
    """The features in a llama.cpp system_info line (``AVX2 = 1 | FMA = 1 | ...``), by name."""
    return {k: int(v) for k, v in SYSTEM_INFO.findall(text)}


def llamacpp_check(info: dict) -> dict:
    """Whether a build's system_info shows the AVX2 + FMA cap: AVX2 and FMA on, nothing wider."""
    wide = sorted(k for k, v in info.items() if k.startswith(WIDER) and v)
    ok = bool(info) and info.get("AVX2") == 1 and info.get("FMA") == 1 and not wide
    return {"system_info": info, "ok": ok} | ({"uncapped": f"{', '.join(wide)} on"} if wide else {})


# OpenVINO CPU plugin primitive types: the ISA in each name (jit_avx512_f32, brgemm_avx2_f32,
# brgconv_avx512_1x1_f32, gemm_mlas_f32, ref_any_f32, ...).
def primitive_isa(primitive: str) -> str:
    p = primitive.lower()
    if "avx512" in p or "amx" in p:
        return "avx512"
    if "avx2" in p:
        return "avx2"
    if "mlas" in p:
        return "mlas (dispatches on CPUID, not capped)"
    return "other"


def openvino_check(counts: dict) -> dict:
    """From the probe's ``{"layerType primitiveType": n}``: the nodes per ISA, and what ran AVX-512."""
    by_isa: dict[str, int] = {}
    wide = []
    for key, n in counts.items():
        isa = primitive_isa(key.split(" ", 1)[-1])
        by_isa[isa] = by_isa.get(isa, 0) + n
        if isa == "avx512" or isa.startswith("mlas"):
            wide.append(f"{n} {key}")
    return {"primitive_types": counts, "nodes_by_isa": by_isa, "ok": not wide} | (
        {"uncapped": "; ".join(sorted(wide))} if wide else {})
