"""Running the comparison: for each shape and precision, every engine round robin over
``--repeat`` rounds (a worker stopped while another engine is timed), then the row's limits and
greedy agreement; then the single-stream and end-to-end rows.

Invariant: an engine that cannot start or fails leaves a note on its cells and the comparison
goes on; no worker process outlives a row, on any path out of it (Ctrl-C included).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

from .agreement import REFERENCE_DTYPE, agreement
from .common import BATCHED, ENGINE_NAMES, INT4, Q4, Run, Skip, log
from .comparison import Comparison
from .engines.hf import HFEngine
from .engines.llamacpp import LlamaCppEngine, llamacpp_single, llamacpp_tokens
from .engines.openvino import OpenVINOEngine, ov_precision
from .engines.tinyllm import TinyEngine, tinyllm_e2e, tinyllm_single
from .engines.vllm import VLLMEngine, vllm_e2e, vllm_model_len
from .guard import WorkerEngine
from .isa import capped_cpu, engine_isa
from .machine import mem_available
from .models import default_gguf, kv_gib
from .workloads import make_prompts, shape_prompts, total_tokens


def open_engine(cmp: Comparison, name: str, factory, where: str = ""):
    """Start one engine; None (with the note kept) when it cannot run. A set-up failure (no venv,
    no build) skips the engine everywhere; a failure to start on one row skips that row only."""
    try:
        return factory()
    except Skip as e:
        log(f"{ENGINE_NAMES[name]} {where}: skipped: {e}")
        return e
    except Exception as e:  # noqa: BLE001 (an engine that cannot start is a note, not the end)
        log(f"{ENGINE_NAMES[name]} {where}: skipped: {type(e).__name__}: {e}")
        return Skip(f"{type(e).__name__}: {str(e)[:200]}")


def row_factories(cmp: Comparison, ctx: dict, shape: str, dtype: str) -> dict:
    """name -> a function that starts the engine for one (shape, dtype) row. Every engine gets the
    same KV memory (``kv``), 2 threads and the row's precision."""
    a, kv = cmp.args, kv_gib(cmp.args, shape)
    if dtype == Q4:
        return default_model_factories(cmp, ctx) if shape == "135m" else {}
    if dtype == INT4:
        return {"tinyllm": lambda: TinyEngine(str(ctx["q4_gguf"](shape)), None, a.config, kv),
                "openvino": lambda: OpenVINOEngine(ctx["ov_py"](), ctx["ov_dir"](shape, "int4"),
                                                   ov_precision(dtype, capped_cpu(cmp.cpu, a.isa)),
                                                   a.cache_dir / "openvino-runs.log", kv, a.vllm_timeout,
                                                   engine_isa(a.isa, "openvino", a.uncapped), a.isa != "native"),
                "llamacpp": lambda: LlamaCppEngine(ctx["llamacpp"](), row_gguf(ctx, shape, dtype))}
    hf_dir = ctx["hf_dir"](shape)
    return {"tinyllm": lambda: TinyEngine(str(hf_dir), dtype, a.batch_config, kv),
            "hf": lambda: HFEngine(hf_dir, dtype),
            "openvino": lambda: OpenVINOEngine(ctx["ov_py"](), ctx["ov_dir"](shape, "fp32"),
                                               ov_precision(dtype, capped_cpu(cmp.cpu, a.isa)),
                                               a.cache_dir / "openvino-runs.log", kv, a.vllm_timeout,
                                               engine_isa(a.isa, "openvino", a.uncapped), a.isa != "native"),
            "vllm": lambda: VLLMEngine(ctx["vllm_py"](), hf_dir, dtype, a.cache_dir / "vllm-runs.log", kv,
                                       a.vllm_timeout, vllm_model_len(ctx["workloads"], a.workloads),
                                       engine_isa(a.isa, "vllm", a.uncapped)),
            "llamacpp": lambda: LlamaCppEngine(ctx["llamacpp"](), row_gguf(ctx, shape, dtype))}


def row_gguf(ctx: dict, shape: str, dtype: str) -> Path:
    """The GGUF llama.cpp runs on a row (tinyllm's int4 row runs on the same file)."""
    if dtype == Q4:
        return default_gguf()
    return ctx["q4_gguf"](shape) if dtype == INT4 else ctx["gguf"](shape, dtype)


def llamacpp_row_tokens(cmp: Comparison, ctx: dict, shape: str, dtype: str, prompts: dict) -> None:
    """llama.cpp's greedy tokens on the row's prompts, for the agreement column only: its timed
    runs (llama-batched-bench) produce no tokens. Skipped with a log line when it cannot run."""
    if "llamacpp" not in cmp.args.engines or "llamacpp" in cmp.notes or dtype not in REFERENCE_DTYPE:
        return
    for bench, ps in prompts.items():
        if not cmp.cell(bench, dtype, "llamacpp", "tok/s", shape).values:
            continue
        try:
            log(f"llama.cpp greedy tokens for {shape} {bench} {dtype} (untimed, one prompt at a time) ...")
            cmp.tokens[(shape, bench, dtype, "llamacpp")] = llamacpp_tokens(
                ctx["llamacpp_py"](), ctx["llamacpp"](), row_gguf(ctx, shape, dtype), ps,
                ctx["workloads"][bench].output_len, ctx["work"])
        except Exception as e:  # noqa: BLE001 (the row keeps its timings without a score)
            log(f"llama.cpp {shape} {bench} {dtype}: no agreement: {e}")


def default_model_factories(cmp: Comparison, ctx: dict) -> dict:
    return {"tinyllm": lambda: TinyEngine("default", None, cmp.args.config),
            "llamacpp": lambda: LlamaCppEngine(ctx["llamacpp"](), default_gguf())}


# Engines that hold their own copy of the weights for the whole row when kept warm; transformers
# loads per run and llama.cpp maps the file per run, so one more copy is there at a time.
RESIDENT = ("tinyllm", "openvino", "vllm")
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, INT4: 1, Q4: 1}


def keep_warm(hf_dir: Path, dtype: str, names, mem_available: int | None, kv_bytes: int = 0) -> bool:
    """Whether every engine of a row can stay loaded at once: the weights in the row's precision
    times (resident engines + 1 transient copy), plus each resident engine's KV pool, must fit in
    60% of the available memory. If not (the 1.5B shape in f32 and bf16), each engine is started,
    run on every workload and closed in turn inside each round: still round robin, but its
    start-up is paid once per round (untimed)."""
    if mem_available is None:
        return True
    params = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors")) / 4  # written in f32
    resident = sum(n in RESIDENT for n in names)
    need = params * BYTES_PER_PARAM.get(dtype, 4) * (resident + 1) + resident * kv_bytes
    return need < 0.6 * mem_available


def run_batched(cmp: Comparison, ctx: dict) -> None:
    """For each shape and dtype: the engines, round robin over repeats (see run_rounds)."""
    a = cmp.args
    benches = [b for b in a.workloads if b in BATCHED]
    if not benches:
        return
    for shape in a.shapes:
        try:
            hf_dir = ctx["hf_dir"](shape)
        except Exception as e:  # noqa: BLE001 (the other shapes still run)
            log(f"shape {shape}: skipped: {type(e).__name__}: {e}")
            cmp.notes[f"shape {shape}"] = str(e)
            continue
        prompts = {}
        for b in benches:
            try:
                prompts[b] = shape_prompts(shape, hf_dir, ctx["workloads"][b], a.seed)
            except Exception as e:  # noqa: BLE001 (the shape's other workloads still run)
                log(f"shape {shape}, {b}: skipped: {type(e).__name__}: {e}")
                cmp.notes[f"shape {shape} {b}"] = str(e)
        if not prompts:
            continue
        for dtype in a.dtypes:
            factories = {n: f for n, f in row_factories(cmp, ctx, shape, dtype).items()
                         if n in a.engines and n not in cmp.notes}
            if not factories:  # q4_1 exists for the default model (135m) only
                continue
            warm = keep_warm(hf_dir, dtype, factories, mem_available(), kv_gib(a, shape) << 30)
            run_rounds(cmp, ctx, factories, prompts, shape, dtype, warm)
            row_limits(cmp, ctx, shape, dtype, prompts)
            llamacpp_row_tokens(cmp, ctx, shape, dtype, prompts)
            score_row(cmp, ctx, shape, dtype, prompts)


def run_rounds(cmp: Comparison, ctx: dict, factories: dict, prompts: dict, shape: str, dtype: str,
               warm: bool) -> None:
    """Round r runs every engine on every workload before round r + 1 starts. Warm: every engine
    is started once for the row and stays loaded; otherwise each is started and closed per round."""
    a, engines = cmp.args, {}
    where = f"{shape} {dtype}"
    log(f"{where}: engines {'kept warm' if warm else 'started per round (memory)'}: "
        + ", ".join(ENGINE_NAMES[n] for n in factories))
    try:
        for r in range(a.repeat):
            for name, factory in factories.items():
                if name not in engines:
                    log(f"starting {ENGINE_NAMES[name]} ({where}) ...")
                    engines[name] = open_engine(cmp, name, factory, where)
                    if isinstance(engines[name], TinyEngine):
                        cmp.runtimes.setdefault((shape, dtype), engines[name].facts())
                eng = engines[name]
                only(engines, name)
                for b in prompts:
                    if isinstance(eng, Skip):
                        cmp.cell(b, dtype, name, "tok/s", shape).note = str(eng)
                        continue
                    run_one(cmp, ctx, eng, name, shape, b, dtype, prompts[b], r)
                    note_isa(cmp, name, eng)
                if not warm and not isinstance(eng, Skip):
                    eng.close()
                    del engines[name]
                    gc.collect()
            for b in prompts:
                log(f"{shape} {b} {dtype} round {r + 1}/{a.repeat}: " + ", ".join(
                    f"{ENGINE_NAMES[n]} {c.values[-1]:.1f}" for n in factories
                    if (c := cmp.cell(b, dtype, n, "tok/s", shape)).values))
    finally:  # also on Ctrl-C: no worker process is left behind
        for eng in engines.values():
            if not isinstance(eng, Skip):
                eng.close()
        engines.clear()
        gc.collect()


def note_isa(cmp: Comparison, name: str, eng) -> None:
    """Under --isa, what verified engine ``name``'s cap (its ``isa_check``, see isa.py), taken once,
    after its first run (llama.cpp prints its features when it runs); logged when not capped."""
    if cmp.args.isa == "native" or name in cmp.isa_checks or not hasattr(eng, "isa_check"):
        return
    check = eng.isa_check()
    if check is None:
        return
    cmp.isa_checks[name] = check
    log(f"{ENGINE_NAMES[name]} --isa {cmp.args.isa}: " + (
        "capped (verified)" if check["ok"] else f"not capped: {check.get('uncapped', '?')}"))


def only(engines: dict, name: str) -> None:
    """Continue engine ``name``'s worker and stop every other loaded one (``WorkerEngine.pause``):
    an idle engine must not take the machine from the one being timed."""
    for n, eng in engines.items():
        if not isinstance(eng, WorkerEngine):
            continue
        if n == name:
            eng.resume()
        else:
            eng.pause()


def row_limits(cmp: Comparison, ctx: dict, shape: str, dtype: str, prompts: dict) -> None:
    """The work per total token of each bench on this row and the CPU's peak (see the module
    docstring), measured now that every engine of the row is closed; nothing without tinyllm's
    model for the row."""
    if (shape, dtype) not in cmp.runtimes:
        return
    from tinyllm_cli.roofline import runtime_peak, workload_bound_s, workload_work
    rt, weight_bytes, kv_bytes = cmp.runtimes[(shape, dtype)]
    peak = runtime_peak(rt, refresh=True)  # merged with the cache: the best this machine has reached
    for bench, ps in prompts.items():
        out_len = ctx["workloads"][bench].output_len
        lens, kw = [len(p) for p in ps], dict(weight_bytes=weight_bytes, kv_elem_bytes=kv_bytes)
        w = workload_work(rt.model_cfg, lens, out_len, **kw)
        bound = workload_bound_s(rt.model_cfg, lens, out_len, peak, **kw)
        cmp.limits[(shape, bench, dtype)] = workload_limit(w, bound, total_tokens(ps, out_len), peak)


def workload_limit(work, bound_s: float, tokens: int, peak: dict) -> dict:
    """FLOPs, bytes and roofline seconds per total token of a workload, and the peak they are
    held against."""
    return {"flops_per_token": work.flops / tokens, "bytes_per_token": work.bytes / tokens,
            "bound_s_per_token": bound_s / tokens,
            "peak_gflops": peak["gemm_gflops"], "peak_path": peak["gemm"], "peak_rows": peak["gemm_rows"],
            "bandwidth_gbps": peak["bandwidth_gbps"], "peak_measurements": peak.get("measurements", 1),
            "peak_measured_at": peak.get("measured_at")}


def engine_rates(limit: dict, tok_s: float) -> dict:
    """An engine's achieved GFLOP/s and GB/s at ``tok_s`` total tokens/s, their fractions of the
    peak and the bandwidth, and the workload's least time over its time (``roofline.workload_bound_s``)."""
    gflops, gbps = tok_s * limit["flops_per_token"] / 1e9, tok_s * limit["bytes_per_token"] / 1e9
    sig = lambda x: float(f"{x:.4g}")  # noqa: E731 (a tiny test model's rates are far below 0.1)
    return {"gflops": sig(gflops), "peak_frac": sig(gflops / limit["peak_gflops"]),
            "gbps": sig(gbps), "bw_frac": sig(gbps / limit["bandwidth_gbps"]),
            "bound_frac": sig(tok_s * limit["bound_s_per_token"])}


def run_one(cmp: Comparison, ctx: dict, eng, name: str, shape: str, bench: str, dtype: str, prompts, rnd: int):
    time.sleep(cmp.args.settle)  # the previous engine's spinning threads go idle first
    out_len = ctx["workloads"][bench].output_len
    run = cmp.attempt(bench, dtype, name, "tok/s", lambda: eng.run(prompts, out_len), shape)
    if run is not None:
        record_batched(cmp, shape, bench, dtype, name, run, rnd)


def record_batched(cmp: Comparison, shape: str, bench: str, dtype: str, name: str, run: Run, rnd: int) -> None:
    c = cmp.cell(bench, dtype, name, "tok/s", shape)
    c.values.append(round(run.tok_s, 2))
    c.runs.append({"elapsed_s": round(run.elapsed_s, 4), "total_tokens": run.total_tokens} | run.extra)
    if rnd == 0 and run.token_ids is not None:
        cmp.tokens[(shape, bench, dtype, name)] = [list(t) for t in run.token_ids]


def reference_tokens(cmp: Comparison, ctx: dict, shape: str, bench: str, dtype: str, prompts) -> list | None:
    """transformers' greedy tokens for the row's reference: its first timed run where it ran,
    else one untimed ``generate`` (the 4-bit rows when the f32 row was not run)."""
    ref_dtype = REFERENCE_DTYPE.get(dtype)
    if ref_dtype is None:
        return None
    key = (shape, bench, ref_dtype, "hf")
    if key not in cmp.tokens:
        try:
            log(f"transformers {ref_dtype} reference for {shape} {bench} (untimed) ...")
            run = HFEngine(ctx["hf_dir"](shape), ref_dtype).run(prompts, ctx["workloads"][bench].output_len)
            cmp.tokens[key] = [list(t) for t in run.token_ids]
        except Exception as e:  # noqa: BLE001 (the row keeps its timings without a score)
            log(f"no transformers reference for {shape} {bench} {dtype}: {e}")
            return None
    return cmp.tokens[key]


def score_row(cmp: Comparison, ctx: dict, shape: str, dtype: str, prompts: dict) -> None:
    """Every engine's first-round tokens on the row, scored against transformers (see agreement);
    transformers itself is the reference, so it gets no score."""
    for bench, ps in prompts.items():
        have = [k for k in cmp.tokens if k[:3] == (shape, bench, dtype) and k[3] != "hf"]
        if not have:
            continue
        ref = reference_tokens(cmp, ctx, shape, bench, dtype, ps)
        if ref is None:
            continue
        for key in have:
            cmp.agreement[key] = agreement(ref, cmp.tokens[key])


def run_single(cmp: Comparison, ctx: dict) -> None:
    """Single stream on the default model plus tinyllm's start-up split, repeated round robin."""
    a = cmp.args
    if "single" not in a.workloads:
        return
    n = ctx["single_new"]
    label = a.config.name if a.config else "default config"
    for _ in range(a.repeat):
        if "tinyllm" in a.engines:
            res = cmp.attempt("single", label, "tinyllm", "tok/s", lambda: tinyllm_single(a.config, n, ctx["work"]))
            if res:
                cmp.add("single", label, "tinyllm", res["decode_tok_s"], res)
                cmp.add("start-up, default model", label, "tinyllm", res["to_first_step_s"], res, "s")
        if "llamacpp" in a.engines and "llamacpp" not in cmp.notes:
            res = cmp.attempt("single", label, "llamacpp", "tok/s",
                              lambda: llamacpp_single(ctx["llamacpp"](), default_gguf(), n))
            if res:
                cmp.add("single", label, "llamacpp", res["decode_tok_s"], res)


def run_e2e(cmp: Comparison, ctx: dict) -> None:
    """The 64-prompt job, each engine a fresh process (cold start counted), round robin; its
    start-up row is the time before generation starts, on the same model for both."""
    a = cmp.args
    if "e2e" not in a.workloads:
        return
    wl = ctx["workloads"]["e2e"]
    hf_dir = ctx["hf_dir"]("135m")
    prompts = make_prompts(hf_dir, wl, a.seed + 1)
    for dtype in [d for d in a.dtypes if d in ("float32", "bfloat16")]:
        for _ in range(a.repeat):
            if "tinyllm" in a.engines:
                res = cmp.attempt("e2e", dtype, "tinyllm", "s", lambda: tinyllm_e2e(
                    hf_dir, dtype, prompts, wl.output_len, a.batch_config, ctx["work"]))
                if res:
                    cmp.add("e2e", dtype, "tinyllm", res["wall_s"], res, "s")
                    cmp.add("start-up", dtype, "tinyllm", res["to_generate_s"], res, "s")
            if "vllm" in a.engines and "vllm" not in cmp.notes:
                res = cmp.attempt("e2e", dtype, "vllm", "s", lambda: vllm_e2e(
                    ctx["vllm_py"](), hf_dir, dtype, prompts, wl.output_len, ctx["work"],
                    a.cache_dir / "vllm-runs.log", kv_gib(a, "135m"), engine_isa(a.isa, "vllm", a.uncapped)))
                if res:
                    cmp.add("e2e", dtype, "vllm", res["wall_s"], res, "s")
                    cmp.add("start-up", dtype, "vllm", res["to_generate_s"], res, "s")
