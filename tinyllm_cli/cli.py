"""The ``tinyllm`` command line: parse flags, load config, call the library, render. No engine logic.

Exit codes: 0 success, 2 usage/config error (nothing ran), 1 runtime error, 130 on SIGINT and
143 on SIGTERM (every finished result is already on disk). stdout carries results only.
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import Interrupted, TinyLLMError, UsageError, shield
from .version import package_version

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Batch generation and KV-cache experiments with small Llama-family models.")



def _print_version(value: bool) -> None:
    if value:
        print(f"tinyllm {package_version()}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print the installed version and exit.")] = False):
    pass


# ---- options, declared once -----------------------------------------------------------------
# Every option a command shares with another is declared here, once, by the setting's own name
# (``config.flat_keys``); ``@shared(...)`` adds the ones a command takes to its signature and
# hands their values to it as one ``Opts`` mapping.

SHARED: dict[str, tuple[object, object]] = {
    "config": (Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file (defaults are built in).")], None),
    "model": (Annotated[Optional[str], typer.Option(help="'default', a .gguf file, a Hugging Face model directory or a Hub id ORG/NAME\\[@REVISION].")], None),
    "device": (Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or cuda:N.")], None),
    "dtype": (Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16.")], None),
    "gemm": (Annotated[Optional[str], typer.Option(help="Weight matmuls: auto (CPU: panel wherever tinyllm's kernels build with AVX2 or AVX-512; else oneDNN), panel (tinyllm's kernel), onednn or torch.")], None),
    "quant": (Annotated[Optional[str], typer.Option(help="Weights: none (dequantize) or gguf (keep a GGUF's 4-/8-bit blocks; CPU, bfloat16).")], None),
    "quant_activations": (Annotated[Optional[str], typer.Option(help="With --quant gguf, what the 4-bit matmuls multiply: bfloat16 (the default), int8 (quantized per group of 32, as llama.cpp does) or auto (int8 wherever tinyllm's 4-bit kernel runs, on AVX2 or AVX512-VNNI integer dot products: faster there).")], None),
    "attention": (Annotated[Optional[str], typer.Option("--attention", help="Attention over the cache: auto, kernel (tinyllm's CPU kernel, reads K/V in the blocks) or gather (PyTorch SDPA on copied K/V).")], None),
    "cache": (Annotated[Optional[str], typer.Option("--cache", help="KV cache kind: paged or slot.")], None),
    "block_size": (Annotated[Optional[int], typer.Option(help="Tokens per KV block (paged cache).")], None),
    "num_blocks": (Annotated[Optional[int], typer.Option(help="KV pool size in blocks (wins over --kv-memory).")], None),
    "kv_memory": (Annotated[Optional[str], typer.Option(help="KV pool size in bytes, e.g. 512MiB; auto (default): max_num_seqs x max_model_len tokens, at most half the free memory.")], None),
    "max_model_len": (Annotated[Optional[int], typer.Option(help="Longest prompt + output, in tokens.")], None),
    "prefix_cache": (Annotated[Optional[bool], typer.Option("--prefix-cache/--no-prefix-cache", help="Reuse K/V of shared prompt prefixes (paged; default on).")], None),
    "max_num_seqs": (Annotated[Optional[int], typer.Option(help="Most sequences running at once.")], None),
    "max_prefill_tokens": (Annotated[Optional[int], typer.Option(help="Prefill token budget per step (longer prompts are chunked).")], None),
    "max_new_tokens": (Annotated[Optional[int], typer.Option(help="Tokens to generate per request.")], None),
    "temperature": (Annotated[Optional[float], typer.Option(help="0 = greedy.")], None),
    "top_p": (Annotated[Optional[float], typer.Option()], None),
    "top_k": (Annotated[Optional[int], typer.Option(help="0 = off.")], None),
    "min_p": (Annotated[Optional[float], typer.Option()], None),
    "repetition_penalty": (Annotated[Optional[float], typer.Option(help="1.0 = off.")], None),
    "seed": (Annotated[Optional[int], typer.Option(help="The run's seed (default 0): each request without its own 'seed' samples with one derived from it and the request's id.")], None),
    "ignore_eos": (Annotated[Optional[bool], typer.Option("--ignore-eos/--no-ignore-eos", help="Keep generating past EOS.")], None),
    "n": (Annotated[Optional[int], typer.Option("--n", help="Completions per prompt (the prompt is prefilled once).")], None),
    "logprobs": (Annotated[Optional[int], typer.Option("--logprobs", help="Report each output token's logprob and K alternatives (0-20).")], None),
    "prompt_logprobs": (Annotated[Optional[int], typer.Option("--prompt-logprobs", help="Report each prompt token's logprob and K alternatives (0-20).")], None),
    "json_schema": (Annotated[Optional[Path], typer.Option("--json-schema", help="Structured output: every output is JSON valid against the schema in FILE (needs tinyllm\\[structured]).")], None),
    "json_object": (Annotated[Optional[bool], typer.Option("--json-object/--no-json-object", help="Structured output: every output is a JSON object.")], None),
    "regex": (Annotated[Optional[str], typer.Option("--regex", help="Structured output: every output matches this regular expression.")], None),
    "choice": (Annotated[Optional[list[str]], typer.Option("--choice", help="Structured output: every output is one of these strings (repeat the flag).")], None),
    "grammar": (Annotated[Optional[Path], typer.Option("--grammar", help="Structured output: every output is in the GBNF/EBNF grammar in FILE.")], None),
    "workers": (Annotated[Optional[int], typer.Option("--workers", help="Engine workers on a Ray cluster (1 = in-process).")], None),
    "ray_address": (Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster: 'auto', HOST:PORT or 'local' (default: a local instance when --workers > 1).")], None),
    "worker_cpus": (Annotated[Optional[float], typer.Option("--worker-cpus", help="CPUs per Ray worker (its torch threads).")], None),
    "worker_gpus": (Annotated[Optional[float], typer.Option("--worker-gpus", help="GPUs per Ray worker.")], None),
    "max_attempts": (Annotated[Optional[int], typer.Option("--max-attempts", help="Ray workers: failures of a request (alone on a worker) before it is answered with an error.")], None),
    "max_restarts": (Annotated[Optional[int], typer.Option("--max-restarts", help="Ray workers: dead workers replaced by new ones, at most.")], None),
    "insecure": (Annotated[Optional[bool], typer.Option("--ray-insecure/--ray-secure", help="Join a remote Ray cluster without token authentication (off by default).")], None),
    "speculative": (Annotated[Optional[str], typer.Option("--speculative", help="Speculative decoding of greedy requests: none, ngram (prompt lookup, no second model) or draft (--draft-model drafts).")], None),
    "num_speculative_tokens": (Annotated[Optional[int], typer.Option("--num-speculative-tokens", help="Draft tokens verified per sequence per step, at most (1-16; default 4).")], None),
    "prompt_lookup_min": (Annotated[Optional[int], typer.Option("--prompt-lookup-min", help="ngram: shortest n-gram of the latest tokens looked up in the earlier ones (default 1).")], None),
    "prompt_lookup_max": (Annotated[Optional[int], typer.Option("--prompt-lookup-max", help="ngram: longest n-gram, tried first (default 3).")], None),
    "draft_model": (Annotated[Optional[str], typer.Option("--draft-model", help="draft: a smaller model with the same tokenizer ('default', a .gguf file, a directory or a Hub id).")], None),
    "draft_quant": (Annotated[Optional[str], typer.Option("--draft-quant", help="draft: how the draft keeps its weights, as --quant (default: the target's); gguf keeps a GGUF draft's 4-bit blocks under a float32 target.")], None),
    "quiet": (Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or tables.")], False),
    "debug": (Annotated[bool, typer.Option("--debug", help="Show tracebacks.")], False),
    "stats_json": (Annotated[Optional[Path], typer.Option("--stats-json", help="Write run stats as JSON here.")], None),
    "plot": (Annotated[Optional[Path], typer.Option("--plot", help="Draw the results into FILE.png or FILE.svg (needs tinyllm\\[plot]).")], None),
    # The workload flags: what bench, inspect-blocks and simulate run when no trace or file is given.
    "prompts": (Annotated[Optional[str], typer.Option("--prompts", help="Run a prompts file (.txt or .jsonl) instead of random-token prompts.")], None),
    "chat": (Annotated[bool, typer.Option("--chat/--raw", help="Wrap a --prompts file's plain prompts in the chat template.")], False),
    "num_prompts": (Annotated[int, typer.Option("--num-prompts", help="Random-token prompts (synthetic requests).")], 32),
    "input_len": (Annotated[int, typer.Option("--input-len", help="Mean prompt length, in tokens.")], 128),
    "output_len": (Annotated[int, typer.Option("--output-len", help="Tokens generated per request (EOS ignored; simulate: the mean).")], 64),
    "range_ratio": (Annotated[float, typer.Option("--range-ratio", help="Lengths uniform in L*(1-r)..L*(1+r).")], 0.5),
    "prefix_len": (Annotated[int, typer.Option("--prefix-len", help="Shared-prefix workload: tokens of shared prefix before each prompt.")], 0),
    "num_prefixes": (Annotated[int, typer.Option("--num-prefixes", help="Shared-prefix workload: distinct prefixes (round robin).")], 1),
    "workload_seed": (Annotated[int, typer.Option("--workload-seed", help="Seed of the random workload.")], 0),
}
GROUPS = {
    "MODEL": ("config", "model", "device", "dtype", "gemm", "quant", "quant_activations", "attention"),
    "CACHE": ("cache", "block_size", "num_blocks", "kv_memory", "max_model_len", "prefix_cache"),
    "SCHEDULER": ("max_num_seqs", "max_prefill_tokens"),
    "SAMPLING": ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                 "ignore_eos", "n", "logprobs", "prompt_logprobs", "json_schema", "json_object", "regex", "choice",
                 "grammar"),
    "SPECULATIVE": ("speculative", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "draft_model",
                    "draft_quant"),
    "CLUSTER": ("workers", "ray_address", "worker_cpus", "worker_gpus", "max_attempts", "max_restarts", "insecure"),
    "RUN": ("quiet", "debug", "stats_json"),
    "SYNTHETIC": ("num_prompts", "input_len", "output_len", "range_ratio", "prefix_len", "num_prefixes",
                  "workload_seed"),
}
GROUPS["WORKLOAD"] = ("prompts", "chat", *GROUPS["SYNTHETIC"])
NOT_SETTINGS = {"config", "quiet", "debug", "stats_json", "plot", *GROUPS["WORKLOAD"]}  # options that are not config keys
ChatOpt = Annotated[bool, typer.Option("--chat/--raw", help="Wrap plain prompts in the model's chat template.")]


class Opts(dict):
    """A command's shared option values, by name (``opts["quiet"]`` or ``opts.quiet``)."""

    __getattr__ = dict.__getitem__

    def config(self, command_defaults: dict | None = None, **more):
        """The run's Config: the --config file, then every shared flag given (and ``more``)."""
        from .config import flat_overrides, load_config
        settings = {k: v for k, v in self.items() if k not in NOT_SETTINGS} | more
        settings |= _constraint_files(settings)
        return load_config(self.get("config"), flat_overrides(settings), command_defaults=command_defaults)

    def workload(self):
        """The workload flags (``GROUPS["WORKLOAD"]``, or the synthetic part of them) as one value."""
        from .workload import Workload
        return Workload(num_prompts=self.num_prompts, input_len=self.input_len, output_len=self.output_len,
                        range_ratio=self.range_ratio, prefix_len=self.prefix_len, num_prefixes=self.num_prefixes,
                        seed=self.workload_seed, prompts=self.get("prompts"), chat=self.get("chat", False))


def _constraint_files(settings: dict) -> dict:
    """--json-schema FILE and --grammar FILE: their contents, read and checked (usage errors)."""
    out = {}
    for key, what in (("json_schema", "--json-schema"), ("grammar", "--grammar")):
        path = settings.get(key)
        if path is None:
            continue
        from .io import existing_file
        try:
            text = existing_file(str(path), f"{what} file").read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{what} file {str(path)!r} is not UTF-8 text")
        if key == "grammar":
            out[key] = text
            continue
        import json
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"{what} file {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno})")
        if not isinstance(out[key], dict):
            raise UsageError(f"{what} file {str(path)!r} must hold a JSON object (a schema)")
    if settings.get("choice") is not None:  # a repeatable flag: () or [] when not given
        out["choice"] = list(settings["choice"]) or None
    return out


STRUCTURED = ("json_schema", "json_object", "regex", "choice", "grammar")


def shared(*names: str):
    """Add the named shared options (or GROUPS) to a command; it receives them as ``opts``."""
    picked = [n for name in names for n in GROUPS.get(name, (name,))]

    def deco(fn):
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=SHARED[n][1], annotation=SHARED[n][0])
                 for n in picked]

        @functools.wraps(fn)
        def command(**kw):
            opts = Opts({n: kw.pop(n) for n in picked})
            return fn(**kw, opts=opts)

        params = own + extra
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command
    return deco


def renamed(ctx: typer.Context, old: str, new: str, old_value, new_value):
    """A deprecated spelling of a flag, still taken (hidden from --help) by the command that had
    it: ``old`` and ``new`` are the two parameters' names. The old one's value, with a note on
    stderr, where only it was given; both given is a usage error; else the new one's value."""
    if not _given(ctx, old):
        return new_value
    flag = {p.name: p.opts[0] for p in ctx.command.params}
    if _given(ctx, new):
        raise UsageError(f"{flag[old]} is the old name of {flag[new]}: give {flag[new]} only")
    print(f"note: {flag[old]} is deprecated here; it is {flag[new]} now", file=sys.stderr)
    return old_value


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the option was on the command line (not its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


# ---- generate ------------------------------------------------------------------------------

@app.command()
@shared("MODEL", "CACHE", "SCHEDULER", "SAMPLING", "SPECULATIVE", "CLUSTER", "RUN")
def generate(
    prompts: Annotated[str, typer.Option("--prompts", "-p", help="Prompts: .txt (one per line), .jsonl, or - for stdin (lines up to 16 MiB; a longer one is that request's error).")],
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="JSONL results file (default stdout).")] = None,
    resume: Annotated[bool, typer.Option(help="Skip ids already in --output and append the rest.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 1 if any request failed.")] = False,
    chat: ChatOpt = True, opts: Opts = None,
):
    """Generate completions for a file of prompts; results in input order as JSONL."""
    from .commands.generate import run_generate
    cfg = opts.config()
    if resume and output in (None, "-"):
        raise UsageError("--resume needs --output FILE (it appends to that file)")
    raise typer.Exit(run_generate(cfg, prompts=prompts, output=output, resume=resume, strict=strict, chat=chat,
                                  quiet=opts.quiet, stats_json=opts.stats_json))


# ---- serve-batch ---------------------------------------------------------------------------

@app.command("serve-batch")
@shared("MODEL", "CACHE", "SCHEDULER", "SAMPLING", "SPECULATIVE", "CLUSTER", "RUN")
def serve_batch(
    input: Annotated[str, typer.Option("--input", "-i", help="OpenAI Batch API JSONL, or - for stdin (lines up to 16 MiB; a longer one is answered with an error line).")] = "-",
    output: Annotated[str, typer.Option("--output", "-o", help="Results JSONL, or - for stdout.")] = "-",
    request_rate: Annotated[Optional[float], typer.Option(help="Poisson arrivals per second (default: as fast as read).")] = None,
    max_inflight: Annotated[Optional[int], typer.Option(help="Most requests inside the engine at once.")] = None,
    strict: Annotated[bool, typer.Option(help="Exit 1 if any line was answered with an error.")] = False,
    opts: Opts = None,
):
    """Serve OpenAI Batch API requests as a stream; results in completion order.

    Memory stays flat on an endless stream; an input line over 16 MiB is skipped without being
    held and answered with an error line for that line number."""
    from .commands.serve_batch import run_serve
    cfg = opts.config()
    if request_rate is not None and request_rate <= 0:
        raise UsageError("--request-rate must be a positive number of requests per second")
    if max_inflight is not None and max_inflight <= 0:
        raise UsageError("--max-inflight must be a positive integer")
    raise typer.Exit(run_serve(cfg, input=input, output=output, request_rate=request_rate, max_inflight=max_inflight,
                               quiet=opts.quiet, stats_json=opts.stats_json, strict=strict))


# ---- serve ---------------------------------------------------------------------------------

@app.command()
@shared("MODEL", "CACHE", "SCHEDULER", "SAMPLING", "SPECULATIVE", "CLUSTER", "quiet", "debug")
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default; another needs --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port, shown on stderr).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="TINYLLM_API_KEY", show_envvar=True, help="Require 'Authorization: Bearer KEY' on every endpoint but /health.")] = None,
    allow_no_auth: Annotated[bool, typer.Option("--allow-no-auth", help="Serve a non-loopback --host without an API key (anyone who can reach it can use it).")] = False,
    max_waiting: Annotated[int, typer.Option(help="Most requests waiting to run; past it, new ones get 429 with Retry-After.")] = 256,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted (bytes); larger ones get 413.")] = 4 << 20,
    drain_timeout: Annotated[float, typer.Option(help="On SIGTERM, seconds to let running requests finish before stopping.")] = 30.0,
    served_model_name: Annotated[Optional[str], typer.Option(help="The model name clients send and /v1/models lists (default: the model's).")] = None,
    opts: Opts = None,
):
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)."""
    from .commands.serve import require_serve, run_serve
    require_serve()  # one sentence naming the install command, before the model loads
    for flag, value in (("--max-waiting", max_waiting), ("--max-body-bytes", max_body_bytes)):
        if value <= 0:
            raise UsageError(f"{flag} must be a positive integer")
    if drain_timeout < 0:
        raise UsageError("--drain-timeout must be >= 0 seconds")
    if not 0 <= port <= 65535:
        raise UsageError("--port must be from 0 to 65535")
    from .config import SERVE_DEFAULTS
    cfg = opts.config(command_defaults=SERVE_DEFAULTS)
    raise typer.Exit(run_serve(cfg, host=host, port=port, api_key=api_key, allow_no_auth=allow_no_auth,
                               max_waiting=max_waiting, max_body_bytes=max_body_bytes, drain_timeout=drain_timeout,
                               served_model_name=served_model_name, quiet=opts.quiet))


# ---- bench ---------------------------------------------------------------------------------

@app.command()
@shared("MODEL", "num_blocks", "kv_memory", "max_model_len", "SCHEDULER", "SPECULATIVE", "ray_address", "worker_cpus",
        "worker_gpus", "max_attempts", "max_restarts", "insecure", "quiet", "debug", "plot", *STRUCTURED, "WORKLOAD")
def bench(
    ctx: typer.Context,
    block_sizes: Annotated[Optional[str], typer.Option("--block-size", help="Sweep: a comma list, e.g. 8,16,32.")] = None,
    caches: Annotated[str, typer.Option("--cache", help="Sweep: a comma list of cache kinds, paged,slot.")] = "paged,slot",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the rows (each run's stats) as JSON.")] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Write the rows as CSV.")] = None,
    warmup: Annotated[bool, typer.Option(help="One short untimed run first.")] = True,
    prefix_modes: Annotated[str, typer.Option("--prefix-cache", help="Sweep: paged runs with prefix caching on, off or on,off.")] = "on",
    baseline: Annotated[Optional[str], typer.Option(help="Also run 'hf' (transformers generate) on the same workload.")] = None,
    roofline: Annotated[bool, typer.Option("--roofline/--no-roofline", help="Show each row's GFLOP/s and GB/s as "
                                           "fractions of this CPU's measured (cached) matmul peak and bandwidth.")] = True,
    remeasure_peak: Annotated[bool, typer.Option("--remeasure-peak", help="Measure the peak again; the cache "
                                                 "keeps each rate at the better of both measurements.")] = False,
    repeat: Annotated[int, typer.Option(help="Runs per row (round robin); rows report the median run.")] = 1,
    torch_profile: Annotated[bool, typer.Option("--torch-profile", help="Rerun the first row under torch.profiler; show where the time goes.")] = False,
    n_values: Annotated[Optional[str], typer.Option("--n", help="Sweep: a comma list of completions per prompt, e.g. 1,4.")] = None,
    workers: Annotated[Optional[str], typer.Option("--workers", help="Sweep: a comma list of Ray worker counts, e.g. 1,2 "
                                                   "(1 = in-process); rows report scaling.")] = None,
    old_profile: Annotated[bool, typer.Option("--profile", hidden=True)] = False,
    old_stats_json: Annotated[Optional[Path], typer.Option("--stats-json", hidden=True)] = None,
    opts: Opts = None,
):
    """Run one seeded workload per cache kind x block size at equal KV memory; one row each."""
    from .commands.bench import BenchSpec, run_bench
    from .plot import prepare
    torch_profile = renamed(ctx, "old_profile", "torch_profile", old_profile, torch_profile)
    json_out = renamed(ctx, "old_stats_json", "json_out", old_stats_json, json_out)
    prepare(opts.plot)
    cfg = opts.config()
    spec = BenchSpec.parse(cfg, block_sizes=block_sizes, caches=caches, workload=opts.workload(), warmup=warmup,
                           prefix_cache=prefix_modes, baseline=baseline, roofline=roofline,
                           remeasure_peak=remeasure_peak, torch_profile=torch_profile,
                           repeat=repeat, n_values=n_values, workers=workers)
    if max(spec.workers) > 1:
        from .cluster import require_ray
        require_ray()  # before anything loads
    raise typer.Exit(run_bench(cfg, spec, json_out, csv_out, opts.quiet, opts.plot))


# ---- inspect-blocks ------------------------------------------------------------------------

@app.command("inspect-blocks")
@shared("MODEL", "block_size", "num_blocks", "kv_memory", "max_model_len", "prefix_cache", "SCHEDULER", "n",
        "CLUSTER", "RUN", "plot", *STRUCTURED, "WORKLOAD")
def inspect_blocks(
    at: Annotated[str, typer.Option(help="Snapshot moment: peak, end, or a step number.")] = "peak",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write snapshot + timeline as JSON.")] = None,
    opts: Opts = None,
):
    """Show the paged cache's block map, block tables, free list and timeline."""
    from .commands.inspect_blocks import run_inspect
    from .plot import prepare
    prepare(opts.plot)
    # A pool small enough to read as a map (and to see preemption), unless sized by the user.
    cfg = opts.config(command_defaults={"cache.num_blocks": 64}, cache="paged", ignore_eos=True,
                      max_new_tokens=opts.output_len)
    raise typer.Exit(run_inspect(cfg, workload=opts.workload(), at=at, json_out=json_out, quiet=opts.quiet,
                                 stats_json=opts.stats_json, plot=opts.plot, n=cfg.sampling.n))


# ---- plot ----------------------------------------------------------------------------------

@app.command("plot")
@shared("debug")
def plot_command(
    stats: Annotated[Path, typer.Argument(help="A saved JSON: bench --json, inspect-blocks --json, load --json or a --stats-json run.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="FILE.png or FILE.svg.")],
    opts: Opts = None,
):
    """Draw a saved bench, inspect-blocks, load or run JSON again, without rerunning anything."""
    from .commands.plot import run_plot
    raise typer.Exit(run_plot(stats, output))


# ---- load ----------------------------------------------------------------------------------

@app.command("load")
@shared("quiet", "debug", "plot")
def load(
    url: Annotated[str, typer.Option("--url", help="The server's OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1.")],
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="TINYLLM_API_KEY", show_envvar=True, help="Sent as 'Authorization: Bearer KEY'.")] = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="completions or chat.")] = "completions",
    served_model: Annotated[Optional[str], typer.Option("--model", help="The model name to request (default: the first the server lists).")] = None,
    request_rate: Annotated[Optional[str], typer.Option("--request-rate", help="Comma list of request rates per second, one run each; inf sends every request at once (default inf; with --trace: the trace's own arrival times).")] = None,
    burstiness: Annotated[float, typer.Option("--burstiness", help="Gamma arrivals' shape: 1 is Poisson, below 1 burstier.")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option("--max-concurrency", help="Requests in flight at most; the others wait their turn (their send lag shows it).")] = None,
    num_requests: Annotated[Optional[int], typer.Option("--num-requests", help="Requests per rate (default 100; with --trace: every line).")] = None,
    duration: Annotated[Optional[float], typer.Option("--duration", help="Instead of --num-requests: send for this many seconds per rate.")] = None,
    trace: Annotated[Optional[str], typer.Option("--trace", "-t", help="Requests JSONL in simulate's trace format (arrival_s, prompt_len, output_len, prefix_group ...).")] = None,
    time_scale: Annotated[float, typer.Option("--time-scale", help="Multiply a trace's arrival times (0.5 replays it twice as fast).")] = 1.0,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="Prompts file instead of random tokens: .txt (one per line) or .jsonl ('prompt' or 'messages').")] = None,
    input_len: Annotated[int, typer.Option(help="Random workload: mean prompt length in tokens.")] = 128,
    output_len: Annotated[int, typer.Option(help="Tokens generated per request, EOS ignored (random workload: the mean).")] = 64,
    range_ratio: Annotated[float, typer.Option(help="Random workload: lengths uniform in L*(1-r)..L*(1+r).")] = 0.5,
    prefix_len: Annotated[int, typer.Option(help="Random workload: shared-prefix tokens per prompt.")] = 0,
    num_prefixes: Annotated[int, typer.Option(help="Random workload: distinct shared prefixes.")] = 1,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Random workload and traces: token ids stay below this (the default model's vocabulary).")] = 49152,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the send times.")] = 0,
    workload_seed: Annotated[int, typer.Option("--workload-seed", help="Seed of the random workload's prompts.")] = 0,
    goodput: Annotated[Optional[list[str]], typer.Option("--goodput", help="SLOs in ms, e.g. 'ttft:500 tpot:50 e2el:5000': goodput counts the requests that meet every one.")] = None,
    server_metrics: Annotated[bool, typer.Option("--server-metrics", help="Read the server's Prometheus /metrics before, during and after each run.")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write every request's record and each rate's summary as JSON ('-': stdout).")] = None,
    opts: Opts = None,
):
    """Send open-loop load to an OpenAI-compatible server and report what each request experienced."""
    from .commands.serve import require_load
    require_load()  # one sentence naming the install command
    from .commands.load import LoadSpec, parse_rates, run_load
    from .loadgen.records import parse_goodput
    from .loadgen.schedule import Workload
    from .plot import prepare
    prepare(opts.plot)
    if endpoint not in ("completions", "chat"):
        raise UsageError(f"--endpoint must be completions or chat, not {endpoint!r}")
    try:
        slo = parse_goodput(goodput)
    except ValueError as e:
        raise UsageError(str(e))
    rates = [None] if trace is not None and request_rate is None else parse_rates(request_rate or "inf")
    if num_requests is None and duration is None and trace is None:
        num_requests = 100
    w = Workload(input_len=input_len, output_len=output_len, range_ratio=range_ratio, prefix_len=prefix_len,
                 num_prefixes=num_prefixes, vocab_size=vocab_size, trace=trace, prompts_file=prompts,
                 chat=endpoint == "chat", seed=workload_seed)
    spec = LoadSpec(url=url, model=served_model, api_key=api_key, rates=rates,
                    burstiness=burstiness, max_concurrency=max_concurrency, num_requests=num_requests,
                    duration_s=duration, time_scale=time_scale, seed=seed, workload=w, slo=slo,
                    server_metrics=server_metrics)
    raise typer.Exit(run_load(spec, json_out, opts.plot, opts.quiet))


# ---- simulate ------------------------------------------------------------------------------

sim_app = typer.Typer(no_args_is_help=False, help="Replay a trace through the real scheduler and block pool with a measured step-cost model.")
app.add_typer(sim_app, name="simulate")


@sim_app.callback(invoke_without_command=True)
@shared("config", "model", "CACHE", "SCHEDULER", "workers", "seed", "RUN", "plot", "SYNTHETIC")
def simulate(
    ctx: typer.Context,
    trace: Annotated[Optional[str], typer.Option("--trace", "-t", help="Requests JSONL (arrival_s, prompt_len, output_len, ...), or a generate / serve-batch output file.")] = None,
    cost_profile: Annotated[Optional[Path], typer.Option("--cost-profile", help="Step-cost profile JSON (default: the shipped one for the default model).")] = None,
    arrivals: Annotated[str, typer.Option(help="Synthetic: offline, poisson or gamma.")] = "offline",
    request_rate: Annotated[Optional[float], typer.Option(help="Arrivals per second: synthetic poisson/gamma (default 1); with --trace, the trace is fed as serve-batch --request-rate feeds it (Poisson, seeded by --seed), its own arrival_s replaced.")] = None,
    burstiness: Annotated[float, typer.Option(help="Synthetic gamma arrivals: shape (< 1 burstier than Poisson).")] = 1.0,
    save_trace: Annotated[Optional[str], typer.Option("--save-trace", help="Also write the trace used as JSONL.")] = None,
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="KEY=V1,V2,..: block_size, num_blocks, max_num_seqs, max_prefill_tokens or workers.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the rows (one per sweep point, each a run's stats) as JSON.")] = None,
    ttft_slo: Annotated[Optional[float], typer.Option("--ttft-slo", help="SLO on TTFT (s) for goodput.")] = None,
    tpot_slo: Annotated[Optional[float], typer.Option("--tpot-slo", help="SLO on TPOT (s) for goodput.")] = None,
    skip_ahead: Annotated[bool, typer.Option("--skip-ahead/--no-skip-ahead", help="Advance decode-only stretches in bulk (same decisions).")] = True,
    serving: Annotated[bool, typer.Option("--serving", help="Predict a live tinyllm serve: charge the profile's serving section (its HTTP cost a step, a request and a streamed token) and take serve's defaults (max_num_seqs 128).")] = False,
    max_waiting: Annotated[int, typer.Option(help="Most timed requests waiting to run, as serve's --max-waiting; past it, arrivals are refused and counted as rejected (0: no bound, as serve-batch).")] = 256,
    old_profile: Annotated[Optional[Path], typer.Option("--profile", hidden=True)] = None,
    old_num_requests: Annotated[Optional[int], typer.Option("--num-requests", hidden=True)] = None,
    opts: Opts = None,
):
    """Simulate a trace: the real scheduler and cache bookkeeping, no model; same stats as a real run."""
    if ctx.invoked_subcommand is not None:
        return
    from .commands.simulate import run_simulate
    from .plot import prepare
    cost_profile = renamed(ctx, "old_profile", "cost_profile", old_profile, cost_profile)
    opts["num_prompts"] = renamed(ctx, "old_num_requests", "num_prompts", old_num_requests, opts.num_prompts)
    prepare(opts.plot)
    workload = opts.workload()
    if trace is None:
        workload.check()
    from .config import SERVE_DEFAULTS
    cfg = opts.config(command_defaults=SERVE_DEFAULTS if serving else None)
    gen = dict(num=workload.num_prompts, input_len=workload.input_len, output_len=workload.output_len,
               arrivals=arrivals, rate=1.0 if request_rate is None else request_rate, burstiness=burstiness,
               range_ratio=workload.range_ratio, prefix_len=workload.prefix_len, num_prefixes=workload.num_prefixes,
               seed=workload.seed)
    if max_waiting < 0:
        raise UsageError(f"--max-waiting must be 0 (no bound) or more, not {max_waiting}")
    replay_rate = request_rate if trace is not None else None
    raise typer.Exit(run_simulate(cfg, trace=trace, replay_rate=replay_rate, cost_profile=cost_profile, gen=gen,
                                  sweep=sweep, ttft_slo=ttft_slo, tpot_slo=tpot_slo, save_trace=save_trace,
                                  quiet=opts.quiet, stats_json=opts.stats_json, json_out=json_out, plot=opts.plot,
                                  skip_ahead=skip_ahead, max_waiting=max_waiting or None, serving=serving))


@sim_app.command("calibrate")
@shared("MODEL", "CACHE", "max_prefill_tokens", "quiet", "debug")
def simulate_calibrate(
    output: Annotated[Path, typer.Option("--output", "-o", help="Profile JSON to write.")],
    scale: Annotated[float, typer.Option(help="Shrink the calibration workloads (0.1 .. 1).")] = 1.0,
    serving: Annotated[bool, typer.Option("--serving", help="Also measure tinyllm serve's HTTP cost (a server on 127.0.0.1 driven by tinyllm load) into the profile's serving section.")] = False,
    opts: Opts = None,
):
    """Time real steps of the configured model on this machine and fit a step-cost profile."""
    from .commands.simulate import run_calibrate
    if not 0 < scale <= 1:
        raise UsageError("--scale must be in (0, 1]")
    if serving:
        from .commands.serve import require_serve
        require_serve()
    raise typer.Exit(run_calibrate(opts.config(), output, opts.quiet, scale, serving=serving))


# ---- entry point ---------------------------------------------------------------------------

def _wrapped_interrupt(e: BaseException) -> Interrupted | None:
    """The ``Interrupted`` behind ``e``, if any. The signal handler raises it wherever the main
    thread is, and a C extension in the middle (Ray's Cython ``CoreWorker.wait``) returns it as a
    ``SystemError`` with the ``Interrupted`` as its cause: still a Ctrl-C, not an internal error."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, Interrupted):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


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
        if (cause := _wrapped_interrupt(e)) is not None:
            _fail(cause, debug, cause.message or f"interrupted by {cause.signal_name}", cause.exit_code)
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
