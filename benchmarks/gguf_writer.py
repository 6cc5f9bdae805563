"""An HF model directory written as the GGUF llama.cpp's converter would write (llama or qwen2):
its tensor names, Q/K rows permuted for llama's interleaved RoPE, the default model's tokenizer
metadata padded to the model's vocabulary.

Invariant: tinyllm's GGUF loader reads a written file back to the HF weights exactly (bf16: their
bf16 rounding); the tests check that against the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import log

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
