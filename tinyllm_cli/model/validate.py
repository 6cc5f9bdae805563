"""Checks a checkpoint's tensor table, weight paths and memory need before any weight is read.

Why: a checkpoint's header says how big its tensors are and where their bytes lie; trusted as is,
a 1 MB file can name a hundred tensors over the same bytes (or layers the model does not have)
and make the loader dequantize each one, until the kernel kills the process.

Invariants:
- Everything here reads headers only (names, shapes, byte ranges); nothing allocates in
  proportion to a tensor's data.
- After ``check_ranges`` and ``check_table`` pass, every tensor the loader will read lies inside
  its file, shares no byte with another, is a weight the configured model has (layer index below
  its layer count), has the shape the config implies, and every weight the model needs is there.
  The bytes the loader then allocates are bounded by the model the config describes, and
  ``check_memory`` has compared exactly those bytes with the memory available.
- A weight file named by a model directory (or its shard index) resolves inside that directory:
  no absolute names, no ``..`` out of it, no symlink to elsewhere (a Hugging Face cache
  snapshot's links into its own repository's ``blobs`` folder excepted: that is its layout).
- A checkpoint that fails a check is a ``BadCheckpoint``: one sentence, exit 2, as a missing
  model path is. Too little memory is a ``CheckpointError`` (exit 1): the checkpoint is fine and
  the same command may succeed on a machine, or at a moment, with more free memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Callable

from .. import machine
from ..errors import CheckpointError

if TYPE_CHECKING:  # annotations only: the GGUF header reader imports this module, keep it light
    from .llama import ModelConfig


class BadCheckpoint(CheckpointError):
    """A local checkpoint that cannot be used: truncated, corrupt, inconsistent or unsupported."""

    exit_code = 2


@dataclass(frozen=True)
class Entry:
    """One tensor as a file declares it."""

    name: str  # as the file spells it (messages use this)
    weight: str | None  # the Hugging Face name it loads as; None: no weight of this decoder
    shape: tuple[int, ...]  # outermost first (GGUF's innermost-first dims already reversed)


# ---- byte ranges ----------------------------------------------------------------------------

def check_ranges(ranges: list[tuple[str, int, int]], lo: int, hi: int) -> None:
    """Every ``(name, begin, end)`` lies in ``[lo, hi)`` and no two share a byte; a ``ValueError``
    naming the tensor(s) otherwise (the format reader wraps it in its sentence)."""
    for name, begin, end in ranges:
        if begin < lo or end < begin:
            raise ValueError(f"tensor {name} has an invalid data offset")
        if end > hi:
            raise ValueError(f"tensor {name} runs past the end of the file, to byte {end} of {hi}")
    # Sorted by start, a range overlaps an earlier one exactly when it starts before the furthest
    # end seen so far; empty ranges hold no byte, so they cannot alias anything.
    furthest, owner = lo, None
    for name, begin, end in sorted((r for r in ranges if r[2] > r[1]), key=lambda r: (r[1], r[2])):
        if begin < furthest:
            raise ValueError(f"tensors {owner} and {name} share data bytes, from byte {begin} on")
        furthest, owner = end, name


# ---- names and shapes -----------------------------------------------------------------------

_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)")


def _top_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    v, h = cfg.vocab_size, cfg.hidden_size
    return {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each layer's weights, by name inside ``model.layers.N.``. Biases and q/k norms only where
    the config has them: a tensor the model would not use is an error, not silently dropped."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    want = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    if cfg.attention_bias:
        want |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if cfg.qk_norm:
        want |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    return want


def expected_shape(cfg: ModelConfig, weight: str) -> tuple[int, ...] | None:
    """The shape of weight ``weight`` (a Hugging Face name) in this config's model, or None
    where the model has no such weight. Looked up per name, never listed per layer: a config
    claiming a billion layers costs nothing until a file holds their tensors."""
    if (shape := _top_shapes(cfg).get(weight)) is not None:
        return shape
    m = _LAYER.fullmatch(weight)
    if m is None or int(m.group(1)) >= cfg.num_layers:
        return None
    return _layer_shapes(cfg).get(m.group(2))


def _required(cfg: ModelConfig):
    """The weights the model cannot be built without, in model order (a tied model reuses the
    embedding); a generator, so finding the first missing one stops there."""
    yield from (w for w in _top_shapes(cfg) if not (cfg.tie_word_embeddings and w == "lm_head.weight"))
    layer = list(_layer_shapes(cfg))
    for n in range(cfg.num_layers):
        yield from (f"model.layers.{n}.{w}" for w in layer)


def _required_count(cfg: ModelConfig) -> int:
    return 3 - cfg.tie_word_embeddings + len(_layer_shapes(cfg)) * cfg.num_layers


def layer_index(weight: str) -> int | None:
    m = _LAYER.fullmatch(weight)
    return int(m.group(1)) if m else None


def check_table(entries: list[Entry], cfg: ModelConfig, source: str, layers_key: str,
                spell: Callable[[str], str] = lambda name: name) -> None:
    """Names and shapes against the config; ``spell`` turns a Hugging Face name back into the
    file's own spelling for the missing-weight sentence. Work and memory grow with the number of
    entries, never with the sizes or layer count the config claims."""
    seen: set[str] = set()
    # The family's full set (bias, q/k norm) tells "this model has no bias" from "no such weight".
    family = replace(cfg, attention_bias=True, qk_norm=True)
    for e in entries:
        layer = None if e.weight is None else layer_index(e.weight)
        if layer is not None and layer >= cfg.num_layers:
            raise BadCheckpoint(f"tensor {e.name} in {source} is for layer {layer}, but the model has "
                                f"{cfg.num_layers} layers ({layers_key} = {cfg.num_layers})")
        shape = None if e.weight is None else expected_shape(cfg, e.weight)
        if shape is None and e.weight is not None and expected_shape(family, e.weight) is not None:
            raise BadCheckpoint(f"tensor {e.name} in {source} is not a weight this {cfg.arch} model uses "
                                f"(its config has {_optional_parts(cfg)})")
        if shape is None:
            raise BadCheckpoint(f"{source} has a tensor named {e.name!r}, which is not part of a {cfg.arch} model")
        if e.weight in seen:
            raise BadCheckpoint(f"{source} holds tensor {e.name} twice")
        seen.add(e.weight)
        if e.shape != shape:
            raise BadCheckpoint(f"tensor {e.name} in {source} has shape {list(e.shape)} but the model config "
                                f"implies {list(shape)}")
    # Every seen name is a distinct expected one (required, or a tied model's spare lm_head), so
    # a shortfall in count means one is missing; the scan for the first stops within len(seen) + 1
    # steps of the generator.
    short = _required_count(cfg) - (len(seen) - (cfg.tie_word_embeddings and "lm_head.weight" in seen))
    if short:
        first = next(w for w in _required(cfg) if w not in seen)
        more = f" and {short - 1} more" if short > 1 else ""
        raise BadCheckpoint(f"{source} lacks tensor {spell(first)}{more}, which the model config requires")


def _optional_parts(cfg: ModelConfig) -> str:
    parts = [("" if cfg.attention_bias else "no ") + "q/k/v bias", ("" if cfg.qk_norm else "no ") + "q/k norm"]
    return " and ".join(parts)


# ---- weight file paths ----------------------------------------------------------------------

def plain_relative(name: str) -> bool:
    """A file name that can only mean a file under the directory it is joined to: relative on
    every platform, no ``..`` part, no glob characters (``hub`` passes these names as patterns)."""
    if not name or "\x00" in name or any(c in name for c in "*?[]"):
        return False
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        return False
    return ".." not in PurePosixPath(name.replace("\\", "/")).parts


def weight_path(root: Path, name: str, named_in: Path | None = None) -> Path:
    """``root / name``, refused with one sentence unless it stays inside ``root`` after every
    symlink is followed."""
    where = f" named in {named_in}" if named_in else ""
    if not plain_relative(name):
        raise BadCheckpoint(f"weight file {name!r}{where} is not a file name inside the model directory {root} "
                            f"(absolute paths, '..' and wildcards are refused)")
    path = root / name
    real = path.resolve()
    if not any(real.is_relative_to(r) for r in _allowed_roots(root)):
        raise BadCheckpoint(f"weight file {path}{where} is a link to {real}, outside the model directory {root}; "
                            f"copy the file into the directory instead")
    return path


def _allowed_roots(root: Path) -> list[Path]:
    """The model directory, and for a Hugging Face cache snapshot
    (``models--ORG--NAME/snapshots/COMMIT``) its repository's ``blobs`` folder, where the
    snapshot's files link to."""
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


# ---- memory ---------------------------------------------------------------------------------

def check_memory(need: int, source: str, alternative: str = "") -> None:
    """Refuse before the big allocations when the weights alone will not fit. ``need`` is a lower
    bound of the load's peak (the weights as they will be held; no K/V cache, no temporaries), so
    a refusal is never wrong about the weights; a pass promises nothing about the rest."""
    avail = machine.host_available_memory()
    if avail is None or need <= avail:
        return
    a, b = two_sizes(need, avail)
    raise CheckpointError(f"cannot load {source}: the model needs {a} of memory for its weights but only "
                          f"{b} is available{alternative}")


def size_text(n: int, decimals: int = 1) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.{decimals}f} {unit}"
    return f"{n} bytes"


def two_sizes(a: int, b: int) -> tuple[str, str]:
    """Both sizes, with enough decimals that two different numbers never print the same."""
    for decimals in (1, 2, 3):
        x, y = size_text(a, decimals), size_text(b, decimals)
        if x != y or a == b:
            return x, y
    return f"{a} bytes", f"{b} bytes"
