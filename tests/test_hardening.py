"""Hardening, case by case: every bad input ends in one clear sentence (exit 2 or 1) or in a
per-request error line; interrupts, full disks and huge inputs leave valid, resumable JSONL.

The tiny random Llama (``llama_dir``, vocab 320, no tokenizer) serves every run; the default
model's GGUF is only read (its header and tokenizer), never run here.
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from tinyllm_cli.cache.blocks import BlockManager
from tinyllm_cli.cli import main
from tinyllm_cli.config import Config, SamplingConfig, build_config, load_config
from tinyllm_cli.engine.engine import LLMEngine
from tinyllm_cli.engine.request import Request
from tinyllm_cli.errors import UsageError
from tinyllm_cli.io import ALIASES, REQUEST_KEYS, SAMPLING_KEYS, RequestBuilder, check_prompt_file, read_records, record_id
from tinyllm_cli.model.checkpoint import default_model_path
from tinyllm_cli.openai_batch import BadLine, decode_line, parse_request
from conftest import wait_s

VOCAB = 320  # llama_dir's vocabulary
SUB_ENV = dict(os.environ, OMP_NUM_THREADS="1")  # subprocesses: no thread oversubscription on 2 cores


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """In-process runs on one thread: immune to another process busy on the second core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def assert_one_sentence(out: str, err: str, *needles: str) -> None:
    """The shape of every error path: nothing on stdout, exactly one line on stderr, no traceback."""
    assert out == "", out
    assert err.count("\n") == 1 and err.endswith("\n") and err.strip(), repr(err)
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


def jsonl(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def strip_metrics(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "metrics"} for r in rows]


def write_lines(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def id_rows(n: int, seed: int = 0, new=(4, 12), first_new: int | None = None) -> list[dict]:
    rnd = random.Random(seed)
    rows = [{"id": f"r{i}", "prompt_token_ids": [rnd.randrange(3, VOCAB) for _ in range(rnd.randrange(3, 14))],
             "max_new_tokens": rnd.randrange(*new)} for i in range(n)]
    if first_new is not None:
        rows[0]["max_new_tokens"] = first_new
    return rows


# ---- prompts file: missing, a directory, not UTF-8, empty -------------------------------------

@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing.jsonl", "does not exist"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "latin1.txt").write_bytes(b"caf\xe9\n") and d / "latin1.txt", "not UTF-8"),
])
def test_bad_prompts_file_exits_2_naming_it(capsys, tmp_path, llama_dir, make, needle):
    path = make(tmp_path)
    code, out, err = cli(capsys, "generate", "-p", path, "--model", llama_dir, "-q")
    assert code == 2
    assert_one_sentence(out, err, needle, repr(str(path)))


def test_empty_prompts_file_is_not_an_error(capsys, tmp_path, llama_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, out, err = cli(capsys, "generate", "-p", empty, "--model", llama_dir, "-q")
    assert (code, out, err) == (0, "", "")
    res = tmp_path / "out.jsonl"
    assert cli(capsys, "generate", "-p", empty, "--model", llama_dir, "-q", "-o", res)[0] == 0
    assert res.read_text() == ""


def test_stdin_line_that_is_not_utf8_is_one_error(capsys, monkeypatch, llama_dir):
    data = b'{"prompt_token_ids": [5, 6], "max_new_tokens": 2}\n\xff\xfe\n{"prompt_token_ids": [7], "max_new_tokens": 2}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbf" + data), encoding="utf-8"))
    code, out, err = cli(capsys, "generate", "-p", "-", "--model", llama_dir, "-q")
    rows = jsonl(out)
    assert code == 0 and [r["finish_reason"] for r in rows] == ["length", "error", "length"]
    assert "not UTF-8" in rows[1]["error"]


# ---- .jsonl lines: each problem is that request's error; the rest run ------------------------

BAD_LINES = [  # (line, words the error must contain)
    ("not json", "not valid JSON"),
    ("[1, 2, 3]", "not an object"),
    ('"just a string"', "not an object"),
    ('{"id": "none"}', "exactly one of"),
    ('{"id": "two", "prompt": "x", "prompt_token_ids": [5]}', "only one of"),
    ('{"id": "ids-str", "prompt_token_ids": "5 6"}', "list of integers"),
    ('{"id": "ids-bool", "prompt_token_ids": [5, true]}', "list of integers"),
    ('{"id": "ids-float", "prompt_token_ids": [5.0]}', "list of integers"),
    ('{"id": "prompt-int", "prompt": 5}', "must be a string"),
    ('{"id": "msgs", "messages": "hi"}', "'messages' must be"),
    ('{"id": "oov", "prompt_token_ids": [5, 320]}', "outside the vocabulary"),
    ('{"id": "neg", "prompt_token_ids": [-1]}', "outside the vocabulary"),
    ('{"id": "huge", "prompt_token_ids": [99999999999999999999999]}', "outside the vocabulary"),
    ('{"id": "empty", "prompt_token_ids": []}', "empty"),
    ('{"id": "temp", "prompt_token_ids": [5], "temperature": "hot"}', "temperature"),
    ('{"id": "nan", "prompt_token_ids": [5], "temperature": NaN}', "temperature"),
    ('{"id": "mnt", "prompt_token_ids": [5], "max_new_tokens": 0}', "max_new_tokens"),
    ('{"id": "stop", "prompt_token_ids": [5], "stop": [1]}', "stop"),
    ('{"id": "typo", "prompt_token_ids": [5], "temprature": 1}', "did you mean 'temperature'"),
    ('{"id": "text", "prompt": "hello"}', "no tokenizer"),
    ('{"id": "surrogate", "prompt": "\\ud800"}', "lone surrogate"),
]


def test_bad_jsonl_lines_become_error_results(capsys, tmp_path, llama_dir):
    good = {"prompt_token_ids": [5, 6, 7], "max_new_tokens": 3}
    rows = [dict(good, id="first")] + [line for line, _ in BAD_LINES] + [dict(good, id="last")]
    p = write_lines(tmp_path / "p.jsonl", rows)
    code, out, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, "-q", "--ignore-eos")
    assert code == 0 and err == ""
    res = jsonl(out)
    assert len(res) == len(rows)
    assert res[0]["finish_reason"] == res[-1]["finish_reason"] == "length"
    assert res[0]["num_output_tokens"] == res[-1]["num_output_tokens"] == 3
    for r, (line, needle) in zip(res[1:-1], BAD_LINES):
        assert r["finish_reason"] == "error" and needle in r["error"], (line, r["error"])
        assert r["token_ids"] == [] and "\n" not in r["error"]
    code, out, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, "-q", "--strict")
    assert code == 1 and len(jsonl(out)) == len(rows)


# ---- YAML config: exit 2, one sentence naming the key and its line, nothing loaded -----------

@pytest.mark.parametrize("yaml_text, needles", [
    ("cache:\n  block_size: [1\n", ["not valid YAML", "line 3"]),
    ("cache:\n  block_size: 8\n  bogus: 1\n", ["'cache.bogus'", "line 3"]),
    ("cache:\n  block_size: \"8\"\n", ["'cache.block_size'", "line 2", "an integer"]),
    ("cache:\n  block_size: -4\n", ["'cache.block_size'", "line 2", "positive"]),
    ("\ncache:\n  block_size: 0\n", ["'cache.block_size'", "line 3", "positive"]),
    ("cache:\n  num_blocks: 3\nscheduler:\n  max_num_seqs: 4\n", ["cache.num_blocks", "line 2", "max_num_seqs"]),
    ("cache:\n  num_blocks: 0\n", ["'cache.num_blocks'", "line 2"]),
    ("cache:\n  kv_memory: nan\n", ["cache.kv_memory", "line 2"]),
    ("cache:\n  kv_memory: 1e400GiB\n", ["cache.kv_memory", "line 2"]),
    ("sampling:\n  temperature: -1\n", ["'sampling.temperature'", "line 2"]),
    ("cache:\n  block_size: 4\n  block_size: 8\n", ["'cache.block_size'", "twice", "lines 2 and 3"]),
    ("- a\n- b\n", ["must be a mapping"]),
    ("cache: 5\n", ["'cache'", "line 1"]),
    ("dtype: int8\n", ["dtype", "line 1"]),
])
def test_config_errors_name_key_and_line(capsys, tmp_path, monkeypatch, llama_dir, yaml_text, needles):
    import tinyllm_cli.llm
    monkeypatch.setattr(tinyllm_cli.llm, "load_runtime", lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt_token_ids": [5]}])
    code, out, err = cli(capsys, "generate", "-p", prompts, "-c", cfg, "--model", llama_dir)
    assert code == 2
    assert_one_sentence(out, err, *needles)


def test_flag_out_of_range_names_the_flag(capsys, tmp_path, llama_dir):
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt_token_ids": [5]}])
    code, out, err = cli(capsys, "generate", "-p", prompts, "--model", llama_dir, "--block-size", -1)
    assert code == 2
    assert_one_sentence(out, err, "'cache.block_size'", "command-line flag")


# ---- model checkpoints: missing, truncated, unsupported ----------------------------------------

def _gguf(path: Path, arch="llama", dtype=np.float32, meta=True) -> Path:
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    if meta:
        w.add_block_count(1)
        w.add_embedding_length(8)
        w.add_head_count(2)
        w.add_head_count_kv(2)
        w.add_feed_forward_length(16)
        w.add_context_length(64)
        w.add_vocab_size(16)
    w.add_tensor("token_embd.weight", np.ones((16, 8), dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf_copy(tmp: Path, src: Path, name: str, config=None, truncate: int | None = None) -> Path:
    d = tmp / name
    shutil.copytree(src, d)
    if config is not None:
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config(c)))
    if truncate is not None:
        st_path = d / "model.safetensors"
        st_path.write_bytes(st_path.read_bytes()[:truncate])
    return d


def _truncated_default(tmp: Path, _src) -> Path:
    out = tmp / "smollm-truncated.gguf"
    with default_model_path().open("rb") as f:
        out.write_bytes(f.read(1 << 20))
    return out


# Every unusable local checkpoint exits 2, like a missing path: nothing ran, the --model was wrong.
MODEL_CASES = {
    "missing": (lambda tmp, src: tmp / "no-such-model", 2, "not found"),
    "not-a-model-file": (lambda tmp, src: (tmp / "w.bin").write_text("x") and tmp / "w.bin", 2, "neither"),
    "truncated-gguf": (_truncated_default, 2, "truncated or corrupt"),
    "empty-gguf": (lambda tmp, src: (tmp / "e.gguf").write_bytes(b"") or tmp / "e.gguf", 2, "empty"),
    "text-as-gguf": (lambda tmp, src: (tmp / "t.gguf").write_text("hello\n") and tmp / "t.gguf", 2, "not a GGUF"),
    "gguf-gpt2-arch": (lambda tmp, src: _gguf(tmp / "gpt2.gguf", arch="gpt2"), 2, "architecture 'gpt2'"),
    "gguf-i32-tensor": (lambda tmp, src: _gguf(tmp / "i32.gguf", dtype=np.int32), 2, "type I32"),
    "gguf-f64-tensor": (lambda tmp, src: _gguf(tmp / "f64.gguf", dtype=np.float64), 2, "type F64"),
    "gguf-no-metadata": (lambda tmp, src: _gguf(tmp / "bare.gguf", meta=False), 2, "lacks"),
    "truncated-safetensors": (lambda tmp, src: _hf_copy(tmp, src, "trunc", truncate=200_000), 2, "truncated"),
    "tiny-safetensors": (lambda tmp, src: _hf_copy(tmp, src, "tiny", truncate=5), 2, "truncated"),
    "hf-gpt2": (lambda tmp, src: _hf_copy(tmp, src, "gpt2", config=lambda c: c | {"model_type": "gpt2"}),
                2, "model_type 'gpt2'"),
    "hf-bad-dim": (lambda tmp, src: _hf_copy(tmp, src, "baddim", config=lambda c: c | {"hidden_size": "big"}),
                   2, "hidden_size"),
    "hf-shape-mismatch": (lambda tmp, src: _hf_copy(tmp, src, "shape", config=lambda c: c | {"hidden_size": 128}),
                          2, "shape"),
    "hf-config-list": (lambda tmp, src: _hf_copy(tmp, src, "list", config=lambda c: [c]), 2, "JSON object"),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_bad_model_one_sentence(capsys, tmp_path, llama_dir, case):
    make, want_code, needle = MODEL_CASES[case]
    model = make(tmp_path, Path(llama_dir))
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt_token_ids": [5]}])
    code, out, err = cli(capsys, "generate", "-p", prompts, "--model", model, "-q")
    assert code == want_code
    assert_one_sentence(out, err, needle)


# ---- lengths: too long, larger than the pool, max_new_tokens past max_model_len --------------

def test_length_limits_are_per_request(capsys, tmp_path, llama_dir):
    rows = [{"id": "long", "prompt_token_ids": list(range(3, 103))},
            {"id": "ok", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 4},
            {"id": "exactly-max", "prompt_token_ids": list(range(3, 67))},
            {"id": "overflow", "prompt_token_ids": list(range(3, 63)), "max_new_tokens": 1000}]
    p = write_lines(tmp_path / "p.jsonl", rows)
    code, out, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, "-q", "--max-model-len", 64,
                         "--ignore-eos")
    res = {r["id"]: r for r in jsonl(out)}
    assert code == 0 and err == ""
    assert res["long"]["finish_reason"] == "error" and "max_model_len" in res["long"]["error"]
    assert res["exactly-max"]["finish_reason"] == "error"
    assert res["ok"]["finish_reason"] == "length" and res["ok"]["num_output_tokens"] == 4
    over = res["overflow"]
    assert over["finish_reason"] == "length" and over["error"] is None
    assert over["num_prompt_tokens"] + over["num_output_tokens"] == 64


def test_request_larger_than_pool_and_pool_pressure_terminate(tmp_path, llama_dir):
    """16 KV slots in all: a prompt needing more is refused up front; sequences that outgrow the
    pool are preempted or stopped, never requeued forever (a subprocess with a timeout)."""
    rows = [{"id": "huge", "prompt_token_ids": list(range(3, 43))}] + \
           [{"id": f"g{i}", "prompt_token_ids": [5 + i, 6, 7], "max_new_tokens": 40} for i in range(4)]
    p = write_lines(tmp_path / "p.jsonl", rows)
    r = subprocess.run([sys.executable, "-m", "tinyllm_cli", "generate", "-p", str(p), "--model", str(llama_dir),
                        "-q", "--num-blocks", "4", "--block-size", "4", "--max-num-seqs", "2", "--ignore-eos"],
                       capture_output=True, text=True, timeout=wait_s(120), env=SUB_ENV)
    assert r.returncode == 0 and r.stderr == ""
    res = {x["id"]: x for x in jsonl(r.stdout)}
    assert list(res) == ["huge", "g0", "g1", "g2", "g3"]
    assert res["huge"]["finish_reason"] == "error" and "KV blocks" in res["huge"]["error"]
    for i in range(4):
        g = res[f"g{i}"]
        # Cut short by the pool: an error (that --strict counts), with the tokens it made.
        assert g["finish_reason"] == "error" and "pool" in g["error"] and 0 < g["num_output_tokens"] < 40
        assert g["num_prompt_tokens"] + g["num_output_tokens"] <= 17  # the pool, plus the unstored last token


# ---- KV budget beyond the machine --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_kv_budget_too_large_is_refused_before_allocating(capsys, tmp_path, llama_dir, kind):
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt_token_ids": [5]}])
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    code, out, err = cli(capsys, "generate", "-p", prompts, "--model", llama_dir, "-q", "--cache", kind,
                         "--kv-memory", "100000GiB")
    assert time.perf_counter() - t0 < wait_s(20)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 1 << 20  # KiB: < 1 GiB more
    assert code == 2
    # 100000 GiB = 102400000 MiB (the pool plus one scratch block/slot rounds to the same MiB)
    assert_one_sentence(out, err, "needs 102400000 MiB", "available")


# ---- Ctrl-C / SIGTERM mid-run, then --resume ---------------------------------------------------

@pytest.fixture(scope="module")
def long_run(tmp_path_factory, llama_dir):
    """A few seconds of work: 240 token-id prompts, up to 120 new tokens each, 8 at a time. The
    first prompt is short, so a result lands early. Returns (prompts, args, reference rows)."""
    d = tmp_path_factory.mktemp("long")
    prompts = write_lines(d / "p.jsonl", id_rows(240, seed=1, new=(20, 120), first_new=4))
    args = [sys.executable, "-m", "tinyllm_cli", "generate", "-p", str(prompts), "--model", str(llama_dir),
            "--ignore-eos", "-q", "--max-num-seqs", "8", "--block-size", "8"]
    ref = d / "ref.jsonl"
    subprocess.run(args + ["-o", str(ref)], check=True, timeout=wait_s(300), env=SUB_ENV)
    return prompts, args, jsonl(ref.read_text())


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_keeps_finished_results_and_resume_completes(tmp_path, long_run, sig, code):
    prompts, args, ref = long_run
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen(args + ["-o", str(out)], stderr=subprocess.PIPE, text=True, env=SUB_ENV)
    deadline = time.monotonic() + wait_s(120)
    while not (out.exists() and out.stat().st_size > 0):
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before any result was written"
        time.sleep(0.005)
    p.send_signal(sig)
    assert p.wait(timeout=wait_s(60)) == code
    err = p.stderr.read()
    assert err.count("\n") == 1 and "--resume" in err and "Traceback" not in err
    data = out.read_bytes()
    assert data.endswith(b"\n")  # no partial line
    rows = [json.loads(x) for x in data.splitlines()]  # every line is valid JSON
    assert 0 < len(rows) < len(ref), "the signal came after the run had finished"
    assert f" {len(rows)} finished results are in" in err
    by_id = {r["id"]: r for r in strip_metrics(ref)}
    assert all(by_id[r["id"]] == r for r in strip_metrics(rows))  # each result is the final one
    r = subprocess.run(args + ["-o", str(out), "--resume"], capture_output=True, text=True, timeout=wait_s(300), env=SUB_ENV)
    assert r.returncode == 0 and r.stderr == ""
    assert strip_metrics(jsonl(out.read_text())) == strip_metrics(ref)


def test_resume_puts_out_of_order_results_back_in_place(capsys, tmp_path, llama_dir):
    """An interrupt writes results that finished ahead of an earlier one after the in-order part;
    --resume moves them back, cuts a torn last line, and runs only what is missing."""
    p = write_lines(tmp_path / "p.jsonl", id_rows(7, seed=3))
    args = ["generate", "-p", p, "--model", llama_dir, "--ignore-eos", "-q"]
    full = tmp_path / "full.jsonl"
    assert cli(capsys, *args, "-o", full)[0] == 0
    lines = full.read_text().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    part.write_text(lines[0] + lines[1] + lines[5] + lines[3] + lines[6][:20])
    code, out, err = cli(capsys, *args, "-o", part, "--resume", "--stats-json", tmp_path / "s.json")
    assert (code, out, err) == (0, "", "")
    assert strip_metrics(jsonl(part.read_text())) == strip_metrics(jsonl(full.read_text()))
    assert json.loads((tmp_path / "s.json").read_text())["num_requests"] == 3  # r2, r4, r6 only


@pytest.mark.parametrize("content, needle", [
    ('{"id": "zzz", "text": null}\n', "not in"),  # results of another prompts file
    ('{"id": "r0"}\ngarbage\n{"id": "r1"}\n', "line 2"),  # damage that is not a torn last line
    ('{"no_id": 1}\n', "no 'id'"),
])
def test_resume_refuses_a_foreign_results_file(capsys, tmp_path, llama_dir, content, needle):
    p = write_lines(tmp_path / "p.jsonl", id_rows(3))
    res = tmp_path / "res.jsonl"
    res.write_text(content)
    code, out, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, "-q", "-o", res, "--resume")
    assert code == 2
    assert_one_sentence(out, err, "cannot resume", needle)
    assert res.read_text() == content  # untouched


# ---- output not writable, disk full --------------------------------------------------------------

@pytest.mark.parametrize("target, needle", [
    ("/dev/full", "No space left on device"),
    ("{tmp}/afile/out.jsonl", "Not a directory"),
    ("{tmp}/no-dir/out.jsonl", "No such file or directory"),
])
def test_unwritable_output_exit_1(capsys, tmp_path, llama_dir, target, needle):
    (tmp_path / "afile").write_text("x")
    p = write_lines(tmp_path / "p.jsonl", id_rows(3))
    target = target.format(tmp=tmp_path)
    code, out, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, "-q", "-o", target)
    assert code == 1
    assert_one_sentence(out, err, needle, target)


def test_serve_batch_disk_full_exit_1(capsys, tmp_path, llama_dir):
    inp = write_lines(tmp_path / "in.jsonl", [{"custom_id": "a", "url": "/v1/completions",
                                               "body": {"prompt": [5, 6], "max_tokens": 2}}])
    code, out, err = cli(capsys, "serve-batch", "-i", inp, "-o", "/dev/full", "--model", llama_dir, "-q")
    assert code == 1
    assert_one_sentence(out, err, "No space left on device")


def test_disk_full_mid_line_leaves_whole_lines(tmp_path, llama_dir):
    """A file-size limit (EFBIG, like ENOSPC: the OS takes part of a line, then refuses) stands in
    for a disk that fills up: exit 1, one sentence, and the file holds only whole result lines."""
    p = write_lines(tmp_path / "p.jsonl", id_rows(40))
    out = tmp_path / "out.jsonl"
    limit = 3000

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    r = subprocess.run([sys.executable, "-m", "tinyllm_cli", "generate", "-p", str(p), "--model", str(llama_dir),
                        "-q", "-o", str(out)], preexec_fn=small_disk, capture_output=True, text=True,
                       timeout=wait_s(120), env=SUB_ENV)
    assert r.returncode == 1
    assert_one_sentence(r.stdout, r.stderr, "cannot write results", "intact")
    data = out.read_bytes()
    assert 0 < len(data) <= limit and data.endswith(b"\n")
    rows = [json.loads(x) for x in data.splitlines()]
    assert [x["id"] for x in rows] == [f"r{i}" for i in range(len(rows))]
    assert f"the {len(rows)} result lines written before it are intact" in r.stderr


# ---- serve-batch: bad lines are error lines, the stream goes on ------------------------------

def test_serve_batch_bad_lines_get_error_lines(capsys, tmp_path, llama_dir):
    ok = lambda cid: {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": [5, 6, 7], "max_tokens": 2}}
    lines = [ok("a"), b"{oops", ok("b") | {"url": "/v1/embeddings"}, ok("a"), b"[1]", b"\xff\xfe", ok("c")]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    code, out, err = cli(capsys, "serve-batch", "-i", inp, "--model", llama_dir, "-q")
    assert code == 0 and err == ""
    res = {r["id"]: r for r in jsonl(out)}
    assert len(res) == len(lines)
    assert res["batch_req_1"]["error"] is None and res["batch_req_7"]["error"] is None
    assert res["batch_req_2"]["error"]["code"] == "invalid_json"
    assert res["batch_req_3"]["error"]["code"] == "invalid_url" and res["batch_req_3"]["custom_id"] == "b"
    assert res["batch_req_4"]["error"]["code"] == "duplicate_custom_id" and res["batch_req_4"]["custom_id"] is None
    assert res["batch_req_5"]["error"]["code"] == "invalid_json"
    assert "UTF-8" in res["batch_req_6"]["error"]["message"]


# ---- 10,000 prompts: flat memory, real ETA ----------------------------------------------------

def test_ten_thousand_prompts_flat_memory(capsys, tmp_path, llama_dir):
    """Peak Python memory (tracemalloc) of a 10,000-prompt run is within a small margin of a
    2,000-prompt run: input is streamed and outputs are written, not held. (Holding just the
    8,000 extra output lines as strings would take ~2.7 MB.)"""
    def prompts(n):
        return write_lines(tmp_path / f"p{n}.jsonl", ({"prompt_token_ids": [3 + i % 300, 5, 7]} for i in range(n)))

    def run(n):
        out = tmp_path / f"out{n}.jsonl"
        args = ["generate", "-p", prompts(n), "--model", llama_dir, "--max-new-tokens", 1, "--max-num-seqs", 256,
                "-q", "-o", out]
        tracemalloc.start()
        try:
            code, _, err = cli(capsys, *args)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert code == 0 and err == ""
        return peak, out

    cli(capsys, "generate", "-p", prompts(10), "--model", llama_dir, "--max-new-tokens", 1, "-q")  # warm imports
    small, _ = run(2000)
    big, out = run(10_000)
    with out.open() as f:
        n_lines = sum(1 for line in f if json.loads(line)["finish_reason"] == "length")
    assert n_lines == 10_000
    growth = big - small
    assert growth < 1_400_000, f"peak grew {growth} bytes ({growth / 8000:.0f} per extra prompt)"


def test_progress_bar_counts_the_prompts_first(capsys, tmp_path, llama_dir):
    p = write_lines(tmp_path / "p.jsonl", ["", *({"prompt_token_ids": [5, i + 3]} for i in range(37)), "  "])
    code, out, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, "--max-new-tokens", 1,
                         "-o", tmp_path / "o.jsonl")
    assert code == 0
    bar = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("generate:")]
    assert bar and all("/37 " in x for x in bar) and "37/37" in bar[-1]


# ---- fuzz: reader, builder, engine admission, serve parser, config ----------------------------

@pytest.fixture(scope="module")
def real_tokenizer(default_checkpoint):
    """The default model's tokenizer and chat template: the session's checkpoint's (loaded once
    for every module that needs the default model)."""
    return default_checkpoint.tokenizer


@pytest.fixture(scope="module")
def admit_engine(tiny_model):
    cache = BlockManager(tiny_model.cfg, 16, 4, torch.float32)
    return LLMEngine(tiny_model, cache, None, max_num_seqs=4, max_model_len=48)


SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
           | st.sampled_from(["\ud800", "a\udfffb", "<|im_start|>", "\x00", "\n"]))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=10)
FIELD = st.sampled_from(sorted(REQUEST_KEYS | SAMPLING_KEYS | set(ALIASES))) | st.text(max_size=8)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=20)}), max_size=3)
RECORD = (st.dictionaries(FIELD, JSON, max_size=5)
          | st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(-3, 400), max_size=8)},
                                  optional={k: JSON for k in sorted(SAMPLING_KEYS)})
          | st.fixed_dictionaries({"prompt": st.text(max_size=30)}, optional={"max_tokens": JSON, "stop": JSON})
          | st.fixed_dictionaries({"messages": MESSAGES | JSON}))
FUZZ_EXAMPLES = int(os.environ.get("TINYLLM_FUZZ_EXAMPLES", "150"))  # raise it for a longer hunt
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_request(req, index: int) -> None:
    assert isinstance(req, Request) and req.index == index
    if req.error is not None:
        assert isinstance(req.error, str) and req.error and "\n" not in req.error
        return
    assert all(isinstance(t, int) and not isinstance(t, bool) for t in req.prompt_token_ids)
    req.params.validate()


def build_all(path: str, builder: RequestBuilder) -> list[Request]:
    try:
        check_prompt_file(path)
    except UsageError:
        return []  # not UTF-8: the whole file is refused with one sentence (exit 2)
    reqs = []
    for n, (lineno, rec) in enumerate(read_records(path)):
        req = builder.build(n, lineno, rec, record_id(n, rec))
        check_request(req, n)
        reqs.append(req)
    return reqs


@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".jsonl", ".txt", ""]), with_tok=st.booleans())
def test_fuzz_prompt_reader_random_bytes(real_tokenizer, data, suffix, with_tok):
    builder = RequestBuilder(real_tokenizer if with_tok else None, True, SamplingConfig())
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"prompts{suffix}"
        path.write_bytes(data)
        build_all(str(path), builder)


@FUZZ
@given(records=st.lists(RECORD | JSON, min_size=1, max_size=5), with_tok=st.booleans(), chat=st.booleans())
def test_fuzz_prompt_reader_random_json(real_tokenizer, admit_engine, records, with_tok, chat):
    builder = RequestBuilder(real_tokenizer if with_tok else None, chat, SamplingConfig())
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        reqs = build_all(str(path), builder)
    assert len(reqs) == len(records)
    for req in reqs:  # the engine either admits a request or answers it with an error
        out = admit_engine.add_request(req)
        assert out is None or (out.finish_reason == "error" and out.error)
    admit_engine.scheduler.waiting.clear()


@settings(max_examples=max(10, FUZZ_EXAMPLES // 4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(st.fixed_dictionaries(
    {"prompt_token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)},
    optional={"temperature": st.floats(0, 1e6) | st.sampled_from([1e-320, float("inf")]),
              "top_p": st.floats(1e-9, 1.0), "top_k": st.integers(0, 2**70), "min_p": st.floats(0, 0.999),
              "repetition_penalty": st.floats(1e-9, 1e300) | st.just(float("inf")),
              "seed": st.integers(-2**70, 2**70), "stop_token_ids": st.lists(st.integers(-2**70, 2**70), max_size=3),
              "max_new_tokens": st.integers(1, 3)}), min_size=1, max_size=6))
def test_fuzz_valid_requests_run_to_an_answer(tiny_model, records):
    """Whatever sampling values pass validation, a batch runs to one answer per request."""
    builder = RequestBuilder(None, False, SamplingConfig(max_new_tokens=2))
    reqs = [builder.build(i, i + 1, r, i) for i, r in enumerate(records)]
    cache = BlockManager(tiny_model.cfg, 32, 4, torch.float32)
    engine = LLMEngine(tiny_model, cache, None, max_num_seqs=4, max_model_len=64)
    outs = list(engine.run(reqs))
    assert sorted(o.index for o in outs) == list(range(len(reqs)))
    for o in outs:
        assert o.finish_reason in ("stop", "length", "error") and all(0 <= t < VOCAB for t in o.token_ids)


SERVE_RECORD = st.fixed_dictionaries(
    {"custom_id": st.sampled_from(["a", "b", ""]) | JSON},
    optional={"method": st.sampled_from(["POST", "GET"]) | JSON,
              "url": st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]) | JSON,
              "body": st.fixed_dictionaries({}, optional={
                  "prompt": st.lists(st.integers(-3, 400), max_size=6) | st.text(max_size=20) | JSON,
                  "messages": MESSAGES | JSON, "max_tokens": JSON, "temperature": JSON, "stop": JSON,
                  "n": JSON, "stream": JSON, "seed": JSON, "stop_token_ids": JSON}) | JSON})


@FUZZ
@given(lines=st.lists(st.binary(max_size=80) | SERVE_RECORD.map(lambda r: json.dumps(r).encode()), max_size=5),
       with_tok=st.booleans())
def test_fuzz_serve_line_parser(real_tokenizer, lines, with_tok):
    builder = RequestBuilder(real_tokenizer if with_tok else None, False, SamplingConfig())
    seen: set[str] = set()
    for n, raw in enumerate(lines, 1):
        try:
            rec = decode_line(n, raw + b"\n")
            if rec is None:
                continue
            job = parse_request(n, rec, builder, seen)
        except BadLine as e:
            assert e.message and "\n" not in e.message and e.code
            continue
        check_request(job.request, n)


CONFIG_KEYS = st.sampled_from(["model", "device", "dtype", "cache", "scheduler", "sampling", "kind", "block_size",
                               "num_blocks", "kv_memory", "max_model_len", "prefix_caching", "max_num_seqs",
                               "max_prefill_tokens", "max_new_tokens", "temperature", "top_p", "stop", "seed"])
CONFIG = st.dictionaries(CONFIG_KEYS | st.text(max_size=6),
                         JSON | st.dictionaries(CONFIG_KEYS | st.text(max_size=6), JSON | st.integers(-5, 5), max_size=5),
                         max_size=6)


def _config_or_one_sentence(load) -> None:
    """A fuzzed config either loads as a Config or fails with a one-line UsageError."""
    try:
        cfg = load()
    except UsageError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert isinstance(cfg, Config)


@FUZZ
@given(data=CONFIG)
def test_fuzz_build_config(data):
    _config_or_one_sentence(lambda: build_config(data))


@FUZZ
@given(text=st.text(max_size=200) | CONFIG.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
       cut=st.integers(0, 200))
def test_fuzz_load_config_yaml_text(text, cut):
    text = text if cut > 150 else text[:cut]  # often a truncated file
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        _config_or_one_sentence(lambda: load_config(path))


def test_an_interrupt_a_c_extension_wrapped_is_still_an_interrupt(monkeypatch, capsys):
    """SIGINT raises Interrupted wherever the main thread is; inside Ray's Cython CoreWorker.wait
    it comes back as SystemError ("returned a result with an exception set") caused by it. The CLI
    must still end as an interrupt (exit 130, its one line), not as an internal error."""
    from tinyllm_cli import cli as cli_module
    from tinyllm_cli.errors import Interrupted

    def app(**_):
        try:
            raise Interrupted(signal.SIGINT)
        except Interrupted as e:
            raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from e

    monkeypatch.setattr(cli_module, "app", app)
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["generate"])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted by SIGINT"
