"""Flat memory on long streams: bounded step history, streaming percentiles, bounded line reading.

No timings are asserted; the long-stream RSS check is ``scripts/long_stream_memory.py``.
"""

from __future__ import annotations

import io
import json
import os
import random
import statistics
import sys
import tracemalloc

import numpy as np
import pytest

import tinyllm_cli.io as tio
from tinyllm_cli.cli import main
from tinyllm_cli.commands import serve_batch
from tinyllm_cli.engine import stats as st
from tinyllm_cli.engine.stats import Quantiles, RunStats, StepRecord, Thinned, Timeline, percentiles
from tinyllm_cli.io import TooLong, bounded_lines, read_records

FAST = ["--device", "cpu", "--num-blocks", "128", "--max-new-tokens", "4", "-q"]


# ---- step history ---------------------------------------------------------------------------

def synthetic_steps(n: int, seed: int = 0) -> list[StepRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        slots = rng.choice([0, 0, 16, 32, 64, 128])
        used = rng.randint(0, 100)
        out.append(StepRecord(
            step=i, t=i * 0.01, running=rng.randint(0, 8), waiting=rng.randint(0, 20), blocks_used=used,
            blocks_free=100 - used, tokens_stored=rng.randint(0, slots), slots_allocated=slots,
            prefill_tokens=rng.choice([0, 0, 0, rng.randint(1, 300)]), decode_tokens=rng.randint(0, 8),
            preempted=rng.random() < 0.01, forward_s=round(rng.random() * 1e-3, 6),
            shared_refs=rng.randint(0, 9), cached_free=rng.randint(0, 5), shared_blocks=rng.randint(0, 7),
            fork_shared_blocks=rng.randint(0, 4), fork_refs=rng.randint(0, 6)))
    return out


def exact_step_summary(steps: list[StepRecord]) -> dict:
    """The summary's step figures as computed from every record (the old, unbounded way)."""
    used = [s for s in steps if s.slots_allocated]
    util = [s.utilization for s in used]
    return {
        "steps": len(steps),
        "peak_running": max((s.running for s in steps), default=0),
        "peak_blocks_used": max((s.blocks_used for s in steps), default=0),
        "mean_block_utilization": round(statistics.fmean(util), 4) if util else 0.0,
        "peak_block_utilization": round(max(util), 4) if util else 0.0,
        "mean_wasted_slots": round(statistics.fmean(s.slots_allocated - s.tokens_stored for s in used), 2) if used else 0.0,
        "peak_wasted_slots": max((s.slots_allocated - s.tokens_stored for s in used), default=0),
        "prefill_tokens": sum(s.prefill_tokens for s in steps),
        "decode_tokens": sum(s.decode_tokens for s in steps),
        "peak_shared_refs": max((s.shared_refs for s in steps), default=0),
        "peak_fork_shared_blocks": max((s.fork_shared_blocks for s in steps), default=0),
        "peak_fork_refs": max((s.fork_refs for s in steps), default=0),
    }


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 4097, 25_000])
def test_summary_aggregates_equal_the_exact_computation(n):
    steps = synthetic_steps(n, seed=n)
    stats = RunStats("paged", 16, 100, 0, 8)
    for s in steps:
        stats.record_step(s)
    summ = stats.summary()
    for k, v in exact_step_summary(steps).items():
        assert summ[k] == v, k


@pytest.mark.parametrize("n", [1, 10, st.TIMELINE_POINTS - 1, st.TIMELINE_POINTS, st.TIMELINE_POINTS + 1,
                               3 * st.TIMELINE_POINTS + 5, 50_000])
def test_timeline_is_bounded_and_covers_the_whole_run(n):
    steps = synthetic_steps(n, seed=1)
    stats = RunStats("paged", 16, 100, 0, 8)
    for s in steps:
        stats.record_step(s)
    tl = stats.timeline()
    assert 0 < len(tl) <= st.TIMELINE_POINTS
    assert tl[0]["step"] == 0 and tl[0]["t"] == steps[0].t  # the first step is kept
    assert tl[-1]["step"] + tl[-1]["span"] - 1 == n - 1  # the last point ends at the last step
    assert sum(p["span"] for p in tl) == n
    for a, b in zip(tl, tl[1:]):  # contiguous
        assert a["step"] + a["span"] == b["step"]
    # Each point is its steps' max / min / sum, as documented.
    for p in tl:
        chunk = steps[p["step"]:p["step"] + p["span"]]
        assert p["blocks_used"] == max(s.blocks_used for s in chunk)
        assert p["blocks_free"] == min(s.blocks_free for s in chunk)
        assert p["running"] == max(s.running for s in chunk)
        assert p["decode_tokens"] == sum(s.decode_tokens for s in chunk)
        assert 0.0 <= p["utilization"] <= 1.0
    if n < st.TIMELINE_POINTS:  # short runs: every step, exactly as recorded
        assert [p["step"] for p in tl] == list(range(n)) and all(p["span"] == 1 for p in tl)
        assert [p["blocks_used"] for p in tl] == [s.blocks_used for s in steps]
    else:
        assert len(tl) >= st.TIMELINE_POINTS // 2


def test_small_timeline_cap_halves_on_overflow():
    tl = Timeline(cap=4)
    for s in synthetic_steps(9):
        tl.add(s)
    assert [(r.step, r.span) for r in tl.records()] == [(0, 4), (4, 4), (8, 1)]
    with pytest.raises(ValueError):
        Timeline(cap=3)


def test_preemption_steps_are_thinned_but_bounded():
    t = Thinned(cap=8)
    for x in range(0, 1000, 3):
        t.append(x)
    assert len(t) <= 8 and t[0] == 0 and list(t) == sorted(t)
    assert set(t) <= set(range(0, 1000, 3))
    few = Thinned(cap=8)
    for x in (4, 9, 11):
        few.append(x)
    assert list(few) == [4, 9, 11]


# ---- percentiles ----------------------------------------------------------------------------

def test_quantiles_are_exact_while_small():
    rng = random.Random(3)
    xs = [rng.lognormvariate(-3, 1) for _ in range(st.EXACT_VALUES)]
    q = Quantiles()
    for x in xs:
        q.add(x)
    assert q.sketch is None and percentiles(q) == percentiles(xs)
    assert percentiles(Quantiles()) == {"p50": None, "p90": None, "p99": None}


@pytest.mark.parametrize("dist", ["lognormal", "exponential", "uniform", "pareto"])
def test_sketched_percentiles_stay_within_the_relative_accuracy(dist):
    rng = np.random.default_rng(7)
    n = 60_000
    xs = {"lognormal": rng.lognormal(-3, 1.0, n), "exponential": rng.exponential(0.05, n),
          "uniform": rng.uniform(0.01, 1, n), "pareto": (rng.pareto(1.5, n) + 1) * 0.01}[dist].tolist()
    q = Quantiles()
    for x in xs:
        q.add(x)
    assert q.values is None and q.sketch is not None  # spilled into the sketch
    got = percentiles(q)
    s = sorted(xs)
    a = st.RELATIVE_ACCURACY
    for p in (50, 90, 99):
        k = (n - 1) * p / 100
        lo, hi = s[int(k)], s[min(int(k) + 1, n - 1)]
        # DDSketch's guarantee: within a of the value at the rank; the exact figure interpolates
        # between the two ranks around it.
        assert lo * (1 - a) - 1e-6 <= got[f"p{p}"] <= hi * (1 + a) + 1e-6, (p, got, lo, hi)
    assert got["mean"] == pytest.approx(statistics.fmean(xs), abs=1e-6)  # the mean stays exact


def test_request_figures_are_sketched_past_the_limit(monkeypatch):
    monkeypatch.setattr(st, "EXACT_VALUES", 10)

    class Out:
        finish_reason, prompt_token_ids, num_output_tokens = "length", [1, 2], 3
        ttft_s, tpot_s, latency_s = 0.5, 0.01, 1.0

    stats = RunStats("paged", 16, 100, 0, 8)
    for _ in range(50):
        stats.record_request(Out())
    assert stats.ttft.sketch is not None and stats.ttft.values is None
    summ = stats.summary()
    assert set(summ["ttft_s"]) == {"p50", "p90", "p99", "mean"}
    assert summ["ttft_s"]["p50"] == pytest.approx(0.5, rel=st.RELATIVE_ACCURACY)
    assert summ["latency_s"]["mean"] == 1.0


# ---- line reading ---------------------------------------------------------------------------

def chunked(data: bytes, size: int):
    f = io.BytesIO(data)
    return lambda n: f.read(min(n, size))


@pytest.mark.parametrize("size", [1, 2, 5, 64, 1 << 16])
def test_bounded_lines_split_like_readlines(size):
    data = b"a\n\nbc\r\nd" * 5 + b"\n" + b"x" * 300 + b"\nend"
    assert list(bounded_lines(chunked(data, size), limit=1000)) == io.BytesIO(data).readlines()


@pytest.mark.parametrize("size", [1, 3, 1 << 16])
def test_a_line_over_the_limit_is_one_too_long_item(size):
    data = b"ok\n" + b"y" * 11 + b"\n" + b"z" * 10 + b"\n" + b"w" * 40
    got = list(bounded_lines(chunked(data, size), limit=10))
    assert got[0] == b"ok\n" and isinstance(got[1], TooLong) and got[1].size == 12
    assert got[2] == b"z" * 10 + b"\n"  # exactly the limit is fine
    assert isinstance(got[3], TooLong) and got[3].size == 40 and len(got) == 4


def test_a_huge_line_is_never_held():
    big = 32 << 20

    left = {"q": big, "tail": b"tail\n"}

    def endless(n):  # a 32 MiB line, then a short one
        if left["q"]:
            k = min(n, left["q"])
            left["q"] -= k
            return b"q" * k + (b"\n" if not left["q"] else b"")
        out, left["tail"] = left["tail"], b""
        return out

    tracemalloc.start()
    try:
        got = list(bounded_lines(endless, limit=1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(got[0], TooLong) and got[0].size == big + 1 and got[1] == b"tail\n"
    assert peak < 4 << 20, peak  # the 1 MiB limit plus chunks, not the 32 MiB line


def test_stdin_reader_is_bounded_and_linear(monkeypatch):
    monkeypatch.setattr(tio, "MAX_LINE_BYTES", 20)
    r, w = os.pipe()
    os.write(w, b'{"a": 1}\n' + b"x" * 100 + b"\n" + b'{"b": 2}\n')
    os.close(w)
    with os.fdopen(r, "rb") as f:
        monkeypatch.setattr(sys, "stdin", f)
        got = list(serve_batch._stdin_lines())
    assert got[0] == b'{"a": 1}\n' and isinstance(got[1], TooLong) and got[2] == b'{"b": 2}\n'


def _batch_line(cid: str, prompt: list[int]) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}}) + "\n"


def test_serve_batch_answers_an_oversized_line_with_its_error(capsys, monkeypatch, tmp_path, llama_dir):
    monkeypatch.setattr(tio, "MAX_LINE_BYTES", 200)
    big = _batch_line("big", [1] + [5] * 100)
    assert len(big) > 200
    inp = tmp_path / "in.jsonl"
    inp.write_text(_batch_line("a", [1, 5, 6]) + big + _batch_line("b", [1, 7]))
    with pytest.raises(SystemExit) as e:
        main(["serve-batch", "--input", str(inp), "--model", str(llama_dir), *FAST])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert sorted(r["custom_id"] or "" for r in rows) == ["", "a", "b"]
    bad = next(r for r in rows if r["custom_id"] is None)
    assert bad["error"]["message"] == "line 2 is longer than the 200 bytes limit"


def test_generate_answers_an_oversized_prompt_line_with_its_error(capsys, monkeypatch, tmp_path, llama_dir):
    monkeypatch.setattr(tio, "MAX_LINE_BYTES", 100)
    p = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt_token_ids": [1, 5, 6], "max_new_tokens": 2},
            {"id": "big", "prompt_token_ids": [1] + [5] * 60, "max_new_tokens": 2},
            {"id": "b", "prompt_token_ids": [1, 7], "max_new_tokens": 2}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tio.check_prompt_file(str(p)) == 3
    recs = list(read_records(str(p)))
    assert recs[1] == (2, {"__error__": "line 2 is longer than the 100 bytes limit"})
    with pytest.raises(SystemExit) as e:
        main(["generate", "-p", str(p), "--model", str(llama_dir), *FAST])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    res = [json.loads(x) for x in out.splitlines()]
    assert [r["finish_reason"] for r in res] == ["length", "error", "length"]
    assert "line 2 is longer than the 100 bytes limit" in res[1]["error"]


def test_generate_stdin_prompts_get_the_same_limit(capsys, monkeypatch, llama_dir):
    monkeypatch.setattr(tio, "MAX_LINE_BYTES", 60)
    data = b'{"prompt_token_ids": [5, 6], "max_new_tokens": 2}\n' + b"w" * 80 + b"\n" + b'{"prompt_token_ids": [7]}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    recs = list(read_records("-"))
    assert [n for n, _ in recs] == [1, 2, 3]
    assert recs[1][1] == {"__error__": "line 2 is longer than the 60 bytes limit"}
