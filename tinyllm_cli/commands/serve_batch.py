"""The ``serve-batch`` command: OpenAI Batch API lines in, as a stream; results out as they finish
(the format itself is ``openai_batch``).

Design:
- A reader thread turns input lines into a bounded ``queue.Queue`` (so stdin may stay open and
  deliver lines slowly, and a huge file is read no faster than it is served). The engine loop on
  the main thread drains the queue without blocking while the engine has work, and blocks with a
  short timeout only when it is idle.
- Parsed requests wait in a local backlog until they are due (``--request-rate``: Poisson
  arrivals, exponential gaps from a seeded RNG, never earlier than the line was read) and there is
  room in the engine (``--max-inflight``: waiting + running; no limit by default, so every
  request read joins the engine at once). Arrivals take effect between engine steps, but latency
  figures (TTFT, latency) count from the request's arrival: when it was due (read, or its
  Poisson arrival), or when room opened if ``--max-inflight`` held it back longer. So the wait for
  the step in flight is counted and time held back by ``--max-inflight`` is not (as with a
  client-side concurrency cap). ``tinyllm simulate --trace F --request-rate R --seed S`` feeds
  a trace with the same arrival times (``workload.poisson_gaps``).
- Every result is one line written with a single ``write`` and flushed, in completion order, so
  an interrupted run leaves valid JSONL with every finished result in it. The output is opened
  only once the model is loaded.
- A bad line (not JSON, a missing or mistyped field, an unknown url, a duplicate ``custom_id``,
  a request the engine rejects) becomes an error line and the stream goes on. So does a line
  longer than ``io.MAX_LINE_BYTES`` (16 MiB): it is read through to its end in chunks without
  being held, and answered "line N is longer than the 16 MiB limit".
- Memory stays flat on an endless stream: input is read in chunks in linear time, and the run's
  statistics are bounded (``engine.stats``: running aggregates, a downsampled timeline,
  sketched percentiles). Only the set of ``custom_id``s seen (for duplicates) grows, by one
  short string per request.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import queue
from collections import deque
from pathlib import Path
from typing import BinaryIO

from ..config import Config
from ..engine.request import RequestOutput
from ..errors import Interrupted, TinyLLMError, UsageError
from ..io import (RequestBuilder, ResultFile, TooLong, bounded_lines, existing_file, open_output, plan_output,
                  too_long_message)
from ..openai_batch import BadLine, Job, decode_line, error_line, parse_request, response_line
from ..workload import poisson_gaps
from .common import finish_run, open_llm

QUEUE_LINES = 1024  # raw lines the reader may run ahead of the engine loop
BACKLOG = 256  # parsed requests held locally (not yet due, or no room in the engine)
DRAIN = 64  # input lines taken per loop turn, so a fast producer cannot starve the engine
IDLE_POLL_S = 0.05  # longest wait for input while idle
_EOF = object()


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
    ``read`` at exit then holds no lock of ``sys.stdin``'s buffer (which would abort shutdown).
    Linear in the input, and no line over ``MAX_LINE_BYTES`` is held (``io.bounded_lines``)."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # stdin replaced by a non-file object
        src = getattr(sys.stdin, "buffer", sys.stdin)
        if hasattr(src, "read") and isinstance(src.read(0), bytes):
            yield from bounded_lines(getattr(src, "read1", None) or src.read)
            return
        for x in src:
            yield x.encode("utf-8") if isinstance(x, str) else x
        return
    yield from bounded_lines(lambda n: os.read(fd, n))


def _file_lines(src: BinaryIO):
    return bounded_lines(getattr(src, "read1", None) or src.read)


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
            for lineno, raw in enumerate(_stdin_lines() if self.src is None else _file_lines(self.src), 1):
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


# ---- the loop --------------------------------------------------------------------------------

def run_serve(cfg: Config, *, input: str, output: str, request_rate: float | None, max_inflight: int | None,
              quiet: bool, stats_json: Path | None, strict: bool = False) -> int:
    plan = plan_output(output, resume=False, inputs=(input,))
    src = open_input(input)
    try:
        llm = open_llm(cfg, quiet)
    except BaseException:
        if src is not None:
            src.close()
        raise
    with llm:
        out = open_output(plan)  # only now: a failed start leaves an existing file as it was
        writer = LineWriter(out)
        reader = None
        try:
            builder = RequestBuilder(llm.tokenizer, False, cfg.sampling.request_defaults())
            serve = Server(llm, builder, writer, llm.runtime.model_name, request_rate, max_inflight,
                           cfg.sampling.run_seed)
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
        summary = llm.stats | {
            "input_lines": serve.lines, "result_lines": writer.written,
            "error_lines": writer.errors, "request_rate": request_rate, "max_inflight": max_inflight,
            "peak_inflight": serve.peak_inflight, "idle_s": round(serve.idle_s, 4)}
        rows = [("result lines (error lines)", f"{writer.written} ({writer.errors})"),
                ("peak in flight" + ("" if max_inflight is None else f" (max {max_inflight})"),
                 str(serve.peak_inflight))]
        if request_rate is not None:
            rows.append(("request rate", f"{request_rate:g} /s (Poisson)"))
        rows.append(("idle, waiting for input", f"{serve.idle_s:.2f} s"))
        finish_run(summary, f"tinyllm serve-batch · {llm.runtime.describe()}", stats_json, quiet, rows)
    return 1 if strict and writer.errors else 0


class Server:
    """The streaming loop over one run of ``llm``'s engine (see the module docstring)."""

    def __init__(self, llm, builder: RequestBuilder, writer: LineWriter, model: str,
                 request_rate: float | None, max_inflight: int | None, seed: int):
        self.llm, self.engine = llm, llm.engine
        self.builder, self.writer, self.model = builder, writer, model
        self.limit = max_inflight if max_inflight is not None else float("inf")
        self.gaps = poisson_gaps(request_rate, seed) if request_rate is not None else None
        self.last_due: float | None = None
        self.room_at = -float("inf")  # when the engine last went from full to having room
        self.backlog: deque[Job] = deque()
        self.jobs: dict[str, Job] = {}  # in the engine, by request id (= custom_id)
        self.seen: set[str] = set()
        self.eof = False
        self.lines = 0
        self.peak_inflight = 0
        self.idle_s = 0.0

    def loop(self, q: queue.Queue) -> None:
        engine = self.engine
        engine.reset_stats()  # one run, from now
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
        if isinstance(raw, TooLong):  # read through and dropped, never held
            self.lines += 1
            self.writer.write(error_line(lineno, None, "invalid_request", too_long_message(lineno)), error=True)
            return
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
        else:
            job.due = job.read_at
        self.backlog.append(job)

    def release(self) -> None:
        """Move due requests into the engine while there is room."""
        now = time.perf_counter()
        while self.backlog and len(self.jobs) < self.limit and self.backlog[0].due <= now:
            job = self.backlog.popleft()
            job.request.arrival = max(job.due, self.room_at)
            out = self.engine.add_request(job.request)
            if out is not None:  # the engine will never run it (too long, bad ids, ...)
                self.writer.write(error_line(job.n, job.custom_id, "invalid_request",
                                             f"line {job.n}: {out.error}"), error=True)
                continue
            self.jobs[job.custom_id] = job
            self.peak_inflight = max(self.peak_inflight, len(self.jobs))

    def finish(self, out: RequestOutput) -> None:
        if len(self.jobs) == self.limit:
            self.room_at = time.perf_counter()
        job = self.jobs.pop(out.id)
        if out.finish_reason == "error":  # refused, or cut short: never a body that looks complete
            self.writer.write(error_line(job.n, job.custom_id, "server_error", f"line {job.n}: {out.error}"),
                              error=True)
        else:
            self.writer.write(response_line(job, out, self.model))
