"""The packed-weight matmul paths (``model/gemm.py``: oneDNN, and tinyllm's ``panel_linear``)
against plain ``F.linear``, and the choice between them (``gemm: auto | panel | onednn | torch``).
Whole-model equivalence with the default path is covered by test_model_vs_hf (transformers) and
test_engine (no-cache recompute); the panel path is forced here on every CPU that can run it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tinyllm_cli.cli import main
from tinyllm_cli.model.checkpoint import load_checkpoint
from conftest import run_without_kernels
from tinyllm_cli import kernels
from tinyllm_cli.model import gemm as gemm_module
from tinyllm_cli.model.gemm import PackedLinear, PanelLinear, onednn_usable, panel_usable, resolve_gemm
from tinyllm_cli.model.fused import LinearKind, fused_layer_args
from tinyllm_cli.model.llama import build_model

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_usable(torch.float32, CPU), reason="torch built without oneDNN")
needs_panel = pytest.mark.skipif(not panel_usable(torch.float32, CPU),
                                 reason="tinyllm's kernels did not build, or not with AVX2 / AVX-512")


def auto_gemm(dtype: torch.dtype) -> str:
    """What 'auto' must resolve to here, from the rule in gemm.py's docstring."""
    onednn = gemm_module.onednn_usable  # looked up at call time: the no_bf16_onednn fixture replaces it
    if panel_usable(dtype, CPU):
        return "panel"
    if onednn(dtype, CPU):
        return "onednn"
    return "onednn-f32" if dtype == torch.bfloat16 and onednn(torch.float32, CPU) else "torch"


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_fp32(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    got, ref = PackedLinear(w, b)(x), F.linear(x, w, b)
    assert got.shape == ref.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_packed_linear_takes_non_contiguous_rows_and_bf16():
    w = torch.randn(64, 48)
    x = torch.randn(10, 96)[:, ::2]  # a strided view, as a split/select can hand it over
    assert not x.is_contiguous()
    torch.testing.assert_close(PackedLinear(w, None)(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
    if onednn_usable(torch.bfloat16, CPU):
        wb, xb = w.bfloat16(), x.contiguous().bfloat16()
        got = PackedLinear(wb, None)(xb)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), F.linear(xb, wb).float(), rtol=2e-2, atol=2e-2)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_widened_packed_linear_is_a_bf16_matmul_with_fp32_accumulation(rows):
    """onednn-f32 (a bfloat16 model on a CPU without bfloat16 matmuls): bfloat16 in and out, the
    float32 product of the bfloat16 values rounded once, as a bfloat16 matmul accumulating in
    float32 computes; the packed weight is float32 (exactly the bfloat16 values)."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(200, 96, generator=g).bfloat16(), torch.randn(200, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    lin = PackedLinear(w, b, widen=True)
    got = lin(x)
    ref = F.linear(x.float(), w.float(), b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200) and lin.bias.dtype == torch.float32
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-5)  # one bfloat16 rounding
    assert "onednn-f32" in repr(lin)


def test_bf16_without_bf16_matmuls_packs_in_fp32(no_bf16_onednn, llama_dir):
    """Where oneDNN has no bfloat16 matmul (monkeypatched here, so every CPU runs this), a
    bfloat16 model's linears pack in float32 ('onednn-f32') and give the logits of the plain
    bfloat16 F.linear path."""
    if not onednn_usable(torch.float32, CPU):
        pytest.skip("torch built without oneDNN")
    assert resolve_gemm("onednn", torch.bfloat16, CPU) == "onednn-f32"
    assert resolve_gemm("auto", torch.bfloat16, CPU) == auto_gemm(torch.bfloat16) in ("panel", "onednn-f32")
    ck = load_checkpoint(str(llama_dir), progress=False)
    wide = build_model(ck.config, ck.weights, torch.bfloat16, "cpu", "onednn")
    plain = build_model(ck.config, ck.weights, torch.bfloat16, "cpu", "torch")
    assert wide.gemm == "onednn-f32" and all(m.widen for m in wide.modules() if isinstance(m, PackedLinear))
    assert sum(isinstance(m, PackedLinear) for m in wide.modules()) == 4 * ck.config.num_layers + 1

    from tinyllm_cli.cache.attention import NoCacheAttention
    ids = torch.randint(3, ck.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(25), torch.arange(15)])
    with torch.inference_mode():
        a = wide(ids, pos, NoCacheAttention([25, 15]), None)
        b = plain(ids, pos, NoCacheAttention([25, 15]), None)
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)  # bfloat16 activations, summation order


def test_resolve_gemm_choices():
    assert resolve_gemm("torch", torch.float32, CPU) == "torch"
    assert resolve_gemm("auto", torch.float16, CPU) == "torch"  # no packed fp16 path: plain F.linear
    assert resolve_gemm("auto", torch.float32, torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="onednn"):
        resolve_gemm("onednn", torch.float16, CPU)
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_gemm("auto", dtype, CPU) == auto_gemm(dtype)
    if onednn_usable(torch.float32, CPU):
        assert resolve_gemm("onednn", torch.float32, CPU) == "onednn"
        # bfloat16: natively where oneDNN has bfloat16 matmuls, else packed in float32
        assert resolve_gemm("onednn", torch.bfloat16, CPU) == ("onednn" if onednn_usable(torch.bfloat16, CPU) else "onednn-f32")
    with pytest.raises(ValueError, match="gemm 'panel' cannot run here: it computes float32 or bfloat16, not float16"):
        resolve_gemm("panel", torch.float16, CPU)
    with pytest.raises(ValueError, match="gemm 'panel' cannot run here: it runs on the CPU only, not cuda"):
        resolve_gemm("panel", torch.float32, torch.device("cuda"))
    if panel_usable(torch.float32, CPU):
        assert resolve_gemm("panel", torch.float32, CPU) == resolve_gemm("panel", torch.bfloat16, CPU) == "panel"


def test_auto_never_picks_the_panel_kernel_without_kernels():
    """TINYLLM_KERNELS=0 (in a fresh process: kernels load once per process): 'auto' resolves to
    oneDNN, and an explicit 'panel' is one sentence naming why."""
    p = run_without_kernels("import torch\n"
                            "from tinyllm_cli.model.gemm import resolve_gemm\n"
                            "print(resolve_gemm('auto', torch.float32, torch.device('cpu')))\n"
                            "try:\n    resolve_gemm('panel', torch.float32, torch.device('cpu'))\n"
                            "except ValueError as e:\n    print(e)\n")
    auto, refused = p.stdout.splitlines()
    assert auto == ("onednn" if onednn_usable(torch.float32, CPU) else "torch")
    assert refused == "gemm 'panel' cannot run here: tinyllm's CPU kernels did not build (disabled by TINYLLM_KERNELS=0)"


@needs_panel
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_equals_f_linear_fp32(rows, bias):
    """Row counts around the 6-row tile and past the register blocking; 200 outputs end in a
    partial panel (200 is not a multiple of 16 or 32)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    lin = PanelLinear(w, b)
    got, ref = lin(x), F.linear(x, w, b)
    assert got.shape == ref.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    assert lin.packed.shape == w.shape and not torch.equal(lin.packed, w)  # the same bytes, reordered
    assert "panel" in repr(lin)


@needs_panel
def test_panel_linear_takes_strided_and_batched_rows():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=g)
    x = torch.randn(10, 96, generator=g)[:, ::2]  # a strided view, as a split/select can hand it over
    assert not x.is_contiguous()
    torch.testing.assert_close(PanelLinear(w, None)(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 5, 48, generator=g)  # leading dimensions are kept
    torch.testing.assert_close(PanelLinear(w, None)(x3), F.linear(x3, w), rtol=1e-5, atol=1e-4)


@needs_panel
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 300])
@pytest.mark.parametrize("n,k", [(200, 96), (136, 2100), (40, 95)])
def test_bf16_panels_are_a_bf16_matmul_with_fp32_accumulation(rows, n, k):
    """bfloat16 weights stay bfloat16 in the panels (half the bytes of onednn-f32): bfloat16 in
    and out, the exact float32 products summed in float32 and rounded once. With AVX-512 they run
    in row tiles of up to 8 (1-300 rows: tiles of 1, 3, 4, 7 and 8), as bfloat16 dot products
    (AVX512-BF16) or widened pair by pair into float32 FMAs (without it), over K blocks of 1024
    (K 2100: partial sums carried between blocks), the last panel narrower than a vector (N 200,
    136, 40); an odd K, and AVX2, keep the narrow widening panels (up to 3 rows read the bfloat16
    panels directly, more widen each panel once into a buffer)."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    lin = PanelLinear(w, b)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and lin.packed.dtype == torch.bfloat16
    ref = F.linear(x.float().double(), w.double(), b.double()).float()
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-5)  # one bfloat16 rounding


@needs_panel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_rows_do_not_depend_on_the_rows_beside_them(dtype):
    """Each row's output is bitwise the same alone or in a step of 13 rows (tiles of 8 and 5, or 6, 6 and 1):
    a speculative verify step reproduces plain one-row steps."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(136, 1100, generator=g).to(dtype), torch.randn(13, 1100, generator=g).to(dtype)
    lin = PanelLinear(w, None)
    together = lin(x)
    for r in range(13):
        assert torch.equal(lin(x[r:r + 1]), together[r:r + 1]), r


@needs_panel
def test_bf16_panels_take_float32_rows_as_bf16_products():
    """A float32 row against bfloat16 panels returns float32: F.linear in float32 of the weight's
    values and the row as the panels multiply it (rounded to bfloat16 on bfloat16 dot products,
    exact when widened)."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(72, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g)
    got = PanelLinear(w, None)(x)
    assert got.dtype == torch.float32
    xs = x.bfloat16().float() if kernels.panel_isa().endswith("-bf16") else x
    torch.testing.assert_close(got, F.linear(xs, w.float()), rtol=1e-5, atol=1e-4)


@needs_panel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_model_packs_every_linear_and_matches_the_torch_path(llama_dir, dtype):
    ck = load_checkpoint(str(llama_dir), progress=False)
    panel = build_model(ck.config, ck.weights, dtype, "cpu", "panel")
    plain = build_model(ck.config, ck.weights, dtype, "cpu", "torch")
    assert panel.gemm == "panel" and not any(isinstance(m, nn.Linear) for m in panel.modules())
    assert sum(isinstance(m, PanelLinear) for m in panel.modules()) == 4 * ck.config.num_layers + 1
    if kernels.load():
        assert {s.kind for layer in panel.layers for s in fused_layer_args(layer).linears} == {LinearKind.PANEL}

    from tinyllm_cli.cache.attention import NoCacheAttention
    ids = torch.randint(3, ck.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(25), torch.arange(15)])
    with torch.inference_mode():
        a = panel(ids, pos, NoCacheAttention([25, 15]), None)
        b = plain(ids, pos, NoCacheAttention([25, 15]), None)
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bfloat16: activations round, summation order differs
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@needs_onednn
def test_model_packs_every_linear_and_matches_the_torch_path(llama_dir):
    ck = load_checkpoint(str(llama_dir), progress=False)
    packed = build_model(ck.config, ck.weights, torch.float32, "cpu", "onednn")
    plain = build_model(ck.config, ck.weights, torch.float32, "cpu", "torch")
    assert packed.gemm == "onednn" and plain.gemm == "torch"
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 4 * ck.config.num_layers + 1
    assert sum(isinstance(m, nn.Linear) for m in plain.modules()) == 4 * ck.config.num_layers + 1

    from tinyllm_cli.cache.attention import NoCacheAttention
    ids = torch.randint(3, ck.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(25), torch.arange(15)])
    with torch.inference_mode():
        a = packed(ids, pos, NoCacheAttention([25, 15]), None)
        b = plain(ids, pos, NoCacheAttention([25, 15]), None)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gemm_errors_are_one_sentence(capsys, tmp_path, llama_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5]}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dtype: float32\ngemm: fast\n")
    for args, needles in ((["-c", cfg], ["gemm", "line 2", "onednn", "panel"]),
                          (["--gemm", "onednn", "--dtype", "float16"], ["onednn", "float16"]),
                          (["--gemm", "panel", "--dtype", "float16"], ["panel", "float16"])):
        with pytest.raises(SystemExit) as e:
            main(["generate", "-p", str(prompts), "--model", str(llama_dir), *map(str, args)])
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == ""
        assert err.count("\n") == 1 and "Traceback" not in err
        assert all(n in err for n in needles), err
