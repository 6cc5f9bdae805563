"""From a validated Config to live objects: device, dtype, model, tokenizer, cache, engine.

One ``Runtime`` describes what runs, wherever it runs: in this process it holds the model; on a
Ray cluster's driver it holds what the driver needs (the model's config, the tokenizer, the
workers' facts) and the workers hold the models. Stats files, tables and bench rows read its
``facts()`` either way, so the two paths cannot report different keys.

The model is loaded once per process; caches and engines are cheap and built per run (bench
builds one per sweep point, all at the same KV budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache.block_keys import prefix_salt
from .cache.blocks import BlockManager, CacheError, SlotBlockManager, parse_bytes, token_bytes
from .cache.storage import KVStorage, PoolMemory, check_room
from .config import Config, draft_quant
from .engine.engine import LLMEngine
from .engine.runner import ModelRunner
from .engine.speculative import ModelDrafter, NgramDrafter, Speculation
from .errors import TinyLLMError, UsageError
from .machine import available_memory
from .model.checkpoint import Checkpoint, load_checkpoint
from .model.gemm import resolve_gemm
from .model.llama import LlamaModel, ModelConfig, build_model
from .model.quant import ACT_DTYPE, int4_usable, int8_activations
from .model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but this machine has no CUDA GPU (use --device cpu)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, quant: str = "none") -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or quant != "none" else torch.float32
    return DTYPES[name]


def check_quant(quant: str, dtype: torch.dtype, device: torch.device) -> None:
    """``quant: gguf`` runs 4-bit / int8 CPU kernels (tinyllm's, or torch's as the fallback), which
    take bfloat16 activations."""
    if quant == "none":
        return
    if not int4_usable(device):
        raise UsageError(f"quant 'gguf' runs on the CPU only (here: {device}); use --quant none")
    if dtype != ACT_DTYPE:
        raise UsageError(f"quant 'gguf' computes in bfloat16, not {str(dtype).removeprefix('torch.')}; "
                         f"use --dtype bfloat16 (or auto)")


@dataclass
class Placement:
    """Where and how the model computes: resolved from the config before anything loads, so a
    bad choice fails fast (and a Ray worker resolves its own: the driver may have no GPU)."""
    device: torch.device
    dtype: torch.dtype
    gemm: str
    int8_activations: bool = False  # quant: gguf's 4-bit matmuls quantize their input

    @classmethod
    def resolve(cls, cfg: Config) -> "Placement":
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device, cfg.quant)
        check_quant(cfg.quant, dtype, device)
        return cls._paths(cfg, device, dtype, cfg.quant)

    @classmethod
    def for_draft(cls, cfg: Config, rt: "Runtime") -> tuple[str, "Placement"]:
        """The draft model's quant and placement: the target's, unless ``speculative.draft_quant``
        differs (then its own dtype: bfloat16 for 4-bit weights, the target's otherwise; its own
        matmul path and activation mode; on the target's device)."""
        quant = draft_quant(cfg)
        if quant == cfg.quant:
            return quant, cls(rt.device, rt.dtype, rt.gemm, rt.int8_activations)
        dtype = ACT_DTYPE if quant != "none" else rt.dtype
        try:
            check_quant(quant, dtype, rt.device)
        except UsageError as e:
            raise UsageError(f"speculative.draft_quant: {e}") from None
        return quant, cls._paths(cfg, rt.device, dtype, quant)

    @classmethod
    def _paths(cls, cfg: Config, device: torch.device, dtype: torch.dtype, quant: str) -> "Placement":
        """Weights kept as ``quant`` in ``dtype`` on ``device`` (checked): with the config's matmul
        path and, for 4-bit weights, its activation mode resolved for them."""
        try:
            int8 = quant != "none" and int8_activations(cfg.quant_activations, device)
            return cls(device, dtype, resolve_gemm(cfg.gemm, dtype, device), int8)
        except ValueError as e:
            raise UsageError(str(e))


@dataclass
class Runtime:
    model_cfg: ModelConfig
    tokenizer: Tokenizer | None
    model_name: str
    device: torch.device
    dtype: torch.dtype
    gemm: str
    quant: str
    native_kernels: bool
    load_s: float
    model: LlamaModel | None = None  # None on a cluster's driver: the workers hold the models
    workers: int = 1  # engines serving the run (Ray workers, or 1 in-process)
    drafts: dict = field(default_factory=dict)  # draft models by spec and form, loaded once (speculative: draft)
    int8_activations: bool = False  # the 4-bit matmuls quantize their input (quant_activations)
    greedy_screen: bool = False  # greedy rows find their argmax through a bfloat16 screen (model/greedy_head.py)
    pool_memory: PoolMemory = field(default_factory=PoolMemory)  # a closed engine's KV pools, for the next one

    def facts(self) -> dict:
        """What ran, for stats files and bench rows (the same keys in-process and on a cluster)."""
        return {"model": self.model_name, "load_s": round(self.load_s, 3),
                "dtype": str(self.dtype).removeprefix("torch."), "gemm": self.gemm, "quant": self.quant,
                "int8_activations": self.int8_activations, "greedy_screen": self.greedy_screen,
                "native_kernels": self.native_kernels, "device": str(self.device), "num_workers": self.workers}

    def describe(self) -> str:
        """What ran, for table titles: model · dtype · matmul path · device (x workers)."""
        quant = " · int4/int8 weights" if self.quant != "none" else ""
        quant += " · int8 activations" if self.int8_activations else ""
        quant += " · screened greedy head" if self.greedy_screen else ""
        where = f"{self.device} x {self.workers} Ray workers" if self.workers > 1 else str(self.device)
        return f"{self.model_name} · {str(self.dtype).removeprefix('torch.')} · gemm {self.gemm}{quant} · {where}"

    @classmethod
    def of_model(cls, model: LlamaModel, ck: Checkpoint, device: torch.device, dtype: torch.dtype,
                 load_s: float) -> "Runtime":
        return cls(model.cfg, ck.tokenizer, ck.name, device, dtype, model.gemm, model.quant,
                   bool(getattr(model, "native", False)), load_s, model=model,
                   int8_activations=model.int8_activations, greedy_screen=model.greedy_screen is not None)

    @classmethod
    def of_workers(cls, ck: Checkpoint, facts: dict, workers: int, load_s: float) -> "Runtime":
        """The driver's view of a pool whose first worker reported ``facts`` (its own ``facts()``)."""
        return cls(ck.config, ck.tokenizer, ck.name, torch.device(facts["device"]), DTYPES[facts["dtype"]],
                   facts["gemm"], facts["quant"], facts["native_kernels"], load_s, workers=workers,
                   int8_activations=facts["int8_activations"], greedy_screen=facts["greedy_screen"])


def load_runtime(cfg: Config, progress: bool = True) -> Runtime:
    t0 = time.perf_counter()
    where = Placement.resolve(cfg)  # before the (slow) load
    ck = load_checkpoint(cfg.model, progress, cfg.quant, dtype=where.dtype)  # its memory check knows the dtype
    return runtime_from_checkpoint(ck, where, t0)


def runtime_from_checkpoint(ck: Checkpoint, where: Placement, t0: float) -> Runtime:
    """Build the model from a loaded checkpoint (in this process, or in a Ray worker that got the
    checkpoint through the object store)."""
    try:
        model = build_model(ck.config, ck.weights, where.dtype, str(where.device), where.gemm,
                            where.int8_activations)
    except ValueError as e:
        raise TinyLLMError(f"cannot build the model from {ck.source}: {e}")
    return Runtime.of_model(model, ck, where.device, where.dtype, time.perf_counter() - t0)


# ``kv_memory: auto`` takes at most this share of the memory available when the pool is built
# (split between the workers of a cluster, which may share a machine).
KV_AUTO_FRACTION = 0.5


@dataclass
class KVBudget:
    bytes: int
    how: str  # how it was chosen, for the run table and --stats-json


def kv_budget(cfg: Config, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
              held: int = 0) -> KVBudget:
    """Bytes of K/V both cache kinds get: num_blocks x block_size tokens when given, else
    kv_memory; ``auto`` (the default) sizes the pool for ``max_num_seqs`` sequences of
    ``max_model_len`` tokens of this model, capped by the memory actually available: free memory
    plus ``held``, the pools a closed engine left for the next (``PoolMemory``), so a reconfigured
    engine gets the pool its settings give on a fresh process."""
    c, per_token = cfg.cache, token_bytes(model_cfg, dtype)
    if c.num_blocks is not None:
        return KVBudget(c.num_blocks * c.block_size * per_token, f"num_blocks {c.num_blocks}")
    if c.kv_memory != "auto":
        return KVBudget(parse_bytes(c.kv_memory), f"kv_memory {c.kv_memory}")
    max_len = min(c.max_model_len, model_cfg.max_position_embeddings)
    seqs = cfg.scheduler.max_num_seqs
    need = seqs * max_len * per_token
    avail = available_memory(torch.device(device)) + held
    cap = int(avail * KV_AUTO_FRACTION / cfg.parallel.workers)
    size = max(min(need, cap), max_len * per_token)  # never less than one whole sequence
    how = f"auto: {seqs} seqs x {max_len} tokens x {per_token} B = {need / 2**30:.2f} GiB"
    if need > cap:
        how += f", capped at {KV_AUTO_FRACTION:.0%} of the {avail / 2**30:.1f} GiB available"
    return KVBudget(size, how)


@dataclass
class PoolSize:
    """A KV pool's size, computed before anything is built: ``num_blocks`` blocks of
    ``block_size`` tokens (a slot pool: slots of ``max_model_len``), and how it was chosen."""

    kind: str
    num_blocks: int
    block_size: int
    how: str


def pool_size(cfg: Config, rt: Runtime, held: int = 0) -> PoolSize:
    """The run's pool size: ``num_blocks`` as given, else as many blocks as the KV budget
    (``kv_budget``, with ``held`` bytes of spare pools counted as available) holds."""
    c, mcfg = cfg.cache, rt.model_cfg
    budget = kv_budget(cfg, mcfg, rt.dtype, rt.device, held=held)
    try:
        if c.kind == "slot":
            max_len = min(c.max_model_len, mcfg.max_position_embeddings)
            n = SlotBlockManager.blocks_in(mcfg, budget.bytes, max_len, rt.dtype)
            return PoolSize("slot", n, max_len, budget.how)
        if c.num_blocks is not None:
            return PoolSize("paged", c.num_blocks, c.block_size, budget.how)
        return PoolSize("paged", BlockManager.blocks_in(mcfg, budget.bytes, c.block_size, rt.dtype), c.block_size,
                        budget.how)
    except CacheError as e:
        raise UsageError(str(e))


def make_blocks(cfg: Config, rt: Runtime, size: PoolSize) -> BlockManager:
    """The run's block manager (tables, free list, prefix cache; no tensors): all of the
    simulator's cache, and the scheduler's half of a real run's."""
    mcfg = rt.model_cfg
    if size.kind == "slot":
        blocks = SlotBlockManager(mcfg, size.num_blocks, size.block_size, rt.dtype)
    else:
        salt = prefix_salt(mcfg, rt.dtype, rt.describe())  # prefix-cache keys name the model, dtype, gemm, quant
        blocks = BlockManager(mcfg, size.num_blocks, size.block_size, rt.dtype,
                              prefix_caching=cfg.cache.prefix_caching, salt=salt)
    blocks.sizing = size.how
    return blocks


def make_storage(cfg: Config, rt: Runtime, blocks: BlockManager) -> KVStorage:
    """The K/V pools for ``blocks`` on ``rt``'s device: the memory of the last engine closed on
    ``rt`` where it fits (``PoolMemory``: new contents, no page faults), else new memory that
    must fit what is available."""
    try:
        return KVStorage(blocks, rt.device, attention=cfg.cache.attention, memory=rt.pool_memory)
    except CacheError as e:
        raise UsageError(str(e))


def make_engine(cfg: Config, rt: Runtime) -> LLMEngine:
    """A fresh in-process engine (new block manager and K/V storage, empty scheduler) on ``rt``'s
    model; its run seed is ``sampling.seed`` (0 when unset)."""
    size = pool_size(cfg, rt, held=rt.pool_memory.held_bytes)
    try:  # a pool that cannot exist is refused before its tables (a list entry per block) are built
        check_room(rt.model_cfg, size.kind, size.num_blocks, size.block_size, rt.dtype, rt.device, rt.pool_memory)
    except CacheError as e:
        raise UsageError(str(e))
    blocks = make_blocks(cfg, rt, size)
    runner = ModelRunner(rt.model, blocks, make_storage(cfg, rt, blocks))
    return LLMEngine(rt.model, blocks, rt.tokenizer, max_num_seqs=cfg.scheduler.max_num_seqs,
                     max_prefill_tokens=cfg.scheduler.max_prefill_tokens,
                     max_model_len=cfg.cache.max_model_len,
                     eos_ids=rt.tokenizer.eos_ids if rt.tokenizer else None, seed=cfg.sampling.run_seed,
                     speculation=make_speculation(cfg, rt, blocks), runner=runner)


def make_speculation(cfg: Config, rt: Runtime, cache: BlockManager) -> Speculation | None:
    """The engine's drafter, or None when ``speculative.method`` is none (the plain step)."""
    sp = cfg.speculative
    if sp.method == "none":
        return None
    if sp.method == "ngram":
        return Speculation("ngram", sp.num_tokens, NgramDrafter(sp.prompt_lookup_min, sp.prompt_lookup_max))
    quant, where = Placement.for_draft(cfg, rt)
    draft = load_draft(sp.draft_model, rt, quant, where)
    # The draft cache holds as many tokens as the target's pool, in the draft model's (smaller) K/V.
    tokens = cache.num_blocks * cache.block_size
    block = cache.block_size if cache.kind == "paged" else 16
    try:
        dcache = BlockManager(draft.cfg, max(1, tokens // block), block, where.dtype)
        dstorage = KVStorage(dcache, rt.device, attention=cfg.cache.attention)
    except CacheError as e:
        raise UsageError(f"the draft model's KV cache cannot be built: {e}")
    return Speculation("draft", sp.num_tokens, ModelDrafter(draft, dcache, dstorage))


def load_draft(spec: str, rt: Runtime, quant: str, where: Placement) -> LlamaModel:
    """The draft model (loaded once per runtime and form), refused unless it shares the target's
    tokenizer."""
    key = (spec, quant, where.dtype, where.gemm, where.int8_activations)
    if key not in rt.drafts:
        try:
            ck = load_checkpoint(spec, False, quant, dtype=where.dtype)
        except UsageError as e:  # name which of the two models it is about
            raise UsageError(f"speculative.draft_model: {e}") from None
        check_draft_vocab(ck, rt)
        try:
            rt.drafts[key] = build_model(ck.config, ck.weights, where.dtype, str(rt.device), where.gemm,
                                         where.int8_activations)
        except ValueError as e:
            raise TinyLLMError(f"cannot build the draft model from {ck.source}: {e}")
    return rt.drafts[key]


def check_draft_vocab(ck: Checkpoint, rt: Runtime) -> None:
    """Draft ids are fed to the target as they are: the two must number tokens the same way."""
    same = ck.config.vocab_size <= rt.model_cfg.vocab_size
    if same and ck.tokenizer is not None and rt.tokenizer is not None:
        same = ck.tokenizer.tok.get_vocab(with_added_tokens=True) == rt.tokenizer.tok.get_vocab(with_added_tokens=True)
    elif same:
        same = ck.config.vocab_size == rt.model_cfg.vocab_size and (ck.tokenizer is None) == (rt.tokenizer is None)
    if not same:
        raise UsageError(f"the draft model {ck.name!r} does not share the tokenizer of {rt.model_name!r} (speculative "
                         f"decoding feeds draft token ids to the target as they are); pick a draft model of the same family")
