"""From a validated Config to live objects: device, dtype, model, tokenizer, cache, engine.

The model is loaded once per process; caches and engines are cheap and built per run (bench
builds one per sweep point, all at the same KV budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache.kv import CacheError, PagedKVCache, SlotKVCache, parse_bytes, prefix_salt, token_bytes
from .config import Config
from .engine.engine import LLMEngine
from .errors import TinyLLMError, UsageError
from .model.checkpoint import Checkpoint, load_checkpoint
from .model.gemm import resolve_gemm
from .model.llama import LlamaModel, build_model
from .model.quant import ACT_DTYPE, int4_usable
from .model.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but this machine has no CUDA GPU (use --device cpu)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, quant: str = "none") -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or quant != "none" else torch.float32
    return _DTYPES[name]


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
class Runtime:
    model: LlamaModel
    tokenizer: Tokenizer | None
    model_name: str
    device: torch.device
    dtype: torch.dtype
    load_s: float

    def facts(self) -> dict:
        """What ran, for stats files and bench rows."""
        return {"model": self.model_name, "load_s": round(self.load_s, 3),
                "dtype": str(self.dtype).removeprefix("torch."), "gemm": self.model.gemm, "quant": self.model.quant,
                "native_kernels": bool(getattr(self.model, "native", False)),
                "device": str(self.device)}

    def describe(self) -> str:
        """What ran, for table titles: model · dtype · matmul path · device."""
        quant = " · int4/int8 weights" if self.model.quant != "none" else ""
        return (f"{self.model_name} · {str(self.dtype).removeprefix('torch.')} · gemm {self.model.gemm}{quant} · "
                f"{self.device}")


def load_runtime(cfg: Config, progress: bool = True) -> Runtime:
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, cfg.quant)
    check_quant(cfg.quant, dtype, device)
    try:
        gemm = resolve_gemm(cfg.gemm, dtype, device)  # before the (slow) load: a bad choice fails fast
    except ValueError as e:
        raise UsageError(str(e))
    ck = load_checkpoint(cfg.model, progress, cfg.quant)
    return runtime_from_checkpoint(ck, device, dtype, gemm, t0)


def runtime_from_checkpoint(ck: Checkpoint, device: torch.device, dtype: torch.dtype, gemm: str,
                            t0: float) -> Runtime:
    """Build the model from a loaded checkpoint (in this process, or in a Ray worker that got the
    checkpoint through the object store)."""
    try:
        model = build_model(ck.config, ck.weights, dtype, str(device), gemm)
    except ValueError as e:
        raise TinyLLMError(f"cannot build the model from {ck.source}: {e}")
    return Runtime(model, ck.tokenizer, ck.name, device, dtype, time.perf_counter() - t0)


def kv_budget(cfg: Config, model_cfg, dtype) -> int:
    """Bytes of K/V both cache kinds get: num_blocks x block_size tokens when given, else kv_memory."""
    c = cfg.cache
    if c.num_blocks is not None:
        return c.num_blocks * c.block_size * token_bytes(model_cfg, dtype)
    return parse_bytes(c.kv_memory)


def make_cache(cfg: Config, rt: Runtime) -> PagedKVCache:
    c, mcfg = cfg.cache, rt.model.cfg
    salt = prefix_salt(mcfg, rt.dtype, rt.describe())  # prefix-cache keys name the model, dtype, gemm, quant
    max_len = min(c.max_model_len, mcfg.max_position_embeddings)
    try:
        if c.kind == "slot":
            return SlotKVCache.from_budget(mcfg, kv_budget(cfg, mcfg, rt.dtype), max_len, rt.dtype, rt.device,
                                           attention=c.attention)
        if c.num_blocks is not None:
            return PagedKVCache(mcfg, c.num_blocks, c.block_size, rt.dtype, rt.device,
                                prefix_caching=c.prefix_caching, attention=c.attention, salt=salt)
        return PagedKVCache.from_budget(mcfg, parse_bytes(c.kv_memory), c.block_size, rt.dtype, rt.device,
                                        prefix_caching=c.prefix_caching, attention=c.attention, salt=salt)
    except CacheError as e:
        raise UsageError(str(e))


def make_engine(cfg: Config, rt: Runtime, seed: int = 0) -> LLMEngine:
    cache = make_cache(cfg, rt)
    return LLMEngine(rt.model, cache, rt.tokenizer, max_num_seqs=cfg.scheduler.max_num_seqs,
                     max_prefill_tokens=cfg.scheduler.max_prefill_tokens,
                     max_model_len=cfg.cache.max_model_len,
                     eos_ids=rt.tokenizer.eos_ids if rt.tokenizer else None, seed=seed)
