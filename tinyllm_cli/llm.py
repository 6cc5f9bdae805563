"""``LLM``: the one front door. A config becomes a runtime and an engine, in this process or on a
Ray cluster, behind the engine contract (``engine/contract.py``); every command and script is a
client of this class.

    from tinyllm_cli import LLM, SamplingParams
    with LLM(max_num_seqs=16) as llm:                       # the default model, in this process
        outs = llm.generate(["Name a colour.", "Name a fruit."], SamplingParams(max_new_tokens=16))
        print(outs[0].text, llm.stats.output_tokens_per_s)

Invariants:
- Settings have one set of names and one validation: ``LLM(config=FILE, **settings)`` is
  ``load_config(FILE, flat_overrides(settings))``, as the command line's flags are.
- ``workers`` > 1 or ``ray_address`` puts the engines on Ray workers; nothing else changes for
  the caller (same outputs, same seeds, same stats keys).
- Each ``generate`` / ``stream`` / ``run`` is one run: ``stats`` describes the last one. The
  model, and the KV pool with its prefix cache, live as long as the ``LLM``; ``reconfigure``
  builds a fresh engine (new pool) on the same model; ``close`` releases the pool or the cluster.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from .config import Config, build_config, flat_overrides, load_config, to_dict
from .engine.contract import Engine
from .engine.request import Request, RequestOutput, SamplingParams
from .engine.stats import RunSummary
from .errors import UsageError
from .io import RequestBuilder
from .runtime import Runtime, load_runtime, make_engine

# Settings that need a new model or cluster: ``reconfigure`` refuses them.
MODEL_KEYS = {"model", "device", "dtype", "gemm", "quant", "quant_activations"}

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, *, config: str | Path | Config | None = None,
                 progress: bool = True, **settings):
        """``model``: 'default', a .gguf file, a Hugging Face directory or a Hub id. ``config``: a
        YAML file (or a ``Config``). ``settings``: any config key by its name (``block_size``,
        ``kv_memory``, ``max_num_seqs``, ``temperature``, ``seed``, ``workers``, ...), validated as
        the YAML keys are. ``progress``: loading progress on stderr."""
        overrides = flat_overrides(settings | {"model": model})
        if isinstance(config, Config):
            cfg = build_config(to_dict(config), overrides=overrides)
        else:
            cfg = load_config(config, overrides)
        self.config = cfg
        self._pool = None
        self._closed = False
        self._summary: RunSummary | None = None
        from .cluster import require_ray, start_pool, wants_cluster
        if wants_cluster(cfg):
            require_ray()  # one sentence naming the install command, before anything loads
            self.runtime, self._pool = start_pool(cfg, quiet=not progress)
        else:
            self.runtime = load_runtime(cfg, progress=progress)
        self.engine: Engine = self._new_engine(cfg)

    # ---- lifecycle ---------------------------------------------------------------------------

    def _new_engine(self, cfg: Config) -> Engine:
        if self._pool is None:
            return make_engine(cfg, self.runtime)
        from .cluster import ClusterEngine
        return ClusterEngine(self._pool, cfg)

    def reconfigure(self, config: Config | None = None, **settings) -> None:
        """A fresh engine (new KV pool, empty scheduler and prefix cache) on the same model, with
        cache, scheduler or sampling settings changed, given as settings or as a whole ``Config``
        (``bench`` sweeps this way). Model and cluster settings cannot change here."""
        self._check_open()
        cfg = build_config(to_dict(config or self.config), overrides=flat_overrides(settings))
        changed = [k for k in sorted(MODEL_KEYS) if getattr(cfg, k) != getattr(self.config, k)]
        if changed or cfg.parallel != self.config.parallel:
            what = changed[0] if changed else "the parallel settings"
            raise UsageError(f"{what!r} cannot change on a live LLM; make a new LLM for it")
        self.engine.close()  # its KV pools go to the runtime's PoolMemory, for the new engine to take
        try:
            self._start(cfg)
        except BaseException:
            self._start(self.config)  # the settings it had, so the LLM stays usable
            raise
        self.config = cfg

    def _start(self, cfg: Config) -> None:
        """A new engine (and, on a cluster, new worker engines) for ``cfg``."""
        if self._pool is not None:
            self._pool.reset(cfg)
        self.engine = self._new_engine(cfg)

    def close(self) -> None:
        """Release the KV pool (and the Ray workers). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        if self._pool is not None:
            self._pool.close()
        self.engine = None
        self.runtime.model = None
        self.runtime.pool_memory.clear()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("this LLM is closed")

    # ---- running -----------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.runtime.tokenizer

    def requests(self, prompts: Prompt | Iterable[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None, *, chat: bool = True) -> list[Request]:
        """Requests from Python values, with ids 0..n-1 (their input positions). A prompt is a
        string (wrapped in the chat template when ``chat``), a list of token ids, or a dict with
        the keys of a JSONL prompts line (``prompt`` / ``messages`` / ``prompt_token_ids``, ``id``,
        sampling fields). ``params``: one for all, one per prompt, or the config's defaults. A bad
        prompt becomes a request that is answered with ``finish_reason: "error"``."""
        if isinstance(prompts, (str, dict)) or _is_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, list) and len(params) != len(prompts):
            raise UsageError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        defaults = self.config.sampling.request_defaults()
        builders: dict[int, RequestBuilder] = {}  # by id of the defaults: one per distinct SamplingParams
        out = []
        for i, p in enumerate(prompts):
            base = params[i] if isinstance(params, list) else (params or defaults)
            builder = builders.get(id(base)) or builders.setdefault(id(base), RequestBuilder(self.tokenizer, chat, base))
            rec = {"prompt_token_ids": list(p)} if _is_ids(p) else p
            rid = rec.get("id", i) if isinstance(rec, dict) else i
            out.append(builder.build(i, i + 1, rec, rid))
        return out

    def run(self, requests: Iterable[Request], *, max_pending: int | None = None,
            use_tqdm: bool = False, total: int | None = None, desc: str = "generate") -> Iterator[RequestOutput]:
        """One run over ``requests`` (fed lazily): outputs as they finish. ``stats`` describes it
        once the iterator is exhausted (or closed)."""
        self._check_open()
        self.engine.reset_stats()
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="req", desc=desc, file=sys.stderr, dynamic_ncols=True)
        try:
            for out in self.engine.run(requests, max_pending):
                if bar is not None:
                    st = self.engine.stats
                    bar.update(1)
                    bar.set_postfix_str(f"{st.output_tokens / max(st.elapsed(), 1e-9):.1f} tok/s", refresh=False)
                yield out
        finally:
            if bar is not None:
                bar.close()
            self._summary = None

    def stream(self, prompts, params=None, *, chat: bool = True, use_tqdm: bool = True) -> Iterator[RequestOutput]:
        """As ``generate``, but yields each output as soon as it finishes (completion order)."""
        reqs = self.requests(prompts, params, chat=chat)
        yield from self.run(reqs, use_tqdm=use_tqdm, total=len(reqs))

    def generate(self, prompts, params=None, *, chat: bool = True, use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs for ``prompts`` in input order (see ``requests`` for what a prompt can be)."""
        reqs = self.requests(prompts, params, chat=chat)
        outs: list[RequestOutput | None] = [None] * len(reqs)
        for out in self.run(reqs, use_tqdm=use_tqdm, total=len(reqs)):
            outs[out.index] = out
        return outs

    @property
    def stats(self) -> RunSummary:
        """The last run's figures: the keys of ``--stats-json`` and of the run table."""
        self._check_open()
        if self._summary is None:
            self._summary = RunSummary(self.engine.stats.summary() | self.runtime.facts())
        return self._summary


def _is_ids(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

