"""Native CPU kernels (``cpu_kernels.cpp``), built on first use and cached on disk.

Why native code: decode attention over a paged pool in PyTorch ops gathers every sequence's K/V
into a padded copy per layer and runs SDPA on it; at batch 32 that is ~0.4 ms a layer, 12 ms a
step, and each prefill segment is one more SDPA call. The kernel serves every query row of a
step (decode and prefill) in one call, reading K/V where they live in the blocks, once per
(row, kv head) for all query heads of the group, in float32 arithmetic. The three fused elementwise ops (residual add +
RMSNorm, SiLU * up, RoPE in place) replace 2-9 eager ops each, which a one-token step feels as
dispatch overhead and a batched step as extra passes over memory. ``q4_linear`` / ``int8_linear``
are the matmuls of ``quant: gguf`` (``model/quant.py``): 4-bit weights as bfloat16 dot products
(AVX512-BF16), int8 rows widened once per group of activation rows, both prefetching the weight
stream that a one-row step is bound by.

Invariants:
- Building needs a C++ compiler and ninja (the ``ninja`` wheel is a dependency). Where the build
  fails, ``load()`` returns None with the reason in ``load_error()``, and callers keep the
  PyTorch path: the same results (it is the reference the tests compare the kernel against).
- The build directory is keyed by the source, torch's version and the CPU's flags: the library
  is compiled with ``-march=native``, so a cache never serves one built for another CPU or torch.
- One build per key across processes (torch's build lock), one load per process.
- Nothing is printed on stdout: a first build says so on stderr.
- ``TINYLLM_KERNELS=0`` turns them off (everything runs the PyTorch path), for comparisons.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
_error: str | None = None


def cache_root() -> Path:
    """``$TINYLLM_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/tinyllm/kernels`` (``~/.cache`` by default)."""
    if os.environ.get("TINYLLM_KERNEL_CACHE"):
        return Path(os.environ["TINYLLM_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tinyllm" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def build_key() -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode(), sys.version.encode(),
                 " ".join(CFLAGS).encode()):
        h.update(part)
    return h.hexdigest()[:16]


def _ensure_ninja() -> None:
    """torch's builder looks ninja up on PATH; a venv used without activation has the wheel's
    binary but not its bin folder on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@lru_cache(maxsize=None)
def load() -> bool:
    """Build (or reuse) and load the kernels; True when ``torch.ops.tinyllm`` is ready."""
    global _error
    if os.environ.get("TINYLLM_KERNELS", "1") == "0":
        _error = "disabled by TINYLLM_KERNELS=0"
        return False
    if hasattr(torch.ops, "tinyllm") and hasattr(torch.ops.tinyllm, "paged_attention"):
        return True
    key = build_key()
    directory = cache_root() / key
    name = f"tinyllm_kernels_{key}"
    library = directory / f"{name}.so"
    try:
        # Built before for this source, torch, Python, flags and CPU (the key), and not being
        # rebuilt by another process right now (torch's builder holds a lock file meanwhile).
        if library.exists() and not (directory / "lock").exists():
            torch.ops.load_library(str(library))
            return True
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        print("building tinyllm's CPU kernels (once per machine, about 10-40 s) ...", file=sys.stderr)
        _ensure_ninja()
        builder_log = logging.getLogger("torch.utils.cpp_extension")
        level = builder_log.level
        builder_log.setLevel(logging.ERROR)  # its compiler-ABI warning is not ours to show
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the builder's notes must not reach stdout
                cpp_extension.load(name, [str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                                   build_directory=str(directory), is_python_module=False, verbose=False)
        finally:
            builder_log.setLevel(level)
    except Exception as e:  # a missing compiler, ninja or headers: the PyTorch path serves instead
        _error = _reason(e)
        return False
    return True


def _reason(e: Exception) -> str:
    """One line out of a failed build: the compiler's first error, or the shell's complaint
    about a missing program, rather than the long command line ninja echoes first."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
    pick = next((ln for ln in lines if "error:" in ln), None)
    pick = pick or next((ln for ln in lines if "not found" in ln or "No such file" in ln), lines[0])
    return f"{type(e).__name__}: {pick}"[:300]


def load_error() -> str | None:
    """Why ``load()`` failed, in one line (None when it did not fail)."""
    return _error


def paged_attention(q, k_pool, v_pool, block_tables, row_seq, row_len, block_size: int, scale: float):
    """See ``cpu_kernels.cpp``: q [T, H, D], pools [P, Hkv, D], tables [S, NB]; query row t
    attends to positions [0, row_len[t]) of sequence row_seq[t]."""
    return torch.ops.tinyllm.paged_attention(q, k_pool, v_pool, block_tables, row_seq, row_len, block_size, scale)


def add_rms_norm_(x, residual, weight, eps: float):
    """``x += residual`` (if not None), then RMSNorm(x) * weight as a new tensor."""
    return torch.ops.tinyllm.add_rms_norm_(x, residual, weight, eps)


def silu_mul(gate_up):
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    return torch.ops.tinyllm.silu_mul(gate_up)


def decoder_layer(x, r, weights, kinds, aux, biases, input_norm, post_norm, eps: float, cos, sin_signed,
                  k_pool, v_pool, slot_mapping, block_tables, row_seq, row_len, block_size: int,
                  n_heads: int, n_kv: int, head_dim: int):
    """A whole decoder layer (model/llama.py's ``DecoderLayer.fused``); returns its MLP output."""
    return torch.ops.tinyllm.decoder_layer(x, r, weights, kinds, aux, biases, input_norm, post_norm, eps, cos,
                                           sin_signed, k_pool, v_pool, slot_mapping, block_tables, row_seq, row_len,
                                           block_size, n_heads, n_kv, head_dim)


def int8_linear(x, q, scale, float32_out: bool = False):
    """x [M, K] @ (q [N, K] int8 * scale [N])^T in x's dtype (torch's ``_weight_int8pack_mm``), or
    in float32 (logits)."""
    return torch.ops.tinyllm.int8_linear(x, q, scale, float32_out)


def rope_(x, cos, sin_signed):
    """Rotate x [T, heads, D] in place (``model.llama.apply_rope``'s math)."""
    return torch.ops.tinyllm.rope_(x, cos, sin_signed)
