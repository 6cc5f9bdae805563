"""The GGUF writer, read back by tinyllm's loader (which undoes llama.cpp's Q/K permutation
independently of the writer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.gguf_writer import gguf_names, gguf_tensor, pad_vocab, write_gguf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_written_for_llamacpp_loads_back_as_the_hf_weights(llama_dir, tmp_path, dtype):
    """tinyllm's GGUF loader undoes llama.cpp's Q/K permutation independently of the writer, so
    weights read back equal the HF checkpoint's (bf16: its bf16 rounding)."""
    from safetensors.torch import load_file
    from tinyllm_cli.model.checkpoint import load_checkpoint
    path = write_gguf(Path(llama_dir), tmp_path / f"tiny-{dtype}.gguf", dtype, tokenizer_from=None)
    ck = load_checkpoint(str(path), progress=False)
    hf = load_file(str(Path(llama_dir) / "model.safetensors"))
    assert set(hf) <= set(ck.weights)
    for name, w in hf.items():
        want = w.float()
        if dtype == "bfloat16" and w.dim() == 2:
            want = want.to(torch.bfloat16).float()
        torch.testing.assert_close(ck.weights[name].float(), want, rtol=0, atol=0, msg=name)


def test_pad_vocab_grows_only_the_token_arrays():
    toks = pad_vocab("tokenizer.ggml.tokens", ["a", "b"], 4)
    assert toks == ["a", "b", "<|tinyllm-unused-2|>", "<|tinyllm-unused-3|>"]
    assert pad_vocab("tokenizer.ggml.token_type", [1, 1], 3) == [1, 1, 5]
    assert pad_vocab("tokenizer.ggml.merges", ["a b"], 4) == ["a b"]
    assert pad_vocab("tokenizer.ggml.tokens", ["a", "b"], None) == ["a", "b"]


def test_qwen2_gguf_keeps_rows_and_biases_and_loads_back(qwen2_dir, tmp_path):
    """llama.cpp's converter does not permute qwen2's Q/K rows and writes the q/k/v biases; tinyllm's
    loader reads the file back to the HF weights, biases included."""
    from safetensors.torch import load_file
    from tinyllm_cli.model.checkpoint import load_checkpoint
    cfg = json.loads((Path(qwen2_dir) / "config.json").read_text())
    names = gguf_names(cfg)
    assert names["blk.0.attn_q.bias"] == "model.layers.0.self_attn.q_proj.bias"
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert (gguf_tensor("blk.0.attn_q.weight", w, cfg) == w).all()
    path = write_gguf(Path(qwen2_dir), tmp_path / "tiny-qwen2.gguf", "float32", tokenizer_from=None)
    ck = load_checkpoint(str(path), progress=False)
    assert ck.config.arch == "qwen2" and ck.config.attention_bias
    for name, t in load_file(str(Path(qwen2_dir) / "model.safetensors")).items():
        torch.testing.assert_close(ck.weights[name].float(), t.float(), rtol=0, atol=0, msg=name)
