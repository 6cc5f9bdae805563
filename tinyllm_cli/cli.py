"""The ``tinyllm`` command line: parse flags, load config, call the library, render. No engine logic.

Exit codes: 0 success, 2 usage/config error (nothing ran), 1 runtime error, 130 on SIGINT and
143 on SIGTERM (every finished result is already on disk). stdout carries results only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import Interrupted, TinyLLMError, UsageError, shield

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Batch generation and KV-cache experiments with small Llama-family models.")

def package_version() -> str:
    """The installed distribution's version; a source tree that was never installed has none."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tinyllm")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e . records it)"


def _print_version(value: bool) -> None:
    if value:
        print(f"tinyllm {package_version()}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print the installed version and exit.")] = False):
    pass


# ---- options shared by every command that runs the engine ------------------------------------

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file (defaults are built in).")]
ModelOpt = Annotated[Optional[str], typer.Option(help="'default', a .gguf file, a Hugging Face model directory or a Hub id ORG/NAME[@REVISION].")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16.")]
GemmOpt = Annotated[Optional[str], typer.Option(help="Weight matmuls: auto (oneDNN with packed weights on CPU), onednn or torch.")]
QuantOpt = Annotated[Optional[str], typer.Option(help="Weights: none (dequantize) or gguf (keep a GGUF's 4-/8-bit blocks; CPU, bfloat16).")]
CacheOpt = Annotated[Optional[str], typer.Option("--cache", help="KV cache kind: paged or slot.")]
AttnOpt = Annotated[Optional[str], typer.Option("--attention", help="Attention over the cache: auto, kernel (tinyllm's CPU kernel, reads K/V in the blocks) or gather (PyTorch SDPA on copied K/V).")]
BlockOpt = Annotated[Optional[int], typer.Option(help="Tokens per KV block (paged cache).")]
NumBlocksOpt = Annotated[Optional[int], typer.Option(help="KV pool size in blocks (wins over --kv-memory).")]
KvMemOpt = Annotated[Optional[str], typer.Option(help="KV pool size in bytes, e.g. 512MiB.")]
SeqsOpt = Annotated[Optional[int], typer.Option(help="Most sequences running at once.")]
LenOpt = Annotated[Optional[int], typer.Option(help="Longest prompt + output, in tokens.")]
PrefillOpt = Annotated[Optional[int], typer.Option(help="Prefill token budget per step (longer prompts are chunked).")]
NewOpt = Annotated[Optional[int], typer.Option(help="Tokens to generate per request.")]
TempOpt = Annotated[Optional[float], typer.Option(help="0 = greedy.")]
TopPOpt = Annotated[Optional[float], typer.Option()]
TopKOpt = Annotated[Optional[int], typer.Option(help="0 = off.")]
MinPOpt = Annotated[Optional[float], typer.Option()]
RepOpt = Annotated[Optional[float], typer.Option(help="1.0 = off.")]
SeedOpt = Annotated[Optional[int], typer.Option(help="Sampling seed (per request streams derive from it).")]
NOpt = Annotated[Optional[int], typer.Option("--n", help="Completions per prompt (the prompt is prefilled once).")]
LogprobsOpt = Annotated[Optional[int], typer.Option("--logprobs", help="Report each output token's logprob and K alternatives (0-20).")]
PromptLogprobsOpt = Annotated[Optional[int], typer.Option("--prompt-logprobs",
                                                          help="Report each prompt token's logprob and K alternatives (0-20).")]
PrefixOpt = Annotated[Optional[bool], typer.Option("--prefix-cache/--no-prefix-cache",
                                                   help="Reuse K/V of shared prompt prefixes (paged; default on).")]
EosOpt = Annotated[Optional[bool], typer.Option("--ignore-eos/--no-ignore-eos", help="Keep generating past EOS.")]
ChatOpt = Annotated[bool, typer.Option("--chat/--raw", help="Wrap plain prompts in the model's chat template.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or tables.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
StatsOpt = Annotated[Optional[Path], typer.Option("--stats-json", help="Write run stats as JSON here.")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="Draw the results into FILE.png or FILE.svg (needs tinyllm[plot]).")]
WorkersOpt = Annotated[Optional[int], typer.Option("--workers", help="Engine workers on a Ray cluster (1 = in-process).")]
RayAddressOpt = Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster: 'auto', HOST:PORT or 'local' "
                                                      "(default: a local instance when --workers > 1).")]
WorkerCpusOpt = Annotated[Optional[float], typer.Option("--worker-cpus", help="CPUs per Ray worker (its torch threads).")]
WorkerGpusOpt = Annotated[Optional[float], typer.Option("--worker-gpus", help="GPUs per Ray worker.")]


def overrides(**kw) -> dict:
    keys = {"model": "model", "device": "device", "dtype": "dtype", "gemm": "gemm", "quant": "quant", "cache": "cache.kind", "attention": "cache.attention",
            "block_size": "cache.block_size", "num_blocks": "cache.num_blocks", "kv_memory": "cache.kv_memory",
            "max_model_len": "cache.max_model_len", "max_num_seqs": "scheduler.max_num_seqs",
            "max_prefill_tokens": "scheduler.max_prefill_tokens", "max_new_tokens": "sampling.max_new_tokens",
            "temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
            "min_p": "sampling.min_p", "repetition_penalty": "sampling.repetition_penalty",
            "seed": "sampling.seed", "ignore_eos": "sampling.ignore_eos", "prefix_cache": "cache.prefix_caching",
            "workers": "parallel.workers", "ray_address": "parallel.ray_address",
            "worker_cpus": "parallel.worker_cpus", "worker_gpus": "parallel.worker_gpus",
            "n": "sampling.n", "logprobs": "sampling.logprobs", "prompt_logprobs": "sampling.prompt_logprobs"}
    return {keys[k]: v for k, v in kw.items() if k in keys and v is not None}


# ---- generate ------------------------------------------------------------------------------

@app.command()
def generate(
    prompts: Annotated[str, typer.Option("--prompts", "-p", help="Prompts: .txt (one per line), .jsonl, or - for stdin.")],
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="JSONL results file (default stdout).")] = None,
    resume: Annotated[bool, typer.Option(help="Skip ids already in --output and append the rest.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 1 if any request failed.")] = False,
    config: ConfigOpt = None, model: ModelOpt = None, device: DeviceOpt = None, dtype: DtypeOpt = None,
    gemm: GemmOpt = None, quant: QuantOpt = None, cache: CacheOpt = None, attention: AttnOpt = None, block_size: BlockOpt = None, num_blocks: NumBlocksOpt = None,
    kv_memory: KvMemOpt = None, max_num_seqs: SeqsOpt = None, max_model_len: LenOpt = None,
    max_prefill_tokens: PrefillOpt = None, max_new_tokens: NewOpt = None, temperature: TempOpt = None,
    top_p: TopPOpt = None, top_k: TopKOpt = None, min_p: MinPOpt = None, repetition_penalty: RepOpt = None,
    seed: SeedOpt = None, ignore_eos: EosOpt = None, chat: ChatOpt = True, quiet: QuietOpt = False,
    debug: DebugOpt = False, stats_json: StatsOpt = None, prefix_cache: PrefixOpt = None,
    workers: WorkersOpt = None, ray_address: RayAddressOpt = None, worker_cpus: WorkerCpusOpt = None,
    worker_gpus: WorkerGpusOpt = None,
    n: NOpt = None, logprobs: LogprobsOpt = None, prompt_logprobs: PromptLogprobsOpt = None,
):
    """Generate completions for a file of prompts; results in input order as JSONL."""
    from .cluster import check_available
    from .commands import run_generate
    from .config import load_config
    ov = overrides(**locals())
    cfg = load_config(config, ov)
    check_available(cfg)
    if resume and output in (None, "-"):
        raise UsageError("--resume needs --output FILE (it appends to that file)")
    code = run_generate(cfg, prompts, output, resume, strict, chat, quiet, stats_json)
    raise typer.Exit(code)


# ---- serve-batch ---------------------------------------------------------------------------

@app.command("serve-batch")
def serve_batch(
    input: Annotated[str, typer.Option("--input", "-i", help="OpenAI Batch API JSONL, or - for stdin.")] = "-",
    output: Annotated[str, typer.Option("--output", "-o", help="Results JSONL, or - for stdout.")] = "-",
    request_rate: Annotated[Optional[float], typer.Option(help="Poisson arrivals per second (default: as fast as read).")] = None,
    max_inflight: Annotated[Optional[int], typer.Option(help="Most requests inside the engine at once.")] = None,
    config: ConfigOpt = None, model: ModelOpt = None, device: DeviceOpt = None, dtype: DtypeOpt = None,
    gemm: GemmOpt = None, quant: QuantOpt = None, cache: CacheOpt = None, attention: AttnOpt = None, block_size: BlockOpt = None, num_blocks: NumBlocksOpt = None,
    kv_memory: KvMemOpt = None, max_num_seqs: SeqsOpt = None, max_model_len: LenOpt = None,
    max_prefill_tokens: PrefillOpt = None, max_new_tokens: NewOpt = None, temperature: TempOpt = None,
    top_p: TopPOpt = None, top_k: TopKOpt = None, seed: SeedOpt = None, ignore_eos: EosOpt = None,
    quiet: QuietOpt = False, debug: DebugOpt = False, stats_json: StatsOpt = None, prefix_cache: PrefixOpt = None,
    workers: WorkersOpt = None, ray_address: RayAddressOpt = None, worker_cpus: WorkerCpusOpt = None,
    worker_gpus: WorkerGpusOpt = None,
    n: NOpt = None, logprobs: LogprobsOpt = None, prompt_logprobs: PromptLogprobsOpt = None,
):
    """Serve OpenAI Batch API requests as a stream; results in completion order."""
    from .cluster import check_available
    from .config import load_config
    from .serve import run_serve
    cfg = load_config(config, overrides(**locals()))
    check_available(cfg)
    if request_rate is not None and request_rate <= 0:
        raise UsageError("--request-rate must be a positive number of requests per second")
    if max_inflight is not None and max_inflight <= 0:
        raise UsageError("--max-inflight must be a positive integer")
    raise typer.Exit(run_serve(cfg, input, output, request_rate, max_inflight, quiet, stats_json))


# ---- bench ---------------------------------------------------------------------------------

@app.command()
def bench(
    block_sizes: Annotated[Optional[str], typer.Option("--block-size", help="Comma list, e.g. 8,16,32.")] = None,
    caches: Annotated[str, typer.Option("--cache", help="Comma list of cache kinds: paged,slot.")] = "paged,slot",
    num_prompts: Annotated[int, typer.Option(help="Random-token prompts to generate.")] = 32,
    input_len: Annotated[int, typer.Option(help="Mean prompt length (random prompts).")] = 128,
    output_len: Annotated[int, typer.Option(help="Tokens generated per request.")] = 64,
    range_ratio: Annotated[float, typer.Option(help="Prompt lengths uniform in L*(1-r)..L*(1+r).")] = 0.5,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="Use a prompts file instead of random tokens.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", "--stats-json",
                                                     help="Write the rows (each run's stats) as JSON.")] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Write the rows as CSV.")] = None,
    bench_seed: Annotated[int, typer.Option("--workload-seed", help="Seed of the random workload.")] = 0,
    warmup: Annotated[bool, typer.Option(help="One short untimed run first.")] = True,
    prefix_len: Annotated[int, typer.Option(help="Shared-prefix workload: tokens of shared prefix per prompt.")] = 0,
    num_prefixes: Annotated[int, typer.Option(help="Shared-prefix workload: distinct prefixes (round robin).")] = 1,
    prefix_modes: Annotated[str, typer.Option("--prefix-cache", help="Paged runs with prefix caching: on, off or on,off.")] = "on",
    baseline: Annotated[Optional[str], typer.Option(help="Also run 'hf' (transformers generate) on the same workload.")] = None,
    roofline: Annotated[bool, typer.Option("--roofline", help="Measure GEMM FLOP/s on the model's shapes; report fractions.")] = False,
    repeat: Annotated[int, typer.Option(help="Runs per row (round robin); rows report the median run.")] = 1,
    profile: Annotated[bool, typer.Option("--profile", help="Rerun the first row under torch.profiler; show where the time goes.")] = False,
    n_values: Annotated[Optional[str], typer.Option("--n", help="Comma list of completions per prompt, e.g. 1,4: one row each.")] = None,
    config: ConfigOpt = None, model: ModelOpt = None, device: DeviceOpt = None, dtype: DtypeOpt = None,
    gemm: GemmOpt = None, quant: QuantOpt = None, attention: AttnOpt = None, num_blocks: NumBlocksOpt = None, kv_memory: KvMemOpt = None,
    max_num_seqs: SeqsOpt = None, max_model_len: LenOpt = None, max_prefill_tokens: PrefillOpt = None, chat: ChatOpt = False,
    quiet: QuietOpt = False, debug: DebugOpt = False, plot: PlotOpt = None,
    workers: Annotated[Optional[str], typer.Option("--workers", help="Comma list of Ray worker counts, e.g. 1,2 "
                                                   "(1 = in-process); rows report scaling.")] = None,
    ray_address: RayAddressOpt = None, worker_cpus: WorkerCpusOpt = None, worker_gpus: WorkerGpusOpt = None,
):
    """Run one seeded workload per cache kind x block size at equal KV memory; one row each."""
    from .bench import BenchSpec, run_bench
    from .cluster import check_available, worker_counts
    from .config import load_config
    from .plot import prepare
    prepare(plot)
    counts = worker_counts(workers)
    cfg = load_config(config, overrides(model=model, device=device, dtype=dtype, gemm=gemm, quant=quant, num_blocks=num_blocks,
                                         attention=attention, kv_memory=kv_memory, max_num_seqs=max_num_seqs,
                                         max_model_len=max_model_len, max_prefill_tokens=max_prefill_tokens,
                                         workers=max(counts), ray_address=ray_address, worker_cpus=worker_cpus,
                                         worker_gpus=worker_gpus))
    check_available(cfg)
    spec = BenchSpec.parse(block_sizes, caches, num_prompts, input_len, output_len, range_ratio, prompts,
                           bench_seed, warmup, chat, cfg, prefix_len, num_prefixes, prefix_modes, baseline, roofline,
                           profile, repeat, n_values)
    spec.workers = counts
    raise typer.Exit(run_bench(cfg, spec, json_out, csv_out, quiet, plot))


# ---- inspect-blocks ------------------------------------------------------------------------

@app.command("inspect-blocks")
def inspect_blocks(
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="Prompts file (else random prompts).")] = None,
    num_prompts: Annotated[int, typer.Option(help="Random-token prompts.")] = 12,
    input_len: Annotated[int, typer.Option(help="Mean random prompt length.")] = 48,
    output_len: Annotated[int, typer.Option(help="Tokens generated per request.")] = 32,
    range_ratio: Annotated[float, typer.Option(help="Prompt lengths uniform in L*(1-r)..L*(1+r).")] = 0.5,
    at: Annotated[str, typer.Option(help="Snapshot moment: peak, end, or a step number.")] = "peak",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write snapshot + timeline as JSON.")] = None,
    config: ConfigOpt = None, model: ModelOpt = None, device: DeviceOpt = None, dtype: DtypeOpt = None,
    gemm: GemmOpt = None, quant: QuantOpt = None, block_size: BlockOpt = None, num_blocks: NumBlocksOpt = None, kv_memory: KvMemOpt = None,
    max_num_seqs: SeqsOpt = None, max_model_len: LenOpt = None, chat: ChatOpt = False,
    quiet: QuietOpt = False, debug: DebugOpt = False, prefix_cache: PrefixOpt = None,
    max_prefill_tokens: PrefillOpt = None, stats_json: StatsOpt = None, plot: PlotOpt = None, n: NOpt = None,
):
    """Show the paged cache's block map, block tables, free list and timeline."""
    from .config import load_config
    from .inspect_blocks import run_inspect
    from .plot import prepare
    prepare(plot)
    cfg = load_config(config, overrides(model=model, device=device, dtype=dtype, gemm=gemm, quant=quant, block_size=block_size,
                                         num_blocks=num_blocks, kv_memory=kv_memory, max_num_seqs=max_num_seqs,
                                         max_model_len=max_model_len, cache="paged", ignore_eos=True,
                                         max_new_tokens=output_len, prefix_cache=prefix_cache,
                                         max_prefill_tokens=max_prefill_tokens, n=n),
                      # a pool small enough to read as a map (and to see preemption), unless sized by the user
                      command_defaults={"cache.num_blocks": 64})
    raise typer.Exit(run_inspect(cfg, prompts, num_prompts, input_len, output_len, range_ratio, at,
                                 json_out, chat, quiet, stats_json, plot, cfg.sampling.n))


# ---- plot ----------------------------------------------------------------------------------

@app.command("plot")
def plot_command(
    stats: Annotated[Path, typer.Argument(help="A saved JSON: bench --json, inspect-blocks --json or a --stats-json run.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="FILE.png or FILE.svg.")],
    debug: DebugOpt = False,
):
    """Draw a saved bench, inspect-blocks or run JSON again, without rerunning anything."""
    from .plot import plot_saved
    kind = plot_saved(stats, output)
    print(f"drew {kind} stats from {stats} into {output}", file=sys.stderr)


# ---- entry point ---------------------------------------------------------------------------

def _on_signal(signum, frame):
    shield.interrupt(signum)  # raises Interrupted, unless a result line is being written


def main(argv: list[str] | None = None) -> None:
    """Run the CLI. Every failure ends in exactly one line on stderr (a traceback too only with
    --debug) and nothing on stdout; SIGINT/SIGTERM unwind as ``Interrupted`` (exit 130/143)."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _on_signal)
    try:
        code = app(args=argv, prog_name="tinyllm", standalone_mode=False)
    except TinyLLMError as e:
        _fail(e, debug, f"error: {e}", e.exit_code)
    except Interrupted as e:
        _fail(e, debug, e.message or f"interrupted by {e.signal_name}", e.exit_code)
    except KeyboardInterrupt as e:  # handlers not installed (not the main thread)
        _fail(e, debug, "interrupted", 130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except Exception as e:  # click usage errors and anything unexpected
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `tinyllm`: the help is the answer
            e.show()
            sys.exit(2)
        if _is_click_error(e):
            _fail(e, False, f"error: {e.format_message()}{_help_hint(e)}", getattr(e, "exit_code", 2))
        if type(e).__name__ == "Abort":
            _fail(e, debug, "interrupted", 130)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        _fail(e, debug, f"error: internal error ({type(e).__name__}: {first}); "
                        f"rerun with --debug for the traceback", 1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.exit(code if isinstance(code, int) else 0)


def _is_click_error(e: BaseException) -> bool:
    # typer vendors its own copy of click, so match by class name rather than by import.
    return any(c.__name__ == "ClickException" for c in type(e).__mro__)


def _help_hint(e) -> str:
    ctx = getattr(e, "ctx", None)
    return f" (see '{ctx.command_path} --help')" if ctx is not None else ""


def _fail(e: BaseException, debug: bool, message: str, code: int) -> None:
    if debug:
        traceback.print_exception(e)
    print(" ".join(message.split()), file=sys.stderr)  # one line, whatever the message holds
    _quiet_stdout()
    sys.exit(code)


def _quiet_stdout() -> None:
    """stdout may be a closed pipe (``| head``): flush now, and if that fails point it at
    /dev/null so the interpreter's own flush at exit prints no second error."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
