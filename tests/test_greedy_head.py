"""Greedy tokens without logits (``model/greedy_head.py``): the model's ``greedy=True`` forward, and
the screened float32 head (``kernels.panel_argmax``), must give exactly the index the float32
logits' argmax gives: checked against ``argmax(panel_linear(x, w))`` (the head's own float32
logits) on random, tied, near-tied, flat, huge and non-finite rows, and end to end against the
engine with the screen taken away."""

from __future__ import annotations

import pytest
import torch

from tinyllm_cli import kernels as native
from tinyllm_cli.engine.request import SamplingParams
from tinyllm_cli.model.greedy_head import GreedyScreen, argmax, head_argmax, row_norms

from tinyllm_cli.cache.blocks import BlockManager

from test_engine import make_requests, reference_greedy, run

SCREENS = native.load() and native.panel_isa().endswith("-bf16")
needs_screen = pytest.mark.skipif(not SCREENS, reason="the screen runs on CPUs with AVX512-BF16 only "
                                                      "(elsewhere no head builds one)")


def _reference(x, packed):
    return argmax(native.panel_linear(x, packed, None))


def _check(w, x):
    screen = GreedyScreen(w, row_norms(w))
    packed = native.panel_pack(w.contiguous())
    got = native.panel_argmax(x, packed, screen.packed, screen.rows, screen.norms)
    ref = _reference(x, packed)
    assert torch.equal(got, ref), (got, ref)
    return got


@needs_screen
@pytest.mark.parametrize("vocab,hidden", [(49152, 576), (4099, 1536), (1000, 64)])
def test_screened_argmax_equals_float32_logits(vocab, hidden):
    """Random heads (a partial last panel, K past one 1,024-step block), 1-33 rows."""
    g = torch.Generator().manual_seed(vocab)
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    for rows in (1, 3, 16, 33):
        _check(w, torch.randn(rows, hidden, generator=g) * 4)


@needs_screen
def test_ties_and_near_ties_resolve_as_the_float32_logits_do():
    g = torch.Generator().manual_seed(1)
    vocab, hidden = 3000, 256
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    w[1500] = w[40]  # exact ties: the first index wins
    w[2999] = w[40]
    # Near ties the screen cannot see: row 41 on the bfloat16 grid, rows 700 / 701 a relative
    # 2^-12 above / below it, which rounds back to the same bfloat16 weights: equal screens,
    # different float32 logits.
    w[41] = w[41].bfloat16().float()
    w[700] = w[41] * (1 + 2**-12)
    w[701] = w[41] * (1 - 2**-12)
    assert torch.equal(w[700].bfloat16(), w[41].bfloat16()) and not torch.equal(w[700], w[41])
    x = torch.randn(5, hidden, generator=g)
    x[0] = w[40] * 50  # rows aimed at the tied and near-tied tokens
    x[1] = w[41] * 50
    x[2] = -w[41] * 50
    x[3, :] = 0.0  # every logit 0: every token ties, the first wins
    got = _check(w, x)
    assert got[0] == 40 and got[1] == 700 and got[3] == 0


@needs_screen
def test_a_cluster_of_near_ties_inside_the_screens_error():
    """30 tokens whose weights differ from one another by bfloat16-sized noise, rows aimed at
    them: the screen's order among them is often wrong, and only the bound keeps the true
    maximum among the candidates."""
    g = torch.Generator().manual_seed(5)
    vocab, hidden = 4096, 576
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    base = torch.randn(hidden, generator=g) * 0.05
    cluster = torch.arange(1000, 1030)
    w[cluster] = base * (1 + torch.randn(len(cluster), hidden, generator=g) * 2**-9)
    x = base * 40 + torch.randn(64, hidden, generator=g) * 2
    got = _check(w, x)
    assert set(got.tolist()) <= set(cluster.tolist()) and len(set(got.tolist())) > 3


@needs_screen
def test_flat_huge_and_non_finite_rows_take_the_full_logits():
    """Rows the bound cannot serve (too many candidates, a possible overflow, NaN / inf) fall
    back to the full float32 logits, where argmax's own rules (a NaN is the maximum) apply."""
    g = torch.Generator().manual_seed(2)
    vocab, hidden = 2048, 128
    w = torch.randn(vocab, hidden, generator=g)
    w[100:1900] = w[7]  # flat: 1,801 tokens share the top logit when x points at row 7
    x = torch.randn(6, hidden, generator=g)
    x[0] = w[7]
    x[1] *= 1e30  # ||x|| max ||w|| past 2^100
    x[2, 5] = float("nan")
    x[3, 9] = float("inf")
    x[4, :] = 1e-41  # subnormal inputs (vdpbf16ps flushes them)
    got = _check(w, x)
    assert got[0] == 7
    # An input near float32's largest (bfloat16 rounding could overflow) against tiny weights.
    tiny = torch.randn(vocab, hidden, generator=g) * 1e-33
    x2 = torch.randn(2, hidden, generator=g)
    x2[0, 3] = 3.4e38
    _check(tiny, x2)


@needs_screen
@pytest.mark.parametrize("tied", [True, False])
def test_model_greedy_forward_is_the_logits_argmax(tiny_model, qwen2_dir, tied):
    """``forward(greedy=True)`` against ``argmax(forward())`` on a model with a screen (the
    Qwen2 shape ties its head to the embedding table, the Llama shape does not)."""
    from tinyllm_cli.model.checkpoint import load_checkpoint
    from tinyllm_cli.model.llama import build_model

    if tied:
        ck = load_checkpoint(str(qwen2_dir), progress=False)
        model = build_model(ck.config, ck.weights, torch.float32, "cpu")
        assert model.greedy_screen.rows.data_ptr() == model.embed.weight.data_ptr()  # no copy
    else:
        model = tiny_model
    assert model.greedy_screen is not None
    h = torch.randn(40, model.cfg.hidden_size) * 3
    assert torch.equal(head_argmax(model, h), argmax(model.lm_head(h).float()))


def _outputs(model, reqs):
    cache = BlockManager(model.cfg, 256, 8, torch.float32)
    outs, _ = run(model, cache, reqs)
    return [(o.token_ids, o.logprobs) for o in outs]


def test_engine_greedy_tokens_do_not_depend_on_the_screen(tiny_model):
    """A greedy batch (every step asks for the argmax alone), one mixing sampled and
    log-probability rows (full logits), and the same with the screen taken away: equal tokens
    and log-probabilities, and the greedy batch equal to the no-cache recompute."""
    greedy = make_requests(6, seed=3)
    mixed = make_requests(6, seed=4)
    for i, r in enumerate(mixed):
        if i % 2:
            r.params = SamplingParams(max_new_tokens=r.params.max_new_tokens, ignore_eos=True, temperature=0.8,
                                      seed=i, logprobs=2)
        elif i % 3 == 0:
            r.params = SamplingParams(max_new_tokens=r.params.max_new_tokens, ignore_eos=True, logprobs=True)
    with_screen = [_outputs(tiny_model, greedy), _outputs(tiny_model, mixed)]
    saved, tiny_model.greedy_screen = tiny_model.greedy_screen, None
    try:
        without = [_outputs(tiny_model, greedy), _outputs(tiny_model, mixed)]
    finally:
        tiny_model.greedy_screen = saved
    assert with_screen == without
    assert [t for t, _ in with_screen[0]] == [reference_greedy(tiny_model, r.prompt_token_ids, r.params.max_new_tokens)
                                             for r in greedy]


@needs_screen
def test_no_screen_for_a_head_it_cannot_bound():
    """A non-finite weight, a bias, a bfloat16 head or another matmul path: no screen (the
    model's greedy forward is then the argmax of its logits)."""
    from torch import nn

    from tinyllm_cli.model.greedy_head import screen_for

    def holder(weight, bias=False):
        m = nn.Module()
        m.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
        m.lm_head.weight = nn.Parameter(weight, requires_grad=False)
        return m

    w = torch.randn(500, 64)
    assert screen_for(holder(w), "panel") is not None
    bad = w.clone()
    bad[123, 7] = float("nan")
    assert screen_for(holder(bad), "panel") is None
    bad[123, 7] = float("inf")
    assert screen_for(holder(bad), "panel") is None
    assert screen_for(holder(w, bias=True), "panel") is None
    assert screen_for(holder(w.bfloat16()), "panel") is None
    assert screen_for(holder(w), "onednn") is None
