"""The serving comparison without its peers: the SLO and sustainable-rate arithmetic, a run made
invalid by a server that does less work, the command line and KV memory each server gets, the
server process (its readiness bound, its last words, the guard that kills it), the stored result
and its table, and one real sweep against ``tinyllm serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import Skip
from benchmarks.guard import GUARD
from benchmarks.machine import cpu_info
from benchmarks.report import write_into
from benchmarks.results import ResultError
from benchmarks.servers import (HOST, ServeSpec, ServerCommand, ServerProcess, free_port, kv_bytes_per_token,
                                kv_summary, llama_server_command, llama_slots, tinyllm_command, vllm_command)
from benchmarks.serving import parse_args, sweep
from benchmarks.serving_results import BEGIN, END, GOALS, load, record, render, validate, write
from benchmarks.sustain import SLO, Point, problems, should_stop, slo_ratio, sustainable

REPO = Path(__file__).resolve().parents[2]
SMOLLM = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


# ---- arithmetic ------------------------------------------------------------------------------

def _points(rates, ratio_of):
    return [Point(r, ratio_of(r)) for r in rates]


@pytest.mark.parametrize("capacity", [2.5, 3.0, 4.7])
def test_a_ratio_linear_in_the_rate_is_interpolated_to_where_it_reaches_one(capacity):
    """Where the SLO ratio grows linearly with the rate, the line through the bracketing runs is
    that line, so the interpolated rate is exactly where the ratio reaches 1."""
    got = sustainable(_points([1, 2, 3, 4, 6, 8], lambda r: r / capacity))
    assert got.how == "interpolated" and got.rate == pytest.approx(capacity)
    assert got.between[0] <= capacity <= got.between[1]


def test_the_first_miss_decides_and_the_ends_are_bounds():
    # a miss at 3 then a pass at 4 (noise): the sustainable rate lies below the first miss
    pts = [Point(1, 0.5), Point(2, 0.8), Point(3, 1.4), Point(4, 0.9)]
    got = sustainable(pts)
    assert got.between == (2, 3) and 2 < got.rate < 3
    assert sustainable([Point(1, 0.2), Point(2, 0.4)]).to_json() == {"rate": 2, "how": "at least", "between": None}
    assert sustainable([Point(1, 1.5), Point(2, 3.0)]).to_json() == {"rate": None, "how": "below", "between": [0.0, 1]}
    # a run that met the latencies but was invalid is no pass: the rate below is all that is known
    got = sustainable([Point(1, 0.3), Point(2, 0.6, valid=False)])
    assert (got.rate, got.how, got.between) == (1, "at least", (1, 2))


def test_a_sweep_stops_after_two_misses_in_a_row():
    assert not should_stop([Point(1, 0.5), Point(2, 1.2)])
    assert not should_stop([Point(1, 1.2), Point(2, 0.9)])
    assert should_stop([Point(1, 0.5), Point(2, 1.2), Point(3, 1.5)])


def test_the_slo_ratio_is_the_worse_p90_over_its_limit_as_numpy_computes_it():
    from tinyllm_cli.loadgen.records import RequestRecord, summarize
    rng = np.random.default_rng(0)
    records = []
    for i in range(50):
        ttft, tpot = float(rng.uniform(0.1, 3.0)), float(rng.uniform(0.05, 0.25))
        records.append(RequestRecord(i, 0.0, sent_s=0.0, prompt_tokens=128, output_tokens=64, ttft_s=ttft,
                                     tpot_s=tpot, latency_s=ttft + 63 * tpot))
    want = max(np.percentile([r.ttft_s for r in records], 90) / SLO["ttft_s"],
               np.percentile([r.tpot_s for r in records], 90) / SLO["tpot_s"])
    assert slo_ratio(summarize(records, 10.0)) == pytest.approx(want)
    assert slo_ratio({"ttft_s": {"p90": None}, "tpot_s": {"p90": None}}) is None


def test_a_server_that_stops_early_or_fails_makes_its_run_invalid():
    good = {"error": None, "latency_s": 1.0, "prompt_tokens": 128, "output_tokens": 64}
    assert problems([good] * 3, 128, 64) == []
    early = good | {"output_tokens": 12}
    failed = good | {"error": "HTTP 500: boom", "latency_s": None}
    why = problems([good, early, failed, good | {"prompt_tokens": 129}], 128, 64)
    assert len(why) == 3
    assert why[0].startswith("1 of 4 requests failed (HTTP 500: boom)")
    assert "1 of 3 answers had other than 64 output tokens (from 12 to 12)" in why[1]
    assert "other than 128 tokens" in why[2]


# ---- what each server is given ---------------------------------------------------------------

def test_every_server_gets_the_same_kv_bytes_threads_precision_and_loopback(tmp_path, llama_dir):
    """KV per token as tinyllm's own cache allocates it; llama-server's slots hold the others'
    bytes to within one slot; vLLM's whole GiB; 2 threads and float32 everywhere; 127.0.0.1."""
    import torch
    from tinyllm_cli.cache.blocks import token_bytes
    from tinyllm_cli.model.checkpoint import load_checkpoint
    cfg = json.loads((llama_dir / "config.json").read_text())
    assert kv_bytes_per_token(cfg) == token_bytes(load_checkpoint(str(llama_dir), progress=False).config, torch.float32)
    per_token = kv_bytes_per_token(SMOLLM)
    assert per_token == 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head_dim x float32
    spec = ServeSpec(kv_gib=1, max_model_len=512)
    t = tinyllm_command("python", tmp_path, 8001, spec)
    v = vllm_command(tmp_path / "bin" / "python", tmp_path, 8002, spec)
    ll = llama_server_command(tmp_path, tmp_path / "m.gguf", 8003, spec, per_token)
    arg = lambda c, flag: c.argv[c.argv.index(flag) + 1]  # noqa: E731
    slots, ctx = int(arg(ll, "--parallel")), int(arg(ll, "-c"))
    assert ctx == slots * 512 and spec.kv_bytes - 512 * per_token < ctx * per_token <= spec.kv_bytes
    assert arg(t, "--kv-memory") == "1GiB" and v.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and arg(ll, "-t") == arg(ll, "-tb") == "2"
    assert all(c.env["OMP_NUM_THREADS"] == "2" for c in (t, ll)) and "OMP_NUM_THREADS" not in v.env
    assert arg(t, "--dtype") == arg(v, "--dtype") == "float32"
    assert arg(ll, "--cache-type-k") == arg(ll, "--cache-type-v") == "f32" and "--cont-batching" in ll.argv
    assert all(arg(c, "--host") == HOST == "127.0.0.1" for c in (t, v, ll))
    assert arg(t, "--max-model-len") == arg(v, "--max-model-len") == "512"
    kv = kv_summary(spec, per_token)
    assert kv["llamacpp"]["tokens"] == ctx and kv["tinyllm"]["bytes"] == kv["vllm"]["bytes"] == 1 << 30
    with pytest.raises(Skip, match="holds no"):
        llama_slots(ServeSpec(kv_gib=1, max_model_len=1 << 20), per_token)


# ---- the server process ----------------------------------------------------------------------

def test_a_server_that_exits_before_answering_is_skipped_with_its_last_words(tmp_path):
    cmd = ServerCommand("fake", [sys.executable, "-c", "import sys; print('error: no such model'); sys.exit(3)"])
    server = ServerProcess(cmd, free_port(), tmp_path / "s.log")
    with pytest.raises(Skip, match=r"exited with status 3 before it answered: error: no such model"):
        server.wait_ready(poll_s=0.05)


def test_a_server_that_never_answers_is_skipped_at_its_bound_and_its_group_ended(tmp_path):
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " \
           "print('loading', flush=True); time.sleep(120)"
    server = ServerProcess(ServerCommand("fake", [sys.executable, "-c", code], ready_timeout_s=1.0), free_port(),
                           tmp_path / "s.log")
    deadline = time.monotonic() + 60  # its first line out (a loaded host can take seconds to start Python)
    while "loading" not in (tmp_path / "s.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(Skip, match="did not answer within 1 s: loading"):
        server.wait_ready(poll_s=0.05)
    assert server.proc.returncode is not None
    if Path("/proc/self/stat").exists():  # nothing of its group is left running (the child it started included)
        deadline = time.monotonic() + 20
        while _group_alive(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(server.proc.pid)


def _stat(pid) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [p for p in pids if (st := _stat(p)) and st[0] != "Z" and int(st[2]) == pgid]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_server_outlives_no_comparison_killed_outright(tmp_path):
    """SIGKILL gives the comparison no chance to stop its server: the guard kills its group."""
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
            "from pathlib import Path\n"
            "from benchmarks.servers import ServerCommand, ServerProcess, free_port\n"
            "cmd = ServerCommand('fake', [sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            f"s = ServerProcess(cmd, free_port(), Path({str(tmp_path / 's.log')!r}))\n"
            "print(s.proc.pid, flush=True)\n"
            "time.sleep(300)\n")
    script = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(script.stdout.readline())
        assert _alive(pid)
    finally:
        script.kill()
        script.wait()
        script.stdout.close()
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the server was left running after its comparison was killed")


# ---- stored results and the table ------------------------------------------------------------

def _rate(rate, ttft90, tpot90, valid=True):
    pct = lambda p90: {"p50": p90 / 2, "p90": p90, "p99": p90, "mean": p90 / 2}  # noqa: E731
    return {"rate": rate, "num_requests": 10, "num_completed": 10, "num_failed": 0, "requests_per_s": rate * 0.9,
            "output_tokens_per_s": rate * 57.6, "total_tokens_per_s": rate * 172.8, "output_tokens": 640,
            "ttft_s": pct(ttft90), "tpot_s": pct(tpot90), "latency_s": pct(ttft90 + 63 * tpot90),
            "send_lag_p99_s": 0.01, "goodput_req_per_s": rate, "slo_ratio": max(ttft90 / 2, tpot90 / 0.2),
            "valid": valid, "problems": [] if valid else ["1 of 10 answers had other than 64 output tokens"]}


def _sweep(engine, rates, text="a b c", gbps=None):
    pts = [Point(r["rate"], r["slo_ratio"], r["valid"]) for r in rates]
    out = {"engine": engine, "command": f"{engine}-server --port 1", "rates": rates, "ready_s": 3.0,
           "greedy": [{"text": text, "tokens": 16}, {"text": "x", "tokens": 16}], "loadavg_before": [1.0, 1, 1],
           "loadavg_after": [2.0, 1, 1], "sustainable": sustainable(pts).to_json()}
    if gbps:  # results stored before the bandwidth was recorded have none
        out |= {"read_gbps_before": gbps[0], "read_gbps_after": gbps[1]}
    return out


def _record(sweeps, notes=None):
    a = parse_args(["--cache-dir", "/tmp/x", "--rates", "1,2,4"])
    spec = ServeSpec()
    return record(a, ["--cache-dir", "/tmp/x"], datetime(2026, 12, 6, 3, 0, tzinfo=timezone.utc), "abc1234",
                  cpu_info(), {"python": "3.11"}, spec, kv_summary(spec, 46080), sweeps, notes or {})


def _linear(rates, capacity, **kw):
    """Rates whose SLO ratio is rate / capacity (p90 TTFT the binding metric): sustainable at capacity."""
    return [_rate(r, 2.0 * r / capacity, 0.1 * r / capacity, **kw) for r in rates]


def test_a_stored_result_renders_its_rates_ratios_and_goals(tmp_path):
    tiny = _sweep("tinyllm", _linear([1, 2, 4], 3.0), gbps=(72.4, 40.1))
    vllm = _sweep("vllm", _linear([1, 2], 1.5), text="a b d")
    llama = _sweep("llamacpp", _linear([1, 2, 4], 2.6), text="a b \ufffdc")  # an undecodable byte shown
    path = write(_record([tiny, vllm, llama], {"x": "a note"}), tmp_path)
    stored = load(tmp_path)
    assert [s["agree"] for s in stored[0]["sweeps"]] == [[2, 2], [1, 2], [2, 2]]
    text = render(stored)
    assert "| tinyllm serve | 3.00 | 2 and 4 |" in text and "| 1.50 | 1 and 2 |" in text and "| 2.60 |" in text
    assert f"{3.0 / 1.5:.2f}x (goal met)" in text and 3.0 / 1.5 >= GOALS["vllm"]
    assert f"{3.0 / 2.6:.2f}x (goal {GOALS['llamacpp']}x missed)" in text and 3.0 / 2.6 < GOALS["llamacpp"]
    assert "1/2 with tinyllm" in text and "x: a note." in text
    assert "| 1.00 → 2.00 | 72 → 40 |" in text and "| 1.00 → 2.00 | not recorded |" in text
    assert write(_record([tiny]), tmp_path) != path  # a new file, never over the old one


def test_an_invalid_run_is_shown_and_a_broken_file_is_refused_by_name(tmp_path):
    bad = _sweep("vllm", [_rate(1, 0.5, 0.05), _rate(2, 0.5, 0.05, valid=False)])
    text = render([_record([_sweep("tinyllm", [_rate(1, 0.5, 0.05)]), bad])])
    assert "no: 1 of 10 answers had other than 64 output tokens" in text
    assert "≥ 1.00" in text and "≤ 1.00x" in text  # tinyllm at least 1, vLLM at least 1: no verdict
    rec = _record([bad])
    del rec["sweeps"][0]["sustainable"]
    with pytest.raises(ResultError, match="the record: sweep 0: no sustainable rate"):
        validate(rec, "the record")
    (tmp_path / "broken.json").write_text(json.dumps({"kind": "serving", "schema": 1}))
    with pytest.raises(ResultError, match="broken.json: no recorded"):
        load(tmp_path)


def test_the_report_fills_the_serving_block_of_a_document(tmp_path):
    write(_record([_sweep("tinyllm", [_rate(1, 0.5, 0.05), _rate(2, 4.0, 0.3)])]), tmp_path / "serving")
    doc = tmp_path / "doc.md"
    doc.write_text(f"# x\n\n{BEGIN}\nold\n{END}\n\ntail\n")
    write_into(doc, [], tmp_path / "serving")
    out = doc.read_text()
    assert "old" not in out and "tinyllm serve" in out and out.endswith("tail\n")


# ---- one real sweep --------------------------------------------------------------------------

def test_a_sweep_against_tinyllm_serve_counts_every_token_and_stops_the_server(tmp_path):
    """The default model through ``tinyllm serve``: greedy texts, every request's exact token
    counts (ignore_eos and max_tokens honoured), the sustainable rate from the rows, the server
    gone afterwards."""
    from benchmarks.models import default_gguf
    a = parse_args(["--cache-dir", str(tmp_path), "--servers", "tinyllm", "--rates", "0.5,1", "--duration", "4",
                    "--input-len", "24", "--output-len", "6", "--max-model-len", "64"])
    out = sweep("tinyllm", {"model_dir": default_gguf()}, a, ServeSpec(kv_gib=1, max_model_len=64), 0, tmp_path)
    assert [r["rate"] for r in out["rates"]] == [0.5, 1.0]
    for r in out["rates"]:
        assert r["valid"], r["problems"]
        report = json.loads((tmp_path / f"tinyllm-{r['rate']:g}.json").read_text())
        records = report["runs"][0]["records"]
        assert len(records) >= 1 and all(x["scheduled_s"] <= 4 for x in records)  # 4 s of arrivals
        assert r["num_completed"] == len(records) and r["output_tokens"] == 6 * len(records)
        assert [x["output_tokens"] for x in records] == [6] * len(records)
    assert len(out["greedy"]) == 8 and all(g["tokens"] == 16 and g["text"] for g in out["greedy"])
    pts = [Point(r["rate"], r["slo_ratio"], r["valid"]) for r in out["rates"]]
    assert out["sustainable"] == sustainable(pts).to_json()
    port = int(out["command"].split("--port ")[1].split()[0])
    with pytest.raises(OSError):
        import socket
        socket.create_connection((HOST, port), timeout=5).close()
    GUARD.close()
