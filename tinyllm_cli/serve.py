"""The ``serve-batch`` command: OpenAI Batch API lines in, as a stream; results out as they finish.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``/v1/completions`` (``prompt``: a string, encoded without the chat template, or a list of token
ids) or ``/v1/chat/completions`` (``messages``). Each output line is the Batch API shape
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.

Design:
- A reader thread turns input lines into a bounded ``queue.Queue`` (so stdin may stay open and
  deliver lines slowly, and a huge file is read no faster than it is served). The engine loop on
  the main thread drains the queue without blocking while the engine has work, and blocks with a
  short timeout only when it is idle.
- Parsed requests wait in a local backlog until they are due (``--request-rate``: Poisson
  arrivals, exponential gaps from a seeded RNG, never earlier than the line was read) and there is
  room in the engine (``--max-inflight``: waiting + running; no limit by default, so every
  request read joins the engine at once). Arrivals take effect between engine steps. Latency
  figures (TTFT, latency) are measured from the moment a request enters the engine, so time
  spent held back by ``--max-inflight`` is not counted (as with a client-side concurrency cap).
- Every result is one line written with a single ``write`` and flushed, in completion order, so
  an interrupted run leaves valid JSONL with every finished result in it.
- A bad line (not JSON, a missing or mistyped field, an unknown url, a duplicate ``custom_id``,
  a request the engine rejects) becomes an error line and the stream goes on. ``id`` and
  ``request_id`` carry the input line number: ``batch_req_<line>``, ``req_<line>``. A duplicate
  ``custom_id``'s error line has ``custom_id: null``, so it cannot overwrite the first one's answer.
- Models without a tokenizer (token-id prompts only) give ``text: null`` and add the generated
  ``token_ids`` to the choice.
- ``n`` gives ``choices`` with n entries (index 0..n-1) and usage counting every completion's
  tokens; ``logprobs`` (an integer k for /v1/completions, ``true`` with ``top_logprobs`` k for
  chat) fills each choice's ``logprobs`` in that endpoint's OpenAI shape; ``prompt_logprobs``
  (vLLM's extension) adds ``prompt_logprobs`` to each choice.
"""

from __future__ import annotations

import codecs
import json
import os
import random
import sys
import threading
import time
import queue
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .commands import write_stats_file
from .config import Config
from .engine.request import Request, RequestOutput
from .errors import Interrupted, TinyLLMError, UsageError
from .io import RequestBuilder, ResultFile, existing_file, open_output
from .cluster import open_cluster, wants_cluster
from .report import print_worker_table, run_table, stderr_console
from .runtime import load_runtime, make_engine

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
# OpenAI body keys -> SamplingParams fields (the last four are common extensions, as in vLLM).
BODY_SAMPLING = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                 "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
                 "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "n": "n",
                 "logprobs": "logprobs", "top_logprobs": "top_logprobs", "prompt_logprobs": "prompt_logprobs"}
QUEUE_LINES = 1024  # raw lines the reader may run ahead of the engine loop
BACKLOG = 256  # parsed requests held locally (not yet due, or no room in the engine)
DRAIN = 64  # input lines taken per loop turn, so a fast producer cannot starve the engine
IDLE_POLL_S = 0.05  # longest wait for input while idle
_EOF = object()


class BadLine(Exception):
    """A line that cannot become a request: answered with an error line."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


@dataclass
class Job:
    n: int  # input line number
    custom_id: str
    url: str
    request: Request
    read_at: float
    due: float = 0.0


# ---- parsing ---------------------------------------------------------------------------------

def decode_line(lineno: int, raw: bytes) -> dict | None:
    """One raw input line -> a JSON object, None for a blank line; BadLine otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine("invalid_json", f"line {lineno} is not UTF-8 text (bad byte at offset {e.start})")
    if lineno == 1:
        text = text.removeprefix(codecs.BOM_UTF8.decode())
    if not text.strip():
        return None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine("invalid_json", f"line {lineno} is not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(rec, dict):
        raise BadLine("invalid_json", f"line {lineno} is a JSON {type(rec).__name__}, not an object")
    return rec


def parse_request(lineno: int, rec: dict, builder: RequestBuilder, seen: set[str]) -> Job:
    """A Batch API record -> a Job (tokenized, with sampling params); BadLine when it is invalid.

    ``seen`` collects every custom_id met so far; a repeated one is an error (its error line has
    ``custom_id: null`` so it cannot be mistaken for the first request's answer)."""
    cid = rec.get("custom_id")
    if cid is None:
        raise BadLine("invalid_request", f"line {lineno} has no 'custom_id'")
    if not isinstance(cid, str) or not cid:
        raise BadLine("invalid_request", f"line {lineno}: 'custom_id' must be a non-empty string")
    if cid in seen:
        raise BadLine("duplicate_custom_id", f"line {lineno}: custom_id {cid!r} was already used by an "
                                             f"earlier line")
    seen.add(cid)

    def bad(message: str, code: str = "invalid_request"):
        return BadLine(code, f"line {lineno}: {message}", cid)

    method = rec.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        raise bad(f"'method' must be \"POST\", not {method!r}")
    url = rec.get("url")
    if url is None:
        raise bad("missing 'url' (use \"/v1/completions\" or \"/v1/chat/completions\")")
    if url not in URLS:
        raise bad(f"unknown url {url!r} (use \"/v1/completions\" or \"/v1/chat/completions\")", "invalid_url")
    body = rec.get("body")
    if body is None:
        raise bad("missing 'body'")
    if not isinstance(body, dict):
        raise bad("'body' must be a JSON object")
    for key, ok, why in (("best_of", lambda v: v == 1, "only best_of = 1 is supported"),
                         ("stream", lambda v: v is False, "streaming responses are not supported in a batch"),
                         ("echo", lambda v: v is False, "echo is not supported")):
        if body.get(key) is not None and not ok(body[key]):
            raise bad(f"'{key}': {why}")
    try:
        over = {}
        for key, field in BODY_SAMPLING.items():
            if body.get(key) is not None:
                over[field] = body[key]
        if isinstance(over.get("stop"), str):
            over["stop"] = [over["stop"]]
        if over.get("stop") and builder.tok is None:
            raise ValueError("'stop' strings need a tokenizer, and this model has none")
        params = builder.params(over)
        if url == CHAT:
            if "messages" not in body:
                raise ValueError(f"{CHAT} needs 'messages'" + (" (not 'prompt')" if "prompt" in body else ""))
            ids, prompt = builder.encode_messages(_flatten_messages(body["messages"])), None
        else:
            if "prompt" not in body:
                raise ValueError(f"{COMPLETIONS} needs 'prompt'" + (" (not 'messages'; use "
                                 f"{CHAT})" if "messages" in body else ""))
            prompt = body["prompt"]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one prompt
            if isinstance(prompt, str):
                ids = builder.tok.encode(prompt) if builder.tok is not None else _no_tokenizer()
            elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids, prompt = list(prompt), None
            else:
                raise ValueError("'prompt' must be a string or a list of token ids (one prompt per request)")
    except (ValueError, TypeError) as e:
        raise bad(str(e).rstrip(".").replace("max_new_tokens", "max_tokens"))
    return Job(lineno, cid, url, Request(lineno, ids, params, prompt, lineno), time.perf_counter())


def _no_tokenizer():
    raise ValueError("this model has no tokenizer, so 'prompt' must be a list of token ids")


def _flatten_messages(messages):
    """OpenAI content parts ``[{"type": "text", "text": ...}, ...]`` -> one string; else unchanged."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = m["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in parts):
                raise ValueError("only text content parts are supported in 'messages'")
            m = m | {"content": "".join(p["text"] for p in parts)}
        out.append(m)
    return out


# ---- result lines ----------------------------------------------------------------------------

def error_line(n: int, custom_id: str | None, code: str, message: str) -> str:
    return json.dumps({"id": f"batch_req_{n}", "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, ensure_ascii=False) + "\n"


def _chat_logprobs(entries: list[dict] | None) -> dict | None:
    """Our per-token entries in the chat API's shape: ``{"content": [{token, logprob, bytes,
    top_logprobs}]}``."""
    if entries is None:
        return None

    def one(e):
        tok = e["token"]
        return {"token": tok, "logprob": e["logprob"],
                "bytes": list(tok.encode("utf-8", "replace")) if tok is not None else None}
    return {"content": [one(e) | {"top_logprobs": [one(a) for a in e["top_logprobs"]]} for e in entries]}


def _completion_logprobs(entries: list[dict] | None) -> dict | None:
    """Our per-token entries in the legacy completions shape: parallel ``tokens``,
    ``token_logprobs`` and ``top_logprobs`` (a {token: logprob} map per position)."""
    if entries is None:
        return None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries]}


def _choice(url: str, c, prompt_logprobs) -> dict:
    reason = "length" if c.finish_reason == "error" else c.finish_reason
    if url == CHAT:
        choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": _chat_logprobs(c.logprobs), "finish_reason": reason}
    else:
        choice = {"index": c.index, "text": c.text, "logprobs": _completion_logprobs(c.logprobs),
                  "finish_reason": reason}
    if c.text is None:  # no tokenizer: the ids are the only form of the answer
        choice["token_ids"] = c.token_ids
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def response_line(job: Job, out: RequestOutput, model: str) -> str:
    usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": out.num_output_tokens,
             "total_tokens": len(out.prompt_token_ids) + out.num_output_tokens}
    created = int(time.time())
    choices = [_choice(job.url, c, out.prompt_logprobs) for c in out.completions]
    if job.url == CHAT:
        body = {"id": f"chatcmpl-{job.n}", "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    else:
        body = {"id": f"cmpl-{job.n}", "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    return json.dumps({"id": f"batch_req_{job.n}", "custom_id": job.custom_id,
                       "response": {"status_code": 200, "request_id": f"req_{job.n}", "body": body},
                       "error": None}, ensure_ascii=False) + "\n"


class LineWriter:
    """One ``write`` + ``flush`` per result, so every finished line survives an interruption
    (a write that fails half way is cut back to the last whole line: ``io.ResultFile``)."""

    def __init__(self, out: ResultFile):
        self.out, self.name = out, out.name
        self.errors = 0

    @property
    def written(self) -> int:
        return self.out.written

    def write(self, line: str, error: bool = False) -> None:
        self.out.write(line)
        self.errors += error


# ---- input -----------------------------------------------------------------------------------

def open_input(path: str) -> BinaryIO | None:
    """The input file opened for binary reading; None for stdin (read by file descriptor)."""
    if path == "-":
        return None
    p = existing_file(path, "input file")
    try:
        return p.open("rb")
    except OSError as e:
        raise UsageError(f"cannot read input file {path!r}: {e.strerror}")


def _stdin_lines():
    """Raw stdin lines read straight from the file descriptor: a reader thread still blocked in
    ``read`` at exit then holds no lock of ``sys.stdin``'s buffer (which would abort shutdown)."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # stdin replaced by a non-file object
        for x in getattr(sys.stdin, "buffer", sys.stdin):
            yield x.encode("utf-8") if isinstance(x, str) else x
        return
    buf = b""
    while chunk := os.read(fd, 1 << 16):
        buf += chunk
        if b"\n" in chunk:
            *lines, buf = buf.split(b"\n")
            for x in lines:
                yield x + b"\n"
    if buf:
        yield buf


class LineReader:
    """Reads raw lines on a daemon thread into a bounded queue; ``_EOF`` (or an OSError) ends it."""

    def __init__(self, src: BinaryIO | None):
        self.src = src
        self.q: queue.Queue = queue.Queue(maxsize=QUEUE_LINES)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="serve-batch-reader", daemon=True)

    def start(self) -> "LineReader":
        self.thread.start()
        return self

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for lineno, raw in enumerate(_stdin_lines() if self.src is None else self.src, 1):
                if not self._put((lineno, raw)):
                    return
        except (OSError, ValueError) as e:  # ValueError: the file was closed under us
            self._put(OSError(f"cannot read the input: {getattr(e, 'strerror', None) or e}"))
        finally:
            self._put(_EOF)

    def stop(self) -> None:
        self._stop.set()
        if self.src is not None:
            self.thread.join(timeout=1.0)
            self.src.close()


def poisson_gaps(rate: float, seed: int):
    """Exponential inter-arrival gaps (seconds) of a Poisson process with ``rate`` per second."""
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(rate)


# ---- the loop --------------------------------------------------------------------------------

def run_serve(cfg: Config, input: str, output: str, request_rate: float | None, max_inflight: int | None,
              quiet: bool, stats_json: Path | None) -> int:
    src = open_input(input)
    try:
        out, _ = open_output(output, resume=False)  # the generate command's writer, fresh file
    except TinyLLMError:
        if src is not None:
            src.close()
        raise
    writer = LineWriter(out)
    reader = None
    try:
        seed = cfg.sampling.seed if cfg.sampling.seed is not None else 0
        if wants_cluster(cfg):
            rt, engine = open_cluster(cfg, quiet, seed=seed)
        else:
            rt = load_runtime(cfg, progress=not quiet)
            engine = make_engine(cfg, rt, seed=seed)
        builder = RequestBuilder(rt.tokenizer, False, cfg.sampling)
        serve = Server(engine, builder, writer, rt.model_name, request_rate, max_inflight, seed)
        reader = LineReader(src).start()
        serve.loop(reader.q)
    except Interrupted as e:
        e.message = f"interrupted: the {writer.written} finished results are already written to {out.name}"
        raise
    except KeyboardInterrupt:  # no signal handlers (run outside the main thread)
        print(f"interrupted: the {writer.written} finished results are already written to {out.name}",
              file=sys.stderr)
        raise SystemExit(130)
    finally:
        if reader is not None:
            reader.stop()
        elif src is not None:
            src.close()
        out.close()
    summary = engine.stats.summary() | rt.facts() | {
        "input_lines": serve.lines, "result_lines": writer.written,
        "error_lines": writer.errors, "request_rate": request_rate, "max_inflight": max_inflight,
        "peak_inflight": serve.peak_inflight, "idle_s": round(serve.idle_s, 4)}
    if wants_cluster(cfg):
        engine.close()  # the Ray workers
    write_stats_file(stats_json, summary)
    if not quiet:
        table = run_table(summary, title=f"tinyllm serve-batch · {rt.describe()}")
        table.add_row("result lines (error lines)", f"{writer.written} ({writer.errors})")
        table.add_row("peak in flight" + ("" if max_inflight is None else f" (max {max_inflight})"),
                      str(serve.peak_inflight))
        if request_rate is not None:
            table.add_row("request rate", f"{request_rate:g} /s (Poisson)")
        table.add_row("idle, waiting for input", f"{serve.idle_s:.2f} s")
        stderr_console().print(table)
        print_worker_table(summary)
    return 0


class Server:
    def __init__(self, engine, builder: RequestBuilder, writer: LineWriter, model: str,
                 request_rate: float | None, max_inflight: int | None, seed: int):
        self.engine, self.builder, self.writer, self.model = engine, builder, writer, model
        self.limit = max_inflight if max_inflight is not None else float("inf")
        self.gaps = poisson_gaps(request_rate, seed) if request_rate is not None else None
        self.last_due: float | None = None
        self.backlog: deque[Job] = deque()
        self.jobs: dict[int, Job] = {}  # in the engine, by request id (= line number)
        self.seen: set[str] = set()
        self.eof = False
        self.lines = 0
        self.peak_inflight = 0
        self.idle_s = 0.0

    def loop(self, q: queue.Queue) -> None:
        engine = self.engine
        engine.stats.start = time.perf_counter()
        while True:
            for _ in range(DRAIN):
                if self.eof or len(self.backlog) >= BACKLOG:
                    break
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                self.take(item)
            self.release()
            if engine.has_unfinished():
                for out in engine.step():
                    self.finish(out)
                continue
            if self.eof and not self.backlog:
                break
            self.wait(q)
        engine.stats.end = time.perf_counter()

    def wait(self, q: queue.Queue) -> None:
        """Nothing to compute: block until input arrives or the next request is due."""
        t0 = time.perf_counter()
        timeout = IDLE_POLL_S
        if self.backlog:
            timeout = min(timeout, max(0.0, self.backlog[0].due - t0))
        if not self.eof and len(self.backlog) < BACKLOG:
            try:
                self.take(q.get(timeout=timeout))
            except queue.Empty:
                pass
        elif timeout > 0:
            time.sleep(timeout)
        self.idle_s += time.perf_counter() - t0

    def take(self, item) -> None:
        if item is _EOF:
            self.eof = True
            return
        if isinstance(item, OSError):
            raise TinyLLMError(str(item))
        lineno, raw = item
        try:
            rec = decode_line(lineno, raw)
            if rec is None:
                return
            self.lines += 1
            job = parse_request(lineno, rec, self.builder, self.seen)
        except BadLine as e:
            self.writer.write(error_line(lineno, e.custom_id, e.code, e.message), error=True)
            return
        if self.gaps is not None:
            due = job.read_at if self.last_due is None else max(job.read_at, self.last_due + next(self.gaps))
            job.due = self.last_due = due
        self.backlog.append(job)

    def release(self) -> None:
        """Move due requests into the engine while there is room."""
        now = time.perf_counter()
        while self.backlog and len(self.jobs) < self.limit and self.backlog[0].due <= now:
            job = self.backlog.popleft()
            out = self.engine.add_request(job.request)
            if out is not None:  # the engine will never run it (too long, bad ids, ...)
                self.writer.write(error_line(job.n, job.custom_id, "invalid_request",
                                             f"line {job.n}: {out.error}"), error=True)
                continue
            self.jobs[job.n] = job
            self.peak_inflight = max(self.peak_inflight, len(self.jobs))

    def finish(self, out: RequestOutput) -> None:
        job = self.jobs.pop(out.id)
        if out.error and not out.num_output_tokens:
            self.writer.write(error_line(job.n, job.custom_id, "server_error", f"line {job.n}: {out.error}"),
                              error=True)
        else:
            self.writer.write(response_line(job, out, self.model))
