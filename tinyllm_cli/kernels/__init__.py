"""Native CPU kernels (the ``.cpp`` and ``.h`` files beside this one, README.md maps them), built
on first use and cached on disk as one extension, ``torch.ops.tinyllm``.

Why native code: decode attention over a paged pool in PyTorch ops gathers every sequence's K/V
into a padded copy per layer and runs SDPA on it; at batch 32 that is ~0.4 ms a layer, 12 ms a
step, and each prefill segment is one more SDPA call. The kernel serves every query row of a
step (decode and prefill) in one call, reading K/V where they live in the blocks, once per
(row, kv head) for all query heads of the group, in float32 arithmetic. The three fused elementwise ops (residual add +
RMSNorm, SiLU * up, RoPE in place) replace 2-9 eager ops each, which a one-token step feels as
dispatch overhead and a batched step as extra passes over memory. ``q4_linear`` / ``int8_linear``
are the matmuls of ``quant: gguf`` (``model/quant.py``): 4-bit weights as bfloat16 dot products
(AVX512-BF16) or decoded to float32 for FMAs (AVX2), int8 rows widened once per group of
activation rows, both prefetching the weight stream that a one-row step is bound by.

Invariants:
- Building needs a C++ compiler and ninja (the ``ninja`` wheel is a dependency). Where the build
  fails, ``load()`` returns False with the reason in ``load_error()``, and callers keep the
  PyTorch path: the same results (it is the reference the tests compare the kernel against).
  ``make setup`` / ``make test`` (``python -m tinyllm_cli.kernels``) fail on a failed build
  unless ``opted_out()``: ``TINYLLM_ALLOW_NO_KERNELS=1`` accepts the fallback, for a machine
  without a compiler.
- All the ``.cpp`` files compile into one library in one ``cpp_extension.load`` call (one
  ``TORCH_LIBRARY``, in bindings.cpp). Its build directory is keyed by every source and header
  (name and bytes), torch's version, the CPU's flags and the compiler flags: the library is
  compiled with ``-march=native`` (or ``$TINYLLM_KERNELS_MARCH``), so a cache never serves one
  built for another CPU, target, torch or source.
- Codes shared with Python are exported by the library: ``linear_kinds()`` gives the C++
  ``LinearKind`` by name, which ``model/fused.py`` checks against its own before it builds a stack.
- One build per key across processes, one load per process. The lock is an ``flock`` on
  ``<key>.lock`` beside the build directory, so it dies with its holder: a build killed midway
  never blocks a later one (its leftovers, torch's own ``lock`` file included, are cleared under
  the lock before building again). A process that finds another live one building waits at most
  ``LOCK_WAIT_S``, saying so on stderr, then runs the PyTorch path with the usual one-line note.
- Nothing is printed on stdout: a first build says so on stderr.
- ``TINYLLM_KERNELS=0`` turns them off (everything runs the PyTorch path), for comparisons.
- ``TINYLLM_KERNELS_MARCH=haswell`` builds for another target than this CPU, for comparisons:
  on an AVX-512 host, the AVX2 paths that AVX2-only CPUs take (8-lane registers, the 6-row panel
  tile, AVX2 integer dot products). It must name a target this CPU can run.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import shutil
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch

from ..machine import cpu_flags_line

try:
    import fcntl
except ImportError:  # not POSIX: builds are not locked across processes
    fcntl = None

KERNEL_DIR = Path(__file__).parent
LOCK_WAIT_S = 300.0  # how long to wait for another live process's build before taking the PyTorch path
_NOTE_AFTER_S = 1.0  # a shorter wait (a loader, or a builder about to finish) goes unmentioned
_POLL_S = 0.1
_error: str | None = None


def cflags() -> tuple[str, ...]:
    """The compiler flags: ``-march`` is this CPU's unless ``$TINYLLM_KERNELS_MARCH`` names another."""
    return ("-O3", f"-march={os.environ.get('TINYLLM_KERNELS_MARCH') or 'native'}", "-fopenmp")


def cache_root() -> Path:
    """``$TINYLLM_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/tinyllm/kernels`` (``~/.cache`` by default)."""
    if os.environ.get("TINYLLM_KERNEL_CACHE"):
        return Path(os.environ["TINYLLM_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tinyllm" / "kernels"


def sources() -> list[Path]:
    """The translation units, compiled together into one library."""
    return sorted(KERNEL_DIR.glob("*.cpp"))


def source_files() -> list[Path]:
    """Everything the library is built from: the sources and the headers they include."""
    return sorted([*KERNEL_DIR.glob("*.cpp"), *KERNEL_DIR.glob("*.h")])


def build_key() -> str:
    """The cache key of a build: every source file's name and bytes, torch's and Python's versions,
    the CPU's flags and the compiler flags."""
    h = hashlib.sha256()
    for path in source_files():
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (torch.__version__.encode(), cpu_flags_line().encode(), sys.version.encode(), " ".join(cflags()).encode()):
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
    _error = _load_from(cache_root() / key, f"tinyllm_kernels_{key}")
    return _error is None


def _load_from(directory: Path, name: str) -> str | None:
    """Load the library ``name`` from ``directory``, building it there first if it is not complete;
    None when it is loaded, else why not in one line. Never raises and never waits past
    ``LOCK_WAIT_S``."""
    try:
        _load_or_build(directory, name)
    except LockTimeout as e:
        return str(e)
    except Exception as e:  # a missing compiler, ninja or headers: the PyTorch path serves instead
        return _reason(e)
    return None


def _load_or_build(directory: Path, name: str) -> None:
    """Load ``directory/name.so``, building it first if no complete build is there.

    A shared lock covers loading a complete build (loaders do not wait for each other); an
    exclusive one covers clearing a dead build's leftovers, building and loading. Both are
    ``flock`` locks on ``lock_path(directory)``, which the kernel releases when their holder
    exits, however it exits: a killed build leaves files behind, never a lock."""
    library = directory / f"{name}.so"
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(lock_path(directory), exclusive=False):
        if _complete(directory, library):
            _load_library(library)
            return
    with _locked(lock_path(directory), exclusive=True):
        if _complete(directory, library):  # another process built it while this one waited
            _load_library(library)
            return
        _clear(directory)
        print("building tinyllm's CPU kernels (once per machine, about 10-40 s) ...", file=sys.stderr)
        _build(directory, name)


def lock_path(directory: Path) -> Path:
    """The flock file of a build directory: beside it, not in it, so that clearing the directory
    never removes a lock file that another process has open."""
    return directory.with_name(directory.name + ".lock")


def _complete(directory: Path, library: Path) -> bool:
    """A finished build: the library is there and torch's builder is not (or no longer) holding its
    lock file, which it creates before compiling and removes after linking. Called under our
    flock, so a ``lock`` file seen here was left by a killed build (or by a version of tinyllm
    that built without this flock), and the library beside it may be half written."""
    return library.exists() and not (directory / "lock").exists()


def _clear(directory: Path) -> None:
    """Start from an empty build directory (under the exclusive flock). What is there is a killed
    or failed build: torch's stale ``lock`` file, which would make its builder wait forever, and
    objects or a library that may be half written, which ninja could take for up to date."""
    if directory.exists():
        shutil.rmtree(directory)  # raises rather than leave torch's lock file (a builder that waits forever)
    directory.mkdir(parents=True)


def _load_library(library: Path) -> None:
    torch.ops.load_library(str(library))


def _build(directory: Path, name: str) -> None:
    """Compile and link ``directory/name.so`` with torch's builder, which also loads it."""
    from torch.utils import cpp_extension

    _ensure_ninja()
    builder_log = logging.getLogger("torch.utils.cpp_extension")
    level = builder_log.level
    builder_log.setLevel(logging.ERROR)  # its compiler-ABI warning is not ours to show
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the builder's notes must not reach stdout
            cpp_extension.load(name, [str(p) for p in sources()], extra_cflags=list(cflags()), extra_ldflags=["-fopenmp"],
                               build_directory=str(directory), is_python_module=False, verbose=False)
    finally:
        builder_log.setLevel(level)


# ---- the build lock ----------------------------------------------------------------------------

class LockTimeout(Exception):
    """Another live process held the build lock for longer than ``LOCK_WAIT_S``."""


@contextlib.contextmanager
def _locked(path: Path, exclusive: bool):
    """Hold a ``flock`` on ``path`` for the block: exclusive (and the holder's pid written in the
    file, for a waiter's message) or shared. Waits at most ``LOCK_WAIT_S``, saying on stderr
    after ``_NOTE_AFTER_S`` whom it waits for; then raises ``LockTimeout``. Without fcntl (not
    POSIX) it does not lock."""
    opened = _open_lock(path) if fcntl is not None else None
    if opened is None:
        yield
        return
    fd, writable = opened
    try:
        _acquire(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        note_pid = exclusive and writable
        if note_pid:
            _write_pid(fd, str(os.getpid()))
        try:
            yield
        finally:
            if note_pid:
                _write_pid(fd, "")  # a later waiter must not name this process once it is gone
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_lock(path: Path) -> tuple[int, bool] | None:
    """The lock file, open for writing (to note the builder's pid), else read-only (a cache this
    user may load from but not build in; flock works on either), else None: no lock file and no
    right to make one, where nobody can build, so loading a complete build needs no lock."""
    for flags, writable in ((os.O_RDWR | os.O_CREAT, True), (os.O_RDONLY, False)):
        try:
            return os.open(path, flags, 0o644), writable
        except OSError:
            pass
    return None


def _acquire(fd: int, mode: int) -> None:
    """Take the flock ``mode`` on ``fd``, polling (a blocking flock cannot be given a timeout
    without signals, which only the main thread may use)."""
    start, noted = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        holder = _read_pid(fd)
        if waited >= LOCK_WAIT_S:
            raise LockTimeout(f"another process, {_who(holder)}, was still building them after {LOCK_WAIT_S:.0f} s")
        if waited >= _NOTE_AFTER_S and not noted:
            print(f"waiting for another process that is building tinyllm's kernels ({_who(holder)}) "
                  f"for up to {LOCK_WAIT_S:.0f} s ...", file=sys.stderr)
            noted = True
        time.sleep(_POLL_S)


def _write_pid(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _read_pid(fd: int) -> str:
    return os.pread(fd, 32, 0).decode(errors="replace").strip()


def _who(pid: str) -> str:
    return f"pid {pid}" if pid.isdigit() else "pid unknown"


def _reason(e: Exception) -> str:
    """One line out of a failed build: the compiler's first error, or the shell's complaint
    about a missing program, rather than the long command line ninja echoes first."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
    pick = next((ln for ln in lines if "error:" in ln), None)
    pick = pick or next((ln for ln in lines if "not found" in ln or "No such file" in ln), lines[0])
    return f"{type(e).__name__}: {pick}"[:300]


def compiler() -> str | None:
    """The C++ compiler torch's builder runs (``$CXX``, else ``c++``) as a path, or None where
    there is none."""
    words = shlex.split(os.environ.get("CXX") or "c++")
    return shutil.which(words[0]) if words else None


def opted_out() -> str | None:
    """The setting that accepts running without the kernels (``TINYLLM_KERNELS=0``, or
    ``TINYLLM_ALLOW_NO_KERNELS=1`` for a machine without a compiler), or None when neither is set."""
    if os.environ.get("TINYLLM_KERNELS", "1") == "0":
        return "TINYLLM_KERNELS=0"
    if os.environ.get("TINYLLM_ALLOW_NO_KERNELS", "") == "1":
        return "TINYLLM_ALLOW_NO_KERNELS=1"
    return None


def expected() -> bool:
    """Whether a failed build is a failure rather than a fallback: nobody opted out and a C++
    compiler is here (``make test`` and the kernel tests fail then; without a compiler they skip)."""
    return opted_out() is None and compiler() is not None


def load_error() -> str | None:
    """Why ``load()`` failed, in one line (None when it did not fail)."""
    return _error


def paged_attention(q, k_pool, v_pool, block_tables, row_seq, row_len, block_size: int, scale: float):
    """See ``ops.h``: q [T, H, D], pools [P, Hkv, D], tables [S, NB]; query row t
    attends to positions [0, row_len[t]) of sequence row_seq[t]."""
    return torch.ops.tinyllm.paged_attention(q, k_pool, v_pool, block_tables, row_seq, row_len, block_size, scale)


def add_rms_norm_(x, residual, weight, eps: float):
    """``x += residual`` (if not None), then RMSNorm(x) * weight as a new tensor."""
    return torch.ops.tinyllm.add_rms_norm_(x, residual, weight, eps)


def silu_mul(gate_up):
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    return torch.ops.tinyllm.silu_mul(gate_up)


def decoder_stack_new(weights, kinds, aux, biases, input_norms, post_norms, eps: float, mlp_rows,
                      n_heads: int, n_kv: int, head_dim: int):
    """Every decoder layer's static arguments held in one kernel object (``decoder_stack`` runs
    them): the four linears' weights, kinds, aux tensors and biases of each layer, layer after
    layer; one input norm, post norm and ``mlp_rows`` per layer (``model/fused.py``'s
    ``FusedLayerArgs``). ``mlp_rows`` > 0: a step of more rows runs that layer's MLP in row
    chunks of about that many."""
    return torch.ops.tinyllm.decoder_stack_new(weights, kinds, aux, biases, input_norms, post_norms, eps, mlp_rows,
                                               n_heads, n_kv, head_dim)


def decoder_stack(stack, x, cos, sin_signed, k_pools, v_pools, slot_mapping, block_tables, row_seq, row_len,
                  block_size: int, keep=None):
    """Every layer of ``stack`` over a step's embedded rows ``x`` (updated in place), one K/V pool
    pair per layer; returns the residual stream and the last layer's MLP output, which the final
    norm adds (``model/fused.py``'s ``run_stack``). ``keep``: int64 row indices; the last
    layer writes every row's K/V and carries only these rows past them (the pair returned is
    theirs)."""
    return torch.ops.tinyllm.decoder_stack(stack, x, cos, sin_signed, k_pools, v_pools, slot_mapping, block_tables,
                                           row_seq, row_len, block_size, keep)


def linear_kinds() -> dict[str, int]:
    """The C++ ``LinearKind`` values by name (``ops.h``): how ``decoder_stack_new``'s ``kinds`` are
    numbered."""
    return dict(torch.ops.tinyllm.linear_kinds())


def int8_linear(x, q, scale, float32_out: bool = False):
    """x [M, K] @ (q [N, K] int8 * scale [N])^T in x's dtype (torch's ``_weight_int8pack_mm``), or
    in float32 (logits)."""
    return torch.ops.tinyllm.int8_linear(x, q, scale, float32_out)


def panel_isa() -> str:
    """The vector width ``panel_linear`` was built for: 'avx512', 'avx2', or '' (it cannot run); with
    '-bf16' where bfloat16 weights run on bfloat16 dot products (AVX512-BF16)."""
    return str(torch.ops.tinyllm.panel_isa())


def panel_pack(w):
    """w [N, K] float32 / bfloat16 -> the same shape and dtype, in ``panel_linear``'s order."""
    return torch.ops.tinyllm.panel_pack(w)


def panel_linear(x, w, bias=None):
    """x [M, K] @ w^T (+ bias) in x's dtype, float32 accumulation, w as ``panel_pack`` made it."""
    return torch.ops.tinyllm.panel_linear(x, w, bias)


def panel_argmax(x, w, ws, rows, norms):
    """argmax over the columns of ``panel_linear(x, w)`` (float32 x and w, no bias), the same index,
    screened through ``ws`` (w in bfloat16, packed alike), ``rows`` (w unpacked, [N, K] float32)
    and ``norms`` (each output's weight norm, rounded up): see argmax.cpp and
    model/greedy_head.py. Needs ``panel_isa()`` '-bf16'."""
    return torch.ops.tinyllm.panel_argmax(x, w, ws, rows, norms)


def argmax(x):
    """x [R, N] float32 with contiguous rows -> [R] int64: ``torch.argmax(x, -1)`` (first index of
    the maximum; a NaN is the maximum), vectorized and split over threads."""
    return torch.ops.tinyllm.argmax(x)


def rope_(x, cos, sin_signed):
    """Rotate x [T, heads, D] in place (``model.llama.apply_rope``'s math)."""
    return torch.ops.tinyllm.rope_(x, cos, sin_signed)
