"""Where the limit is: the model-determined work of a run (FLOPs, bytes moved) and this CPU's
measured peak (matmul FLOP/s, memory bandwidth), so a bench row can say how close to the machine
an engine runs.

Work is counted from the model's shape and five counts, never from timings or engine internals:
forwards (forward passes), tokens (rows through the decoder layers), logit rows (rows through
the output projection), attention pairs (query-key pairs of causal attention) and K/V positions
read. For one step:

- linear FLOPs = 2 x (decoder-layer weight params x tokens + hidden x vocab x logit rows): every
  weight matmul, a multiply-add counted as 2; the output projection only for the rows whose
  logits are computed (tinyllm: sampled rows and scored prompt rows, never every prompt token).
- attention FLOPs = 4 x heads x head_dim x layers x pairs (QK^T and P.V, 2 each per pair and
  head dimension); causal: a chunk of n rows from position p has n*p + n(n+1)/2 pairs, however
  a kernel computes them.
- weight bytes = the weights' bytes once per forward (the lower bound: each forward streams
  every weight from memory at least once; a quantized model's actual packed bytes).
- K/V bytes = (positions read + tokens written) x K/V bytes per token (all layers): each decode
  row reads its whole context, each prefill chunk its context once; each token writes its own.
  Activations, norms, biases and the embedding lookup are left out (small against these).

Invariants:
- Every count is a sum over steps and every formula is linear in the counts, so the work of a run
  is the sum of its steps' work, however the stats timeline merged them.
- ``workload_work`` gives any engine's work for a workload (prompt lengths, output length, n),
  greedy to exactly ``output_len`` tokens: FLOPs and K/V writes are exact for any batching (no
  prefix-cache hits, no preemption); weight bytes and prefill K/V reads assume the workload is
  prefilled first, in ceil(prompt tokens / max_prefill_tokens) forwards (one chunk per prompt),
  then decoded together in output_len - 1 forwards: what a continuous batcher does when the
  whole workload fits at once. tinyllm's own runs use the exact counts its steps recorded.
- The roofline time of a workload (``workload_bound_s``) is a sum over those phases of the slower
  of FLOPs at the peak and bytes at the bandwidth: no engine can take less on this machine, so
  bound / elapsed is how close a run came to it (100% only if every forward ran at its limit).
  Two exceptions, tinyllm's own, where it does less than the work counted here (which stays the
  model's, as for every engine): greedy steps of a float32 model with a screened head
  (``model/greedy_head.py``) read the output matrix in bfloat16 and compute it at the bfloat16
  rate; and the last decoder layer on tinyllm's panels carries only the rows whose logits are
  read past its K/V projection (``model/fused.py``'s ``keep_rows``), about 1/L of a prompt
  step's matmuls skipped.
- The peak is a microbenchmark in this process, on the run's device: the best matmul rate of
  ``F.linear``, and on a CPU also of the resolved packed linear (oneDNN or tinyllm's panels,
  where usable) and, for a model with 4-bit weights on tinyllm's kernel, of that kernel in the
  model's activation mode (``q4`` or ``q4-int8``: with int8 activations it outruns the float
  matmuls, so a run could otherwise read over 100% of "the peak"), on the model's hidden -> FFN
  shape at 1, 32 and 256 rows (the peak is the 256-row figure), and the read bandwidth of a sum
  over 512 MiB (best of several). On an accelerator a timed sample is ``DEVICE_CALLS`` calls
  between two synchronizations, so launches overlap as they do in a run and the clock reads the
  device's time. It is cached per device (the CPU's or accelerator's name), dtype, thread count
  (CPU), torch version, shape, paths and kernel build (``peak_key``) in ``peak_cache_path()``, so
  only the first bench on a machine pays for it. A measurement again (``refresh``) is merged with
  the cached one, each rate and the bandwidth the larger of the two: the peak is what the machine
  has reached, and a busy moment on a shared host (2 Zen 4 cores: 210 against 231 GFLOP/s one hour
  apart) can lower a measurement, never raise it, so one would otherwise inflate every fraction
  held against it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from .machine import device_name

PEAK_ROWS = (1, 32, 256)  # matmul rows measured; the peak is the last
BANDWIDTH_BYTES = 512 * 2**20  # well past any last-level cache these machines have
DEVICE_CALLS = 50  # calls per timed sample on an accelerator: one call is a few microseconds


@dataclass(frozen=True)
class Work:
    forwards: int = 0
    tokens: int = 0
    linear_flops: int = 0
    attention_flops: int = 0
    weight_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0

    @property
    def flops(self) -> int:
        return self.linear_flops + self.attention_flops

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    def __add__(self, other: "Work") -> "Work":
        return Work(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(Work)})

    def as_dict(self) -> dict:
        return asdict(self) | {"flops": self.flops, "bytes": self.bytes}


# ---- the model's shape ---------------------------------------------------------------------

def layer_params(cfg) -> int:
    """Weight params of one decoder layer's matmuls: q/k/v, o, gate/up, down."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = h * d * (cfg.num_heads + 2 * cfg.num_kv_heads)
    return qkv + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size


def head_params(cfg) -> int:
    """Weight params of the output projection (the embedding matrix itself when tied)."""
    return cfg.hidden_size * cfg.vocab_size


def dense_weight_bytes(cfg, elem_bytes: int) -> int:
    """Bytes of weights one forward reads for a model held dense at ``elem_bytes`` per weight."""
    return (cfg.num_layers * layer_params(cfg) + head_params(cfg)) * elem_bytes


def model_weight_bytes(model) -> int:
    """Bytes of weights one forward of a loaded ``LlamaModel`` reads, as held (packed oneDNN,
    4-bit or int8 buffers included): every tensor of the decoder layers, the final norm and the
    output projection (a tied one holds the embedding matrix). The embedding lookup reads T rows
    only, so the embedding is not counted unless the output projection is it."""
    mods = [*model.layers, model.norm, model.lm_head, *getattr(model.lm_head, "_embed", [])]  # Int8Head's rows
    seen, total = set(), 0
    for m in mods:
        for sub in m.modules():
            ts = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
            packed = getattr(sub, "packed", None)  # Packed/PanelLinear keep their weight unregistered
            ts += [packed] if isinstance(packed, torch.Tensor) else []
            for t in ts:
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.nbytes
    return total


def runtime_bytes(rt) -> tuple[int, int]:
    """(weight bytes one forward reads, K/V element bytes) of a loaded runtime: its weights as
    held (``model_weight_bytes``) and its K/V pools, which hold the model dtype."""
    return model_weight_bytes(rt.model), torch.tensor([], dtype=rt.dtype).element_size()


# ---- counts -> work ------------------------------------------------------------------------

def work_of_counts(cfg, counts: Mapping[str, int], *, weight_bytes: int, kv_elem_bytes: int) -> Work:
    """The work of ``counts`` (forwards, tokens, logit_rows, attn_pairs, kv_read_tokens) on this
    model: the formulas of the module docstring."""
    per_pair = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    kv_token = cfg.kv_bytes_per_token * kv_elem_bytes
    return Work(forwards=counts["forwards"], tokens=counts["tokens"],
                linear_flops=2 * (cfg.num_layers * layer_params(cfg) * counts["tokens"]
                                  + head_params(cfg) * counts["logit_rows"]),
                attention_flops=per_pair * counts["attn_pairs"],
                weight_bytes=weight_bytes * counts["forwards"],
                kv_read_bytes=kv_token * counts["kv_read_tokens"], kv_write_bytes=kv_token * counts["tokens"])


def step_counts(rec) -> dict[str, int]:
    """The counts of one ``StepRecord`` (or a merged one)."""
    return {"forwards": rec.forwards, "tokens": rec.prefill_tokens + rec.decode_tokens,
            "logit_rows": rec.logit_rows, "attn_pairs": rec.attn_pairs, "kv_read_tokens": rec.kv_read_tokens}


def work_of_steps(cfg, records: Iterable, *, weight_bytes: int, kv_elem_bytes: int) -> Work:
    """The work of tinyllm's steps: the sum over ``StepRecord``s (a timeline, merged or not)."""
    total = Work()
    for rec in records:
        total += work_of_counts(cfg, step_counts(rec), weight_bytes=weight_bytes, kv_elem_bytes=kv_elem_bytes)
    return total


def work_of_run(cfg, summary: Mapping, *, weight_bytes: int, kv_elem_bytes: int) -> Work:
    """The work of one tinyllm run, exact, from its summary's ``work_counts`` (the running sums of
    its steps' counts: equal to ``work_of_steps`` over its whole timeline)."""
    return work_of_counts(cfg, summary["work_counts"], weight_bytes=weight_bytes, kv_elem_bytes=kv_elem_bytes)


def workload_phases(prompt_lens: Sequence[int], output_len: int, n: int = 1,
                    max_prefill_tokens: int | None = None) -> list[dict[str, int]]:
    """The counts of a workload run by any engine under the module docstring's assumption, phase
    by phase: the prefill (its forwards together: each prompt once, its logits sampled for the
    ``n`` forks), then each of the ``output_len - 1`` decode forwards (every sequence one row, its
    context one longer each time; the last token is sampled, never fed back)."""
    if output_len < 1 or n < 1 or not prompt_lens or min(prompt_lens) < 1:
        raise ValueError("a workload needs prompts of at least 1 token, output_len >= 1 and n >= 1")
    prompt, rows = sum(prompt_lens), n * len(prompt_lens)
    prefill_steps = 1 if max_prefill_tokens is None else math.ceil(prompt / max_prefill_tokens)
    phases = [{"forwards": prefill_steps, "tokens": prompt, "logit_rows": rows,
               "attn_pairs": sum(L * (L + 1) // 2 for L in prompt_lens), "kv_read_tokens": prompt}]
    for j in range(1, output_len):  # decode forward j: contexts L + j
        ctx = n * (prompt + j * len(prompt_lens))
        phases.append({"forwards": 1, "tokens": rows, "logit_rows": rows, "attn_pairs": ctx, "kv_read_tokens": ctx})
    return phases


def workload_counts(prompt_lens: Sequence[int], output_len: int, n: int = 1,
                    max_prefill_tokens: int | None = None) -> dict[str, int]:
    """The counts of a whole workload: the sum of its phases' (``workload_phases``)."""
    phases = workload_phases(prompt_lens, output_len, n, max_prefill_tokens)
    return {k: sum(p[k] for p in phases) for k in phases[0]}


def workload_work(cfg, prompt_lens: Sequence[int], output_len: int, *, weight_bytes: int, kv_elem_bytes: int,
                  n: int = 1, max_prefill_tokens: int | None = None) -> Work:
    """Any engine's work for a workload (``python -m benchmarks.compare`` divides it by each
    engine's wall time). ``weight_bytes``: ``dense_weight_bytes(cfg, 4 or 2)`` for float32 or
    bfloat16 weights, the file's actual bytes for a quantized one; ``kv_elem_bytes``: the K/V
    dtype's bytes (the model dtype's in tinyllm)."""
    return work_of_counts(cfg, workload_counts(prompt_lens, output_len, n, max_prefill_tokens),
                          weight_bytes=weight_bytes, kv_elem_bytes=kv_elem_bytes)


def bound_s(work: Work, peak: dict) -> float:
    """The least time ``work`` takes on this machine: its FLOPs at the matmul peak or its bytes at
    the read bandwidth, whichever is slower (one phase's roofline)."""
    return max(work.flops / (peak["gemm_gflops"] * 1e9), work.bytes / (peak["bandwidth_gbps"] * 1e9))


def workload_bound_s(cfg, prompt_lens: Sequence[int], output_len: int, peak: dict, *, weight_bytes: int,
                     kv_elem_bytes: int, n: int = 1, max_prefill_tokens: int | None = None) -> float:
    """The roofline time of a workload: ``bound_s`` phase by phase (``workload_phases``), summed.
    The prefill is bound by the FLOPs, a small batch's decode forwards by the bytes; one figure for
    the whole workload would hide either (a run can be at the bandwidth while decoding and far
    from the peak in its prefill, or the reverse)."""
    return sum(bound_s(work_of_counts(cfg, c, weight_bytes=weight_bytes, kv_elem_bytes=kv_elem_bytes), peak)
               for c in workload_phases(prompt_lens, output_len, n, max_prefill_tokens))


def rates(work: Work, elapsed_s: float, peak: dict | None) -> dict:
    """Achieved GFLOP/s and GB/s of ``work`` done in ``elapsed_s``, with their fractions of the
    measured peak where there is one (None otherwise)."""
    gflops, gbps = work.flops / elapsed_s / 1e9, work.bytes / elapsed_s / 1e9
    return {"achieved_gflops": _sig(gflops), "achieved_gbps": _sig(gbps),
            "roofline_frac": _sig(gflops / peak["gemm_gflops"]) if peak else None,
            "bandwidth_frac": _sig(gbps / peak["bandwidth_gbps"]) if peak else None}


def _sig(x: float) -> float:
    """4 significant digits: a tiny test model's rates are far below 0.1 and still not zero."""
    return float(f"{x:.4g}")


# ---- the peak ------------------------------------------------------------------------------

def peak_cache_path() -> Path:
    """``$TINYLLM_PEAK_CACHE``, else ``$XDG_CACHE_HOME/tinyllm/peak.json`` (``~/.cache`` by
    default), beside the kernels' cache."""
    if os.environ.get("TINYLLM_PEAK_CACHE"):
        return Path(os.environ["TINYLLM_PEAK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tinyllm" / "peak.json"


def peak_key(dtype: torch.dtype, threads: int | None, shape: tuple[int, int], gemm: str, q4: str = "",
             device: torch.device = torch.device("cpu")) -> str:
    """Names everything the peak depends on: the device, dtype, torch version, shape and matmul
    path measured (``gemm``), and on a CPU the thread count, the 4-bit kernel's mode (``q4``) and
    the build of tinyllm's kernels, so a peak cached before a new path or a faster kernel existed
    is not this path's peak. An accelerator's runs use neither threads nor the CPU kernels."""
    head = f"{device.type}: {device_name(device)} | {str(dtype).removeprefix('torch.')}"
    tail = f"torch {torch.__version__} | {shape[0]}x{shape[1]} | gemm {gemm}"
    if device.type != "cpu":
        return f"{head} | {tail}"
    from . import kernels as native
    build = native.build_key() if native.load() else "none"
    return f"{head} | {threads} threads | {tail} | kernels {build}" + (f" | {q4}" if q4 else "")


def _read_cache(path: Path) -> dict:
    try:
        got = json.loads(path.read_text())
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or damaged: measure again and rewrite it


def _write_cache(path: Path, key: str, peak: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_cache(path) | {key: peak}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=2) + "\n")
        os.replace(tmp, path)  # atomic: a concurrent bench reads the old file or the new one
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time


def measure_peak(dtype: torch.dtype, shape: tuple[int, int] = (576, 1536), threads: int | None = None,
                 seconds: float = 1.5, refresh: bool = False, q4: str = "", device="cpu") -> dict:
    """The measured peak of ``device`` (a CPU: with ``threads`` torch threads, this process's
    setting when None) at ``dtype`` on a ``shape`` = (hidden, FFN) matmul: from the cache unless
    ``refresh`` (then measured again and merged with the cached entry: module docstring); measuring
    takes about ``seconds``. ``q4`` ('q4' or 'q4-int8') adds tinyllm's 4-bit kernel in that
    activation mode (``q4_path``; CPU only). Returns gemm_gflops (the best path at 256 rows), gemm
    (that path), gemm_rows, gflops (path -> rows -> GFLOP/s), bandwidth_gbps, the device's name,
    measurements (how many were merged) and where it came from."""
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    before = torch.get_num_threads()
    threads = (threads or before) if on_cpu else None
    from .model.gemm import resolve_gemm
    packed = resolve_gemm("auto", dtype, device)  # 'panel', 'onednn', 'onednn-f32' or 'torch'
    key, path = peak_key(dtype, threads, shape, packed, q4, device), peak_cache_path()
    earlier = _read_cache(path).get(key)
    earlier = earlier if isinstance(earlier, dict) and isinstance(earlier.get("gflops"), dict) else None
    if not refresh and earlier is not None:
        return earlier | {"cached": True}
    if on_cpu:
        torch.set_num_threads(threads)
    try:
        gflops = _matmul_rates(dtype, shape, packed, seconds * 0.75, q4, device)
        bandwidth = read_bandwidth(seconds * 0.25, device)
    finally:
        torch.set_num_threads(before)
    measurements = 1
    if earlier is not None:  # merged: module docstring
        gflops = _best_rates(gflops, earlier["gflops"])
        bandwidth = max(bandwidth, _number(earlier.get("bandwidth_gbps")))
        measurements += int(_number(earlier.get("measurements")) or 1)
    top = str(PEAK_ROWS[-1])  # string keys, as JSON gives them back from the cache
    best = max(gflops, key=lambda p: gflops[p][top])
    peak = {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."), "threads": threads,
            "torch": torch.__version__, "shape": list(shape), "gemm": best,
            "gemm_gflops": gflops[best][top], "gemm_rows": PEAK_ROWS[-1], "gflops": gflops,
            "bandwidth_gbps": bandwidth, "measurements": measurements,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write_cache(path, key, peak)
    return peak | {"cached": False}


def _best_rates(now: dict[str, dict[str, float]], before: dict) -> dict[str, dict[str, float]]:
    """Each (path, rows) rate of a new measurement, or the earlier one's where that was higher."""
    def earlier(path: str, rows: str) -> float:
        rates = before.get(path)
        return _number(rates.get(rows)) if isinstance(rates, dict) else 0.0
    return {path: {rows: max(rate, earlier(path, rows)) for rows, rate in rates.items()} for path, rates in now.items()}


def _number(x) -> float:
    """A cached figure, or 0 where the cache holds something else (an edited or older file)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0


def runtime_peak(rt, refresh: bool = False) -> dict:
    """``measure_peak`` for a runtime (loaded or closed: only its settings are read): its device
    and dtype on its model's hidden -> FFN shape, with its 4-bit path (``q4_path``)."""
    shape = (rt.model_cfg.hidden_size, rt.model_cfg.intermediate_size)
    q4 = q4_path(rt.quant, rt.int8_activations, shape)  # '' off the CPU: 4-bit weights run there only
    return measure_peak(rt.dtype, shape, refresh=refresh, q4=q4, device=rt.device)


def _best_seconds(fn, budget: float, device: torch.device = torch.device("cpu")) -> float:
    """The fastest of repeated calls of ``fn`` within about ``budget`` seconds (best, not mean:
    on a shared machine the fastest call is the one nothing else interrupted). On an accelerator
    a sample is ``DEVICE_CALLS`` calls closed by a synchronization, and its time per call counts."""
    calls = 1 if device.type == "cpu" else DEVICE_CALLS
    sync = (lambda: None) if device.type == "cpu" else partial(getattr(torch, device.type).synchronize, device)

    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - t0) / calls

    sample()  # first-call costs (allocation, kernel selection) are not the rate
    best, stop = math.inf, time.perf_counter() + budget
    while True:
        best = min(best, sample())
        if time.perf_counter() >= stop:
            return best


def q4_path(quant: str, int8_activations: bool, shape: tuple[int, int]) -> str:
    """The 4-bit kernel path a run's peak should include: 'q4' or 'q4-int8' for ``quant: gguf``
    on tinyllm's kernel (where the shape fits its blocks), else ''."""
    from .model.quant import GROUP, q4_usable
    if quant == "none" or not q4_usable(torch.device("cpu")) or shape[0] % GROUP or shape[1] % 16:
        return ""
    return "q4-int8" if int8_activations else "q4"


def _matmul_rates(dtype: torch.dtype, shape: tuple[int, int], packed: str, budget: float,
                  q4: str = "", device: torch.device = torch.device("cpu")) -> dict[str, dict[str, float]]:
    """GFLOP/s of x[rows, hidden] @ W[FFN, hidden]^T per row count on ``device``, for F.linear,
    the resolved ``packed`` path and the 4-bit kernel in mode ``q4`` (random 4-bit codes,
    bfloat16 rows; CPU)."""
    from .model.gemm import linear_for
    k, n = shape
    w = torch.randn(n, k).to(device, dtype)
    paths = {"torch": partial(F.linear, weight=w)}
    if packed != "torch":
        paths[packed] = linear_for(packed, w, None)
    if q4:
        from .model.quant import Q4Linear, QuantWeight
        scale = torch.rand(n, k // 32) / 100
        q = QuantWeight(torch.randint(0, 16, (n, k), dtype=torch.uint8), scale, -8 * scale)
        lin = Q4Linear(q, None, int8=q4 == "q4-int8")
        paths[q4] = lambda x: lin(x.to(torch.bfloat16))
    slice_s = budget / (len(paths) * len(PEAK_ROWS))
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, fn in paths.items():
            out[name] = {}
            for rows in PEAK_ROWS:
                x = torch.randn(rows, k).to(device, dtype)
                seconds = _best_seconds(lambda: fn(x), slice_s, device)
                # Significant digits, not decimals: a tiny model's rate on a starved host can be
                # under 0.05 GFLOP/s, and a peak rounded to 0 would divide every bound by zero.
                out[name][str(rows)] = _sig(2 * rows * k * n / seconds / 1e9)
    return out


def read_bandwidth(budget: float = 0.5, device: torch.device = torch.device("cpu")) -> float:
    """GB/s of summing a ``BANDWIDTH_BYTES`` float32 tensor on ``device`` (a read stream, like
    weights): the best pass within ``budget`` seconds."""
    x = torch.ones(BANDWIDTH_BYTES // 4, device=device)  # written once, so every page is mapped before timing
    with torch.inference_mode():
        return _sig(x.nbytes / _best_seconds(x.sum, budget, device) / 1e9)
