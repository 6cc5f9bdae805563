"""The rounds, the rows and their arithmetic, on fake engines: round robin, medians, ratios,
greedy agreement and the memory rule that keeps engines warm."""

from __future__ import annotations

import pytest

from benchmarks.agreement import agreement, agreement_text
from benchmarks.common import Run, Skip
from benchmarks.compare import parse_args
from benchmarks.comparison import Comparison
from benchmarks.runs import keep_warm, record_batched, run_rounds, score_row
from benchmarks.table import markdown_table, table_rows
from benchmarks.workloads import QUICK

from .fakes import FakeEngine


def test_agreement_counts_prefix_until_the_first_difference():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    ag = agreement(ref, got)
    assert (ag["exact"], ag["n"], ag["tokens"]) == (1, 3, 12)
    assert ag["prefix_tokens"] == 4 + 2 + 0  # equal tokens after a difference do not count
    assert ag["prefix_frac"] == pytest.approx(6 / 12, abs=1e-4)
    assert ag["same_pos_frac"] == pytest.approx(10 / 12, abs=1e-4)
    assert agreement_text(ag) == "1/3 · 50%" and agreement_text(None) == "-"
    with pytest.raises(ValueError):
        agreement(ref, got[:2])


def _comparison(shapes=("135m",)):
    a = parse_args(["--shapes", ",".join(shapes), "--repeat", "2"])
    cpu = {"model_name": "Test CPU", "cores": 2, "amx": False, "avx512_bf16": False, "avx512f": True,
           "family": None, "model": None}
    return Comparison(a, cpu)


def test_table_rows_ratios_and_agreement_per_shape():
    cmp = _comparison(("135m", "1.5b"))
    for engine, vals in (("tinyllm", [100.0, 120.0]), ("openvino", [50.0, 70.0]), ("llamacpp", [80.0, 80.0])):
        for v in vals:
            record_batched(cmp, "1.5b", "W1", "int4", engine, Run(1.0, int(v), [[1, 2]]), 0)
    cmp.cell("W1", "int4", "vllm", "tok/s", "1.5b").note = "no int4 path"
    cmp.tokens[("1.5b", "W1", "float32", "hf")] = [[1, 3]]
    score_row(cmp, None, "1.5b", "int4", {"W1": [[7, 8]]})
    rows = table_rows(cmp)
    assert len(rows) == 1
    r = rows[0]
    assert (r["shape"], r["bench"], r["dtype"]) == ("1.5b", "W1", "int4")
    assert r["tinyllm"] == 110.0 and r["openvino"] == 60.0
    assert r["tinyllm / OpenVINO"] == pytest.approx(110 / 60, abs=1e-3)
    assert r["tinyllm / llama.cpp"] == pytest.approx(110 / 80, abs=1e-3)
    assert r["vllm"] == "skipped: no int4 path" and "tinyllm / vLLM" not in r
    # int4 rows are scored against transformers in f32 on the same shape and workload
    assert r["agree openvino"]["prefix_tokens"] == 1 and r["agree openvino"]["exact"] == 0
    md = markdown_table(cmp, rows)
    assert md.startswith("### Test CPU, 2 cores")
    assert "| 1.5b | W1 | int4 | tok/s | 110.0 | 60.00 | skipped | 80.00 | 1.83x | 1.38x | 0/1 · 50% |" in md
    assert "vLLM CPU 1.5b W1 int4 skipped: no int4 path" in md


def test_keep_warm_counts_resident_copies(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4000)  # 1000 f32 parameters
    names = ["tinyllm", "hf", "openvino", "vllm", "llamacpp"]  # 3 resident + 1 transient copy
    assert keep_warm(tmp_path, "float32", names, 16000 / 0.6 + 1)
    assert not keep_warm(tmp_path, "float32", names, 16000 / 0.6 - 1)
    assert keep_warm(tmp_path, "bfloat16", names, 8000 / 0.6 + 1)
    assert keep_warm(tmp_path, "float32", names, None)
    # each resident engine also holds its KV pool
    assert not keep_warm(tmp_path, "float32", names, 16000 / 0.6 + 1, kv_bytes=1)
    assert keep_warm(tmp_path, "float32", names, 16003 / 0.6 + 1, kv_bytes=1)


@pytest.mark.parametrize("warm", [True, False])
def test_rounds_interleave_engines_and_restart_them_only_when_cold(warm):
    cmp = _comparison()
    cmp.args.repeat, cmp.args.settle = 2, 0

    def broken():
        raise Skip("cannot start")
    factories = {"tinyllm": lambda: FakeEngine("tinyllm"), "openvino": lambda: FakeEngine("openvino"),
                 "vllm": broken}
    ctx = {"workloads": QUICK}
    prompts = {"W1": [[5, 6, 7]] * 2, "W2": [[8, 9]] * 3}
    FakeEngine.log = []
    run_rounds(cmp, ctx, factories, prompts, "135m", "float32", warm)
    starts = [e for kind, e in FakeEngine.log if kind == "start"]
    runs = [e for kind, e in FakeEngine.log if kind == "run"]
    assert starts == (["tinyllm", "openvino"] if warm else ["tinyllm", "openvino"] * 2)
    assert runs == ["tinyllm", "tinyllm", "openvino", "openvino"] * 2  # round robin, every round
    assert sorted(e for kind, e in FakeEngine.log if kind == "close") == sorted(starts)
    for bench in prompts:
        assert cmp.cell(bench, "float32", "vllm", "tok/s", "135m").note == "cannot start"
        c = cmp.cell(bench, "float32", "tinyllm", "tok/s", "135m")
        assert len(c.values) == 2 and c.values[0] == pytest.approx(c.runs[0]["total_tokens"] / 0.5)
    assert cmp.tokens[("135m", "W2", "float32", "openvino")] == [[1] * QUICK["W2"].output_len] * 3
