"""Where the limit is (``roofline.py``): FLOPs and bytes checked against independent counts
(torch's FlopCounterMode on a tiny model's forward, the weights' own bytes), the engine's step
counts against the closed-form workload counts, run totals against per-step sums, the peak's
cache, and bench's new columns. Nothing here is timed: speed is measured by scripts."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tinyllm_cli import LLM
from tinyllm_cli import roofline as rl
from tinyllm_cli.engine.stats import Timeline
from tinyllm_cli.model.checkpoint import load_checkpoint
from tinyllm_cli.model.llama import ModelConfig, build_model, use_native_ops
from test_cli import cli


class CausalAttention:
    """Attention written out row by row (query i against keys 0..i of its sequence), so that
    FlopCounterMode counts exactly the causal query-key pairs: an independent reference."""

    def __init__(self, layers: int):
        self.k = [dict() for _ in range(layers)]
        self.v = [dict() for _ in range(layers)]
        self.rows: list[int] = []  # the step's sequence id per packed row

    def attend(self, layer: int, q, k, v):
        out = torch.empty_like(q)
        rep = q.shape[1] // k.shape[1]
        for i, sid in enumerate(self.rows):
            ks = self.k[layer][sid] = torch.cat([self.k[layer].get(sid, k[:0]), k[i:i + 1]])
            vs = self.v[layer][sid] = torch.cat([self.v[layer].get(sid, v[:0]), v[i:i + 1]])
            kk, vv = ks.repeat_interleave(rep, 1).transpose(0, 1), vs.repeat_interleave(rep, 1).transpose(0, 1)
            w = torch.softmax(torch.bmm(q[i][:, None, :], kk.transpose(1, 2)) / q.shape[-1] ** 0.5, -1)
            out[i] = torch.bmm(w, vv)[:, 0]
        return out


@pytest.fixture(scope="module")
def torch_model(llama_dir):
    ck = load_checkpoint(str(llama_dir), progress=False)
    model = build_model(ck.config, ck.weights, torch.float32, "cpu", gemm="torch")
    use_native_ops(model, False)  # aten ops only, so the flop counter sees every matmul
    return model


def counted(model, attn, chunks, lengths) -> tuple[int, int]:
    """(matmul FLOPs, attention FLOPs) FlopCounterMode counts for one packed step of ``chunks``
    [(seq id, start, n, samples)], ``lengths`` the sequences' tokens so far (updated)."""
    ids, pos, rows, logit_rows = [], [], [], []
    for sid, start, n, samples in chunks:
        ids += [3 + (sid * 7 + p) % 50 for p in range(start, start + n)]
        pos += range(start, start + n)
        rows += [sid] * n
        if samples:
            logit_rows.append(len(ids) - 1)
        lengths[sid] = start + n
    attn.rows = rows
    with FlopCounterMode(display=False) as fc:
        model(torch.tensor(ids), torch.tensor(pos), attn, torch.tensor(logit_rows))
    ops = {str(op).removeprefix("aten."): n for op, n in fc.get_flop_counts()["Global"].items()}
    return ops.get("mm", 0) + ops.get("addmm", 0), ops.get("bmm", 0)


def test_step_flops_match_flop_counter(torch_model):
    """Prefill chunks (one split in two), decode rows and a mixed step: the counter's matmul and
    attention FLOPs equal the formulas on hand-computed counts."""
    cfg = torch_model.cfg
    attn, lengths = CausalAttention(cfg.num_layers), {}
    steps = [
        [(0, 0, 5, True), (1, 0, 3, True)],  # two prompts; each samples its first token
        [(0, 5, 1, True), (1, 3, 1, True), (2, 0, 4, False)],  # two decode rows + a first chunk
        [(0, 6, 1, True), (2, 4, 3, True)],  # a decode row + the chunk that completes prompt 2
    ]
    for chunks in steps:
        mm, bmm = counted(torch_model, attn, chunks, lengths)
        counts = {"forwards": 1, "tokens": sum(n for _, _, n, _ in chunks),
                  "logit_rows": sum(s for *_, s in chunks),
                  "attn_pairs": sum(n * start + n * (n + 1) // 2 for _, start, n, _ in chunks),
                  "kv_read_tokens": 0}
        w = rl.work_of_counts(cfg, counts, weight_bytes=0, kv_elem_bytes=4)
        assert (w.linear_flops, w.attention_flops) == (mm, bmm)


def test_hand_count_for_the_tiny_config(torch_model):
    cfg = torch_model.cfg  # hidden 64, 3 layers, 4 heads of 16, 2 KV heads, FFN 160, vocab 320
    assert rl.layer_params(cfg) == 64 * 16 * (4 + 2 * 2) + 64 * 64 + 3 * 64 * 160
    assert rl.head_params(cfg) == 64 * 320
    w = rl.work_of_counts(cfg, {"forwards": 2, "tokens": 10, "logit_rows": 3, "attn_pairs": 40, "kv_read_tokens": 25},
                          weight_bytes=1000, kv_elem_bytes=2)
    assert w.linear_flops == 2 * (3 * 43008 * 10 + 20480 * 3)
    assert w.attention_flops == 4 * 4 * 16 * 3 * 40
    assert w.weight_bytes == 2000
    kv_token = 2 * 3 * 2 * 16 * 2  # K and V x layers x KV heads x head_dim x bytes
    assert (w.kv_read_bytes, w.kv_write_bytes) == (25 * kv_token, 10 * kv_token)
    assert w.as_dict()["flops"] == w.linear_flops + w.attention_flops


def test_weight_bytes_as_held(llama_dir, torch_model):
    """A dense model reads its linears' weights (the dense formula) plus its norms."""
    cfg = torch_model.cfg
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    assert rl.model_weight_bytes(torch_model) == rl.dense_weight_bytes(cfg, 4) + norms
    ck = load_checkpoint(str(llama_dir), progress=False)
    packed = build_model(ck.config, ck.weights, torch.float32, "cpu")  # oneDNN's packed layout where usable
    assert rl.model_weight_bytes(packed) >= rl.dense_weight_bytes(cfg, 4)


def test_engine_counts_equal_the_workload_formula(llama_dir):
    """Everything fits at once, one chunk per prompt: tinyllm's recorded counts equal the
    closed form any engine's figures come from, and the run total equals the per-step sum,
    over the whole timeline and over a merged (downsampled) one."""
    prompts = [[5 + i for i in range(L)] for L in (5, 3, 9, 2)]
    with LLM(str(llama_dir), max_new_tokens=6, ignore_eos=True, progress=False) as llm:
        llm.generate(prompts, use_tqdm=False)
        summary, records = llm.stats, llm.engine.stats.history.records()
        cfg, model = llm.runtime.model_cfg, llm.runtime.model
    assert summary["work_counts"] == rl.workload_counts([5, 3, 9, 2], 6)
    kw = dict(weight_bytes=rl.model_weight_bytes(model), kv_elem_bytes=4)
    run = rl.work_of_run(cfg, summary, **kw)
    per_step = [rl.work_of_steps(cfg, [r], **kw) for r in records]
    assert run == rl.work_of_steps(cfg, records, **kw) == sum(per_step, rl.Work())
    merged = Timeline(cap=2)
    for r in records:
        merged.add(r)
    assert len(merged) < len(records) and rl.work_of_steps(cfg, merged.records(), **kw) == run
    assert run == rl.workload_work(cfg, [5, 3, 9, 2], 6, **kw)


def test_workload_counts_with_forks_and_chunked_prefill():
    c = rl.workload_counts([4, 6], 3, n=2, max_prefill_tokens=4)
    assert c["forwards"] == 3 + 2  # ceil(10 / 4) prefill steps, then 2 decode steps
    assert c["tokens"] == 10 + 2 * 2 * 2 and c["logit_rows"] == 2 * 2 * 3
    assert c["attn_pairs"] == (10 + 21) + 2 * ((5 + 6) + (7 + 8))
    with pytest.raises(ValueError):
        rl.workload_counts([], 3)
    phases = rl.workload_phases([4, 6], 3, n=2, max_prefill_tokens=4)
    assert [p["forwards"] for p in phases] == [3, 1, 1] and [p["kv_read_tokens"] for p in phases[1:]] == [2 * 12, 2 * 14]


def test_roofline_bound_holds_each_phase_against_its_own_limit():
    """A prefill of many rows is bound by its FLOPs, a decode forward of few rows by its bytes:
    the workload's bound sums the slower of the two phase by phase, which is more than either limit
    over the whole workload when the phases differ."""
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    peak = {"gemm_gflops": 100.0, "bandwidth_gbps": 10.0}
    kw = dict(weight_bytes=rl.dense_weight_bytes(cfg, 4), kv_elem_bytes=4)
    lens, out = [500, 700], 9
    phases = [rl.work_of_counts(cfg, c, **kw) for c in rl.workload_phases(lens, out)]
    prefill, decode = phases[0], phases[1]
    assert prefill.flops / 100e9 > prefill.bytes / 10e9 and decode.bytes / 10e9 > decode.flops / 100e9
    bound = rl.workload_bound_s(cfg, lens, out, peak, **kw)
    assert bound == pytest.approx(prefill.flops / 100e9 + sum(w.bytes / 10e9 for w in phases[1:]))
    whole = rl.workload_work(cfg, lens, out, **kw)
    assert bound > max(whole.flops / 100e9, whole.bytes / 10e9) == rl.bound_s(whole, peak)


def test_peak_cache_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYLLM_PEAK_CACHE", str(tmp_path / "peak.json"))
    calls = []
    monkeypatch.setattr(rl, "_matmul_rates", lambda *a: calls.append(a) or {"torch": {"1": 1.0, "32": 5.0, "256": 9.0}})
    monkeypatch.setattr(rl, "read_bandwidth", lambda *a: 12.5)
    first = rl.measure_peak(torch.float32, (64, 160), threads=1)
    again = rl.measure_peak(torch.float32, (64, 160), threads=1)
    assert (first["cached"], again["cached"], len(calls)) == (False, True, 1)
    assert {k: v for k, v in first.items() if k != "cached"} == {k: v for k, v in again.items() if k != "cached"}
    assert first["gemm_gflops"] == 9.0 and first["bandwidth_gbps"] == 12.5 and first["gemm"] == "torch"
    assert rl.measure_peak(torch.bfloat16, (64, 160), threads=1)["cached"] is False  # another key
    assert rl.measure_peak(torch.float32, (64, 160), threads=1, refresh=True)["cached"] is False
    assert len(calls) == 3 and len(json.loads(rl.peak_cache_path().read_text())) == 2
    rl.peak_cache_path().unlink()
    assert rl.measure_peak(torch.float32, (64, 160), threads=1)["cached"] is False
    # Measured again: a busy moment (lower rates) cannot lower the cached peak, a better one raises it.
    monkeypatch.setattr(rl, "_matmul_rates", lambda *a: {"torch": {"1": 2.0, "32": 4.0, "256": 7.0}})
    monkeypatch.setattr(rl, "read_bandwidth", lambda *a: 20.0)
    merged = rl.measure_peak(torch.float32, (64, 160), threads=1, refresh=True)
    assert merged["gflops"]["torch"] == {"1": 2.0, "32": 5.0, "256": 9.0} and merged["gemm_gflops"] == 9.0
    assert merged["bandwidth_gbps"] == 20.0 and merged["measurements"] == 2
    monkeypatch.setattr(rl, "_matmul_rates", lambda *a: {"torch": {"1": 1.0, "32": 5.0, "256": 11.0}})
    assert rl.measure_peak(torch.float32, (64, 160), threads=1, refresh=True)["gemm_gflops"] == 11.0
    again = rl.measure_peak(torch.float32, (64, 160), threads=1)
    assert again["cached"] and again["gemm_gflops"] == 11.0 and again["measurements"] == 3
    entries = json.loads(rl.peak_cache_path().read_text())  # an entry edited into junk is measured afresh
    entries[next(iter(entries))] |= {"gflops": {"torch": "fast"}, "bandwidth_gbps": None, "measurements": "x"}
    rl.peak_cache_path().write_text(json.dumps(entries))
    fresh = rl.measure_peak(torch.float32, (64, 160), threads=1, refresh=True)
    assert fresh["gemm_gflops"] == 11.0 and fresh["bandwidth_gbps"] == 20.0 and fresh["measurements"] == 2
    rl.peak_cache_path().write_text("not json")  # a damaged cache is measured again, not an error
    assert rl.measure_peak(torch.float32, (64, 160), threads=1)["cached"] is False


def test_peak_measures_something(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYLLM_PEAK_CACHE", str(tmp_path / "peak.json"))
    p = rl.measure_peak(torch.float32, (64, 160), threads=1, seconds=0.05)
    assert set(p["gflops"]["torch"]) == {"1", "32", "256"} and p["gemm_gflops"] > 0 and p["bandwidth_gbps"] > 0
    assert p["threads"] == 1 and p["device"] and not p["cached"]


def test_the_peak_of_a_4bit_run_includes_its_kernel_in_the_run_s_activation_mode(tmp_path, monkeypatch):
    """With int8 activations the 4-bit kernel outruns the float matmuls; a peak without it would
    let such a run read over 100%. The mode is part of the cache key."""
    monkeypatch.setenv("TINYLLM_PEAK_CACHE", str(tmp_path / "peak.json"))
    from tinyllm_cli.model.quant import q4_usable
    assert rl.q4_path("none", True, (64, 160)) == ""
    if not q4_usable(torch.device("cpu")):
        assert rl.q4_path("gguf", True, (64, 160)) == ""
        pytest.skip("tinyllm's 4-bit kernel does not run here")
    assert rl.q4_path("gguf", True, (64, 160)) == "q4-int8" and rl.q4_path("gguf", False, (64, 160)) == "q4"
    assert rl.q4_path("gguf", True, (60, 160)) == ""  # hidden not a multiple of 32: no 4-bit form
    for mode in ("q4", "q4-int8"):
        p = rl.measure_peak(torch.bfloat16, (64, 160), threads=1, seconds=0.05, q4=mode)
        assert not p["cached"] and set(p["gflops"][mode]) == {"1", "32", "256"} and p["gflops"][mode]["256"] > 0
        assert p["gemm_gflops"] == max(rates["256"] for rates in p["gflops"].values())
    assert "q4" not in rl.measure_peak(torch.bfloat16, (64, 160), threads=1, seconds=0.05)["gflops"]


def test_bench_shows_where_the_limit_is(capsys, llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYLLM_PEAK_CACHE", str(tmp_path / "peak.json"))
    monkeypatch.setattr(rl, "_matmul_rates", lambda *a: {"torch": {"1": 1.0, "32": 5.0, "256": 9.0}})
    monkeypatch.setattr(rl, "read_bandwidth", lambda *a: 12.5)
    js = tmp_path / "b.json"
    args = ("bench", "--model", llama_dir, "--cache", "paged", "--num-prompts", 3, "--input-len", 8,
            "--output-len", 4, "--max-model-len", 64, "--no-warmup", "--json", js)
    code, out, err = cli(capsys, *args)
    assert code == 0 and out == ""
    assert all(c in err for c in ("GFLOP/s", "% peak", "GB/s", "% BW", "matmul peak"))
    (row,) = json.loads(js.read_text())
    assert row["work"]["flops"] > 0 and row["work"]["forwards"] == row["work_counts"]["forwards"]
    gflops, gbps = (row["work"][k] / row["elapsed_s"] / 1e9 for k in ("flops", "bytes"))
    assert row["achieved_gflops"] == pytest.approx(gflops, rel=1e-3)
    assert row["roofline_frac"] == pytest.approx(gflops / 9.0, rel=1e-3)
    assert row["bandwidth_frac"] == pytest.approx(gbps / 12.5, rel=1e-3)
    assert row["reference"]["roofline"]["gemm_gflops"] == 9.0
    code, _, err = cli(capsys, *args, "--no-roofline")
    (row,) = json.loads(js.read_text())
    assert code == 0 and row["roofline_frac"] is None and row["achieved_gflops"] is not None
    assert "roofline" not in row["reference"] and "% peak" in err  # the column shows "-"
    code, _, err = cli(capsys, *args, "--no-roofline", "--remeasure-peak")
    assert code == 2 and "--remeasure-peak" in err
    # Measured again at a busy moment: the caption keeps the better peak and says it was merged.
    monkeypatch.setattr(rl, "_matmul_rates", lambda *a: {"torch": {"1": 1.0, "32": 4.0, "256": 6.0}})
    code, _, err = cli(capsys, *args, "--remeasure-peak")
    (row,) = json.loads(js.read_text())
    assert code == 0 and row["reference"]["roofline"]["gemm_gflops"] == 9.0
    assert "best of 2 measurements" in " ".join(err.split())


def test_slow_rates_are_kept_to_significant_digits_not_rounded_to_zero(monkeypatch):
    # A tiny shape timed on a starved host: 0.2 s a call is ~0.02 GFLOP/s and ~0.08 GB/s, which
    # decimal rounding turned into a zero peak (and a ZeroDivisionError in bound_s).
    monkeypatch.setattr(rl, "_best_seconds", lambda fn, budget, device=None: 0.2)
    rates = rl._matmul_rates(torch.float32, (64, 160), "torch", 0.01)
    expect = {rows: 2 * int(rows) * 64 * 160 / 0.2 / 1e9 for rows in rates["torch"]}
    assert all(r > 0 for r in rates["torch"].values())
    assert rates["torch"] == pytest.approx(expect, rel=1e-3)
    assert 0 < rl.read_bandwidth(0.01) == pytest.approx(rl.BANDWIDTH_BYTES / 0.2 / 1e9, rel=1e-3)
