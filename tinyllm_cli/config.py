"""Typed configuration: built-in defaults < YAML file < command-line flags.

Invariants:
- Every key has a type and a default here; ``configs/default.yaml`` spells out the same values.
- Loading validates everything before anything is built: an unknown key, a wrong type or an
  out-of-range value is a ``UsageError`` naming the key, its line in the file, and for unknown
  keys the closest valid one. Nothing is loaded or run after such an error.
- A value the user set (in the file or by a flag) is never changed. A default may adapt to one
  the user set (``max_num_seqs`` shrinks to a small ``num_blocks``); two values the user set
  that contradict each other are an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .params import SamplingParams
from .errors import UsageError


@dataclass
class CacheConfig:
    kind: str = "paged"
    block_size: int = 16
    num_blocks: int | None = None  # wins over kv_memory when set
    kv_memory: str = "auto"  # bytes ("2GiB"), or auto: max_num_seqs x max_model_len tokens, capped by free memory
    max_model_len: int = 2048
    prefix_caching: bool = True  # paged only: reuse K/V blocks of shared prompt prefixes
    attention: str = "auto"  # kernel (CPU: every row of a step reads K/V in the blocks), gather (SDPA on copies), auto


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_prefill_tokens: int = 2048


@dataclass
class ParallelConfig:
    """The ``parallel`` section: data-parallel engine workers on a Ray cluster (``cluster.py``)."""
    workers: int = 1  # 1 without ray_address: the plain in-process engine
    ray_address: str | None = None  # None: start a local instance when workers > 1; 'auto'; HOST:PORT; 'local'
    worker_cpus: float = 1.0  # CPUs each worker reserves; also its torch thread count
    worker_gpus: float = 0.0
    max_attempts: int = 3  # failures with a request alone aboard a worker before it is answered with an error
    max_restarts: int = 2  # dead workers replaced by new ones, over the pool's life
    insecure: bool = False  # join a remote cluster without token authentication (never the default)


@dataclass
class SpeculativeConfig:
    """The ``speculative`` section: draft tokens verified in one forward (``engine/speculative.py``)."""
    method: str = "none"  # none, ngram (prompt lookup: no second model) or draft (draft_model drafts)
    num_tokens: int = 4  # draft tokens per sequence per step, at most
    prompt_lookup_min: int = 1  # ngram: shortest n-gram of the latest tokens looked up in the earlier ones
    prompt_lookup_max: int = 3  # ngram: longest (tried first)
    draft_model: str | None = None  # draft: a smaller model with the same tokenizer, given like ``model``
    # draft: how the draft model's weights are kept (as ``quant``; unset: the target's). 'gguf'
    # keeps a GGUF draft's 4-bit blocks (computing in bfloat16) under a target that does not: a
    # cheap drafter, even the target's own file, for an exact float32 target.
    draft_quant: str | None = None


SPEC_METHODS = ("none", "ngram", "draft")


@dataclass
class SamplingConfig(SamplingParams):
    """The ``sampling`` section: the defaults every request starts from (the same fields as a
    request's own sampling parameters, which override them per request)."""

    def params(self, **override) -> SamplingParams:
        values = dataclasses.asdict(self) | override
        return SamplingParams(**values)

    @property
    def run_seed(self) -> int:
        """The run's seed: ``seed``, or 0 when unset (so an unseeded run is reproducible too)."""
        return self.seed if self.seed is not None else 0

    def request_defaults(self) -> SamplingParams:
        """What a request starts from. ``seed`` here is the run's seed, not a request's: each
        request derives its own from it and its id (``engine.request.request_seed``), so two
        equal prompts under one run seed still draw different samples."""
        return self.params(seed=None)


@dataclass
class Config:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    gemm: str = "auto"
    quant: str = "none"  # 'gguf': keep a GGUF file's 4-bit/8-bit weights quantized (model/quant.py)
    quant_activations: str = "bfloat16"  # what quant: gguf's 4-bit matmuls multiply (model/quant.py)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "sampling": SamplingConfig,
            "parallel": ParallelConfig, "speculative": SpeculativeConfig}
DTYPES = ("auto", "float32", "bfloat16", "float16")
GEMMS = ("auto", "panel", "onednn", "torch")  # see model/gemm.py
QUANTS = ("none", "gguf")  # see model/quant.py
QUANT_ACTIVATIONS = ("auto", "bfloat16", "int8")  # see model/quant.py


def _hints(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, (str, int)) and not isinstance(value, bool)
    return True


def _type_name(hint) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return "a list of strings"
    if args:
        return names.get(args[0], str(args[0])) + " (or null)"
    return names.get(hint, str(hint))


def _unknown(key: str, valid, where: str) -> UsageError:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return UsageError(f"unknown config key {key!r}{where}{hint}")


def _line(node) -> str:
    return f" (line {node.start_mark.line + 1})" if node is not None else ""


def load_yaml(path: str | Path) -> tuple[dict, dict]:
    """Parse a YAML config into plain data plus a map from dotted key to its YAML node."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file {str(p)!r} does not exist" if not p.exists()
                         else f"config path {str(p)!r} is not a file")
    try:
        text = p.read_text(encoding="utf-8")
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except UnicodeDecodeError:
        raise UsageError(f"config file {str(p)!r} is not UTF-8 text")
    except RecursionError:
        raise UsageError(f"config file {str(p)!r} is nested too deeply to be a tinyllm config")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None)
        if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow; no mark
            where = f" at line {text[:e.position].count(chr(10)) + 1}"
            problem = f"character {e.character!r} is not allowed"
        problem = " ".join(str(problem or str(e).splitlines()[0]).split())
        raise UsageError(f"config file {str(p)!r} is not valid YAML{where}: {problem}")
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {str(p)!r} must be a mapping of sections (model, cache, ...)")
    nodes: dict[str, object] = {}
    for knode, vnode in root.value:
        _note(nodes, str(knode.value), knode, p)
        if isinstance(vnode, yaml.MappingNode):
            for k2, _ in vnode.value:
                _note(nodes, f"{knode.value}.{k2.value}", k2, p)
    return data, nodes


def _note(nodes: dict, dotted: str, node, p: Path) -> None:
    """Remember where a key is; a key given twice is an error (YAML would keep the last one)."""
    if dotted in nodes:
        raise UsageError(f"config key {dotted!r} is given twice in {str(p)!r} (lines "
                         f"{nodes[dotted].start_mark.line + 1} and {node.start_mark.line + 1})")
    nodes[dotted] = node


# A command's own default for a key does not apply when the user set a key that competes with it.
COMPETING = {"cache.num_blocks": ("cache.kv_memory",)}

# A live server's defaults (``serve``, and ``simulate --serving``, which predicts one): requests
# arrive over time, so more sequences may run at once than in a batch run. Past its throughput a
# server with 64 rows queues the newcomers (TTFT grows with the queue); with 128 it admits them
# and every row's TPOT grows a little instead, which is what a TTFT + TPOT SLO rewards
# (docs/serve.md measures both). vLLM's OpenAI server on a CPU defaults to 128 as well.
SERVE_DEFAULTS = {"scheduler.max_num_seqs": 128}


def build_config(data: dict, nodes: dict | None = None, overrides: dict | None = None,
                 command_defaults: dict | None = None) -> Config:
    """Validate ``data`` (from YAML) and apply ``overrides`` ({"cache.block_size": 32, ...}).
    ``command_defaults`` replace built-in defaults for one command (inspect-blocks' small pool);
    they count as defaults, not as values the user set."""
    nodes = nodes or {}
    if not isinstance(data, dict):
        raise UsageError("a config must be a mapping of sections (model, cache, ...)")
    cfg = Config()
    origins: dict[str, str] = {}  # dotted key -> where its value came from, for range errors
    top = {f.name for f in dataclasses.fields(Config)}
    for key, value in data.items():
        key = str(key)
        node = nodes.get(key)
        if key not in top:
            raise _unknown(key, top, _line(node))
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise UsageError(f"config section {key!r}{_line(node)} must be a mapping of keys")
            for k2, v2 in value.items():
                _set(cfg, f"{key}.{k2}", v2, nodes.get(f"{key}.{k2}"), origins=origins)
        else:
            _set(cfg, key, value, node, origins=origins)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set(cfg, dotted, value, None, from_flag=True, origins=origins)
    user_set = set(origins)
    for dotted, value in (command_defaults or {}).items():
        if not {dotted, *COMPETING.get(dotted, ())} & user_set:
            _set(cfg, dotted, value, None)
            origins[dotted] = " (this command's default)"
    adapt_defaults(cfg, user_set)
    validate(cfg, origins)
    return cfg


def adapt_defaults(cfg: Config, user_set: set[str]) -> None:
    """A paged pool needs a block per running sequence. When the pool has fewer blocks than
    ``max_num_seqs``, whichever of the two the user did not set gives way (``validate`` refuses
    the pair only when the user set both)."""
    c, s = cfg.cache, cfg.scheduler
    if c.kind != "paged" or c.num_blocks is None or not 0 < c.num_blocks < s.max_num_seqs:
        return  # (a non-positive num_blocks is validate's to refuse, as itself)
    if "scheduler.max_num_seqs" not in user_set:
        s.max_num_seqs = c.num_blocks
    elif "cache.num_blocks" not in user_set:
        c.num_blocks = s.max_num_seqs


def _set(cfg: Config, dotted: str, value, node, from_flag: bool = False, origins: dict | None = None) -> None:
    dotted = str(dotted)
    section, dot, key = dotted.partition(".")  # "cache.block_size"; a key may itself hold dots
    if not dot or section not in SECTIONS:
        section, key = "", dotted
    target = getattr(cfg, section) if section else cfg
    hints = _hints(type(target))
    where = " (command-line flag)" if from_flag else _line(node)
    if key not in hints:
        raise _unknown(key if not section else f"{section}.{key}",
                       [f"{section}.{k}" if section else k for k in hints], where)
    hint = hints[key]
    if isinstance(value, str) and hint is list[str]:
        value = [value]
    if not _type_ok(value, hint):
        raise UsageError(f"config key {dotted!r}{where} must be {_type_name(hint)}, not {value!r}")
    if hint is float and isinstance(value, int):
        value = float(value)
    if hint is str and isinstance(value, int):
        value = str(value)
    setattr(target, key, value)
    if origins is not None:
        origins[dotted] = where


def validate(cfg: Config, origins: dict[str, str] | None = None) -> None:
    """Range checks; ``origins`` (dotted key -> " (line N)" or " (command-line flag)") places them."""
    at = (origins or {}).get
    c, s = cfg.cache, cfg.scheduler
    positive = [("cache.block_size", c.block_size), ("cache.max_model_len", c.max_model_len),
                ("scheduler.max_num_seqs", s.max_num_seqs),
                ("scheduler.max_prefill_tokens", s.max_prefill_tokens)]
    if c.num_blocks is not None:
        positive.append(("cache.num_blocks", c.num_blocks))
    for name, v in positive:
        if v <= 0:
            raise UsageError(f"config key {name!r}{at(name, '')} must be a positive integer, not {v}")
    if c.kind not in ("paged", "slot"):
        raise UsageError(f"cache.kind{at('cache.kind', '')} must be 'paged' or 'slot', not {c.kind!r}")
    if c.kind == "paged" and c.num_blocks is not None and c.num_blocks < s.max_num_seqs:
        raise UsageError(f"cache.num_blocks{at('cache.num_blocks', '')} is {c.num_blocks}, fewer than "
                         f"scheduler.max_num_seqs{at('scheduler.max_num_seqs', '')} = {s.max_num_seqs}: every "
                         f"running sequence needs at least one block; raise num_blocks or lower max_num_seqs")
    par = cfg.parallel
    if par.workers < 1:
        raise UsageError(f"parallel.workers{at('parallel.workers', '')} must be at least 1, not {par.workers}")
    if par.max_attempts < 1 or par.max_restarts < 0:
        raise UsageError(f"parallel.max_attempts must be at least 1 and parallel.max_restarts at least 0, not "
                         f"{par.max_attempts} and {par.max_restarts}")
    if not par.worker_cpus > 0 or not par.worker_gpus >= 0:
        raise UsageError(f"parallel.worker_cpus must be > 0 and parallel.worker_gpus >= 0, not "
                         f"{par.worker_cpus} and {par.worker_gpus}")
    if cfg.dtype not in DTYPES:
        raise UsageError(f"dtype{at('dtype', '')} must be one of {', '.join(DTYPES)}, not {cfg.dtype!r}")
    if cfg.gemm not in GEMMS:
        raise UsageError(f"gemm{at('gemm', '')} must be one of {', '.join(GEMMS)}, not {cfg.gemm!r}")
    if cfg.quant not in QUANTS:
        raise UsageError(f"quant{at('quant', '')} must be one of {', '.join(QUANTS)}, not {cfg.quant!r}")
    if cfg.quant_activations not in QUANT_ACTIVATIONS:
        raise UsageError(f"quant_activations{at('quant_activations', '')} must be one of "
                         f"{', '.join(QUANT_ACTIVATIONS)}, not {cfg.quant_activations!r}")
    if cfg.quant_activations == "int8" and "gguf" not in (cfg.quant, draft_quant(cfg)):
        raise UsageError(f"quant_activations{at('quant_activations', '')} is int8, which applies to quant: gguf only "
                         f"(here quant is none); drop it or set quant: gguf")
    from .cache.attention import ATTENTION_PATHS
    if c.attention not in ATTENTION_PATHS:
        raise UsageError(f"cache.attention{at('cache.attention', '')} must be one of {', '.join(ATTENTION_PATHS)}, "
                         f"not {c.attention!r}")
    if not (cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:")):
        raise UsageError(f"device{at('device', '')} must be auto, cpu, cuda or cuda:N, not {cfg.device!r}")
    from .cache.blocks import CacheError, parse_bytes
    try:
        if c.kv_memory != "auto":
            parse_bytes(c.kv_memory)
    except CacheError as e:
        raise UsageError(f"cache.kv_memory{at('cache.kv_memory', '')}: {e}")
    except (ValueError, OverflowError):  # nan / inf get past parse_bytes' own check
        raise UsageError(f"cache.kv_memory{at('cache.kv_memory', '')}: cannot read {c.kv_memory!r} as a "
                         f"memory size (examples: 512MiB, 2GiB, 1000000)")
    _validate_speculative(cfg.speculative, at)
    try:
        cfg.sampling.params()
    except ValueError as e:
        name = next((f.name for f in dataclasses.fields(SamplingConfig) if str(e).startswith(f.name)), None)
        dotted = f"sampling.{name}" if name else "sampling"
        raise UsageError(f"config key {dotted!r}{at(dotted, '')}: {e}")


def _validate_speculative(sp: SpeculativeConfig, at) -> None:
    if sp.method not in SPEC_METHODS:
        raise UsageError(f"speculative.method{at('speculative.method', '')} must be one of {', '.join(SPEC_METHODS)}, "
                         f"not {sp.method!r}")
    if not 1 <= sp.num_tokens <= MAX_SPEC_TOKENS:
        raise UsageError(f"speculative.num_tokens{at('speculative.num_tokens', '')} must be an integer from 1 to "
                         f"{MAX_SPEC_TOKENS}, not {sp.num_tokens}")
    if not 1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max:
        raise UsageError(f"speculative.prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, not "
                         f"{sp.prompt_lookup_min} and {sp.prompt_lookup_max}")
    if sp.draft_quant is not None and sp.draft_quant not in QUANTS:
        raise UsageError(f"speculative.draft_quant{at('speculative.draft_quant', '')} must be one of "
                         f"{', '.join(QUANTS)}, not {sp.draft_quant!r}")
    if sp.method == "draft" and not sp.draft_model:
        raise UsageError(f"speculative.method{at('speculative.method', '')} 'draft' needs speculative.draft_model "
                         f"(--draft-model PATH): the smaller model that drafts, with the same tokenizer")


MAX_SPEC_TOKENS = 16  # a longer draft is almost never all accepted, and its rows cost every step


def draft_quant(cfg: Config) -> str | None:
    """How the draft model keeps its weights: ``speculative.draft_quant``, else the target's
    ``quant``; None when no draft model runs."""
    sp = cfg.speculative
    return (sp.draft_quant or cfg.quant) if sp.method == "draft" else None


# Flat names (command-line flags, ``LLM(...)`` keywords) -> dotted keys: every key by its own
# name, plus those whose flag is named differently (``--speculative ngram``, vLLM's
# ``num_speculative_tokens``).
FLAT_ALIASES = {"cache": "cache.kind", "prefix_cache": "cache.prefix_caching", "speculative": "speculative.method",
                "num_speculative_tokens": "speculative.num_tokens"}


def flat_keys() -> dict[str, str]:
    keys = {f.name: f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS}
    for section, cls in SECTIONS.items():
        keys |= {f.name: f"{section}.{f.name}" for f in dataclasses.fields(cls)}
    return keys | FLAT_ALIASES


def flat_overrides(values: dict) -> dict[str, object]:
    """``{"block_size": 32, "kv_memory": "1GiB"}`` -> ``{"cache.block_size": 32, ...}``; None
    values are not set. An unknown name is a ``UsageError`` naming the closest valid one."""
    keys = flat_keys()
    out = {}
    for name, value in values.items():
        if name not in keys:
            close = difflib.get_close_matches(name, list(keys), n=1, cutoff=0.6)
            raise UsageError(f"unknown setting {name!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                            f"; settings: {', '.join(sorted(keys))}"))
        if value is not None:
            out[keys[name]] = value
    return out


def load_config(path: str | Path | None, overrides: dict | None = None,
                command_defaults: dict | None = None) -> Config:
    data, nodes = load_yaml(path) if path else ({}, {})
    return build_config(data, nodes, overrides, command_defaults)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
