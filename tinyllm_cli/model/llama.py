"""The Llama-family decoder, readable top to bottom (nanoGPT style).

Covers Llama, Mistral, Qwen2, Qwen3 and SmolLM shapes: RMSNorm, rotary embeddings in the Hugging
Face ``rotate_half`` convention (with optional Llama-3 / linear ``rope_scaling``, or llama.cpp's
per-frequency factors), grouped-query attention, a SwiGLU MLP, optional q/k/v bias, optional
per-head q/k RMSNorm before RoPE (Qwen3), tied or separate output embedding.

Invariants:
- Input is *packed*: ``input_ids`` and ``positions`` are flat ``[T]`` tensors holding the tokens of
  every sequence in the step back to back, with no padding anywhere. Each token carries its own
  rotary position, so a sequence never needs a pad-count offset.
- The model knows nothing about caching or scheduling. Per layer it hands ``q, k, v`` (already
  rotated) to ``attn.attend(layer, q, k, v)``, an object from ``tinyllm_cli.cache`` that stores
  K/V wherever it likes and returns the attention output for the same T tokens.
- Only the rows in ``logits_index`` go through the output projection: during prefill that is the
  last token of each sequence, which saves the (large) vocabulary matmul for every other token.
  With ``greedy`` the forward returns those rows' argmax instead of their logits, the same ids
  (``greedy_head.py``: a float32 head may find them without reading all of its weights).
- Q/K/V and gate/up are fused into one matmul each at load time (``fuse_weights``).
- On CPU the weight matmuls run through oneDNN with pre-packed weights (``gemm.py``) unless
  ``gemm='torch'``; ``model.gemm`` says which path a loaded model uses.
- On CPU, where ``tinyllm_cli.kernels`` builds, residual add + RMSNorm, RoPE and SiLU * up run as
  one fused kernel each (``model.native``); the PyTorch ops stay as the reference and the path
  for every other device. The residual add of each layer's MLP is deferred into the next norm.
  With the paged kernel attention every layer runs in one C++ call a step (``fused.py``: the
  same ops in the same order, the same bits).
- On panels a big step's MLP runs in row chunks (``fused.mlp_chunk_rows``), in both the C++
  layer and this one: a panel row's output does not depend on the rows beside it, so the bits
  are those of one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels as native
from . import fused
from .gemm import pack_linears, resolve_gemm
from .greedy_head import head_argmax, screen_for
from .quant import Int8Embedding, Int8Head, Int8Rows, QuantWeight, int4_linear, is_quantized


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    arch: str = "llama"
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies across all layers, per element byte."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


class Attention(Protocol):
    """What a cache hands the model for one step (see ``tinyllm_cli.cache``)."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Rotary inverse frequencies, with the scaling types Llama checkpoints use."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind in ("default", None):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(sc["factor"])).float()
    if kind == "freq_factors":
        # llama.cpp's rope_freqs tensor (how its converter stores Llama-3 scaling): one divisor
        # per frequency, the same numbers the "llama3" branch below computes.
        factors = torch.as_tensor(sc["factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors, the head needs {inv_freq.numel()}")
        return (inv_freq / factors).float()
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_len = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(mid, blended, scaled).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, where ``rotate_half(x) = cat(-x2, x1)``: that is
    a half-roll of x with the first half negated, and the sign is folded into ``sin_signed``
    once per step. Rotates ``x`` in place (it is a view of a fresh projection output) and
    returns it: one temporary (the roll) instead of three."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed)
    return x.mul_(cos).add_(rolled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # One fused kernel. In bfloat16/float16 it accumulates in float32 and rounds once, where
        # transformers rounds the normalised x and then the product (within one ulp of it); the
        # eight-op reference cost 2 x 7 extra dispatches per layer, which a one-token step feels.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class HeadNorm(RMSNorm):
    """Qwen3's q_norm and k_norm as one op on the fused ``[T, q heads + kv heads, head_dim]`` view:
    each head vector is RMS-normalised on its own, then scaled by its row of ``weight`` (the
    q_norm weight repeated for every q head, then k_norm's for every kv head)."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise over head_dim only; the [heads, dim] weight then broadcasts over tokens.
        return F.rms_norm(x, x.shape[-1:], None, self.eps).mul_(self.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.qk_norm = HeadNorm(self.n_heads + self.n_kv, d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.inter = cfg.intermediate_size
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.native = False  # fused CPU kernels (tinyllm_cli.kernels) for norm, RoPE, SwiGLU; see use_native_ops

    def forward(self, x: Tensor, r: Tensor | None, cos: Tensor, sin: Tensor, attn: Attention) -> tuple[Tensor, Tensor]:
        """``x`` is the residual stream and ``r`` the previous layer's MLP output, not yet added
        to it (None before the first layer): the add is fused into this layer's first norm.
        Returns the same pair for the next layer; ``x`` is updated in place."""
        t = x.shape[0]
        qkv = self.qkv(add_norm(x, r, self.input_norm, self.native))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(t, self.n_heads + self.n_kv, self.head_dim)
        if self.qk_norm is not None:  # Qwen3 normalises each head before RoPE
            qk = self.qk_norm(qk)
        # Q and K heads rotate together in one pass.
        qk = native.rope_(qk, cos, sin) if self.native else apply_rope(qk, cos, sin)
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)
        v = v.view(t, self.n_kv, self.head_dim)
        o = attn.attend(self.index, q, k, v)
        h = add_norm(x, self.o_proj(o.reshape(t, self.q_size)), self.post_norm, self.native)
        return x, self.mlp(h)

    def mlp(self, h: Tensor) -> Tensor:
        """down(SwiGLU(gate_up(h))); a big step in the row chunks the C++ layer uses
        (``fused.mlp_chunk_rows``): the same bits as one pass, less memory."""
        rows = fused.mlp_chunk_rows(self)
        if not rows or h.shape[0] <= rows:
            return self.down(self.swiglu(self.gate_up(h)))
        chunks = h.split(fused.chunk_size(h.shape[0], rows))
        return torch.cat([self.down(self.swiglu(self.gate_up(c))) for c in chunks])

    def swiglu(self, gate_up: Tensor) -> Tensor:
        if self.native:
            return native.silu_mul(gate_up)
        gate, up = gate_up.split(self.inter, dim=-1)
        # In place: gate and up are views of a fresh matmul output nobody else holds.
        return F.silu(gate, inplace=True).mul_(up)


def add_norm(x: Tensor, r: Tensor | None, norm: RMSNorm, fused: bool) -> Tensor:
    """``x += r`` (when r is given), then ``norm(x)``: one pass with the native kernel."""
    if fused:
        return native.add_rms_norm_(x, r, norm.weight, norm.eps)
    if r is not None:
        x.add_(r)
    return norm(x)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # build_model builds this on the meta device and assigns every tensor afterwards. Nothing
        # here may run a computing op: on meta tensors those go through torch._refs, whose first
        # use imports torch._dynamo (2 s of start-up). So the embedding gets an empty weight (no
        # normal_() init) and inv_freq an empty placeholder.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.gemm = "torch"
        self.native = False  # see use_native_ops
        self.quant = "none"  # 'gguf' when some weights are held quantized (quant.py)
        self.greedy_screen = None  # greedy_head.GreedyScreen where the head has one
        self.stack = None  # every layer in one C++ call (fused.stack_layers), where every layer has its arguments
        self.int8_activations = False  # whether the 4-bit matmuls quantize their input (quant.py)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the final norm's: embeddings may be held quantized)."""
        return self.norm.weight.dtype

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin of shape [T, 1, head_dim], computed in float32 then cast (as HF
        does); the sign (-1 on the first half) is ``rotate_half``'s, see ``apply_rope``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        sin = freqs.sin()
        cos = torch.cat((freqs.cos(),) * 2, dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    def forward(
        self, input_ids: Tensor, positions: Tensor, attn: Attention, logits_index: Tensor | None = None,
        greedy: bool = False,
    ) -> Tensor:
        """Packed forward: returns float32 logits for the rows in ``logits_index`` (all if None), or
        with ``greedy`` their argmax, int64 token ids (``greedy_head.head_argmax``: the same ids)."""
        x, r = self.embed(input_ids), None
        cos, sin = self.rope(positions)
        stacked = fused.run_stack(self, x, cos, sin, attn, logits_index)  # every layer in one C++ call
        if stacked is None:
            for layer in self.layers:
                x, r = layer(x, r, cos, sin, attn)
            kept = False
        else:
            x, r, kept = stacked  # kept: only the logit rows came out of the last layer
        if logits_index is not None and not kept:
            x = x.index_select(0, logits_index)
            r = None if r is None else r.index_select(0, logits_index)
        h = add_norm(x, r, self.norm, self.native)
        return head_argmax(self, h) if greedy else self.lm_head(h).float()


def build_model(cfg: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype, device: str,
                gemm: str = "auto", int8_activations: bool = False) -> LlamaModel:
    """Create the model on ``device`` from HF-named weights (``model.layers.N.self_attn.q_proj...``).
    ``gemm`` is 'auto', 'panel', 'onednn' or 'torch' (see ``gemm.py``); packing comes last because a
    packed model can no longer be moved. ``int8_activations``: the 4-bit matmuls quantize their
    input (``quant.int8_activations``)."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    state = fuse_weights(cfg, weights)
    quantized = {k: state.pop(k) for k in [k for k, v in state.items() if is_quantized(v)]}
    model.load_state_dict(state, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta and n not in quantized]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:4])}")
    install_quantized(model, quantized, state, device, int8_activations)
    kept_quantized = bool(quantized)
    # From here the model holds the only references to the fused tensors (Q/K/V, gate/up), so the
    # cast and the packing below free each one as they replace it (pack_linears): the 1.5b shape's
    # bfloat16 load peaked at 8.0 GB of RSS with all of them beside their packed copies, now 6.4.
    del state, quantized
    model = model.to(device=device, dtype=dtype)
    model.inv_freq = model.inv_freq.float()
    model = model.eval().requires_grad_(False)
    model.gemm = resolve_gemm(gemm, dtype, torch.device(device))
    model.greedy_screen = screen_for(model, model.gemm)  # from the head's weight, before it is packed
    pack_linears(model, model.gemm)
    model.quant = "gguf" if kept_quantized else "none"
    model.int8_activations = any(getattr(m, "int8", False) for m in model.modules())
    use_native_ops(model, native.load() if torch.device(device).type == "cpu" else False)
    return model


def use_native_ops(model: LlamaModel, on: bool) -> None:
    """Run RMSNorm (+ residual add), RoPE and SwiGLU through the fused CPU kernels, or (off, and
    on any other device) through the PyTorch ops above, which the tests use as the reference."""
    model.native = on
    for m in model.modules():
        if isinstance(m, Int8Embedding):
            m.native = on
    for layer in model.layers:
        layer.native = on
    model.stack = fused.stack_layers(model) if on else None


def install_quantized(model: LlamaModel, quantized: dict, state: dict, device: torch.device | str,
                      int8_activations: bool = False) -> None:
    """Swap in quantized modules (``quant.py``) for the weights that arrived quantized. They hold
    packed integer buffers that a later ``.to(dtype)`` leaves alone; biases come from ``state``."""
    for name, w in quantized.items():
        owner, _, leaf = name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        if leaf == "embed":
            if isinstance(w, Int8Rows):
                model.embed = Int8Embedding(w, int8_activations)
                if model.cfg.tie_word_embeddings:
                    model.lm_head = Int8Head(model.embed)
            else:  # int4 rows cannot be looked up cheaply: keep this one dequantized
                model.embed.weight = nn.Parameter(w.dequantize(), requires_grad=False)
                if model.cfg.tie_word_embeddings:
                    model.lm_head.weight = model.embed.weight
        elif isinstance(w, Int8Rows):
            setattr(parent, leaf, Int8Head(Int8Embedding(w, int8_activations)))
        else:
            bias = state.get(name.removesuffix("weight") + "bias")
            setattr(parent, leaf, int4_linear(w, bias, device, int8_activations))


def fuse_weights(cfg: ModelConfig, w: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map HF names to ours and concatenate q/k/v and gate/up so each is one matmul."""
    def cat(parts: list) -> Tensor | QuantWeight:
        if all(isinstance(p, QuantWeight) for p in parts):
            return QuantWeight.cat(parts)
        return torch.cat([p.dequantize() if is_quantized(p) else p for p in parts])

    def take(name: str) -> Tensor:
        if name not in w:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return w[name]

    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.qkv.weight"] = cat([take(a + f"{n}_proj.weight") for n in "qkv"])
        if cfg.attention_bias:
            out[f"layers.{i}.qkv.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
        if cfg.qk_norm:
            d = cfg.head_dim
            out[f"layers.{i}.qk_norm.weight"] = torch.cat([take(a + "q_norm.weight").expand(cfg.num_heads, d),
                                                           take(a + "k_norm.weight").expand(cfg.num_kv_heads, d)])
        out[f"layers.{i}.o_proj.weight"] = take(a + "o_proj.weight")
        out[f"layers.{i}.input_norm.weight"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.post_norm.weight"] = take(p + "post_attention_layernorm.weight")
        m = p + "mlp."
        out[f"layers.{i}.gate_up.weight"] = cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        out[f"layers.{i}.down.weight"] = take(m + "down_proj.weight")
    return out
