"""GGUF files written the way llama.cpp's ``convert_hf_to_gguf`` writes them, read back by our loader.

The tiny random Llama checkpoint (saved by transformers, see ``conftest.llama_dir``) is converted
in the test itself with ``gguf.GGUFWriter``: llama metadata through the writer's ``add_*`` helpers,
llama.cpp tensor names, and Q/K rows permuted exactly as the converter permutes them. Then:

1. F32: the loaded weights are the HF weights bit for bit, and our logits equal transformers'.
2. Every tensor type the ``gguf`` package can quantize in Python: the loaded weights are exactly
   ``dequantize(quantize(permuted))`` un-permuted (what the file holds), our logits equal
   transformers' run on those same weights, and stay close to the F32 model's.
3. K-quants (no Python quantizer): hand-built blocks with sane f16 scales in a hidden-256 model;
   the loaded weights are gguf's own dequantization, un-permuted, and the forward matches
   transformers on those weights.

The inverse permutation used here is computed independently of ``checkpoint._unpermute``: the
forward permutation is applied to row indices and scattered back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import LLAMA_SHAPE
from tinyllm_cli.cache.attention import NoCacheAttention
from tinyllm_cli.model.checkpoint import load_checkpoint
from tinyllm_cli.model.llama import build_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

PROMPT_LENS = [7, 19, 40]
LAYER_NAMES = {  # llama.cpp block tensor -> HF module under model.layers.N
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# ---- the converter's side -------------------------------------------------------------------

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _inverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo ``_permute`` by index bookkeeping: permuted[i] = original[idx[i]]."""
    idx = _permute(np.arange(w.shape[0]), n_head)
    out = np.empty_like(w)
    out[idx] = w
    return out


def _hf_config(path):
    return transformers.AutoConfig.from_pretrained(str(path))


def _gguf_tensors(hf_state: dict[str, torch.Tensor], cfg) -> dict[str, tuple[np.ndarray, str]]:
    """llama.cpp name -> (float32 array as the converter would store it, HF name)."""
    out = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for n in range(cfg.num_hidden_layers):
        for g, h in LAYER_NAMES.items():
            out[f"blk.{n}.{g}.weight"] = f"model.layers.{n}.{h}.weight"
    tensors = {}
    for gname, hname in out.items():
        w = hf_state[hname].float().numpy().copy()
        if gname.endswith("attn_q.weight"):
            w = _permute(w, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            w = _permute(w, cfg.num_key_value_heads)
        tensors[gname] = (np.ascontiguousarray(w, dtype=np.float32), hname)
    return tensors


def _write_gguf(path, cfg, tensors: dict[str, tuple[np.ndarray, QT | None]]) -> None:
    """``tensors``: name -> (data, raw_dtype); raw_dtype None means F32 from a float32 array."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- running both models --------------------------------------------------------------------

def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _our_logits(ck, prompts) -> list[torch.Tensor]:
    model = build_model(ck.config, ck.weights, torch.float32, "cpu")
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    out = model(ids, pos, NoCacheAttention([len(p) for p in prompts]), None)
    return list(out.split([len(p) for p in prompts]))


@torch.no_grad()
def _hf_logits(hf, prompts) -> list[torch.Tensor]:
    return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


def _hf_with(cfg, state: dict[str, torch.Tensor]):
    """A transformers Llama (float32) holding exactly ``state``."""
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def _max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _assert_weights_exact(ck, expected: dict[str, torch.Tensor]) -> None:
    """Every expected tensor loads as float32 with exactly the expected values."""
    for name, want in expected.items():
        got = ck.weights[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max().item():.3g}"


def _check_common(ck, cfg, names: set[str]) -> None:
    c = ck.config
    assert ck.tokenizer is None  # no tokenizer.ggml.* metadata in the file
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size) == (
        cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
        cfg.num_key_value_heads, cfg.intermediate_size)
    assert c.head_dim == cfg.hidden_size // cfg.num_attention_heads
    assert c.rope_theta == pytest.approx(10000.0)
    assert c.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert c.max_position_embeddings == cfg.max_position_embeddings
    assert not c.tie_word_embeddings and not c.attention_bias
    assert set(ck.weights) == names


# ---- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_ref(llama_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items() if "rotary" not in k}
    return _hf_config(llama_dir), hf, state


@pytest.fixture(scope="module")
def f32_gguf(hf_ref, tmp_path_factory):
    cfg, _, state = hf_ref
    tensors = _gguf_tensors(state, cfg)
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    _write_gguf(path, cfg, {n: (w, None) for n, (w, _) in tensors.items()})
    return path


@pytest.fixture(scope="module")
def f32_logits(hf_ref, f32_gguf):
    """Our model on the F32 file, over ``_prompts``: the reference for the quantized types."""
    return torch.cat(_our_logits(load_checkpoint(str(f32_gguf), progress=False), _prompts(hf_ref[0].vocab_size)))


# ---- 1: F32 --------------------------------------------------------------------------------

def test_f32_gguf_matches_transformers(hf_ref, f32_gguf):
    cfg, hf, state = hf_ref
    assert cfg.vocab_size == LLAMA_SHAPE["vocab_size"] and cfg.hidden_size == LLAMA_SHAPE["hidden_size"]
    ck = load_checkpoint(str(f32_gguf), progress=False)
    _check_common(ck, cfg, set(state))
    assert ck.name == "tiny-llama-test"
    # F32 storage is lossless, so the unpermuted Q/K (and everything else) are the HF tensors exactly.
    for name, ref in state.items():
        assert torch.equal(ck.weights[name], ref), name
    prompts = _prompts(cfg.vocab_size)
    ours, ref = _our_logits(ck, prompts), _hf_logits(hf, prompts)
    for got, want in zip(ours, ref):
        assert got.shape == want.shape
    err = _max_err(ours, ref)
    assert err <= 1e-4, f"max |ours - transformers| = {err:.3g}"


def test_f32_gguf_without_unpermute_would_differ(hf_ref):
    """Guard that the test above has teeth: the permutation really changes Q and K here."""
    cfg, _, state = hf_ref
    for name, heads in (("model.layers.0.self_attn.q_proj.weight", cfg.num_attention_heads),
                        ("model.layers.0.self_attn.k_proj.weight", cfg.num_key_value_heads)):
        w = state[name].numpy()
        assert not np.array_equal(_permute(w, heads), w)
        assert np.array_equal(_inverse_permute(_permute(w, heads), heads), w)


# ---- 2: Python-quantizable types -----------------------------------------------------------

# Every type gguf 0.19's Python ``quantize`` implements that a llama converter would use for
# weight matrices. Not listed, because the package has no quantizer for them (``quantize`` raises
# NotImplementedError): the K-quants Q2_K..Q6_K (covered in test 3 with hand-built blocks) and
# the IQ* types. TQ1_0/TQ2_0/MXFP4 have quantizers but are ternary / MoE-expert formats that the
# llama converter never writes for ordinary weights, so they are left out on purpose.
# Tolerances against the F32 model, over all rows of the prompts: the relative L2 error of the
# logits, ||q - f32|| / ||f32||, and the share of "confident" rows (F32 top-1 beats top-2 by more
# than CONFIDENT_MARGIN) whose argmax is unchanged. Measured on this fixture (whose logits are
# small, std ~0.6, with many near-ties, so plain argmax agreement is mostly noise): rel ~ 0.0007
# F16, 0.006 BF16, 0.017 Q8_0, 0.13-0.15 Q5_x, 0.28-0.31 Q4_x; confident agreement 100% up to
# Q5_1, 93% Q5_0, ~77% Q4_x. The bounds leave about 2x headroom.
CONFIDENT_MARGIN = 0.1
QUANT_TYPES = {
    QT.F16: (0.005, 1.0),
    QT.BF16: (0.03, 1.0),
    QT.Q8_0: (0.06, 1.0),
    QT.Q5_0: (0.35, 0.8),
    QT.Q5_1: (0.35, 0.8),
    QT.Q4_0: (0.6, 0.6),
    QT.Q4_1: (0.6, 0.6),
}


@pytest.mark.parametrize("qtype", list(QUANT_TYPES), ids=lambda q: q.name)
def test_quantized_gguf_loads_what_the_file_holds(qtype, hf_ref, f32_logits, tmp_path):
    cfg, _, state = hf_ref
    tensors = _gguf_tensors(state, cfg)
    to_write, expected = {}, {}
    for gname, (w, hname) in tensors.items():
        if w.ndim == 1:  # norm vectors stay F32, as llama.cpp keeps them
            to_write[gname] = (w, None)
            expected[hname] = torch.from_numpy(w.copy())
            continue
        q = quantize(w, qtype)  # raises NotImplementedError if the package lost the quantizer: fail loudly
        to_write[gname] = (q, qtype)
        held = np.asarray(dequantize(q, qtype), dtype=np.float32)
        assert held.shape == w.shape
        if gname.endswith("attn_q.weight"):
            held = _inverse_permute(held, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            held = _inverse_permute(held, cfg.num_key_value_heads)
        expected[hname] = torch.from_numpy(np.ascontiguousarray(held))
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_gguf(path, cfg, to_write)

    reader = gguf.GGUFReader(str(path))
    assert {t.name: t.tensor_type for t in reader.tensors}["blk.0.attn_q.weight"] == qtype

    ck = load_checkpoint(str(path), progress=False)
    _check_common(ck, cfg, set(state))
    _assert_weights_exact(ck, expected)
    # The quantization actually changed something (otherwise this would be test 1 again).
    if qtype != QT.F16:
        assert not torch.equal(ck.weights["model.layers.0.self_attn.q_proj.weight"],
                               state["model.layers.0.self_attn.q_proj.weight"])

    prompts = _prompts(cfg.vocab_size)
    ours = _our_logits(ck, prompts)
    # Same (dequantized) weights in transformers: the forward agrees as tightly as in F32.
    err = _max_err(ours, _hf_logits(_hf_with(cfg, expected), prompts))
    assert err <= 1e-4, f"{qtype.name}: max |ours - transformers on the same weights| = {err:.3g}"
    # And against the unquantized model: close, as the type allows.
    rel_max, agree_min = QUANT_TYPES[qtype]
    got, ref = torch.cat(ours), f32_logits
    assert torch.isfinite(got).all()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel <= rel_max, f"{qtype.name}: ||quantized - f32|| / ||f32|| = {rel:.3g}"
    top2 = ref.topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) > CONFIDENT_MARGIN
    assert confident.sum() >= 20  # enough rows for the share to mean something
    agree = (got.argmax(-1) == ref.argmax(-1))[confident].float().mean().item()
    assert agree >= agree_min, f"{qtype.name}: argmax agrees on {agree:.0%} of the confident rows"


# ---- 3: K-quants, hand-built blocks --------------------------------------------------------

K_SHAPE = dict(LLAMA_SHAPE, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
# Byte offsets of the f16 scale fields inside one 256-value block (the rest is quants and
# 6/8-bit sub-scales, where any byte value is valid), from ggml-common.h's block_qN_K structs.
K_BLOCKS = {
    QT.Q2_K: (84, (80, 82)),      # scales[16], qs[64], d, dmin
    QT.Q3_K: (110, (108,)),       # hmask[32], qs[64], scales[12], d
    QT.Q4_K: (144, (0, 2)),       # d, dmin, scales[12], qs[128]
    QT.Q5_K: (176, (0, 2)),       # d, dmin, scales[12], qh[32], qs[128]
    QT.Q6_K: (210, (208,)),       # ql[128], qh[64], scales[16] (int8), d
}


def _k_blocks(rng, rows: int, cols: int, qtype: QT) -> np.ndarray:
    """Random quants and sub-scales, with the f16 super-block scales set so |w| averages ~0.05
    (a K-quant block dequantizes linearly in its f16 scales, so one rescale gets there)."""
    block_bytes, f16_offsets = K_BLOCKS[qtype]
    assert gguf.GGML_QUANT_SIZES[qtype] == (256, block_bytes)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    unit = rng.uniform(0.5, 1.5, size=(n, len(f16_offsets)))

    def set_scales(c: float) -> None:
        for j, off in enumerate(f16_offsets):
            blocks[:, off:off + 2] = (unit[:, j] * c).astype(np.float16).view(np.uint8).reshape(n, 2)

    set_scales(1.0)
    set_scales(0.05 / np.abs(dequantize(blocks, qtype)).mean())
    return blocks.reshape(rows, cols // 256 * block_bytes)


@pytest.fixture(scope="module")
def k_cfg():
    return transformers.LlamaConfig(**K_SHAPE)


@pytest.mark.parametrize("qtype", list(K_BLOCKS), ids=lambda q: q.name)
def test_k_quant_gguf_loads_ggufs_own_dequantization(qtype, k_cfg, tmp_path):
    cfg = k_cfg
    rng = np.random.default_rng(int(qtype))
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd = cfg.num_attention_heads * (h // cfg.num_attention_heads)
    kvd = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = {"token_embd.weight": (v, h), "output.weight": (v, h), "output_norm.weight": (h,)}
    for n in range(cfg.num_hidden_layers):
        p = f"blk.{n}."
        shapes |= {p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
                   p + "attn_q.weight": (qd, h), p + "attn_k.weight": (kvd, h),
                   p + "attn_v.weight": (kvd, h), p + "attn_output.weight": (h, qd),
                   p + "ffn_gate.weight": (i, h), p + "ffn_up.weight": (i, h), p + "ffn_down.weight": (h, i)}
    hf_names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                "output_norm.weight": "model.norm.weight"}
    for n in range(cfg.num_hidden_layers):
        for g, hn in LAYER_NAMES.items():
            hf_names[f"blk.{n}.{g}.weight"] = f"model.layers.{n}.{hn}.weight"

    to_write, expected = {}, {}
    for gname, shape in shapes.items():
        if len(shape) == 1:
            w = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
            to_write[gname] = (w, None)
            expected[hf_names[gname]] = torch.from_numpy(w.copy())
            continue
        raw = _k_blocks(rng, *shape, qtype)
        to_write[gname] = (raw, qtype)  # uint8 bytes: the writer derives the element shape
        held = np.asarray(dequantize(raw, qtype), dtype=np.float32)
        assert held.shape == shape and np.isfinite(held).all()
        assert 0.02 < np.abs(held).mean() < 0.1
        if gname.endswith("attn_q.weight"):
            held = _inverse_permute(held, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            held = _inverse_permute(held, cfg.num_key_value_heads)
        expected[hf_names[gname]] = torch.from_numpy(np.ascontiguousarray(held))
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_gguf(path, cfg, to_write)

    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == qtype and types["output_norm.weight"] == QT.F32
    assert [int(x) for x in next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight").shape] == [i, h]

    ck = load_checkpoint(str(path), progress=False)
    _check_common(ck, cfg, set(expected))
    _assert_weights_exact(ck, expected)

    prompts = _prompts(v)
    ours = _our_logits(ck, prompts)
    assert all(torch.isfinite(x).all() for x in ours)
    ref = _hf_logits(_hf_with(cfg, expected), prompts)
    scale = max(x.abs().max().item() for x in ref)
    err = _max_err(ours, ref)
    assert err <= 1e-4 * max(1.0, scale), \
        f"{qtype.name}: max |ours - transformers| = {err:.3g} (|logits| <= {scale:.3g})"
