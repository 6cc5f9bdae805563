"""The native CPU kernels (tinyllm_cli/kernels) against their PyTorch references: each op alone
over shapes, strides, block sizes and dtypes, then the whole engine on both attention paths and
both dense-op paths against a no-cache recompute."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinyllm_cli import kernels
from tinyllm_cli.cache.attention import causal_attention, chunk_mask, decode_attention, resolve_attention
from tinyllm_cli.cache.blocks import BlockManager, CacheError, SlotBlockManager
from tinyllm_cli.machine import cpu_flags_line
from tinyllm_cli.model import fused
from tinyllm_cli.model.fused import LinearKind, fused_layer_args
from tinyllm_cli.model.llama import apply_rope, use_native_ops

from conftest import run_without_kernels, wait_s
from test_engine import make_requests, preempting_blocks, reference_greedy, run

# Only the tests that call the kernels carry this: where they did not build, conftest fails those
# tests if a compiler is here (kernels.expected()) and skips them if not; the rest always run.
needs_kernels = pytest.mark.needs_kernels

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def paged_case(batch, heads, kv_heads, dim, block_size, dtype, seed=0, max_len=70):
    """Random pools with each sequence's blocks scattered through them, and the gather path's
    inputs (flat slots padded with a zeroed scratch slot, and a mask) for the same rows."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    per_seq = [(int(n) + block_size - 1) // block_size for n in lens]
    num_blocks = sum(per_seq) + 3
    slots = num_blocks * block_size
    kp = torch.randn(slots + 1, kv_heads, dim, generator=g).to(dtype)
    vp = torch.randn(slots + 1, kv_heads, dim, generator=g).to(dtype)
    kp[slots].zero_(), vp[slots].zero_()
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, nb = [], max(per_seq)
    for n_blocks in per_seq:
        tables.append(order[:n_blocks] + [0] * (nb - n_blocks))  # padding entries are never read
        order = order[n_blocks:]
    tables = torch.tensor(tables)
    longest = int(lens.max())
    pos = torch.arange(longest)
    idx = tables[:, pos // block_size] * block_size + pos % block_size
    valid = pos[None, :] < lens[:, None]
    idx = torch.where(valid, idx, torch.full_like(idx, slots))
    q = torch.randn(batch, heads + kv_heads, dim, generator=g).to(dtype)[:, :heads]  # strided, as in the model
    return q, kp, vp, tables, lens, idx, valid[:, None, None, :]


def gather_reference(q, kp, vp, idx, mask):
    b, l = idx.shape
    kc = kp.index_select(0, idx.reshape(-1)).view(b, l, *kp.shape[1:])
    vc = vp.index_select(0, idx.reshape(-1)).view(b, l, *vp.shape[1:])
    return decode_attention(q, kc, vc, mask)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 80])
# (14, 2, 128) and (7, 1, 64): groups of 7 heads, more than one pass over V serves (3 heads a pass
# at 128, 6 at 64 on AVX-512), so a group splits into full passes and a remainder.
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 16), (14, 2, 128), (7, 1, 64)])
def test_paged_attention_decode_rows_match_gather_sdpa(dtype, block_size, heads, kv_heads, dim):
    q, kp, vp, tables, lens, idx, mask = paged_case(5, heads, kv_heads, dim, block_size, dtype, seed=block_size)
    got = kernels.paged_attention(q, kp, vp, tables, torch.arange(len(lens)), lens, block_size, dim ** -0.5)
    want = gather_reference(q, kp, vp, idx, mask)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernels
def test_paged_attention_is_exact_in_float64_terms():
    """float32 against a float64 softmax: the kernel's fast exp keeps float32 accuracy."""
    q, kp, vp, tables, lens, idx, mask = paged_case(6, 9, 3, 64, 16, torch.float32, seed=3, max_len=300)
    got = kernels.paged_attention(q, kp, vp, tables, torch.arange(len(lens)), lens, 16, 0.125)
    want = gather_reference(q.double(), kp.double(), vp.double(), idx, mask)
    assert (got.double() - want).abs().max().item() < 2e-6


@needs_kernels
def test_paged_attention_rejects_rows_outside_the_tables_or_pool():
    q, kp, vp, tables, lens, _, _ = paged_case(2, 4, 2, 16, 4, torch.float32)
    tables[0, 0] = kp.shape[0]  # one past the end
    rows = torch.arange(len(lens))
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.paged_attention(q, kp, vp, tables, rows, lens, 4, 0.25)
    tables[0, 0] = 0
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernels.paged_attention(q, kp, vp, tables, rows, lens + 10 ** 6, 4, 0.25)
    with pytest.raises(RuntimeError, match="outside the block tables"):
        kernels.paged_attention(q, kp, vp, tables, rows + 5, lens, 4, 0.25)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_attention_prefill_rows_match_causal_sdpa(dtype, block_size):
    """Prefill rows (a fresh prompt, and a chunk after cached positions) mixed with decode rows:
    each prefill row at position p sees [0, p], as causal SDPA over the gathered sequence does."""
    heads, kv_heads, dim = 9, 3, 64
    _, kp, vp, tables, lens, _, _ = paged_case(3, heads, kv_heads, dim, block_size, dtype, seed=7, max_len=90)
    g = torch.Generator().manual_seed(8)
    # rows: sequence 0 decodes; sequence 1 prefills all of it; sequence 2 prefills its last 5 positions
    n1, n2 = int(lens[1]), min(5, int(lens[2]))
    row_seq = torch.tensor([0] + [1] * n1 + [2] * n2)
    row_len = torch.tensor([int(lens[0])] + list(range(1, n1 + 1)) + list(range(int(lens[2]) - n2 + 1, int(lens[2]) + 1)))
    q = torch.randn(len(row_seq), heads, dim, generator=g).to(dtype)
    got = kernels.paged_attention(q, kp, vp, tables, row_seq, row_len, block_size, dim ** -0.5)

    def seq_kv(s, n):
        pos = torch.arange(n)
        slots = tables[s, pos // block_size] * block_size + pos % block_size
        return kp[slots], vp[slots]

    k0, v0 = seq_kv(0, int(lens[0]))
    want = [decode_attention(q[:1], k0[None], v0[None], torch.ones(1, 1, 1, int(lens[0]), dtype=torch.bool))]
    k1, v1 = seq_kv(1, n1)
    want.append(causal_attention(q[1:1 + n1], k1, v1))
    k2, v2 = seq_kv(2, int(lens[2]))
    want.append(causal_attention(q[1 + n1:], k2, v2, chunk_mask(int(lens[2]) - n2, n2, "cpu")))
    torch.testing.assert_close(got.float(), torch.cat(want).float(), atol=TOL[dtype], rtol=TOL[dtype])


BLOCK_CASES = [(dtype, block_size, heads, kv_heads, dim) for dtype in (torch.float32, torch.bfloat16)
               for block_size in (1, 16, 32) for heads, kv_heads, dim in ((9, 3, 64), (14, 2, 128), (7, 1, 64), (4, 4, 128))]


def rows_alone_and_together(dtype, block_size, heads, kv_heads, dim) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's attention through the kernel, all rows in one call and each row alone. The step
    mixes a decode row, a whole prompt (129 rows: whole and partial chunks, blocks of 8 and a
    remainder), a chunk of 23 rows after cached positions, and a sequence of 2 rows."""
    lens = [40, 129, 75, 37]
    n_rows = [1, 129, 23, 2]
    g = torch.Generator().manual_seed(block_size + dim)
    per_seq = [(n + block_size - 1) // block_size for n in lens]
    total = sum(per_seq)
    kp = torch.randn(total * block_size + block_size, kv_heads, dim, generator=g).to(dtype)
    vp = torch.randn(kp.shape, generator=g).to(dtype)
    order = torch.randperm(total, generator=g).tolist()
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.long)
    for s, n_blocks in enumerate(per_seq):
        tables[s, :n_blocks] = torch.tensor(order[:n_blocks])
        order = order[n_blocks:]
    row_seq = torch.cat([torch.full((n,), s) for s, n in enumerate(n_rows)])
    row_len = torch.cat([torch.arange(length - n + 1, length + 1) for length, n in zip(lens, n_rows)])
    q = torch.randn(len(row_seq), heads + kv_heads, dim, generator=g).to(dtype)[:, :heads]
    scale = dim ** -0.5
    together = kernels.paged_attention(q, kp, vp, tables, row_seq, row_len, block_size, scale)
    alone = torch.cat([kernels.paged_attention(q[t:t + 1], kp, vp, tables, row_seq[t:t + 1], row_len[t:t + 1],
                                               block_size, scale) for t in range(len(row_seq))])
    return together, alone


@needs_kernels
@pytest.mark.parametrize("dtype,block_size,heads,kv_heads,dim", BLOCK_CASES)
def test_prompt_rows_in_blocks_equal_rows_one_at_a_time_bit_for_bit(dtype, block_size, heads, kv_heads, dim):
    """A prompt's consecutive rows are scored in blocks from K transposed and share passes over V
    (attend_block); a row alone takes the pair path. Each row's output must be the same bits
    either way, or a speculative verify, a chunked prompt and plain decoding would disagree."""
    together, alone = rows_alone_and_together(dtype, block_size, heads, kv_heads, dim)
    assert torch.equal(together, alone)


AVX2_BUILD_TESTS = ("tests/test_kernels.py", "tests/test_quant.py", "tests/test_gemm.py", "tests/test_greedy_head.py")


@needs_kernels
@pytest.mark.skipif("avx2" not in cpu_flags_line().split() or "fma" not in cpu_flags_line().split(),
                    reason="an AVX2 build needs an x86 CPU with AVX2 and FMA")
@pytest.mark.skipif("avx512f" not in cpu_flags_line().split(), reason="this CPU's own build is the AVX2 build")
@pytest.mark.skipif(bool(os.environ.get("TINYLLM_KERNELS_MARCH")), reason="already inside a build for another target")
def test_the_avx2_build_passes_the_kernel_tests():
    """The kernels build for the CPU they run on (-march=native), so an AVX-512 host never runs
    their AVX2 paths (8-lane registers, sum_lanes' other tree, the 6-row panel tile, silu_mul's
    vector form, the vpmaddubsw tiles), which AVX2-only CPUs take. This builds them for AVX2
    alone (TINYLLM_KERNELS_MARCH=haswell) and runs the kernel tests against it in a process of
    its own: every bit-for-bit check against the plain loops and PyTorch, on every host."""
    root = Path(__file__).parent.parent
    env = os.environ | {"PYTHONPATH": str(root), "TINYLLM_KERNELS_MARCH": "haswell"}
    isa = subprocess.run([sys.executable, "-c", "from tinyllm_cli import kernels; assert kernels.load(); import torch; "
                          "print(kernels.panel_isa(), torch.ops.tinyllm.q4_q8_isa(), torch.ops.tinyllm.q4_isa())"],
                         capture_output=True, text=True, timeout=wait_s(900), env=env)
    assert isa.stdout.split() == ["avx2", "avx2", "avx2"], isa.stdout + isa.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AVX2_BUILD_TESTS],
                       cwd=root, capture_output=True, text=True, timeout=wait_s(900), env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]  # 0: tests ran and passed (5 would be none collected)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_matches_add_then_rms_norm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    r = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    ref_x = x.clone().add_(r)
    want = F.rms_norm(ref_x, (576,), w, 1e-5)
    got = kernels.add_rms_norm_(x, r, w, 1e-5)
    assert torch.equal(x, ref_x)  # the residual stream itself is rounded exactly as a plain add
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    alone = kernels.add_rms_norm_(x.clone(), None, w, 1e-5)  # no residual: a plain RMSNorm
    torch.testing.assert_close(alone.float(), F.rms_norm(x, (576,), w, 1e-5).float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_silu_times_up(dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(37, 2 * 160, generator=g) * 6).to(dtype)  # wide range: exp's clamp is exercised
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gate_up.float().split(160, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul(gate_up).float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_apply_rope_on_a_strided_view(dtype):
    g = torch.Generator().manual_seed(2)
    t, heads, dim = 11, 6, 64
    qkv = torch.randn(t, (heads + 2) * dim, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (t,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = pos[:, None] * inv[None]
    cos = torch.cat([freqs.cos()] * 2, -1).to(dtype)[:, None]
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(dtype)[:, None]
    before = qkv.clone()  # the reference for both checks, taken before the kernel writes anything
    want = apply_rope(before[:, : heads * dim].reshape(t, heads, dim).float(), cos.float(), sin.float())
    view = qkv[:, : heads * dim].view(t, heads, dim)  # rows strided by the fused projection's width
    kernels.rope_(view, cos, sin)
    torch.testing.assert_close(qkv[:, : heads * dim].view(t, heads, dim).float(), want, atol=TOL[dtype] * 2,
                               rtol=TOL[dtype])
    # The columns past the view (the K/V heads of the fused output) keep their values bit for bit:
    # a kernel that ignored the row stride, or rotated a head too many, would write there.
    torch.testing.assert_close(qkv[:, heads * dim:], before[:, heads * dim:], rtol=0, atol=0)


def set_dense_path(model, path: str) -> None:
    """'fused': every layer in one kernel call a step; 'ops': the fused elementwise kernels called
    from the Python layer; 'torch': plain PyTorch ops."""
    use_native_ops(model, path != "torch")
    if path == "ops":
        model.stack = None


@pytest.fixture(scope="module")
def tiny_torch_gemm(llama_dir):
    """The tiny model with plain F.linear weights (the fused layer's linear kind 0)."""
    from tinyllm_cli.model.checkpoint import load_checkpoint
    from tinyllm_cli.model.llama import build_model
    ck = load_checkpoint(str(llama_dir), progress=False)
    return build_model(ck.config, ck.weights, torch.float32, "cpu", gemm="torch")


@pytest.mark.parametrize("attention", [pytest.param("kernel", marks=needs_kernels), "gather"])
@pytest.mark.parametrize("dense", [pytest.param("fused", marks=needs_kernels), pytest.param("ops", marks=needs_kernels),
                                   "torch"])
@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_engine_paths_equal_no_cache_recompute(tiny_model, kind, attention, dense):
    """Every combination of attention path and dense-op path, with preemption, prefix hits and
    chunked prefill in the paged case, gives the tokens of a full recompute on the same ops.
    (The fused layer needs the kernel's attention: with 'gather' it runs as 'ops'.)"""
    reqs = make_requests(n=6, seed=11)
    reqs += [make_requests(n=1, seed=11)[0]]  # a repeated prompt: a prefix-cache hit
    reqs[-1].id, reqs[-1].index = "dup", len(reqs) - 1
    set_dense_path(tiny_model, dense)
    try:
        refs = [reference_greedy(tiny_model, r.prompt_token_ids, r.params.max_new_tokens) for r in reqs]
        if kind == "paged":
            cache = BlockManager(tiny_model.cfg, preempting_blocks(reqs), 4, torch.float32, prefix_caching=True)
            outs, eng = run(tiny_model, cache, reqs, attention=attention, max_prefill_tokens=16)
            assert eng.stats.preemptions > 0 and cache.prefix_hits > 0
        else:
            cache = SlotBlockManager(tiny_model.cfg, 3, 128, torch.float32)
            outs, eng = run(tiny_model, cache, reqs, attention=attention)
        assert eng.runner.storage.attention == attention
        assert [o.token_ids for o in outs] == refs
    finally:
        use_native_ops(tiny_model, kernels.load())


@needs_kernels
@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_torch_gemm"])
def test_fused_layer_equals_the_python_layer_exactly(model_name, request):
    """The one-call layer runs the same ops in the same order as the Python layer on the native
    path, for the default packed weights (oneDNN or panels, by CPU) and plain ones: logits and
    log-probabilities are bitwise equal."""
    model = request.getfixturevalue(model_name)
    assert model.stack is not None
    kinds = {s.kind for layer in model.layers for s in fused_layer_args(layer).linears}
    assert kinds == {{"onednn": LinearKind.ONEDNN, "panel": LinearKind.PANEL, "torch": LinearKind.TORCH}[model.gemm]}
    assert_fused_equals_ops(model, torch.float32)


def assert_fused_equals_ops(model, dtype: torch.dtype) -> list:
    """Greedy tokens and log-probabilities of the one-call layer and of the Python layer (with
    the fused elementwise kernels) on the same requests, bitwise equal; returns them."""
    reqs = make_requests(n=4, seed=5, logprobs=3)
    assert all(r.params.logprobs == 3 for r in reqs)
    results = {}
    try:
        for dense in ("fused", "ops"):
            set_dense_path(model, dense)
            cache = BlockManager(model.cfg, 64, 4, dtype)
            outs, _ = run(model, cache, reqs, attention="kernel", max_prefill_tokens=16)
            results[dense] = [(o.token_ids, o.logprobs) for o in outs]
    finally:
        use_native_ops(model, True)
    assert all(lp for _, lp in results["fused"])  # log-probabilities were produced, so compared
    assert results["fused"] == results["ops"]
    return results["fused"]


@needs_kernels
def test_the_last_layer_carries_only_the_logit_rows_with_the_same_bits(tiny_model, monkeypatch):
    """On tinyllm's panels the one-call last layer runs attention, o_proj and the MLP for the rows
    whose logits are read only (keep_rows: one row per finished prompt, none for a chunk that does
    not finish its prompt); greedy tokens and log-probabilities equal the Python layer's, which
    carries every row, bit for bit. Fails if the kept rows are the wrong ones or were skipped."""
    if tiny_model.gemm != "panel":
        pytest.skip("the last layer keeps rows on tinyllm's panels only")
    calls, real = [], kernels.decoder_stack

    def spy(stack, x, *args):
        keep = args[-1]
        calls.append((x.shape[0], None if keep is None else keep.numel()))
        return real(stack, x, *args)

    monkeypatch.setattr(kernels, "decoder_stack", spy)
    assert_fused_equals_ops(tiny_model, torch.float32)
    kept = [(rows, n) for rows, n in calls if n is not None]
    assert kept and all(n < rows for rows, n in kept) and any(n == 0 for _, n in kept)


@needs_kernels
def test_fused_layer_runs_widened_bf16_linears_exactly(no_bf16_onednn, llama_dir):
    """A bfloat16 model whose linears pack in float32 (onednn-f32, forced here on every CPU):
    the one-call layer's linear kind 4 gives the Python layer's tokens and log-probabilities
    bitwise."""
    from tinyllm_cli.model.checkpoint import load_checkpoint
    from tinyllm_cli.model.llama import build_model
    ck = load_checkpoint(str(llama_dir), progress=False)
    model = build_model(ck.config, ck.weights, torch.bfloat16, "cpu", "onednn")
    if model.gemm != "onednn-f32":
        pytest.skip("torch built without oneDNN")
    assert {s.kind for layer in model.layers for s in fused_layer_args(layer).linears} == {LinearKind.ONEDNN_WIDENED}
    assert_fused_equals_ops(model, torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_runs_panel_linears_exactly(llama_dir, dtype):
    """gemm 'panel' (forced on every CPU that runs it): the one-call layer's linear kind 5 gives
    the Python layer's tokens and log-probabilities bitwise."""
    from tinyllm_cli.model.checkpoint import load_checkpoint
    from tinyllm_cli.model.gemm import panel_usable
    from tinyllm_cli.model.llama import build_model
    if not panel_usable(dtype, torch.device("cpu")):
        pytest.skip("the kernels were built without AVX2 / AVX-512")
    ck = load_checkpoint(str(llama_dir), progress=False)
    model = build_model(ck.config, ck.weights, dtype, "cpu", "panel")
    assert {s.kind for layer in model.layers for s in fused_layer_args(layer).linears} == {LinearKind.PANEL}
    assert_fused_equals_ops(model, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_in_mlp_chunks_is_the_whole_step_bit_for_bit(llama_dir, dtype, monkeypatch):
    """A big step's MLP in row chunks (fused.mlp_chunk_rows; forced here to 3 rows, so 8-row
    chunks and a shorter last one), in the one-call layer and in the Python layer, gives the
    tokens and log-probabilities of the whole step at once, bitwise; by default a chunk is at
    least 256 rows and only panels chunk."""
    from tinyllm_cli.model import llama
    from tinyllm_cli.model.checkpoint import load_checkpoint
    from tinyllm_cli.model.gemm import panel_usable
    if not panel_usable(dtype, torch.device("cpu")):
        pytest.skip("the kernels were built without AVX2 / AVX-512")
    ck = load_checkpoint(str(llama_dir), progress=False)
    model = llama.build_model(ck.config, ck.weights, dtype, "cpu", "panel")
    assert all(fused_layer_args(layer).mlp_rows >= 256 for layer in model.layers)
    torch_model = llama.build_model(ck.config, ck.weights, dtype, "cpu", "torch")
    assert all(fused_layer_args(layer).mlp_rows == 0 for layer in torch_model.layers)
    whole = assert_fused_equals_ops(model, dtype)
    monkeypatch.setattr(fused, "mlp_chunk_rows", lambda layer: 3)
    assert assert_fused_equals_ops(model, dtype) == whole


def test_kernel_attention_on_another_device_is_one_sentence():
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_attention("kernel", torch.device("cuda"))
    assert resolve_attention("auto", torch.device("cuda")) == "gather"
    assert resolve_attention("auto", torch.device("cpu")) == ("kernel" if kernels.load() else "gather")


def test_disabled_kernels_fall_back_or_refuse(tiny_model):
    """TINYLLM_KERNELS=0: auto falls back to the gather path with a note; an explicit 'kernel' is
    a CacheError naming why (in a fresh process, since loading is once per process)."""
    p = run_without_kernels(
        "import torch, sys\n"
        "from tinyllm_cli.cache.blocks import BlockManager, CacheError\n"
        "from tinyllm_cli.cache.storage import KVStorage\n"
        "from tinyllm_cli.model.llama import ModelConfig\n"
        "cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)\n"
        "print(KVStorage(BlockManager(cfg, 4, 4, torch.float32), 'cpu').attention)\n"
        "try:\n    KVStorage(BlockManager(cfg, 4, 4, torch.float32), 'cpu', attention='kernel')\n"
        "except CacheError as e:\n    print('refused:', e)\n")
    assert p.stdout.splitlines() == ["gather", "refused: attention 'kernel' is unavailable: it did not build "
                                                "(disabled by TINYLLM_KERNELS=0)"]
    assert "gather path" in p.stderr


def test_a_failed_build_falls_back_with_the_compilers_reason(tmp_path):
    """No working compiler (CXX points nowhere) and a kernel cache where a killed build left
    torch's lock file: generate still runs, on the PyTorch path, and stderr says why in one line.
    (This is torch's real builder: given that lock file, it would wait for it forever.)"""
    stale = tmp_path / kernels.build_key() / "lock"
    stale.parent.mkdir()
    stale.touch()
    code = ("import torch\n"
            "from tinyllm_cli import kernels\n"
            "from tinyllm_cli.cache.blocks import BlockManager\n"
            "from tinyllm_cli.cache.storage import KVStorage\n"
            "from tinyllm_cli.model.llama import ModelConfig\n"
            "cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)\n"
            "print(kernels.load(), KVStorage(BlockManager(cfg, 4, 4, torch.float32), 'cpu').attention)\n")
    env = {**os.environ, "TINYLLM_KERNEL_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=wait_s(120))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "gather"]
    assert not stale.exists()
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "did not build" in notes[0] and "not found" in notes[0] and "gather path" in notes[0]
    assert "WARNING" not in p.stderr  # torch's compiler-ABI warning is not passed on


def test_the_kernels_module_exit_status_says_whether_they_built(tmp_path):
    """``python -m tinyllm_cli.kernels`` (make setup / make test) fails when they did not build,
    unless TINYLLM_ALLOW_NO_KERNELS=1 accepts the PyTorch path."""
    env = {**os.environ, "TINYLLM_KERNEL_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    env.pop("TINYLLM_ALLOW_NO_KERNELS", None)
    env.pop("TINYLLM_KERNELS", None)
    failed = subprocess.run([sys.executable, "-m", "tinyllm_cli.kernels"], capture_output=True, text=True, env=env,
                            timeout=wait_s(120))
    assert failed.returncode == 1 and failed.stdout == ""
    assert "not built" in failed.stderr and "no C++ compiler" in failed.stderr
    assert "TINYLLM_ALLOW_NO_KERNELS=1" in failed.stderr
    env["TINYLLM_ALLOW_NO_KERNELS"] = "1"
    allowed = subprocess.run([sys.executable, "-m", "tinyllm_cli.kernels"], capture_output=True, text=True, env=env,
                             timeout=wait_s(120))
    assert allowed.returncode == 0 and allowed.stdout == ""
    assert "not built" in allowed.stderr and "PyTorch path" in allowed.stderr


def test_needs_kernels_fails_where_a_build_was_expected_and_skips_elsewhere(monkeypatch):
    from conftest import require_kernels
    monkeypatch.setattr(kernels, "load", lambda: False)
    monkeypatch.setattr(kernels, "compiler", lambda: "/usr/bin/c++")
    monkeypatch.delenv("TINYLLM_ALLOW_NO_KERNELS", raising=False)
    monkeypatch.delenv("TINYLLM_KERNELS", raising=False)
    with pytest.raises(pytest.fail.Exception, match="although a C\\+\\+ compiler is here"):
        require_kernels()
    monkeypatch.setenv("TINYLLM_ALLOW_NO_KERNELS", "1")
    with pytest.raises(pytest.skip.Exception, match="TINYLLM_ALLOW_NO_KERNELS=1"):
        require_kernels()
    monkeypatch.delenv("TINYLLM_ALLOW_NO_KERNELS")
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    with pytest.raises(pytest.skip.Exception, match="no C\\+\\+ compiler"):
        require_kernels()


# ---- the build lock: it dies with its holder; a live holder is waited for, for a bounded time ----

# A process that builds with a fake builder (no compiler run): it leaves what a real build leaves
# while it runs (torch's lock file, half a library), says "building", and finishes after argv[3]
# seconds, unless it is killed first.
FAKE_BUILDER = """
import sys, time
from pathlib import Path
from tinyllm_cli import kernels

def build(directory, name):
    (directory / "lock").touch()
    (directory / f"{name}.so").write_bytes(b"half")
    print("building", flush=True)
    time.sleep(float(sys.argv[3]))
    (directory / f"{name}.so").write_bytes(b"built")
    (directory / "lock").unlink()

kernels._build, kernels._load_library = build, lambda library: None
kernels._load_or_build(Path(sys.argv[1]), sys.argv[2])
"""


def start_fake_build(directory, name: str, seconds: float) -> subprocess.Popen:
    """A fake build of ``directory/name.so`` in another process, returned once it is building."""
    p = subprocess.Popen([sys.executable, "-c", FAKE_BUILDER, str(directory), name, str(seconds)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "building"
    return p


@pytest.fixture
def fake_toolchain(monkeypatch):
    """This process's builds and loads, recorded instead of run: a build finds the directory empty
    (no stale lock for torch's builder to wait on, nothing half written) and writes a library."""
    calls = []

    def build(directory, name):
        assert list(directory.iterdir()) == []
        (directory / f"{name}.so").write_bytes(b"built")
        calls.append("build")

    def load_library(library):
        assert library.read_bytes() == b"built"
        calls.append("load")

    monkeypatch.setattr(kernels, "_build", build)
    monkeypatch.setattr(kernels, "_load_library", load_library)
    return calls


def test_a_build_killed_midway_does_not_block_the_next(tmp_path, fake_toolchain, capsys):
    directory = tmp_path / "key"
    builder = start_fake_build(directory, "k", 600)
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    assert (directory / "lock").exists() and (directory / "k.so").read_bytes() == b"half"
    start = time.monotonic()
    assert kernels._load_from(directory, "k") is None
    assert time.monotonic() - start < wait_s(10) and fake_toolchain == ["build"]  # rebuilt at once, not waited for
    assert "waiting" not in capsys.readouterr().err
    assert kernels._load_from(directory, "k") is None and fake_toolchain == ["build", "load"]  # now complete


def test_a_live_build_is_waited_for_and_its_library_loaded(tmp_path, fake_toolchain, capsys, monkeypatch):
    monkeypatch.setattr(kernels, "_NOTE_AFTER_S", 0.2)
    directory = tmp_path / "key"
    builder = start_fake_build(directory, "k", 2)
    try:
        assert kernels._load_from(directory, "k") is None
    finally:
        builder.wait(timeout=wait_s(60))
    assert fake_toolchain == ["load"]  # the other process's build, not a second one
    assert f"waiting for another process that is building tinyllm's kernels (pid {builder.pid})" in \
        capsys.readouterr().err


def test_a_build_that_outlasts_the_wait_leaves_the_pytorch_path_and_one_note(tmp_path):
    """The whole path in a fresh process, as a user meets it: a live holder of the lock for this
    key, a wait that runs out, then the gather path with one note: no hang, no traceback."""
    directory = tmp_path / kernels.build_key()
    builder = start_fake_build(directory, f"tinyllm_kernels_{kernels.build_key()}", 600)
    code = ("import torch\n"
            "from tinyllm_cli import kernels\n"
            "from tinyllm_cli.cache.blocks import BlockManager\n"
            "from tinyllm_cli.cache.storage import KVStorage\n"
            "from tinyllm_cli.model.llama import ModelConfig\n"
            "kernels.LOCK_WAIT_S, kernels._NOTE_AFTER_S = 2.0, 0.5\n"
            "cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)\n"
            "print(kernels.load(), KVStorage(BlockManager(cfg, 4, 4, torch.float32), 'cpu').attention)\n")
    env = {**os.environ, "TINYLLM_KERNEL_CACHE": str(tmp_path)}
    env.pop("TINYLLM_KERNELS", None)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=wait_s(120))
    finally:
        builder.kill()
        builder.wait()
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "gather"]
    assert "Traceback" not in p.stderr
    waits = [ln for ln in p.stderr.splitlines() if ln.startswith("waiting for another process")]
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note:")]
    assert len(waits) == 1 and f"(pid {builder.pid})" in waits[0]
    assert len(notes) == 1 and f"pid {builder.pid}, was still building them after 2 s" in notes[0]


# ---- one extension from many files: the key covers them all; shared codes agree ---------------

def test_every_source_builds_into_one_library_keyed_by_every_source_and_header(tmp_path, monkeypatch):
    """The library is every .cpp compiled in one load (one TORCH_LIBRARY), and a change to any
    .cpp or .h, or a new file, gives a new build key (a cached build never outlives its source)."""
    here = Path(kernels.__file__).parent
    files = sorted(p.name for p in [*here.glob("*.cpp"), *here.glob("*.h")])
    assert {"bindings.cpp", "isa.h", "ops.h"} <= set(files)
    copy = tmp_path / "kernels"
    copy.mkdir()
    for name in files:
        (copy / name).write_bytes((here / name).read_bytes())
    monkeypatch.setattr(kernels, "KERNEL_DIR", copy)
    assert [p.name for p in kernels.sources()] == [f for f in files if f.endswith(".cpp")]
    assert [p.name for p in kernels.source_files()] == files
    keys = {kernels.build_key()}
    for name in files:
        original = (copy / name).read_bytes()
        (copy / name).write_bytes(original + b"\n")
        keys.add(kernels.build_key())
        (copy / name).write_bytes(original)
    (copy / "new.h").write_text("#pragma once\n")
    keys.add(kernels.build_key())
    assert len(keys) == len(files) + 2
    from torch.utils import cpp_extension
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **kw: built.append(sources))
    kernels._build(tmp_path / "build", "k")
    assert built == [[str(p) for p in kernels.sources()]]


def test_package_data_ships_every_source_and_header():
    text = (Path(kernels.__file__).parents[2] / "pyproject.toml").read_text()
    assert '"tinyllm_cli.kernels" = ["*.cpp", "*.h"]' in text


@needs_kernels
def test_the_kernels_number_the_linear_kinds_as_python_does(monkeypatch):
    """model/fused.py's LinearKind and the C++ LinearKind (exported by linear_kinds()) agree name
    for name and value for value; a library that disagreed would be refused before a stack is
    built."""
    assert kernels.linear_kinds() == {kind.name: kind.value for kind in LinearKind}
    fused.check_linear_kinds()
    monkeypatch.setattr(kernels, "linear_kinds", lambda: {**{k.name: k.value for k in LinearKind}, "PANEL": 7})
    with pytest.raises(RuntimeError, match="number the linear kinds"):
        fused.check_linear_kinds.__wrapped__()


@needs_kernels
def test_a_stack_with_an_unknown_linear_kind_is_refused(tiny_model):
    """The C++ side checks the kinds it is given when the stack is made, not mid-step."""
    args = fused.fused_layer_args(tiny_model.layers[0])
    specs = args.linears
    first = tiny_model.layers[0]
    with pytest.raises(RuntimeError, match="unknown linear kind 7"):
        kernels.decoder_stack_new([s.weight for s in specs], [int(s.kind) for s in specs[:3]] + [7],
                                  [s.aux for s in specs], [s.bias for s in specs], [args.input_norm],
                                  [args.post_norm], args.eps, [args.mlp_rows], first.n_heads, first.n_kv,
                                  first.head_dim)


def test_bad_attention_value_is_a_usage_error(tmp_path):
    from tinyllm_cli.config import load_config
    from tinyllm_cli.errors import UsageError
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  attention: flash\n")
    with pytest.raises(UsageError, match=r"cache.attention \(line 2\) must be one of auto, kernel, gather"):
        load_config(f)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9])
def test_int8_linear_matches_torchs_int8_matmul(rows):
    """Every row tile (4, 2, 1 activation rows; 8-row weight blocks and a 4-row tail: N = 532)."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (532, 576), generator=g, dtype=torch.int8)
    scale = (torch.rand(532, generator=g) / 50).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    want = x.double() @ (q.double() * scale.double()[:, None]).T
    got = kernels.int8_linear(x, q, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 532)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, torch.ops.aten._weight_int8pack_mm(x, q, scale), atol=2e-2, rtol=1e-2)
    # float32 logits: the same sums, not rounded to bfloat16 (float32 summation error only)
    logits = kernels.int8_linear(x, q, scale, float32_out=True)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), want, atol=1e-5 * want.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def tiny_bf16(llama_dir):
    from tinyllm_cli.model.checkpoint import load_checkpoint
    from tinyllm_cli.model.llama import build_model
    ck = load_checkpoint(str(llama_dir), progress=False)
    return build_model(ck.config, ck.weights, torch.bfloat16, "cpu")


@needs_kernels
@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_bf16_engine_on_the_kernels_matches_a_pytorch_recompute(tiny_bf16, kind):
    """bfloat16 on the kernel path, with preemption, prefix hits and chunked prefill (paged): every
    sampled token's log-probability equals a no-cache recompute on the PyTorch ops, to bf16
    tolerance, and each greedy pick is the recompute's best token up to that tolerance (exact
    token equality would hinge on bf16 near-ties, which differ between summation orders)."""
    from tinyllm_cli.cache.attention import NoCacheAttention
    reqs = make_requests(n=5, seed=21, logprobs=True)
    reqs += [make_requests(n=1, seed=21, logprobs=True)[0]]
    reqs[-1].id, reqs[-1].index = "dup", len(reqs) - 1
    assert tiny_bf16.native and tiny_bf16.stack is not None
    if kind == "paged":
        cache = BlockManager(tiny_bf16.cfg, preempting_blocks(reqs), 4, torch.bfloat16, prefix_caching=True)
        outs, eng = run(tiny_bf16, cache, reqs, max_prefill_tokens=16)
        assert eng.stats.preemptions > 0 and cache.prefix_hits > 0
    else:
        cache = SlotBlockManager(tiny_bf16.cfg, 3, 128, torch.bfloat16)
        outs, eng = run(tiny_bf16, cache, reqs)
    assert eng.runner.storage.attention == "kernel"
    use_native_ops(tiny_bf16, False)
    worst: list[float] = []
    try:
        for r, o in zip(reqs, outs):
            seq = r.prompt_token_ids + o.token_ids
            with torch.inference_mode():
                logits = tiny_bf16(torch.tensor(seq), torch.arange(len(seq)), NoCacheAttention([len(seq)]))
            ref = torch.log_softmax(logits.float(), -1)
            n = len(r.prompt_token_ids)
            for i, (tok, entry) in enumerate(zip(o.token_ids, o.logprobs)):
                row = ref[n - 1 + i]
                worst.append(abs(entry["logprob"] - row[tok].item()))
                assert worst[-1] < 0.08
                assert row[tok].item() >= row.max().item() - 0.08
        assert len(worst) == sum(len(o.token_ids) for o in outs) > 50
    finally:
        use_native_ops(tiny_bf16, True)


@needs_kernels
def test_argmax_is_torch_argmax_with_ties_nans_and_infinities():
    """The greedy sampler's argmax kernel against torch.argmax: row lengths around the 16-lane
    vector loop and its tail, ties (the first index wins, across and within lanes), NaN (the
    first NaN wins), rows of -inf, and rows strided inside a wider tensor."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 31, 32, 33, 47, 100, 49152):
        x = torch.randn(7, n, generator=g)
        x[1] = 0.0  # all tied: index 0
        x[2, n // 2:] = x[2].max() + 1  # a tie at the maximum from the middle on
        x[3] = float("-inf")
        x[4, n - 1] = float("nan")
        x[5, (n * 2) // 3] = float("nan")
        x[5, n - 1] = float("nan")
        x[6] = torch.randint(0, 3, (n,), generator=g).float()  # many ties, spread over lanes
        assert torch.equal(kernels.argmax(x), x.argmax(-1)), n
        wide = torch.randn(7, n + 9, generator=g)
        assert torch.equal(kernels.argmax(wide[:, 3:3 + n]), wide[:, 3:3 + n].argmax(-1)), n
    for r in (0, 1, 64):
        x = torch.randn(r, 1000, generator=g)
        assert torch.equal(kernels.argmax(x), x.argmax(-1))
