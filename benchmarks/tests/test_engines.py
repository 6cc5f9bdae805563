"""The engines' parts that run here without the engines: the parsing of llama.cpp output captured
from the real llama-batched-bench / llama-bench binaries (data/), and OpenVINO GenAI's precisions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import INT4
from benchmarks.engines.llamacpp import parse_batched_bench, parse_llama_bench
from benchmarks.engines.openvino import ov_precision

DATA = Path(__file__).resolve().parent / "data"


def test_parse_batched_bench_real_output():
    text = (DATA / "batched_bench_jsonl.txt").read_text()
    rows = parse_batched_bench(text)
    assert len(rows) == 1
    r = rows[0]
    assert r["n_kv"] == r["pl"] * (r["pp"] + r["tg"])  # not shared-prompt mode: every sequence prefilled
    assert r["speed"] == pytest.approx(r["n_kv"] / r["t"], rel=1e-3)  # 'speed' is total tok/s
    assert r["t"] == pytest.approx(r["t_pp"] + r["t_tg"], rel=1e-3)


def test_parse_llama_bench_real_output():
    rows = parse_llama_bench((DATA / "llama_bench_json.txt").read_text())
    assert len(rows) == 1
    r = rows[0]
    assert (r["n_prompt"], r["n_gen"], r["n_threads"]) == (0, 8, 2)
    assert r["avg_ts"] > 0 and r["avg_ts"] == pytest.approx(np.mean(r["samples_ts"]), rel=1e-3)


def test_parsers_ignore_log_lines():
    assert parse_batched_bench("main: n_kv_max = 4096\n|    PP |     TG |\n") == []
    assert parse_llama_bench("load_backend: loaded CPU backend\n") == []


def test_openvino_int4_row_computes_in_f32_where_the_cpu_has_no_bf16():
    """OpenVINO's AVX2 paged attention refuses bf16 K/V, so its int4 row runs f32 there; the
    bf16 row keeps what it asks for (and is reported as unable to run)."""
    avx2 = {"avx512_bf16": False, "amx": False}
    assert ov_precision(INT4, avx2) == ("f32", "f32")
    assert ov_precision(INT4, {"avx512_bf16": True, "amx": False}) == ("bf16", "bf16")
    assert ov_precision(INT4, {"avx512_bf16": False, "amx": True}) == ("bf16", "bf16")
    assert ov_precision("bfloat16", avx2) == ("bf16", "bf16")
    assert ov_precision("float32", avx2) == ("f32", "f32")
