"""``tinyllm serve`` under faults: a full waiting room, SIGTERM and SIGINT, keys and addresses,
an engine that breaks mid-stream, and Ray workers that die. Most use the tiny random model
(token-id prompts), so a server starts in seconds."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serving_util import ROOT, START_S, ServerProc  # noqa: E402

IDS = [5, 6, 7, 8, 9]


def stream_lines(url: str, body: dict, out: list, started: threading.Event | None = None) -> None:
    """Read an SSE stream into ``out`` (data payloads); ``started`` is set at the first chunk."""
    try:
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=START_S) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    if started is not None:
                        started.set()
    except httpx.HTTPError as e:
        out.append(e)
    finally:
        if started is not None:
            started.set()


def tokens_of(payloads: list) -> list[int]:
    ids = []
    for p in payloads:
        if isinstance(p, str) and p != "[DONE]":
            for c in json.loads(p).get("choices", []):
                ids += c.get("token_ids") or []
    return ids


def test_a_full_waiting_room_answers_429_with_retry_after(llama_dir):
    with ServerProc("--model", llama_dir, "--max-num-seqs", 1, "--max-waiting", 1, "-q") as s:
        url = s.v1 + "/completions"
        body = {"prompt": IDS, "max_tokens": 400, "ignore_eos": True}
        first, started = [], threading.Event()
        t = threading.Thread(target=stream_lines, args=(url, body, first, started))
        t.start()
        assert started.wait(START_S)
        codes, headers = [], []

        def post():
            r = httpx.post(url, json=body | {"max_tokens": 4}, timeout=START_S)
            codes.append(r.status_code)
            headers.append(r.headers.get("retry-after"))
        posts = [threading.Thread(target=post) for _ in range(6)]
        for p in posts:
            p.start()
        for p in posts:
            p.join()
        t.join()
        assert 429 in codes and 200 in codes, codes
        assert all(h == "1" for c, h in zip(codes, headers) if c == 429)
        assert first[-1] == "[DONE]"
        assert s.metrics()["tinyllm:requests_rejected_total"] == codes.count(429)


def test_sigterm_drains_running_streams_then_exits_0(llama_dir):
    with ServerProc("--model", llama_dir, "--max-num-seqs", 2, "--drain-timeout", 300) as s:
        url = s.v1 + "/completions"
        out, started = [], threading.Event()
        t = threading.Thread(target=stream_lines, args=(url, {"prompt": IDS, "max_tokens": 300, "ignore_eos": True},
                                                        out, started))
        t.start()
        assert started.wait(START_S)
        s.signal(signal.SIGTERM)
        t.join(START_S)
        assert out[0] == 200 and out[-1] == "[DONE]"
        assert len(tokens_of(out)) == 300  # the running request finished whole
        assert s.wait() == 0
        with pytest.raises(httpx.HTTPError):  # nothing listens any more
            httpx.get(s.base + "/health", timeout=5)


def test_sigint_twice_exits_at_once(llama_dir):
    with ServerProc("--model", llama_dir, "--max-num-seqs", 1, "--drain-timeout", 600) as s:
        body = {"prompt": IDS, "max_tokens": 500, "ignore_eos": True}
        outs, started = [[] for _ in range(32)], threading.Event()
        # 32 long requests, one running at a time, so the drain takes seconds even on a fast host
        # (500 tokens of this tiny model take ~0.15 s): far longer than the two signals apart.
        streams = [threading.Thread(target=stream_lines, args=(s.v1 + "/completions", body, out, started if i == 0 else None))
                   for i, out in enumerate(outs)]
        for t in streams:
            t.start()
        assert started.wait(START_S)
        # Half of them queued behind the running one before the first signal: the drain has work.
        s.wait_metric("vllm:num_requests_waiting", lambda v: v is not None and v >= 16, "reached 16")
        s.signal(signal.SIGINT)
        assert wait_refused(s.base + "/health"), "the first SIGINT did not start the drain"
        s.signal(signal.SIGINT)
        assert s.wait() == 130
        for t in streams:
            t.join(START_S)
        assert any("[DONE]" not in out for out in outs)  # cut short, not drained


def wait_refused(url: str) -> bool:
    """Whether the server stops taking connections (its drain began) within ``START_S``."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=START_S)
        except httpx.ConnectError:
            return True
        time.sleep(0.01)
    return False


def test_api_key_guards_everything_but_health(llama_dir):
    with ServerProc("--model", llama_dir, "-q", env={"TINYLLM_API_KEY": "s3cret"}) as s:
        assert httpx.get(s.base + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(s.base + path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert httpx.get(s.base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(s.base + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        c = openai.OpenAI(base_url=s.v1, api_key="s3cret", max_retries=0, timeout=START_S)
        r = c.completions.create(model=c.models.list().data[0].id, prompt=IDS, max_tokens=3)
        assert r.usage.completion_tokens == 3 and len(r.choices[0].model_extra["token_ids"]) == 3
        bad = openai.OpenAI(base_url=s.v1, api_key="nope", max_retries=0, timeout=START_S)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_a_public_address_without_a_key_is_refused_before_loading(llama_dir):
    r = subprocess.run([sys.executable, "-m", "tinyllm_cli", "serve", "--model", str(llama_dir), "--host", "0.0.0.0",
                        "--port", "0"], capture_output=True, text=True, timeout=START_S, cwd=ROOT,
                       env={**__import__("os").environ, "TINYLLM_API_KEY": ""})
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--api-key" in lines[0] and "--allow-no-auth" in lines[0], r.stderr
    assert "loading" not in r.stderr


def test_serve_runs_128_sequences_at_once_unless_told_otherwise(llama_dir, tmp_path):
    """serve's own default (SERVE_DEFAULTS, above the batch commands' 64) is the one it runs with;
    a flag or a config file's value wins over it."""
    from tinyllm_cli.config import Config
    assert Config().scheduler.max_num_seqs == 64  # the batch default, which serve raises
    cfg = tmp_path / "seven.yaml"
    cfg.write_text("scheduler:\n  max_num_seqs: 7\n")
    for args, want in (((), 128), (("--max-num-seqs", 3), 3), (("--config", cfg), 7)):
        with ServerProc("--model", llama_dir, "-q", *args) as s:
            assert f"up to {want} sequences at once" in "".join(s.lines), s.lines


def test_a_taken_port_is_one_sentence(llama_dir):
    with ServerProc("--model", llama_dir, "-q") as s:
        port = s.base.rsplit(":", 1)[1]
        r = subprocess.run([sys.executable, "-m", "tinyllm_cli", "serve", "--model", str(llama_dir), "--port", port],
                           capture_output=True, text=True, timeout=START_S, cwd=ROOT)
        assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr


# ---- an engine that breaks mid-stream (the app in this process, the fault injected) ------------

class Breaks:
    """Wraps an engine: its step raises once ``after`` steps have run."""

    def __init__(self, engine, after: int):
        self.engine, self.after, self.steps = engine, after, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        self.steps += 1
        if self.steps > self.after:
            raise RuntimeError("injected fault")
        return self.engine.step()


def test_an_engine_failure_after_streaming_began_is_an_sse_error_event(llama_dir):
    import socket

    import uvicorn

    from tinyllm_cli import LLM
    from tinyllm_cli.serving.app import ServeSettings, create_app

    with LLM(str(llama_dir), progress=False, max_num_seqs=2) as llm:
        app = create_app(Breaks(llm.engine, after=5), llm.tokenizer, llm.config.sampling.request_defaults(),
                         ServeSettings("tiny"), max_model_len=512)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        deadline = time.monotonic() + START_S
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=START_S)
            chunks = []
            with pytest.raises(openai.APIError) as e:
                for chunk in c.completions.create(model="tiny", prompt=IDS, max_tokens=100, stream=True,
                                                  extra_body={"ignore_eos": True}):
                    chunks.append(chunk)
            assert chunks, "the error came before any chunk: it should have been a 4xx/5xx status"
            assert "injected fault" in str(e.value)
            # The engine loop is gone: new requests and /health say so.
            r = httpx.post(base + "/v1/completions", json={"prompt": IDS, "max_tokens": 5}, timeout=START_S)
            assert r.status_code == 503
            assert httpx.get(base + "/health").status_code == 503
        finally:
            server.should_exit = True
            th.join(START_S)


# ---- Ray workers ------------------------------------------------------------------------------

def engine_workers(pid: int):
    psutil = pytest.importorskip("psutil")
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for c in kids:
        try:
            if "EngineWorker" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def test_ray_workers_serve_the_same_answers_and_survive_a_killed_worker(llama_dir):
    pytest.importorskip("ray")
    bodies = [{"prompt": [5 + i, 6, 7, 8 + i], "max_tokens": 120, "ignore_eos": True} for i in range(4)]
    with ServerProc("--model", llama_dir, "--max-num-seqs", 2, "-q") as s:
        ref = [httpx.post(s.v1 + "/completions", json=b, timeout=START_S).json()["choices"][0]["token_ids"]
               for b in bodies]
    env = {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    with ServerProc("--model", llama_dir, "--max-num-seqs", 2, "--workers", 2, "-q", env=env) as s:
        outs = [[] for _ in bodies]
        started = threading.Event()
        threads = [threading.Thread(target=stream_lines, args=(s.v1 + "/completions", b, o, started))
                   for b, o in zip(bodies, outs)]
        for t in threads:
            t.start()
        assert started.wait(START_S)
        deadline = time.monotonic() + START_S
        while len(engine_workers(s.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        engine_workers(s.proc.pid)[0].kill()
        for t in threads:
            t.join(START_S)
        for o, want in zip(outs, ref):
            assert o[0] == 200 and o[-1] == "[DONE]", o[-3:]
            assert tokens_of(o) == want  # a retried request streams on from where the client was
        r = httpx.post(s.v1 + "/completions", json=bodies[0], timeout=START_S)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref[0]
