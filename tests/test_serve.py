"""serve-batch: OpenAI Batch API lines in as a stream, results out in completion order."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading

import pytest

from tinyllm_cli.cli import main
from tinyllm_cli.workload import poisson_gaps

from conftest import wait_s

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FAST = ["--device", "cpu", "--num-blocks", "128", "--max-new-tokens", "8"]


def line(cid, url=COMPLETIONS, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"


def ids(n: int, start: int = 5) -> list[int]:
    return [1] + [start + i for i in range(n - 1)]


def serve(capsys, tmp_path, lines: list[str], *args) -> tuple[list[dict], str]:
    """Run ``serve-batch`` in this process on ``lines``; return (result objects, stderr)."""
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(lines))
    with pytest.raises(SystemExit) as e:
        main(["serve-batch", "--input", str(inp), *args])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    return [json.loads(x) for x in out.splitlines()], err


def by_cid(results: list[dict]) -> dict:
    return {r["custom_id"]: r for r in results if r["custom_id"] is not None}


def check_completion(r: dict, n_prompt: int, n_out: int | None = None) -> dict:
    assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
    assert r["id"].startswith("batch_req_")
    resp = r["response"]
    assert resp["status_code"] == 200 and resp["request_id"] == "req_" + r["id"].removeprefix("batch_req_")
    body = resp["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int) and isinstance(body["model"], str)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["prompt_tokens"] == n_prompt and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if n_out is not None:
        assert u["completion_tokens"] == n_out
    return choice


# ---- tiny random model (no tokenizer: token-id prompts) -------------------------------------

class Serving:
    """``serve-batch`` in a subprocess reading stdin; result lines are read with a timeout."""

    def __init__(self, model_dir):
        self.p = subprocess.Popen([sys.executable, "-m", "tinyllm_cli", "serve-batch", "--model", str(model_dir),
                                   *FAST, "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for x in self.p.stdout:
            self.lines.put(x)

    def send(self, *lines: str) -> None:
        self.p.stdin.write("".join(lines))
        self.p.stdin.flush()

    def read(self, n: int, timeout: float | None = None) -> list[dict]:
        timeout = wait_s(60) if timeout is None else timeout
        try:
            return [json.loads(self.lines.get(timeout=timeout)) for _ in range(n)]
        except queue.Empty:
            self.p.kill()
            pytest.fail(f"no result line within {timeout} s; stderr: {self.p.stderr.read()}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def test_streaming_stdin_answers_before_later_lines_are_written(llama_dir):
    """Results for the first requests come out while stdin is still open and nothing else was sent."""
    with Serving(llama_dir) as s:
        s.send(line("early-1", prompt=ids(4), max_tokens=4, ignore_eos=True),
               line("early-2", prompt=ids(6), max_tokens=3, ignore_eos=True))
        first = s.read(2)
        assert {r["custom_id"] for r in first} == {"early-1", "early-2"}
        assert s.p.poll() is None  # still serving, stdin still open
        s.send(*(line(f"late-{i}", prompt=ids(3 + i), max_tokens=2, ignore_eos=True) for i in range(3)))
        s.p.stdin.close()
        rest = s.read(3)
        assert s.p.wait(timeout=wait_s(60)) == 0
        assert s.lines.empty() and "Traceback" not in s.p.stderr.read()
    assert {r["custom_id"] for r in rest} == {"late-0", "late-1", "late-2"}
    for r in first + rest:
        check_completion(r, r["response"]["body"]["usage"]["prompt_tokens"])


def test_ctrl_c_keeps_finished_lines(llama_dir):
    with Serving(llama_dir) as s:
        s.send(line("a", prompt=ids(4), max_tokens=2))
        (first,) = s.read(1)
        s.p.send_signal(signal.SIGINT)
        assert s.p.wait(timeout=wait_s(60)) == 130
        err = s.p.stderr.read()
    assert first["custom_id"] == "a" and first["error"] is None
    assert "1 finished results are already written" in err and s.lines.empty()


def test_error_lines_and_the_rest_answered(capsys, tmp_path, llama_dir):
    lines = [
        line("ok-1", prompt=ids(5), max_tokens=4, ignore_eos=True),
        "{not json\n",
        "[1, 2]\n",
        line("bad-url", url="/v1/embeddings", input="x"),
        line("ok-1", prompt=ids(3)),  # duplicate
        line("too-long", prompt=ids(40)),  # max_model_len is 32
        line("bad-temp", prompt=ids(3), temperature="hot"),
        line("n0", prompt=ids(3), n=0),
        line("stream", prompt=ids(3), stream=True),
        line("bad-prompt", prompt=[[1, 2], [3]]),
        line("no-chat-template", url=CHAT, messages=[{"role": "user", "content": "hi"}]),
        line("oov", prompt=[1, 99999]),
        json.dumps({"method": "POST", "url": COMPLETIONS, "body": {"prompt": [1]}}) + "\n",
        json.dumps({"custom_id": "no-body", "method": "POST", "url": COMPLETIONS}) + "\n",
        "\n",
        line("ok-2", prompt=ids(7), max_tokens=2, ignore_eos=True, model="gpt-4o", user="u1"),
    ]
    results, _ = serve(capsys, tmp_path, lines, "--model", str(llama_dir), *FAST, "--max-model-len", "32", "-q")
    assert len(results) == len(lines) - 1  # one line per non-blank input line
    assert len({r["id"] for r in results}) == len(results)
    errors = [r for r in results if r["error"] is not None]
    assert all(r["response"] is None and set(r["error"]) == {"code", "message"} for r in errors)
    assert all(r["error"]["message"].count(". ") == 0 for r in errors)  # one sentence each
    codes = {r["id"]: r["error"]["code"] for r in errors}
    assert codes["batch_req_2"] == codes["batch_req_3"] == "invalid_json"
    assert codes["batch_req_5"] == "duplicate_custom_id"
    cids = by_cid(errors)
    assert cids["bad-url"]["error"]["code"] == "invalid_url"
    assert "max_model_len" in cids["too-long"]["error"]["message"]
    assert "temperature" in cids["bad-temp"]["error"]["message"]
    assert "n must be an integer >= 1" in cids["n0"]["error"]["message"]
    assert "stream" in cids["stream"]["error"]["message"]
    assert "vocabulary" in cids["oov"]["error"]["message"]
    for cid in ("too-long", "bad-temp", "n0", "stream", "bad-prompt", "no-chat-template", "oov", "no-body"):
        assert cids[cid]["error"]["code"] == "invalid_request", cid
    assert [r for r in errors if r["id"] == "batch_req_13"][0]["custom_id"] is None  # no custom_id
    assert [r for r in errors if r["id"] == "batch_req_5"][0]["custom_id"] is None  # the duplicate
    ok = by_cid([r for r in results if r["error"] is None])
    assert set(ok) == {"ok-1", "ok-2"}
    assert check_completion(ok["ok-1"], 5, 4)["token_ids"] and ok["ok-1"]["id"] == "batch_req_1"
    check_completion(ok["ok-2"], 7, 2)


def test_completion_order_shape_and_defaults(capsys, tmp_path, llama_dir):
    lines = [line("slow", prompt=ids(4), max_tokens=12, ignore_eos=True),
             line("fast", prompt=ids(4), max_completion_tokens=1, ignore_eos=True),
             line("default-len", prompt=ids(6), ignore_eos=True),  # --max-new-tokens 8 from the flags
             line("sampled", prompt=ids(4), max_tokens=5, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05,
                  repetition_penalty=1.1, seed=3, ignore_eos=True),
             line("one-of-a-list", prompt=[ids(3)], max_tokens=2, stop=None, temperature=None)]
    results, _ = serve(capsys, tmp_path, lines, "--model", str(llama_dir), *FAST, "-q")
    assert [r["custom_id"] for r in results][0] == "fast"  # completion order, not input order
    assert results[-1]["custom_id"] == "slow"
    r = by_cid(results)
    assert check_completion(r["slow"], 4, 12)["finish_reason"] == "length"
    check_completion(r["fast"], 4, 1)
    check_completion(r["default-len"], 6, 8)
    choice = check_completion(r["sampled"], 4, 5)
    assert choice["text"] is None and len(choice["token_ids"]) == 5  # no tokenizer: ids given
    check_completion(r["one-of-a-list"], 3)


def test_request_rate_paces_arrivals(capsys, tmp_path, llama_dir):
    rate, n = 50.0, 5
    lines = [line(f"r{i}", prompt=ids(4 + i), max_tokens=2, ignore_eos=True) for i in range(n)]
    stats = tmp_path / "stats.json"
    results, err = serve(capsys, tmp_path, lines, "--model", str(llama_dir), *FAST,
                         "--request-rate", str(rate), "--stats-json", str(stats))
    assert sorted(r["custom_id"] for r in results) == [f"r{i}" for i in range(n)]
    assert all(r["error"] is None for r in results)
    s = json.loads(stats.read_text())
    for key in ("num_requests", "output_tokens", "ttft_s", "tpot_s", "latency_s"):
        assert key in s
    assert s["num_requests"] == n and s["output_tokens"] == 2 * n and s["request_rate"] == rate
    assert set(s["ttft_s"]) >= {"p50", "p90", "p99"}
    gaps = poisson_gaps(rate, 0)
    assert s["elapsed_s"] >= sum(next(gaps) for _ in range(n - 1)) * 0.99  # the last arrival is that late
    assert "TTFT" in err and "result lines (error lines)" in err  # the table, on stderr


def test_max_inflight_one_completes_everything(capsys, tmp_path, llama_dir):
    lines = [line(f"m{i}", prompt=ids(3 + i), max_tokens=3, ignore_eos=True) for i in range(6)]
    lines.insert(2, line("too-long", prompt=ids(40)))
    stats = tmp_path / "stats.json"
    results, _ = serve(capsys, tmp_path, lines, "--model", str(llama_dir), *FAST, "--max-model-len", "32",
                       "--max-inflight", "1", "--stats-json", str(stats), "-q")
    ok = [r["custom_id"] for r in results if r["error"] is None]
    assert ok == [f"m{i}" for i in range(6)]  # one at a time, so in input order
    s = json.loads(stats.read_text())
    assert s["peak_inflight"] == 1 and s["peak_running"] == 1 and s["max_inflight"] == 1
    assert s["error_lines"] == 1 and s["result_lines"] == 7 and s["input_lines"] == 7


def test_missing_input_and_unwritable_output(capsys, tmp_path, llama_dir):
    with pytest.raises(SystemExit) as e:
        main(["serve-batch", "--input", str(tmp_path / "nope.jsonl"), "--model", str(llama_dir), *FAST])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    inp = tmp_path / "in.jsonl"
    inp.write_text(line("a", prompt=ids(3)))
    with pytest.raises(SystemExit) as e:
        main(["serve-batch", "--input", str(inp), "--output", str(tmp_path / "no-dir" / "out.jsonl"),
              "--model", str(llama_dir), *FAST])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "cannot open output file" in err and err.count("\n") == 1


def test_output_file(capsys, tmp_path, llama_dir):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(line("a", prompt=ids(3), max_tokens=2) + "oops\n")
    with pytest.raises(SystemExit) as e:
        main(["serve-batch", "-i", str(inp), "-o", str(out), "--model", str(llama_dir), *FAST, "-q"])
    assert e.value.code == 0 and capsys.readouterr().out == ""
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["error"] is None for r in results) == [False, True]


# ---- the real default model (text prompts, chat template) ------------------------------------

def test_default_model_completions_and_chat(capsys, tmp_path):
    q = "What is the capital of France?"
    lines = [line("chat", url=CHAT, model="gpt-4o-mini", messages=[{"role": "user", "content": q}],
                  max_completion_tokens=16),
             line("chat-parts", url=CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": q}]}],
                  max_tokens=16, stop="Paris"),
             line("plain", prompt="The capital of France is", max_tokens=4)]
    results, _ = serve(capsys, tmp_path, lines, "--model", "default", *FAST, "-q")
    r = by_cid(results)
    assert set(r) == {"chat", "chat-parts", "plain"} and all(x["error"] is None for x in results)
    body = r["chat"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] > 0
    stopped = r["chat-parts"]["response"]["body"]["choices"][0]
    assert stopped["finish_reason"] == "stop" and "Paris" not in stopped["message"]["content"]
    assert r["chat-parts"]["response"]["body"]["usage"]["prompt_tokens"] == u["prompt_tokens"]
    plain = check_completion(r["plain"], r["plain"]["response"]["body"]["usage"]["prompt_tokens"])
    assert isinstance(plain["text"], str) and "Paris" in plain["text"] and "token_ids" not in plain
    # a plain completion is not wrapped in the chat template
    assert r["plain"]["response"]["body"]["usage"]["prompt_tokens"] < 10 < u["prompt_tokens"]


class _RecordingEngine:
    """What ``Server.release`` / ``finish`` use of an engine; records each request's arrival."""

    def __init__(self):
        self.added = []

    def add_request(self, req):
        self.added.append((req.id, req.arrival))


def _server(limit):
    from types import SimpleNamespace
    from tinyllm_cli.commands.serve_batch import Server
    from tinyllm_cli.engine.request import Request, SamplingParams
    from tinyllm_cli.openai_batch import Job
    eng = _RecordingEngine()
    srv = Server(SimpleNamespace(engine=eng), None, None, "m", None, limit, 0)
    job = lambda cid, due: Job(1, cid, "/v1/completions", Request(cid, [1, 2], SamplingParams()), due, due)
    return srv, eng, job


def test_arrival_is_when_due_not_when_released():
    """A request due mid-step enters the engine after the step, but its TTFT counts from when it
    was due (as the simulator counts it)."""
    import time
    srv, eng, job = _server(None)
    t = time.perf_counter()
    srv.backlog.extend([job("a", t - 0.5), job("b", t - 0.2)])
    srv.release()
    assert eng.added == [("a", t - 0.5), ("b", t - 0.2)]


def test_arrival_held_back_by_max_inflight_counts_from_room():
    """Time held back by --max-inflight is not counted: arrival = when room opened."""
    import time
    from types import SimpleNamespace
    srv, eng, job = _server(1)
    t = time.perf_counter()
    srv.backlog.extend([job("a", t - 1.0), job("b", t - 0.9)])
    srv.release()  # room for one
    assert eng.added == [("a", t - 1.0)]
    srv.writer = type("W", (), {"write": lambda self, line, error=False: None})()
    srv.finish(SimpleNamespace(id="a", finish_reason="error", error="cut short"))  # room opens now
    srv.release()
    (cid, arrival), = eng.added[1:]
    assert cid == "b" and arrival >= t  # from the moment "a" finished, not from b's due time
