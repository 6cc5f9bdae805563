"""scripts/compare_engines.py: its --quick smoke mode end to end (tinyllm and transformers on the
tiny random Llama), its GGUF writer read back by tinyllm's loader, and its parsing of llama.cpp
output captured from the real llama-batched-bench / llama-bench binaries (tests/data/llamacpp/).

Timing values are only checked for being finite and positive (no timed assertions); the structure
and the arithmetic (medians, ratios, token counts, greedy agreement) are checked exactly.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "compare_engines.py"
DATA = Path(__file__).resolve().parent / "data" / "llamacpp"


def _load_script():
    spec = importlib.util.spec_from_file_location("compare_engines", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compare_engines"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


ce = _load_script()


def _run(args, tmp_path):
    env = os.environ | {"PYTHONPATH": str(REPO), "TINYLLM_COMPARE_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_quick_compare_tinyllm_and_transformers(llama_dir, tmp_path):
    out = tmp_path / "compare.json"
    p = _run(["--quick", "--engines", "tinyllm,hf", "--workloads", "W1,W2", "--dtypes", "float32",
              "--repeat", "2", "--settle", "0", "--hf-dir", str(llama_dir), "--json", str(out)], tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""  # the table and the log go to stderr
    assert "tinyllm / transformers" in p.stderr and "W1" in p.stderr and "W2" in p.stderr
    res = json.loads(out.read_text())
    assert res["cpu"]["model_name"] in p.stderr
    cells = {(c["bench"], c["dtype"], c["engine"]): c for c in res["cells"]}
    assert set(cells) == {(b, "float32", e) for b in ("W1", "W2") for e in ("tinyllm", "hf")}
    for (bench, _, _), c in cells.items():
        wl = ce.QUICK[bench]
        prompts = ce.make_prompts(llama_dir, wl, 0)
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
    for bench in ("W1", "W2"):
        n = ce.QUICK[bench].num_prompts
        assert res["greedy_match_vs_tinyllm"][f"{bench}/float32/hf"] == f"{n}/{n}"


def test_bad_flag_is_one_usage_error(tmp_path):
    p = _run(["--engines", "tinyllm,sglang"], tmp_path)
    assert p.returncode == 2
    assert "--engines takes a comma list of tinyllm,hf,vllm,llamacpp" in p.stderr
    assert "Traceback" not in p.stderr


def test_prompts_are_the_ones_tinyllm_bench_draws(llama_dir):
    from tinyllm_cli.workload import random_prompts
    from tinyllm_cli.model.checkpoint import load_checkpoint
    wl = ce.FULL["W1"]
    cfg = load_checkpoint(str(llama_dir), progress=False).config
    ours = ce.make_prompts(llama_dir, wl, 0)
    assert ours == random_prompts(cfg, wl.num_prompts, wl.input_len, wl.range_ratio, 0)
    assert len(ours) == 16 and all(64 <= len(p) <= 127 for p in ours)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_written_for_llamacpp_loads_back_as_the_hf_weights(llama_dir, tmp_path, dtype):
    """tinyllm's GGUF loader undoes llama.cpp's Q/K permutation independently of the writer, so
    weights read back equal the HF checkpoint's (bf16: its bf16 rounding)."""
    from safetensors.torch import load_file
    from tinyllm_cli.model.checkpoint import load_checkpoint
    path = ce.write_gguf(Path(llama_dir), tmp_path / f"tiny-{dtype}.gguf", dtype, tokenizer_from=None)
    ck = load_checkpoint(str(path), progress=False)
    hf = load_file(str(Path(llama_dir) / "model.safetensors"))
    assert set(hf) <= set(ck.weights)
    for name, w in hf.items():
        want = w.float()
        if dtype == "bfloat16" and w.dim() == 2:
            want = want.to(torch.bfloat16).float()
        torch.testing.assert_close(ck.weights[name].float(), want, rtol=0, atol=0, msg=name)


def test_parse_batched_bench_real_output():
    text = (DATA / "batched_bench_jsonl.txt").read_text()
    rows = ce.parse_batched_bench(text)
    assert len(rows) == 1
    r = rows[0]
    assert r["n_kv"] == r["pl"] * (r["pp"] + r["tg"])  # not shared-prompt mode: every sequence prefilled
    assert r["speed"] == pytest.approx(r["n_kv"] / r["t"], rel=1e-3)  # 'speed' is total tok/s
    assert r["t"] == pytest.approx(r["t_pp"] + r["t_tg"], rel=1e-3)


def test_parse_llama_bench_real_output():
    rows = ce.parse_llama_bench((DATA / "llama_bench_json.txt").read_text())
    assert len(rows) == 1
    r = rows[0]
    assert (r["n_prompt"], r["n_gen"], r["n_threads"]) == (0, 8, 2)
    assert r["avg_ts"] > 0 and r["avg_ts"] == pytest.approx(np.mean(r["samples_ts"]), rel=1e-3)


def test_parsers_ignore_log_lines():
    assert ce.parse_batched_bench("main: n_kv_max = 4096\n|    PP |     TG |\n") == []
    assert ce.parse_llama_bench("load_backend: loaded CPU backend\n") == []
