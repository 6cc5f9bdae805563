"""``python -m benchmarks.compare`` end to end: its --quick smoke mode (tinyllm and transformers on
the tiny random Llama) with the stored result it writes, its usage errors, and its termination.

Timing values are only checked for being finite and positive (no timed assertions); the structure
and the arithmetic (medians, ratios, token counts, greedy agreement, the limits) are checked exactly.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from benchmarks.common import BATCHED
from benchmarks.compare import parse_args, parse_kv_gib
from benchmarks.comparison import Comparison
from benchmarks.machine import cpu_class
from benchmarks.report import render
from benchmarks.results import git_commit, load
from benchmarks.models import SHAPES, kv_gib
from benchmarks.workloads import QUICK, make_prompts

REPO = Path(__file__).resolve().parents[2]


def _run(args, tmp_path):
    env = os.environ | {"PYTHONPATH": str(REPO), "TINYLLM_COMPARE_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "benchmarks.compare", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)


def test_quick_compare_tinyllm_and_transformers(llama_dir, tmp_path):
    out = tmp_path / "compare.json"
    p = _run(["--quick", "--engines", "tinyllm,hf", "--workloads", "W1,W2,long", "--dtypes", "float32",
              "--repeat", "2", "--settle", "0", "--hf-dir", str(llama_dir), "--json", str(out),
              "--results-dir", str(tmp_path / "results")], tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""  # the table and the log go to stderr
    assert "tinyllm / transformers" in p.stderr and all(b in p.stderr for b in BATCHED)
    res = json.loads(out.read_text())
    assert res["cpu"]["model_name"] in p.stderr
    cells = {(c["bench"], c["dtype"], c["engine"]): c for c in res["cells"]}
    assert {c["shape"] for c in res["cells"]} == {"135m"}
    assert set(cells) == {(b, "float32", e) for b in BATCHED for e in ("tinyllm", "hf")}
    for (bench, _, _), c in cells.items():
        wl = QUICK[bench]
        prompts = make_prompts(llama_dir, wl, 0)
        assert c["unit"] == "tok/s" and c["note"] is None
        assert len(c["values"]) == 2 and all(math.isfinite(v) and v > 0 for v in c["values"])
        assert c["median"] == pytest.approx(statistics.median(c["values"]))
        for run, v in zip(c["runs"], c["values"]):
            assert run["total_tokens"] == sum(map(len, prompts)) + len(prompts) * wl.output_len
            assert v == pytest.approx(run["total_tokens"] / run["elapsed_s"], rel=1e-3)
    rows = {r["bench"]: r for r in res["table"]}
    for bench, row in rows.items():
        mine, hf = cells[(bench, "float32", "tinyllm")]["median"], cells[(bench, "float32", "hf")]["median"]
        assert row["tinyllm / transformers"] == pytest.approx(mine / hf, rel=1e-2)
        assert "tinyllm / vLLM" not in row and row.get("vllm") is None
    # The tiny model's weights are scaled so greedy decoding is decided by the model, not float noise:
    # transformers and tinyllm must produce the same tokens for every prompt.
    for bench in BATCHED:
        wl = QUICK[bench]
        ag = res["agreement_vs_transformers"][f"135m/{bench}/float32/tinyllm"]
        assert ag["exact"] == ag["n"] == wl.num_prompts and ag["prefix_frac"] == 1.0
        assert ag["tokens"] == wl.num_prompts * wl.output_len
        assert f"135m/{bench}/float32/hf" not in res["agreement_vs_transformers"]  # it is the reference
        assert rows[bench]["agree tinyllm"]["exact"] == wl.num_prompts
    assert "| 135m | W1 | float32 | tok/s |" in res["markdown"] and res["cpu_label"] in res["markdown"]
    _check_limits(res, rows, llama_dir)
    _check_stored_result(tmp_path / "results", res)


def _check_stored_result(directory: Path, res: dict) -> None:
    """The run's result file holds the --json output's medians and rounds, per engine, workload and
    dtype, with the CPU class, the commit and the command; the report renders its table from it."""
    [stored] = load(directory)
    d = stored.data
    assert d["source"] == "measured" and d["commit"] == git_commit()
    assert d["cpu"]["model_name"] == res["cpu"]["model_name"] and d["cpu"]["cpu_class"] == cpu_class(res["cpu"])
    assert d["settings"]["statistic"] == "median" and d["settings"]["rounds"] == 2
    assert d["settings"]["command"].startswith("python -m benchmarks.compare --quick --engines tinyllm,hf")
    got = {(f["shape"], f["bench"], f["dtype"], f["engine"]): (f["value"], f["values"]) for f in d["figures"]}
    assert got == {(c["shape"], c["bench"], c["dtype"], c["engine"]): (c["median"], c["values"]) for c in res["cells"]}
    table = render(load(directory))
    for row in res["table"]:
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| 135m | {row['bench']} | float32 | tok/s |"))
        # The stored figures are rounded; the rendered ratio is theirs (within the run's own by rounding).
        ours, theirs = (got[("135m", row["bench"], "float32", e)][0] for e in ("tinyllm", "hf"))
        assert f"| {ours / theirs:.2f}x | a |" in line
        assert ours / theirs == pytest.approx(row["tinyllm / transformers"], rel=1e-3)
    assert table.startswith(f"### {d['cpu']['cpu_class']}\n") and f"Recorded {d['recorded'][:10]}" in table


def test_a_quick_run_stores_no_result_unless_asked(tmp_path, monkeypatch):
    """A --quick run is a smoke test: it writes into benchmarks/results only where --results-dir
    names a directory; a measured run always does."""
    import benchmarks.compare as compare
    stored = []
    monkeypatch.setattr(compare.results, "write", lambda rec, directory: stored.append(directory) or directory / "x")
    cmp = Comparison(parse_args(["--quick"]), {"model_name": "Test CPU", "cores": 2, "amx": False,
                                               "avx512_bf16": False, "avx512f": False, "family": None, "model": None})
    cmp.cell("W1", "float32", "tinyllm").values.append(1.0)
    compare.store_result(cmp, ["--quick"], datetime.now(timezone.utc), False)
    assert stored == []
    cmp.args = parse_args([])
    compare.store_result(cmp, [], datetime.now(timezone.utc), False)
    assert stored == [compare.results.RESULTS_DIR]
    cmp.args = parse_args(["--quick", "--results-dir", str(tmp_path)])
    compare.store_result(cmp, [], datetime.now(timezone.utc), False)
    assert stored[-1] == tmp_path


def test_a_result_leaves_out_cells_never_reached_and_a_failed_store_is_one_line(tmp_path, capsys):
    import benchmarks.compare as compare
    cpu = {"model_name": "Test CPU", "cores": 2, "amx": False, "avx512_bf16": False, "avx512f": True,
           "family": None, "model": None}
    cmp = Comparison(parse_args(["--results-dir", str(tmp_path / "r")]), cpu)
    cmp.cell("W1", "float32", "tinyllm").values.extend([5.0, 7.0])
    cmp.cell("W1", "float32", "vllm")  # created, never run: no figure
    cmp.cell("W2", "float32", "openvino").note = "cannot run here"
    assert compare.store_result(cmp, ["--results-dir", "r"], datetime(2026, 12, 6, 1, 2, 3, tzinfo=timezone.utc), False)
    [stored] = load(tmp_path / "r")
    assert stored.path.name == "2026-12-06T010203Z-test-cpu-avx-512-no-amx.json"
    figs = {(f["bench"], f["engine"]): f for f in stored.data["figures"]}
    assert set(figs) == {("W1", "tinyllm"), ("W2", "openvino")}
    assert figs[("W1", "tinyllm")]["value"] == 6.0 and figs[("W1", "tinyllm")]["values"] == [5.0, 7.0]
    assert figs[("W2", "openvino")]["value"] is None and figs[("W2", "openvino")]["note"] == "cannot run here"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cmp.args.results_dir = blocker / "results"
    assert not compare.store_result(cmp, [], datetime.now(timezone.utc), False)
    assert "error: the result could not be stored in" in capsys.readouterr().err


def _flops(hf: dict, prompt_lens: list[int], out: int) -> int:
    """A workload's FLOPs from the HF config by hand: every weight matmul (2 per multiply-add, the
    output projection on sampled rows only) and causal attention's QK^T and P.V."""
    h, layers, heads, kv = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"]
    d = h // heads
    per_layer = h * d * (heads + 2 * kv) + heads * d * h + 3 * h * hf["intermediate_size"]
    dec = out - 1
    tokens = sum(prompt_lens) + len(prompt_lens) * dec
    pairs = sum(L * (L + 1) // 2 + dec * L + dec * (dec + 1) // 2 for L in prompt_lens)
    return 2 * (layers * per_layer * tokens + h * hf["vocab_size"] * len(prompt_lens) * out) + 4 * heads * d * layers * pairs


def _check_limits(res: dict, rows: dict, llama_dir) -> None:
    """The where-the-limit-is table: the workload's FLOPs per token (the same for every engine),
    each engine's rate from its median, against the peak bench measures (cached under the tests'
    peak cache)."""
    hf = json.loads((llama_dir / "config.json").read_text())
    for bench, row in rows.items():
        wl, lim = QUICK[bench], row["limit"]
        assert res["limits"][f"135m/{bench}/float32"] == lim
        lens = [len(p) for p in make_prompts(llama_dir, wl, 0)]
        tokens = sum(lens) + len(lens) * wl.output_len
        assert lim["flops_per_token"] == pytest.approx(_flops(hf, lens, wl.output_len) / tokens)
        assert lim["peak_gflops"] > 0 and lim["bandwidth_gbps"] > 0 and lim["peak_rows"] == 256
        for eng in ("tinyllm", "hf"):
            rate = row[f"rate {eng}"]
            gflops = row[eng] * lim["flops_per_token"] / 1e9
            assert rate["gflops"] == pytest.approx(gflops, rel=1e-3) and rate["gflops"] > 0
            assert rate["peak_frac"] == pytest.approx(gflops / lim["peak_gflops"], rel=1e-3)
            assert rate["bw_frac"] == pytest.approx(row[eng] * lim["bytes_per_token"] / 1e9 / lim["bandwidth_gbps"],
                                                    rel=1e-3)
            # the bound (least time) is at least the slower of the whole workload's two limits
            assert lim["bound_s_per_token"] >= max(lim["flops_per_token"] / lim["peak_gflops"],
                                                   lim["bytes_per_token"] / lim["bandwidth_gbps"]) / 1e9 * (1 - 1e-9)
            assert rate["bound_frac"] == pytest.approx(row[eng] * lim["bound_s_per_token"], rel=1e-3)
    assert "Where the limit is" in res["markdown"] and "| 135m | W1 | float32 |" in res["markdown"].split("limit is")[1]


def test_bad_flag_is_one_usage_error(tmp_path):
    p = _run(["--engines", "tinyllm,sglang"], tmp_path)
    assert p.returncode == 2
    assert "--engines takes a comma list of tinyllm,hf,openvino,vllm,llamacpp" in p.stderr
    assert "Traceback" not in p.stderr


def test_bad_kv_gib_and_shape_are_usage_errors(tmp_path):
    for args, msg in ((["--kv-gib", "135m=0"], "--kv-gib takes whole GiB"),
                      (["--kv-gib", "7b=2"], "unknown shape '7b'"), (["--shapes", "7b"], "--shapes takes")):
        p = _run(args, tmp_path)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr


def test_parse_kv_gib():
    assert parse_kv_gib(None) == {}
    assert parse_kv_gib("3") == dict.fromkeys(SHAPES, 3)
    assert parse_kv_gib("135m=1, 1.5b=2") == {"135m": 1, "1.5b": 2}
    a = parse_args(["--kv-gib", "1.5b=4"])
    assert (kv_gib(a, "1.5b"), kv_gib(a, "135m")) == (4, SHAPES["135m"].kv_gib)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_termination_ends_a_run_as_ctrl_c_does(sig):
    """SIGTERM / SIGHUP raise KeyboardInterrupt in the script (the path that continues and closes
    the stopped workers and still writes the table), not a silent death."""
    code = (f"import os, signal, sys, time; sys.path.insert(0, {str(REPO)!r})\n"
            "from benchmarks.compare import interrupt_on_termination\n"
            "interrupt_on_termination()\n"
            "try:\n"
            f"    os.kill(os.getpid(), signal.{sig}); time.sleep(10); print('not interrupted')\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "interrupted", out.stderr
