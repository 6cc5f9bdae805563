"""``quant: gguf``: GGUF 4-bit / 8-bit weights kept quantized, and the fast GGUF header reader.

References: the ``gguf`` package's own dequantizer (what the file holds), ``F.linear`` on those
dequantized weights, the dequantized model (logits), and a no-cache recompute (engine). The
quantized path computes in bfloat16, so its tolerances are bfloat16's, stated per test.
"""

from __future__ import annotations

import os
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import LLAMA_SHAPE
from test_gguf_roundtrip import _gguf_tensors, _hf_config, _k_blocks, _write_gguf
from tinyllm_cli.cache.attention import NoCacheAttention
from tinyllm_cli.config import Config
from tinyllm_cli.engine.request import Request, SamplingParams
from tinyllm_cli.model.checkpoint import load_checkpoint
from tinyllm_cli.model.gguf_file import GGUFFile
from tinyllm_cli.model.llama import build_model
from tinyllm_cli import kernels
from tinyllm_cli.model import quant
from tinyllm_cli.model.quant import Int4Linear, Int8Embedding, Int8Rows, Q4Linear, QuantWeight, from_gguf
from tinyllm_cli.runtime import Runtime, make_engine

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

# Each skip names what its tests need, so the rest (the GGUF forms and reader, the int8 rows, the
# kernels' own 4-bit path) still run where one of them is missing.
needs_int4 = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch has no CPU int4 matmul")
# tinyllm's kernels: conftest fails these tests where the kernels should have built and did not,
# and skips them where they are not expected (no compiler, or TINYLLM_ALLOW_NO_KERNELS=1).
needs_kernels = pytest.mark.needs_kernels


def _raw(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == QT.Q4_K:
        return _k_blocks(rng, rows, cols, qtype)
    return quantize(rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda q: q.name)
def test_int4_forms_hold_exactly_what_the_file_holds(qtype):
    rows, cols = 48, 512
    raw = _raw(qtype, rows, cols)
    held = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32))
    q = from_gguf(raw, qtype.name, rows, cols)
    assert isinstance(q, QuantWeight) and int(q.codes.max()) <= 15
    # float32 scale/zero reproduce the file's values to float32 rounding of d*q + m.
    torch.testing.assert_close(q.dequantize(), held, rtol=0, atol=1e-6 * held.abs().max().item())


def test_q8_0_becomes_int8_rows_within_half_a_row_step():
    rows, cols = 32, 256
    raw = _raw(QT.Q8_0, rows, cols)
    held = torch.from_numpy(np.asarray(dequantize(raw, QT.Q8_0), dtype=np.float32))
    q = from_gguf(raw, "Q8_0", rows, cols)
    assert isinstance(q, Int8Rows) and q.q.dtype == torch.int8
    step = held.abs().amax(1, keepdim=True) / 127
    assert ((q.dequantize() - held).abs() <= step / 2 + 1e-7).all()


def test_unsupported_types_and_shapes_stay_dequantized():
    assert from_gguf(_raw(QT.Q5_1, 32, 64), "Q5_1", 32, 64) is None
    assert from_gguf(_raw(QT.Q4_1, 8, 64), "Q4_1", 8, 64) is None  # N not a multiple of 16


@needs_int4
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_equals_f_linear_on_the_dequantized_weight(bias):
    rows, cols = 96, 256
    q = from_gguf(_raw(QT.Q4_1, rows, cols, seed=1), "Q4_1", rows, cols)
    b = torch.randn(rows) if bias else None
    lin = Int4Linear(q, b)
    for m in (1, 2, 7, 40):
        x = torch.randn(m, cols).bfloat16()
        ref = F.linear(x.float(), q.dequantize(), b)
        got = lin(x)
        assert got.dtype == torch.bfloat16
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"{m} rows: relative error {rel:.3g}"  # bfloat16 weights/activations: ~3e-3


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize("bias", [False, True])
def test_q4_linear_equals_f_linear_on_the_dequantized_weight(qtype, bias):
    """tinyllm's 4-bit layout, on its vector path (where this CPU has one) and its plain loops,
    over row counts that leave every tile remainder (1-4 rows, 2- and 4-block tiles)."""
    rows, cols = 80 if qtype != QT.Q4_K else 48, 512 if qtype == QT.Q4_K else 96
    q = from_gguf(_raw(qtype, rows, cols, seed=3), qtype.name, rows, cols)
    b = torch.randn(rows).bfloat16() if bias else None
    lin = Q4Linear(q, b)
    for m in (1, 2, 3, 4, 5, 8, 17, 40):
        x = torch.randn(m, cols).bfloat16()
        ref = F.linear(x.double(), q.dequantize().double(), None if b is None else b.double())
        for got in (lin(x), torch.ops.tinyllm.q4_linear_portable(x, lin.packed, lin.bias)):
            assert got.dtype == torch.bfloat16 and got.shape == (m, rows)
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            # Q4_0 / Q4_1: the weights are exact, so only bf16 output rounding (2^-9) and float32
            # sums remain; Q4_K's products of scales round to float16 (2^-11) on top.
            assert err < 5e-3, f"{qtype.name}, {m} rows: max error {err:.3g} of the largest output"


@needs_kernels
@pytest.mark.parametrize("int8", [False, True], ids=["bf16-acts", "int8-acts"])
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K], ids=lambda q: q.name)
def test_a_q4_linear_row_does_not_depend_on_the_rows_beside_it(qtype, int8):
    """Batch invariance: each row of a step gets bitwise the output it gets alone, at every row
    count the vector path tiles differently (1-4 rows in registers, more through a decoded
    panel on the float32 path; 4/2/1-row tiles on the bfloat16 dot path). Speculative decoding's
    verify step of k + 1 rows then reproduces plain decoding's one-row steps exactly. With int8
    activations each row is quantized on its own, so the same holds (3-row tiles on AVX2, 8 on
    AVX512-VNNI, 48-row chunks)."""
    rows, cols = 48, 512 if qtype == QT.Q4_K else 96
    q = from_gguf(_raw(qtype, rows, cols, seed=7), qtype.name, rows, cols)
    lin = Q4Linear(q, torch.randn(rows).bfloat16(), int8=int8)
    x = torch.randn(60, cols).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
    for m in (2, 3, 4, 5, 6, 7, 13, 40, 60):
        assert torch.equal(lin(x[:m]), alone[:m]), f"{m} rows"


def _q8_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of x [m, k], written independently of the kernel: per group of 32,
    d = max|x| / 127 and codes round-half-even(x * (127 / max|x|)), each float32 operation
    correctly rounded (done in float64, then rounded: exact for one division or product; torch's
    float32 division is not always, and a product on .5 then rounds the other way). Returns the
    codes [m, k / 32, 32] and d [m, k / 32, 1] in float64."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    codes = torch.round((g.double() * inv.double()).float().clamp(-127, 127))
    return codes.double(), (amax.double() / 127.0).float().double()


def _q8(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] after the Q8_0 round trip (``_q8_codes``), in float64."""
    codes, d = _q8_codes(x)
    return (codes * d).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize("bias", [False, True])
def test_q4_linear_with_int8_activations_is_the_q8_round_trip_times_the_weight(qtype, bias):
    """``q4_q8_linear``: its vector path equals its plain loops bit for bit (integer sums are
    exact and the float32 steps are the same), and both equal F.linear of the Q8_0 round trip of
    x with the dequantized weight, up to float32 sums and bfloat16 output rounding. Row counts
    leave every tile remainder (3-row tiles on AVX2, 8 on AVX512-VNNI) and cross the 48-row chunk."""
    rows, cols = 80 if qtype != QT.Q4_K else 48, 512 if qtype == QT.Q4_K else 96
    q = from_gguf(_raw(qtype, rows, cols, seed=5), qtype.name, rows, cols)
    b = torch.randn(rows).bfloat16() if bias else None
    lin = Q4Linear(q, b, int8=True)
    w = q.dequantize().double()
    gen = torch.Generator().manual_seed(11)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 17, 40, 100):
        x = torch.randn(m, cols, generator=gen).bfloat16()
        x[0, :7] *= 30  # an outlier channel, as real activations have: its group's step grows
        if m > 2:  # an all-zero group, and halves that round to even (step 1: max |x| = 127)
            x[1, 32:64] = 0
            x[2, 32:64] = torch.tensor([127.0] + [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] * 4 + [-127.0, 3.5, -3.5])
        got = lin(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, rows)
        assert torch.equal(got, torch.ops.tinyllm.q4_q8_linear_portable(x, lin.packed, lin.bias)), f"{m} rows"
        bd = None if b is None else b.double()
        ref = F.linear(_q8(x).double(), w, bd)
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 5e-3, f"{qtype.name}, {m} rows: max error {err:.3g} of the largest output"
        # The cost of quantizing x at all: real, and bounded (a step of max|x| / 127 per group;
        # 1-3% here, where row 0 has an outlier 30x its neighbours; measured up to 3.2% over 300 seeds).
        exact = F.linear(x.double(), w, bd)
        cost = ((ref - exact).norm() / exact.norm()).item()
        assert 1e-4 < cost < 0.06, f"{m} rows: int8 activations moved the output by {cost:.3g}"


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda q: q.name)
def test_q4_unpack_inverts_q4_pack_and_many_rows_take_it(qtype):
    """``q4_unpack`` gives back exactly the weight the kernel holds (float16 scale and min), and
    a step of ``DEQUANT_ROWS`` rows or more (a ``big_step`` on the bfloat16 dot path, the 4-bit
    kernel itself on the float32 path) agrees with the 4-bit kernel and with F.linear."""
    rows, cols = 48, 512 if qtype == QT.Q4_K else 96
    q = from_gguf(_raw(qtype, rows, cols, seed=5), qtype.name, rows, cols)
    lin = Q4Linear(q, torch.randn(rows).bfloat16())
    half = QuantWeight(q.codes, q.scale.half().float(), q.min.half().float())  # what q4_pack keeps
    assert torch.equal(quant.q4_unpack(lin.packed, torch.float32), half.dequantize())
    x = torch.randn(quant.DEQUANT_ROWS, cols).bfloat16()
    ref = F.linear(x.double(), q.dequantize().double(), lin.bias.double())
    for got in (lin(x), torch.ops.tinyllm.q4_linear(x, lin.packed, lin.bias)):
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, f"{qtype.name}: max error {err:.3g} of the largest output"


@needs_kernels
@pytest.mark.parametrize("rows", [1, 9, 300])
@pytest.mark.parametrize("n,k", [(48, 96), (80, 2080), (16, 64)])
def test_q4_wide_linear_is_the_unpacked_bf16_matmul(rows, n, k):
    """``q4_wide_linear`` (big steps without AMX): the weight decoded to bfloat16 panel block by
    panel block, then bfloat16 products summed in float32 and rounded once: F.linear over
    ``q4_unpack``'s bfloat16 weight, for a whole panel of 48 outputs, a panel and a partial one
    (80), a lone block (16), and K in blocks of 1,024 (2,080: partial sums carried over). Each
    weight may differ from q4_unpack's by one bfloat16 rounding (a fused multiply-add there)."""
    if torch.ops.tinyllm.q4_isa() != "avx512-bf16" or not kernels.panel_isa().endswith("-bf16"):
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            torch.ops.tinyllm.q4_wide_linear(torch.zeros(1, 64).bfloat16(), torch.zeros(1, 2, 320, dtype=torch.uint8), None)
        return
    q = from_gguf(_raw(QT.Q4_1, n, k, seed=rows), "Q4_1", n, k)
    lin = Q4Linear(q, torch.randn(n).bfloat16())
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    got = torch.ops.tinyllm.q4_wide_linear(x, lin.packed, lin.bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    ref = F.linear(x.double(), quant.q4_unpack(lin.packed).double(), lin.bias.double())
    err = ((got.double() - ref).abs() / (ref.abs() + ref.abs().mean())).max().item()
    assert err < 2 ** -7, f"relative error {err:.3g}"
    for r in range(0, rows, max(1, rows // 3)):  # a row's output does not depend on the others
        assert torch.equal(torch.ops.tinyllm.q4_wide_linear(x[r:r + 1], lin.packed, lin.bias), got[r:r + 1])


@needs_kernels
def test_q4_pack_refuses_shapes_it_cannot_hold():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tinyllm.q4_pack(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2), torch.zeros(8, 2))
    lin = Q4Linear(from_gguf(_raw(QT.Q4_1, 16, 64), "Q4_1", 16, 64), None)
    with pytest.raises(RuntimeError, match="inputs"):
        lin(torch.randn(1, 96).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        lin(torch.randn(1, 64))


def test_int8_embedding_lookup_and_head_share_one_matrix():
    rows, cols = 64, 128
    w = from_gguf(_raw(QT.Q8_0, rows, cols, seed=2), "Q8_0", rows, cols)
    emb = Int8Embedding(w)
    ids = torch.tensor([3, 0, 63, 3])
    torch.testing.assert_close(emb(ids).float(), w.dequantize()[ids], rtol=1e-2, atol=1e-3)
    x = torch.randn(5, cols).bfloat16()
    ref = x.float() @ w.dequantize().t()
    assert ((emb.linear(x).float() - ref).norm() / ref.norm()).item() < 1e-2


@needs_kernels
def test_int8_head_with_int8_activations_is_exact_integer_dot_products():
    """With int8 activations the int8 output matrix (the tied embedding) is held in
    ``int8_pack``'s order and multiplies the Q8_0 codes of its input in integers (AVX2, AVX512-VNNI):
    the lookup reads the same rows as before, one copy; the logits are the int8 weight against
    the Q8_0 round trip of x, summed group by group in float32 (so within float32 rounding of an
    exact float64 sum); the vector path equals the plain loops bit for bit, and a row's logits do
    not depend on the rows beside it. Shapes the kernel cannot tile keep the bfloat16 path."""
    rows, cols = 96, 128
    w = from_gguf(_raw(QT.Q8_0, rows, cols, seed=2), "Q8_0", rows, cols)
    plain = Int8Embedding(w)
    assert not plain.int8 and not Int8Embedding(Int8Rows(w.q[:40], w.scale[:40]), int8=True).int8
    if not quant.int8_head_packs((rows, cols)):
        pytest.skip("the int8 output matmul with int8 activations needs AVX2 or AVX512-VNNI")
    emb = Int8Embedding(w, int8=True)
    assert emb.int8 and emb.q.numel() == rows * cols and emb.q.shape == (rows // 16, cols // 4, 16, 4)
    ids = torch.tensor([3, 0, 95, 17, 3])
    assert torch.equal(emb(ids), plain(ids))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(57, cols, generator=gen).bfloat16()  # 8-row tiles, a remainder, past the 48-row chunk
    x[2, :5] *= 40  # an outlier channel
    got = emb.linear(x)
    assert got.dtype == torch.float32 and got.shape == (57, rows)
    assert torch.equal(got, torch.ops.tinyllm.int8_q8_linear_portable(x, emb.q, emb.scale))
    codes, d = _q8_codes(x)
    isum = torch.einsum("vge,mge->mvg", w.q.double().reshape(rows, -1, 32), codes)
    ref = (isum * d.transpose(1, 2)).sum(-1) * emb.scale.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    alone = torch.cat([emb.linear(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(got, alone)
    # The cost of int8 activations here, against bfloat16 ones: real and small.
    cost = ((got - plain.linear(x).float()).norm() / got.norm()).item()
    assert 1e-4 < cost < 0.03, cost


# ---- a whole model from a llama.cpp-style Q4_1 file ----------------------------------------------

@pytest.fixture(scope="module")
def q4_gguf(llama_dir, tmp_path_factory):
    """The tiny Llama as llama.cpp's converter + quantizer would write it: Q4_1 matrices (Q/K rows
    permuted), a Q8_0 embedding and output matrix (the int8 head, as the default model's tied
    one), F32 norms."""
    import transformers
    cfg = _hf_config(llama_dir)
    state = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir)).state_dict()
    to_write = {}
    for gname, (w, _) in _gguf_tensors(state, cfg).items():
        if w.ndim == 1:
            to_write[gname] = (w, None)
        else:
            kind = QT.Q8_0 if gname in ("token_embd.weight", "output.weight") else QT.Q4_1
            to_write[gname] = (quantize(w, kind), kind)
    path = tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf"
    _write_gguf(path, cfg, to_write)
    return path


def _logits(model, prompts):
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        return model(ids, pos, NoCacheAttention([len(p) for p in prompts]), None).float()


PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(10, 40)), [300, 2, 8]]


@pytest.mark.parametrize("kernel", [pytest.param("tinyllm", marks=needs_kernels),
                                    pytest.param("tinyllm-int8", marks=needs_kernels),
                                    pytest.param("torch", marks=needs_int4)])
def test_quantized_model_holds_no_float_copy_and_matches_the_dequantized_one(q4_gguf, kernel, monkeypatch):
    if kernel != "torch" and not quant.q4_usable(torch.device("cpu")):
        pytest.skip("tinyllm's 4-bit kernel runs where its build has an AVX2 or AVX-512 path")  # the kernels loaded
    if kernel == "torch":  # what a CPU without AVX2 (or without a compiler) runs
        monkeypatch.setattr(quant, "q4_usable", lambda device: False)
    ck = load_checkpoint(str(q4_gguf), progress=False, quant="gguf")
    model = build_model(ck.config, ck.weights, torch.bfloat16, "cpu", int8_activations=kernel == "tinyllm-int8")
    assert model.quant == "gguf" and model.int8_activations == (kernel == "tinyllm-int8")
    layer = model.layers[0]
    kind = Int4Linear if kernel == "torch" else Q4Linear
    mods = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    assert all(isinstance(m, kind) and getattr(m, "int8", False) == model.int8_activations for m in mods)
    assert isinstance(model.embed, Int8Embedding)
    head = model.lm_head._embed[0]  # the Q8_0 output matrix: int8 activations too where it packs
    assert head.int8 == (model.int8_activations and quant.int8_head_packs(head.scale.shape + (LLAMA_SHAPE["hidden_size"],)))
    biggest_float = max(p.numel() for p in model.parameters())
    assert biggest_float <= LLAMA_SHAPE["hidden_size"]  # only norm vectors stay as float parameters

    deq = load_checkpoint(str(q4_gguf), progress=False)  # the same file, dequantized (exact)
    ref = _logits(build_model(deq.config, deq.weights, torch.float32, "cpu"), PROMPTS)
    got = _logits(model, PROMPTS)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.05, f"relative logit error {rel:.3g}"  # measured ~0.01: bfloat16 + int8 rows
    top2 = ref.topk(2, -1).values
    # Measured: max |logit difference| 0.04, so rows whose top two differ by more than 0.1 must
    # keep their argmax (about 25 of the 40 rows here).
    confident = (top2[:, 0] - top2[:, 1]) > 0.1
    assert confident.sum() >= 15
    assert (got.argmax(-1) == ref.argmax(-1))[confident].all()


@needs_kernels
@pytest.mark.parametrize("int8", [False, True], ids=["bf16-acts", "int8-acts"])
def test_big_steps_leave_the_4bit_tiles_and_agree(q4_gguf, monkeypatch, int8):
    """A step of ``DEQUANT_ROWS`` rows or more: on the bfloat16 dot path (AVX512-BF16) it leaves
    the one-call layer kernel for the layer's modules, whose Q4Linear unpacks to bfloat16 for
    oneDNN where it has AMX (either activation mode) and runs ``q4_wide_linear`` elsewhere with
    bfloat16 activations; with int8 activations and no AMX the VNNI tile keeps it, as it does on
    the float32 path (AVX2; oneDNN has no fast bfloat16 matmul there). Either way the logits
    agree with the dequantized model, and the path taken is the one ``q4_isa``, the activation
    mode and the CPU's flags say."""
    if not quant.q4_usable(torch.device("cpu")):
        pytest.skip("tinyllm's 4-bit kernel runs where its build has an AVX2 or AVX-512 path")
    from tinyllm_cli.machine import has_amx
    bf16_dot = torch.ops.tinyllm.q4_isa() == "avx512-bf16"
    expected = None if not bf16_dot else "unpack" if has_amx() else None if int8 else "wide"
    ck = load_checkpoint(str(q4_gguf), progress=False, quant="gguf")
    model = build_model(ck.config, ck.weights, torch.bfloat16, "cpu", int8_activations=int8)
    assert model.int8_activations == int8
    deq = load_checkpoint(str(q4_gguf), progress=False)
    ref = _logits(build_model(deq.config, deq.weights, torch.float32, "cpu"), PROMPTS)
    calls = []
    real_unpack, real_wide = quant.q4_unpack, torch.ops.tinyllm.q4_wide_linear
    monkeypatch.setattr(quant, "q4_unpack", lambda *a, **k: calls.append("unpack") or real_unpack(*a, **k))
    monkeypatch.setattr(torch.ops.tinyllm, "q4_wide_linear", lambda *a: calls.append("wide") or real_wide(*a))
    monkeypatch.setattr(quant, "DEQUANT_ROWS", 8)  # the prompts' 40 rows are a big step now
    got = _logits(model, PROMPTS)
    assert set(calls) == ({expected} if expected else set()), f"{set(calls)} on the {torch.ops.tinyllm.q4_isa()} path"
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.05, f"relative logit error {rel:.3g}"
    top2 = ref.topk(2, -1).values
    confident = (top2[:, 0] - top2[:, 1]) > 0.1
    assert (got.argmax(-1) == ref.argmax(-1))[confident].all()
    # Through the engine (paged attention, where layers otherwise run as one kernel call).
    from tinyllm_cli import LLM
    calls.clear()
    with LLM(str(q4_gguf), quant="gguf", dtype="bfloat16", num_blocks=64, progress=False,
             quant_activations="int8" if int8 else "bfloat16") as llm:
        out = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=3, ignore_eos=True), chat=False, use_tqdm=False)
    assert set(calls) == ({expected} if expected else set()) and len(out[0].completions[0].token_ids) == 3


@needs_kernels
def test_int8_prompts_do_not_depend_on_the_prompts_beside_them(q4_gguf, monkeypatch):
    """With int8 activations and no AMX every step runs the 4-bit VNNI / AVX2 tiles (``big_step``
    is None), whose rows do not depend on the rows beside them: prompts prefilled together in one
    step past ``DEQUANT_ROWS`` give the tokens and log-probabilities, bit for bit, that each
    gives prefilled alone below it. (Before, on AVX512-BF16 CPUs the big step ran the bfloat16
    tile and a prompt's answer could change with the batch it arrived in.)"""
    from tinyllm_cli.machine import has_amx
    if not quant.q4_usable(torch.device("cpu")) or has_amx():
        pytest.skip("with AMX a big step unpacks to bfloat16 for oneDNN; without the kernel there is no int8 path")
    monkeypatch.setattr(quant, "DEQUANT_ROWS", max(map(len, PROMPTS)) + 1)
    assert sum(map(len, PROMPTS)) >= quant.DEQUANT_ROWS  # together: one big step; alone: small ones
    from tinyllm_cli import LLM
    p = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)
    with LLM(str(q4_gguf), quant="gguf", dtype="bfloat16", num_blocks=64, progress=False,
             quant_activations="int8", prefix_caching=False) as llm:
        together = llm.generate(PROMPTS, p, chat=False, use_tqdm=False)
        alone = [llm.generate([pr], p, chat=False, use_tqdm=False)[0] for pr in PROMPTS]
    for t, a in zip(together, alone):
        assert t.completions[0].token_ids == a.completions[0].token_ids
        assert t.completions[0].logprobs == a.completions[0].logprobs


@needs_int4  # quant: gguf runs only where torch has its int4 matmul (runtime.check_quant), the fallback
@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=needs_kernels)], ids=["bf16-acts", "int8-acts"])
def test_quantized_engine_equals_no_cache_recompute(q4_gguf, int8):
    """Cache equivalence holds for any weights: the paged engine (with preemption; its layers one
    kernel call each) produces the tokens a full recompute of the same quantized model (its
    modules, one call each) produces."""
    if int8 and not quant.q4_usable(torch.device("cpu")):
        pytest.skip("int8 activations run on tinyllm's 4-bit kernel (AVX2 or AVX-512)")
    cfg = Config(model=str(q4_gguf), quant="gguf", dtype="bfloat16")
    cfg.cache.block_size, cfg.cache.num_blocks = 4, 12
    ck = load_checkpoint(cfg.model, progress=False, quant="gguf")
    model = build_model(ck.config, ck.weights, torch.bfloat16, "cpu", int8_activations=int8)
    rt = Runtime.of_model(model, ck, torch.device("cpu"), torch.bfloat16, 0.0)
    eng = make_engine(cfg, rt)
    p = SamplingParams(max_new_tokens=10, ignore_eos=True)
    outs = {o.id: o for o in eng.run([Request(str(i), pr, p, index=i) for i, pr in enumerate(PROMPTS)])}
    assert eng.stats.preemptions > 0
    for i, pr in enumerate(PROMPTS):
        seq = list(pr)
        for _ in range(10):
            seq.append(int(_logits(model, [seq])[-1].argmax()))
        assert outs[str(i)].token_ids == seq[len(pr):]


@needs_kernels
@pytest.mark.parametrize("int8", [False, True], ids=["bf16-acts", "int8-acts"])
def test_speculative_greedy_on_the_4bit_kernel_equals_plain_decoding(q4_gguf, int8):
    """Batch invariance end to end: with the 4-bit kernel, prompt-lookup speculation (verify
    steps of up to k + 1 rows per sequence, beside other sequences' rows) gives exactly the
    tokens of plain decoding, and the pool is empty afterwards."""
    if not quant.q4_usable(torch.device("cpu")):
        pytest.skip("tinyllm's 4-bit kernel runs where its build has an AVX2 or AVX-512 path")
    from tinyllm_cli.cache.blocks import BlockManager
    from tinyllm_cli.engine.engine import LLMEngine
    from tinyllm_cli.engine.speculative import NgramDrafter, Speculation
    ck = load_checkpoint(str(q4_gguf), progress=False, quant="gguf")
    model = build_model(ck.config, ck.weights, torch.bfloat16, "cpu", int8_activations=int8)
    assert isinstance(model.layers[0].gate_up, Q4Linear) and model.layers[0].gate_up.int8 == int8
    prompts = [[5, 17, 99, 5, 17, 99, 5, 17], list(range(10, 40)) * 2, [300, 2, 8, 300, 2]]
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)

    def go(spec):
        cache = BlockManager(model.cfg, 128, 4, torch.bfloat16, prefix_caching=True)
        eng = LLMEngine(model, cache, None, speculation=spec)
        outs = sorted(eng.run([Request(str(i), pr, p, index=i) for i, pr in enumerate(prompts)]), key=lambda o: o.index)
        assert not cache.tables and cache.pool.num_active == 0
        return [o.token_ids for o in outs], eng

    plain, _ = go(None)
    spec, eng = go(Speculation("ngram", 4, NgramDrafter(1, 3)))
    assert spec == plain
    assert eng.stats.spec_drafted_tokens > 0


def test_quant_activations_resolve_per_cpu_and_bad_settings_are_one_sentence(q4_gguf, tmp_path, capsys):
    """'auto' means int8 exactly where the 4-bit kernel runs and has an integer vector path
    (AVX512-VNNI where the CPU has it, else AVX2); the run's title and stats say which ran; int8
    without quant: gguf, or an unknown value, is a usage error before anything loads."""
    import json
    from test_cli import cli
    cpu = torch.device("cpu")
    flags = set(" ".join(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split())
    isa = torch.ops.tinyllm.q4_q8_isa() if quant.q4_usable(cpu) else ""
    if isa and not os.environ.get("TINYLLM_KERNELS_MARCH"):  # built for this CPU: the best path it has
        assert isa == ("avx512-vnni" if {"avx512_vnni", "avx512bw"} <= flags else "avx2"), (isa, flags)
    assert quant.int8_activations("auto", cpu) == bool(isa)
    assert not quant.int8_activations("bfloat16", cpu)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": PROMPTS[0]}) + "\n")
    model = ["-p", prompts, "--model", q4_gguf, "--max-new-tokens", 2]
    if quant.q4_usable(cpu):
        assert quant.int8_activations("int8", cpu)
        stats = tmp_path / "stats.json"
        code, out, err = cli(capsys, "generate", *model, "--quant", "gguf", "--quant-activations", "int8",
                             "--stats-json", stats)
        assert code == 0 and "int8 activations" in " ".join(err.split()), err  # the table title (wrapped)
        assert json.loads(stats.read_text())["int8_activations"] is True
    with pytest.MonkeyPatch.context() as mp:  # no 4-bit kernel (not built, TINYLLM_KERNELS=0, no AVX2)
        mp.setattr(quant, "q4_usable", lambda device: False)
        assert not quant.int8_activations("auto", cpu)
        with pytest.raises(ValueError, match="needs tinyllm's 4-bit kernel"):
            quant.int8_activations("int8", cpu)
    code, _, err = cli(capsys, "generate", *model, "--quant-activations", "int8")
    assert code == 2 and "is int8, which applies to quant: gguf only" in err and "Traceback" not in err
    code, _, err = cli(capsys, "generate", *model, "--quant", "gguf", "--quant-activations", "int4")
    assert code == 2 and "must be one of auto, bfloat16, int8, not 'int4'" in err


# ---- the GGUF header reader ------------------------------------------------------------------

def test_fast_reader_reads_what_gguf_reader_reads(q4_gguf):
    from tinyllm_cli.model.checkpoint import default_model_path
    for path in (q4_gguf, default_model_path()):
        ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
        assert list(ours.fields) == list(theirs.fields)
        for k, f in theirs.fields.items():
            a, b = ours.fields[k].contents(), f.contents()
            assert a == b and type(a) is type(b), k
        for a, b in zip(ours.tensors, theirs.tensors, strict=True):
            assert (a.name, list(a.shape), a.tensor_type) == (b.name, list(b.shape), b.tensor_type)
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_fast_reader_refuses_a_truncated_file(q4_gguf, tmp_path):
    data = q4_gguf.read_bytes()
    for cut in (10, 200, len(data) - 100):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError):
            GGUFFile(str(short))
