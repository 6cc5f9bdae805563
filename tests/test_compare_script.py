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
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import wait_s

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
                          timeout=wait_s(600))


def test_quick_compare_tinyllm_and_transformers(llama_dir, tmp_path):
    out = tmp_path / "compare.json"
    p = _run(["--quick", "--engines", "tinyllm,hf", "--workloads", "W1,W2,long", "--dtypes", "float32",
              "--repeat", "2", "--settle", "0", "--hf-dir", str(llama_dir), "--json", str(out)], tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""  # the table and the log go to stderr
    assert "tinyllm / transformers" in p.stderr and all(b in p.stderr for b in ce.BATCHED)
    res = json.loads(out.read_text())
    assert res["cpu"]["model_name"] in p.stderr
    cells = {(c["bench"], c["dtype"], c["engine"]): c for c in res["cells"]}
    assert {c["shape"] for c in res["cells"]} == {"135m"}
    assert set(cells) == {(b, "float32", e) for b in ce.BATCHED for e in ("tinyllm", "hf")}
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
    for bench in ce.BATCHED:
        wl = ce.QUICK[bench]
        ag = res["agreement_vs_transformers"][f"135m/{bench}/float32/tinyllm"]
        assert ag["exact"] == ag["n"] == wl.num_prompts and ag["prefix_frac"] == 1.0
        assert ag["tokens"] == wl.num_prompts * wl.output_len
        assert f"135m/{bench}/float32/hf" not in res["agreement_vs_transformers"]  # it is the reference
        assert rows[bench]["agree tinyllm"]["exact"] == wl.num_prompts
    assert f"| 135m | W1 | float32 | tok/s |" in res["markdown"] and res["cpu_label"] in res["markdown"]
    _check_limits(res, rows, llama_dir)


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
        wl, lim = ce.QUICK[bench], row["limit"]
        assert res["limits"][f"135m/{bench}/float32"] == lim
        lens = [len(p) for p in ce.make_prompts(llama_dir, wl, 0)]
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


def test_bad_kv_gib_and_shape_are_usage_errors(tmp_path):
    for args, msg in ((["--kv-gib", "135m=0"], "--kv-gib takes whole GiB"),
                      (["--kv-gib", "7b=2"], "unknown shape '7b'"), (["--shapes", "7b"], "--shapes takes")):
        p = _run(args, tmp_path)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr


def test_parse_kv_gib():
    assert ce.parse_kv_gib(None) == {}
    assert ce.parse_kv_gib("3") == dict.fromkeys(ce.SHAPES, 3)
    assert ce.parse_kv_gib("135m=1, 1.5b=2") == {"135m": 1, "1.5b": 2}
    a = ce.parse_args(["--kv-gib", "1.5b=4"])
    assert (ce.kv_gib(a, "1.5b"), ce.kv_gib(a, "135m")) == (4, ce.SHAPES["135m"].kv_gib)


def test_agreement_counts_prefix_until_the_first_difference():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    ag = ce.agreement(ref, got)
    assert (ag["exact"], ag["n"], ag["tokens"]) == (1, 3, 12)
    assert ag["prefix_tokens"] == 4 + 2 + 0  # equal tokens after a difference do not count
    assert ag["prefix_frac"] == pytest.approx(6 / 12, abs=1e-4)
    assert ag["same_pos_frac"] == pytest.approx(10 / 12, abs=1e-4)
    assert ce.agreement_text(ag) == "1/3 · 50%" and ce.agreement_text(None) == "-"
    with pytest.raises(ValueError):
        ce.agreement(ref, got[:2])


def _comparison(shapes=("135m",)):
    a = ce.parse_args(["--shapes", ",".join(shapes), "--repeat", "2"])
    cpu = {"model_name": "Test CPU", "cores": 2, "amx": False, "avx512_bf16": False, "avx512f": True,
           "family": None, "model": None}
    return ce.Comparison(a, cpu)


def test_table_rows_ratios_and_agreement_per_shape():
    cmp = _comparison(("135m", "1.5b"))
    for engine, vals in (("tinyllm", [100.0, 120.0]), ("openvino", [50.0, 70.0]), ("llamacpp", [80.0, 80.0])):
        for v in vals:
            ce.record_batched(cmp, "1.5b", "W1", "int4", engine, ce.Run(1.0, int(v), [[1, 2]]), 0)
    cmp.cell("W1", "int4", "vllm", "tok/s", "1.5b").note = "no int4 path"
    cmp.tokens[("1.5b", "W1", "float32", "hf")] = [[1, 3]]
    ce.score_row(cmp, None, "1.5b", "int4", {"W1": [[7, 8]]})
    rows = ce.table_rows(cmp)
    assert len(rows) == 1
    r = rows[0]
    assert (r["shape"], r["bench"], r["dtype"]) == ("1.5b", "W1", "int4")
    assert r["tinyllm"] == 110.0 and r["openvino"] == 60.0
    assert r["tinyllm / OpenVINO"] == pytest.approx(110 / 60, abs=1e-3)
    assert r["tinyllm / llama.cpp"] == pytest.approx(110 / 80, abs=1e-3)
    assert r["vllm"] == "skipped: no int4 path" and "tinyllm / vLLM" not in r
    # int4 rows are scored against transformers in f32 on the same shape and workload
    assert r["agree openvino"]["prefix_tokens"] == 1 and r["agree openvino"]["exact"] == 0
    md = ce.markdown_table(cmp, rows)
    assert md.startswith("### Test CPU, 2 cores")
    assert "| 1.5b | W1 | int4 | tok/s | 110.0 | 60.00 | skipped | 80.00 | 1.83x | 1.38x | 0/1 · 50% |" in md
    assert "vLLM CPU 1.5b W1 int4 skipped: no int4 path" in md


def test_keep_warm_counts_resident_copies(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4000)  # 1000 f32 parameters
    names = ["tinyllm", "hf", "openvino", "vllm", "llamacpp"]  # 3 resident + 1 transient copy
    assert ce.keep_warm(tmp_path, "float32", names, 16000 / 0.6 + 1)
    assert not ce.keep_warm(tmp_path, "float32", names, 16000 / 0.6 - 1)
    assert ce.keep_warm(tmp_path, "bfloat16", names, 8000 / 0.6 + 1)
    assert ce.keep_warm(tmp_path, "float32", names, None)
    # each resident engine also holds its KV pool
    assert not ce.keep_warm(tmp_path, "float32", names, 16000 / 0.6 + 1, kv_bytes=1)
    assert ce.keep_warm(tmp_path, "float32", names, 16003 / 0.6 + 1, kv_bytes=1)


def test_pad_vocab_grows_only_the_token_arrays():
    toks = ce.pad_vocab("tokenizer.ggml.tokens", ["a", "b"], 4)
    assert toks == ["a", "b", "<|tinyllm-unused-2|>", "<|tinyllm-unused-3|>"]
    assert ce.pad_vocab("tokenizer.ggml.token_type", [1, 1], 3) == [1, 1, 5]
    assert ce.pad_vocab("tokenizer.ggml.merges", ["a b"], 4) == ["a b"]
    assert ce.pad_vocab("tokenizer.ggml.tokens", ["a", "b"], None) == ["a", "b"]


def test_qwen2_gguf_keeps_rows_and_biases_and_loads_back(qwen2_dir, tmp_path):
    """llama.cpp's converter does not permute qwen2's Q/K rows and writes the q/k/v biases; tinyllm's
    loader reads the file back to the HF weights, biases included."""
    from safetensors.torch import load_file
    from tinyllm_cli.model.checkpoint import load_checkpoint
    cfg = json.loads((Path(qwen2_dir) / "config.json").read_text())
    names = ce.gguf_names(cfg)
    assert names["blk.0.attn_q.bias"] == "model.layers.0.self_attn.q_proj.bias"
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert (ce.gguf_tensor("blk.0.attn_q.weight", w, cfg) == w).all()
    path = ce.write_gguf(Path(qwen2_dir), tmp_path / "tiny-qwen2.gguf", "float32", tokenizer_from=None)
    ck = load_checkpoint(str(path), progress=False)
    assert ck.config.arch == "qwen2" and ck.config.attention_bias
    for name, t in load_file(str(Path(qwen2_dir) / "model.safetensors")).items():
        torch.testing.assert_close(ck.weights[name].float(), t.float(), rtol=0, atol=0, msg=name)


class _FakeEngine:
    """Stands in for an engine: counts starts and closes, answers every run at once."""
    log: list = []

    def __init__(self, name):
        self.name = name
        _FakeEngine.log.append(("start", name))

    def run(self, prompts, output_len):
        _FakeEngine.log.append(("run", self.name))
        return ce.Run(0.5, ce.total_tokens(prompts, output_len), [[1] * output_len for _ in prompts])

    def close(self):
        _FakeEngine.log.append(("close", self.name))


@pytest.mark.parametrize("warm", [True, False])
def test_rounds_interleave_engines_and_restart_them_only_when_cold(warm):
    cmp = _comparison()
    cmp.args.repeat, cmp.args.settle = 2, 0

    def broken():
        raise ce.Skip("cannot start")
    factories = {"tinyllm": lambda: _FakeEngine("tinyllm"), "openvino": lambda: _FakeEngine("openvino"),
                 "vllm": broken}
    ctx = {"workloads": ce.QUICK}
    prompts = {"W1": [[5, 6, 7]] * 2, "W2": [[8, 9]] * 3}
    _FakeEngine.log = []
    ce.run_rounds(cmp, ctx, factories, prompts, "135m", "float32", warm)
    starts = [e for kind, e in _FakeEngine.log if kind == "start"]
    runs = [e for kind, e in _FakeEngine.log if kind == "run"]
    assert starts == (["tinyllm", "openvino"] if warm else ["tinyllm", "openvino"] * 2)
    assert runs == ["tinyllm", "tinyllm", "openvino", "openvino"] * 2  # round robin, every round
    assert sorted(e for kind, e in _FakeEngine.log if kind == "close") == sorted(starts)
    for bench in prompts:
        assert cmp.cell(bench, "float32", "vllm", "tok/s", "135m").note == "cannot start"
        c = cmp.cell(bench, "float32", "tinyllm", "tok/s", "135m")
        assert len(c.values) == 2 and c.values[0] == pytest.approx(c.runs[0]["total_tokens"] / 0.5)
    assert cmp.tokens[("135m", "W2", "float32", "openvino")] == [[1] * ce.QUICK["W2"].output_len] * 3


def test_prompt_texts_and_text_windows(tmp_path):
    (tmp_path / "a.txt").write_text("Hello there.\n\nHello there.\nSecond line.\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "Second line."}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]}) + "\n")
    assert ce.prompt_texts([tmp_path / "a.txt", tmp_path / "b.jsonl"]) == [
        "Hello there.", "Second line.", "Be brief.", "Why?"]
    stream = list(range(100))
    wins = ce.text_windows(stream, [10, 20, 5], seed=3)
    assert [len(w) for w in wins] == [10, 20, 5]
    assert all(w == list(range(w[0], w[0] + len(w))) for w in wins)  # contiguous text
    assert wins == ce.text_windows(stream, [10, 20, 5], seed=3)  # seeded: the same every run
    with pytest.raises(ce.Skip):
        ce.text_windows(stream, [101], seed=0)
    for path in ce.TEXT_SOURCES:  # the real shape's sources are in the repository
        assert (REPO / path).exists(), path


def test_openvino_int4_row_computes_in_f32_where_the_cpu_has_no_bf16():
    """OpenVINO's AVX2 paged attention refuses bf16 K/V, so its int4 row runs f32 there; the
    bf16 row keeps what it asks for (and is reported as unable to run)."""
    avx2 = {"avx512_bf16": False, "amx": False}
    assert ce.ov_precision(ce.INT4, avx2) == ("f32", "f32")
    assert ce.ov_precision(ce.INT4, {"avx512_bf16": True, "amx": False}) == ("bf16", "bf16")
    assert ce.ov_precision(ce.INT4, {"avx512_bf16": False, "amx": True}) == ("bf16", "bf16")
    assert ce.ov_precision("bfloat16", avx2) == ("bf16", "bf16")
    assert ce.ov_precision("float32", avx2) == ("f32", "f32")


def test_a_worker_that_exits_is_skipped_with_its_last_words(tmp_path):
    """An engine worker (OpenVINO GenAI, vLLM) that dies before answering: the row is skipped
    with the last line it wrote (its exception's message); one that stays silent past the
    timeout is 'hung'."""
    log = tmp_path / "runs.log"
    log.write_text("an earlier worker's output\n")
    crash = [sys.executable, "-c", "import sys; sys.stderr.write('Traceback (most recent call last):\\n"
             "RuntimeError: expect kvcache type f32, current: bf16\\n\\n'); sys.exit(1)"]
    with pytest.raises(ce.Skip, match=r"worker exited: RuntimeError: expect kvcache type f32, current: bf16 \(see "):
        ce.WorkerEngine(crash, dict(os.environ), log, timeout=wait_s(60))
    silent = [sys.executable, "-c", "import time; time.sleep(5)"]
    with pytest.raises(ce.Skip, match="worker hung"):
        ce.WorkerEngine(silent, dict(os.environ), log, timeout=0.5)


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (T: stopped, Z: exited, waiting for its parent); None
    when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _states(pids, want_stopped: bool) -> list[str]:
    """The processes' state letters, polled up to 5 s until each is (or is not) stopped: a signal
    is acted on after kill() returns."""
    def states():
        return [_state(p) for p in pids]
    deadline = time.monotonic() + wait_s(5)
    while any((s == "T") != want_stopped for s in states()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return states()


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(signal, "SIGSTOP"), reason="needs /proc and SIGSTOP")
def test_only_the_timed_engine_runs_the_others_workers_are_stopped(tmp_path):
    """A loaded worker is stopped, with the processes it started (vLLM's engine core), while
    another engine runs, and continued for its own runs; closing a stopped worker ends it."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('@@RESULT ' + json.dumps({'child': child.pid}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    n = json.loads(line)['max_tokens']\n"
        "    print('@@RESULT ' + json.dumps({'elapsed_s': 0.25, 'token_ids': [[1] * n]}), flush=True)\n"
        "child.kill()\n")
    log = tmp_path / "runs.log"
    a = ce.WorkerEngine([sys.executable, str(script)], dict(os.environ), log, timeout=wait_s(60))
    b = ce.WorkerEngine([sys.executable, str(script)], dict(os.environ), log, timeout=wait_s(60))
    pids = {"a": (a.proc.pid, a.info["child"]), "b": (b.proc.pid, b.info["child"])}
    try:
        engines = {"tinyllm": _FakeEngine("tinyllm"), "a": a, "b": b}
        ce.only(engines, "a")
        assert _states(pids["b"], True) == ["T", "T"] and "T" not in _states(pids["a"], False)
        assert a.run([[5, 6]], 3).token_ids == [[1, 1, 1]]
        ce.only(engines, "b")
        assert _states(pids["a"], True) == ["T", "T"] and "T" not in _states(pids["b"], False)
        assert b.run([[5, 6]], 2).token_ids == [[1, 1]]
        ce.only(engines, "tinyllm")
        assert _states([p for pair in pids.values() for p in pair], True) == ["T"] * 4
    finally:
        a.close()
        b.close()
        ce.GUARD.close()
    assert a.proc.returncode == 0 and b.proc.returncode == 0  # continued, read the end of input, exited


def _gone(pids) -> bool:
    """Whether every process has exited (no /proc entry, or a zombie waiting for its new parent),
    polled up to 20 s."""
    def alive(p):
        return _state(p) not in (None, "Z")
    deadline = time.monotonic() + wait_s(20)
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(alive, pids))


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(signal, "SIGKILL"), reason="needs /proc and SIGKILL")
def test_workers_stopped_by_a_script_killed_outright_are_continued_and_end(tmp_path):
    """SIGKILL gives the script no chance to continue the workers it stopped: the guard process
    does, and each one, with the process it started, then reads the end of its input and exits."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE)\n"
        "print('@@RESULT ' + json.dumps({'child': child.pid}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    pass\n"
        "child.stdin.close()\n"
        "child.wait()\n")
    code = (f"import os, sys, time; sys.path.insert(0, {str(SCRIPT.parent)!r}); import compare_engines as ce\n"
            f"w = ce.WorkerEngine([sys.executable, {str(worker)!r}], dict(os.environ), ce.Path({str(tmp_path / 'runs.log')!r}), 60)\n"
            "w.pause()\n"
            "print(w.proc.pid, w.info['child'], flush=True)\n"
            "time.sleep(60)\n")
    script = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in script.stdout.readline().split()]
        assert len(pids) == 2 and _states(pids, True) == ["T", "T"]
    finally:
        script.kill()
        script.wait()
        script.stdout.close()
    ended = _gone(pids)
    for p in pids if not ended else []:  # leave no stopped process behind a failure
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    assert ended, "a worker stopped by the killed script was left running or stopped"


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(signal, "SIGSTOP"), reason="needs /proc and SIGSTOP")
def test_the_guard_continues_every_group_it_holds_even_after_being_restarted():
    """The guard continues the groups it was given when its input ends, not the ones it was told
    to forget; a guard that was killed is replaced by one that learns every group still held."""
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
                for _ in range(3)]
    pids = [p.pid for p in sleepers]
    guard = ce.WorkerGuard()
    try:
        for pid in pids:
            os.killpg(pid, signal.SIGSTOP)
        guard.add(pids[0])
        guard.add(pids[1])
        first = guard.proc
        first.kill()
        first.wait()
        guard.add(pids[2])
        assert guard.proc is not first and guard.proc.poll() is None
        guard.discard(pids[2])
        guard.close()  # its input ends: what this script's exit does
        assert "T" not in _states(pids[:2], False)
        assert _states(pids[2:], True) == ["T"]  # forgotten: left as it was
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_termination_ends_a_run_as_ctrl_c_does(sig):
    """SIGTERM / SIGHUP raise KeyboardInterrupt in the script (the path that continues and closes
    the stopped workers and still writes the table), not a silent death."""
    code = (f"import os, signal, sys, time; sys.path.insert(0, {str(SCRIPT.parent)!r}); import compare_engines as ce\n"
            "ce.interrupt_on_termination()\n"
            "try:\n"
            f"    os.kill(os.getpid(), signal.{sig}); time.sleep(10); print('not interrupted')\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=wait_s(60))
    assert out.stdout.strip() == "interrupted", out.stderr


def test_vllm_gets_the_context_the_chosen_workloads_need(llama_dir):
    """vLLM's worker defaults to a 512-position context; the long workload's prompt alone is 2000
    ids, so its row asks for what the longest sequence reaches (in vLLM's 128-token blocks)."""
    for bench, wl in ce.FULL.items():  # the bound covers every prompt the seeded draw makes
        longest = max(map(len, ce.make_prompts(llama_dir, wl, 0))) + wl.output_len
        assert longest <= ce.longest_sequence(ce.FULL, [bench]) <= longest + wl.input_len * wl.range_ratio + 2
    assert ce.vllm_model_len(ce.FULL, ["W1", "W2"]) == 512
    assert ce.vllm_model_len(ce.FULL, ["W1", "long"]) == 2048
