"""Prompt files in, JSONL results out, resume.

Invariants:
- Input is streamed: prompts are read and tokenized lazily, one line at a time, so memory does
  not grow with the number of prompts.
- A bad line never stops the run: it becomes a request that carries its error and is answered
  with ``finish_reason: "error"``.
- Each result is one complete line written with a single ``write`` and flushed, so an
  interrupted run leaves valid JSONL; a write that fails half way (disk full) is cut back to the
  last whole line, and ``--resume`` first cuts a torn last line, if any.
- Results go out in input order. On an interrupt, results that finished ahead of an earlier,
  unfinished one are written too (after the in-order part), so every finished result is on
  disk; ``--resume`` puts them back in their place, so the final file equals an uninterrupted
  run's. Resuming reads the results file and the prompts side by side: memory stays flat.
- No line is held in memory past ``MAX_LINE_BYTES`` (16 MiB): a longer one is read through to
  its end in chunks, dropped, and answered as that line's error ("line N is longer than the
  16 MiB limit"); ``serve-batch`` reads its input with the same ``bounded_lines``.
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

from .engine.request import CONSTRAINTS, Request, SamplingParams
from .errors import TinyLLMError, UsageError, shield
from .model.tokenizer import Tokenizer

try:
    from jinja2 import TemplateError  # a chat template's raise_exception(...)
except ImportError:  # pragma: no cover
    TemplateError = ValueError

REQUEST_KEYS = {"id", "prompt", "messages", "prompt_token_ids", "metadata"}
SAMPLING_KEYS = SamplingParams.field_names()
ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
CONSTRAINTS_AND_FORMAT = set(CONSTRAINTS) | {"response_format"}


MAX_LINE_BYTES = 16 << 20  # longest input line (prompts file, stdin, serve-batch input), newline excluded
READ_CHUNK = 1 << 16


class TooLong:
    """Stands for a line longer than ``MAX_LINE_BYTES``: its ``size`` bytes (with its newline)
    were read and dropped."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def __repr__(self) -> str:
        return f"TooLong({self.size})"


def size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def too_long_message(lineno: int) -> str:
    return f"line {lineno} is longer than the {size_text(MAX_LINE_BYTES)} limit"


def bounded_lines(read, limit: int | None = None) -> Iterator[bytes | TooLong]:
    """Lines (each with its ``\\n``, the last one perhaps without) from ``read(n)`` (a file's
    ``read1``/``read``, or ``os.read`` on a descriptor), in time linear in the input. A line of
    more than ``limit`` bytes (``MAX_LINE_BYTES``; its ``\\n`` not counted) is consumed to its end
    without being kept and comes out as a ``TooLong``, so memory stays under ``limit`` plus a chunk."""
    limit = MAX_LINE_BYTES if limit is None else limit
    buf = bytearray()
    skipped = -1  # bytes of the too-long line being skipped; -1 when not skipping
    while chunk := read(READ_CHUNK):
        start = 0
        while (i := chunk.find(b"\n", start)) >= 0:
            if skipped >= 0:
                yield TooLong(skipped + i + 1 - start)
                skipped = -1
            elif len(buf) + i - start > limit:
                yield TooLong(len(buf) + i + 1 - start)
                buf.clear()
            else:
                buf += chunk[start:i + 1]
                yield bytes(buf)
                buf.clear()
            start = i + 1
        rest = len(chunk) - start
        if skipped >= 0:
            skipped += rest
        elif len(buf) + rest > limit:
            skipped = len(buf) + rest
            buf = bytearray()  # give the memory back
        elif rest:
            buf += chunk[start:]
    if skipped >= 0:
        yield TooLong(skipped)
    elif buf:
        yield bytes(buf)


def _reader(f):
    """The ``read(n)`` of a binary file that returns what is there rather than waiting for ``n`` bytes."""
    return getattr(f, "read1", None) or f.read


def existing_file(path: str, what: str) -> Path:
    """``path`` as a Path, or a one-sentence usage error naming ``what`` when it is missing or a directory."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{what} {path!r} does not exist")
    if p.is_dir():
        raise UsageError(f"{what} {path!r} is a directory, not a file")
    return p


def check_prompt_file(path: str) -> int | None:
    """Fail early (exit 2) on a file that is missing, a directory, or not UTF-8; in the same
    single pass, count its non-blank lines (for a progress bar with a real ETA; None for stdin)."""
    if path == "-":
        return None
    p = existing_file(path, "prompts file")
    count, offset = 0, 0
    try:
        with p.open("rb") as f:
            # Lines split on b"\n", which never falls inside a UTF-8 character.
            for raw in bounded_lines(_reader(f)):
                if isinstance(raw, TooLong):  # answered as that line's error
                    count += 1
                    offset += raw.size
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UsageError(f"prompts file {path!r} is not UTF-8 text "
                                     f"(bad byte at offset {offset + e.start})")
                if offset == 0:
                    line = line.removeprefix("\ufeff")
                count += bool(line.strip())
                offset += len(raw)
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path!r}: {e.strerror}")
    return count


def _lines(path: str) -> Iterator[str | None | TooLong]:
    """Text lines (a leading BOM dropped); None for a stdin line that is not UTF-8 (files are
    checked up front by ``check_prompt_file``); a ``TooLong`` for a line over ``MAX_LINE_BYTES``."""
    if path == "-":
        raw = getattr(sys.stdin, "buffer", None)
        if raw is None:  # stdin replaced by a text object (tests)
            for n, line in enumerate(sys.stdin):
                if len(line) > MAX_LINE_BYTES and len(line.encode("utf-8").rstrip(b"\n")) > MAX_LINE_BYTES:
                    yield TooLong(len(line))
                    continue
                yield line.removeprefix("\ufeff") if n == 0 else line
            return
        yield from _decoded(bounded_lines(_reader(raw)))
        return
    with open(path, "rb") as f:
        yield from _decoded(bounded_lines(_reader(f)))


def _decoded(lines: Iterator[bytes | TooLong]) -> Iterator[str | None | TooLong]:
    for n, b in enumerate(lines):
        if isinstance(b, TooLong):
            yield b
            continue
        try:
            line = b.decode("utf-8")
        except UnicodeDecodeError:
            yield None
            continue
        yield line.removeprefix("\ufeff") if n == 0 else line


def read_records(path: str) -> Iterator[tuple[int, object]]:
    """(line number, record) for every non-blank line: a str (text file), a dict (JSONL), or an
    error sentence wrapped as ``{"__error__": ...}``."""
    suffix = Path(path).suffix.lower() if path != "-" else ""
    mode = "jsonl" if suffix in (".jsonl", ".json", ".ndjson") else ("txt" if suffix else None)
    for lineno, line in enumerate(_lines(path), 1):
        if line is None:
            yield lineno, {"__error__": f"line {lineno} is not UTF-8 text"}
            continue
        if isinstance(line, TooLong):
            yield lineno, {"__error__": too_long_message(lineno)}
            continue
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if mode is None:  # stdin or no suffix: sniff from the first line
            mode = "jsonl" if line.lstrip().startswith("{") else "txt"
        if mode == "txt":
            yield lineno, line
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            yield lineno, {"__error__": f"line {lineno} is not valid JSON ({e.msg})"}
            continue
        if not isinstance(rec, dict):
            rec = {"__error__": f"line {lineno} is a JSON {type(rec).__name__}, not an object"}
        yield lineno, rec


def record_id(index: int, rec) -> object:
    if isinstance(rec, dict) and "id" in rec and isinstance(rec["id"], (str, int)) and not isinstance(rec["id"], bool):
        return rec["id"]
    return index


class RequestBuilder:
    """Turns records into Requests: chat template, tokenization, per-request sampling.

    A record is a text line (str) or a JSONL object; its own sampling fields override
    ``defaults`` (``SamplingConfig.request_defaults()`` for the commands)."""

    def __init__(self, tokenizer: Tokenizer | None, chat: bool, defaults: SamplingParams):
        self.tok, self.chat, self.defaults = tokenizer, chat, defaults

    def build(self, index: int, lineno: int, rec, rid) -> Request:
        try:
            req = self._build(index, lineno, rid, rec)
            if isinstance(rec, dict):
                req.metadata = rec.get("metadata")
            return req
        except (ValueError, TypeError, KeyError, TemplateError) as e:
            prompt = rec.get("prompt") if isinstance(rec, dict) else rec
            return Request(rid, [], SamplingParams(), prompt if isinstance(prompt, str) else None, index,
                           error=f"line {lineno}: {e}" if not str(e).startswith("line ") else str(e))

    def _build(self, index, lineno, rid, rec) -> Request:
        if isinstance(rec, str):
            return Request(rid, self.encode_prompt(rec), self.params({}), rec, index)
        if "__error__" in rec:
            raise ValueError(rec["__error__"])
        unknown = set(rec) - REQUEST_KEYS - SAMPLING_KEYS - set(ALIASES)
        if unknown:
            import difflib
            key = sorted(unknown)[0]
            close = difflib.get_close_matches(key, sorted(REQUEST_KEYS | SAMPLING_KEYS | set(ALIASES)), 1, 0.6)
            raise ValueError(f"unknown field {key!r}" + (f" (did you mean {close[0]!r}?)" if close else
                             " (put extra data under 'metadata')"))
        given = [k for k in ("prompt", "messages", "prompt_token_ids") if k in rec]
        if len(given) != 1:
            raise ValueError("each line needs exactly one of 'prompt', 'messages' or 'prompt_token_ids'"
                             if not given else f"give only one of {', '.join(given)}")
        params = self.params(rec)
        kind = given[0]
        if kind == "prompt_token_ids":
            ids = rec[kind]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("'prompt_token_ids' must be a list of integers")
            return Request(rid, ids, params, None, index)
        if kind == "messages":
            return Request(rid, self.encode_messages(rec[kind]), params, None, index)
        if not isinstance(rec["prompt"], str):
            raise ValueError("'prompt' must be a string")
        return Request(rid, self.encode_prompt(rec["prompt"]), params, rec["prompt"], index)

    def params(self, rec: dict) -> SamplingParams:
        over = {ALIASES.get(k, k): v for k, v in rec.items() if k in SAMPLING_KEYS or k in ALIASES}
        base = vars(self.defaults)
        if CONSTRAINTS_AND_FORMAT & set(over):  # a line's own constraint replaces the defaults'
            base = base | dict.fromkeys(CONSTRAINTS, None) | {"json_object": False}
        return SamplingParams(**(base | over))

    def encode_prompt(self, text: str) -> list[int]:
        _check_text(text, "'prompt'")
        if self.tok is None:
            raise ValueError("this model has no tokenizer, so prompts must be given as prompt_token_ids")
        if self.chat and self.tok.chat_template:
            return self.tok.encode_chat([{"role": "user", "content": text}])
        return self.tok.encode(text)

    def encode_messages(self, messages) -> list[int]:
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages) or not messages:
            raise ValueError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
        if self.tok is None or not self.tok.chat_template:
            raise ValueError("this model has no chat template, so 'messages' cannot be used")
        for m in messages:
            _check_text(m["role"], "a message's 'role'")
            _check_text(m["content"], "a message's 'content'")
        return self.tok.encode_chat(messages)


def _check_text(text: str, what: str) -> None:
    """JSON may spell lone surrogates (``"\\ud800"``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} holds an invalid Unicode escape (a lone surrogate)") from None


def output_line(out) -> str:
    return json.dumps(out.to_json(), ensure_ascii=False) + "\n"


class ResultFile:
    """A results stream that only ever holds whole lines.

    A regular file is written unbuffered in binary: one line is one ``write`` (looped if the OS
    takes part of it), and when a write fails (disk full) or is interrupted half way, the file is
    cut back to the end of the last whole line. stdout is written as text and flushed per line.
    """

    def __init__(self, fh: TextIO | BinaryIO, name: str):
        self.fh, self.name = fh, name
        self.binary = not isinstance(fh, io.TextIOBase)
        self.written = 0
        self.failed = False
        self.end: int | None = None  # byte offset after the last whole line (regular files)
        if self.binary:
            try:
                if stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    self.end = fh.seek(0, os.SEEK_END)
            except (OSError, ValueError):
                self.end = None

    def write(self, line: str) -> None:
        try:
            data = line.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate echoed from the input: escape it
            line = json.dumps(json.loads(line)) + "\n"
            data = line.encode("utf-8")
        with shield:  # SIGINT/SIGTERM wait until the line is out and counted
            try:
                if self.binary:
                    view = memoryview(data)
                    while view:
                        view = view[self.fh.write(view):]
                else:
                    self.fh.write(line)
                    self.fh.flush()
            except OSError as e:
                self.failed = True
                self._cut()
                raise TinyLLMError(f"cannot write results to {self.name}: {e.strerror or e}; the "
                                   f"{self.written} result line{'' if self.written == 1 else 's'} written "
                                   f"before it {'is' if self.written == 1 else 'are'} intact") from e
            except BaseException:  # a bare KeyboardInterrupt (no signal handlers installed)
                self._cut()
                raise
            if self.end is not None:
                self.end += len(data)
            self.written += 1

    def _cut(self) -> None:
        if self.end is not None:
            try:
                os.ftruncate(self.fh.fileno(), self.end)
            except OSError:
                pass

    def close(self) -> None:
        """Close a file (never stdout); a failure here cannot lose a line (nothing is buffered)."""
        if self.fh in (sys.stdout, sys.__stdout__):
            return
        try:
            self.fh.close()
        except OSError:
            pass


class OrderedWriter:
    """Writes results in input order as soon as every earlier one is done."""

    def __init__(self, out: ResultFile, first_index: int = 0):
        self.out = out
        self.next = first_index
        self.pending: dict[int, str] = {}

    @property
    def written(self) -> int:
        return self.out.written

    def add(self, index: int, line: str) -> None:
        self.pending[index] = line
        while self.next in self.pending:
            self.out.write(self.pending.pop(self.next))
            self.next += 1

    def flush_pending(self) -> None:
        """On an interrupt: write the results that finished ahead of an unfinished earlier one
        (``--resume`` moves them back into input order). Best effort: a write error stops it."""
        if self.out.failed:
            return
        for index in sorted(self.pending):
            try:
                self.out.write(self.pending.pop(index))
            except TinyLLMError:
                return


@dataclass
class Resume:
    """What ``--resume`` found in the results file."""

    skip: int = 0  # leading input records already answered, in input order
    tail: dict[str, deque] = field(default_factory=dict)  # id -> result lines written out of order

    @property
    def num_tail(self) -> int:
        return sum(len(v) for v in self.tail.values())

    def take(self, key: str) -> str | None:
        lines = self.tail.get(key)
        if not lines:
            return None
        line = lines.popleft()
        if not lines:
            del self.tail[key]
        return line


@dataclass
class OutputPlan:
    """Where results go and what is done already; made before anything loads, and acted on
    (``open_output``) only once the job can run, so a failed start leaves the file as it was."""

    path: str | None  # None: stdout
    resume: bool = False
    done: Resume = field(default_factory=Resume)
    keep_bytes: int | None = None  # --resume: cut the file here (after the in-order results)


def plan_output(path: str | None, resume: bool, inputs: tuple[str, ...] = (), prompts: str | None = None) -> OutputPlan:
    """Check the results path (not a directory, not one of ``inputs``) and, with ``resume``,
    read what is done. Writes nothing."""
    if path in (None, "-"):
        return OutputPlan(None)
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"output path {path!r} is a directory")
    for name in inputs:
        if name != "-" and p.exists() and Path(name).exists() and p.samefile(name):
            raise UsageError(f"the output file {path!r} is also an input of this run; writing it would destroy "
                             f"its contents (choose another --output)")
    if resume and prompts == "-":
        raise UsageError("--resume needs --prompts FILE: it reads the prompts again to match them with "
                         "the results, and stdin cannot be read twice")
    if not (resume and p.is_file()):
        return OutputPlan(path, resume)
    if prompts is None:
        raise UsageError("--resume needs the prompts file the results came from")
    done, keep = _plan_resume(p, prompts)
    return OutputPlan(path, resume, done, keep)


def open_output(plan: OutputPlan) -> ResultFile:
    """Open the results stream the plan describes (a fresh file is truncated only now)."""
    if plan.path is None:
        return ResultFile(sys.stdout, "stdout")
    try:
        if plan.keep_bytes is not None:
            with open(plan.path, "r+b") as f:
                f.truncate(plan.keep_bytes)  # a torn or out-of-order tail (kept in the plan)
        fh = open(plan.path, "ab" if plan.resume else "wb", buffering=0)
    except OSError as e:
        raise TinyLLMError(f"cannot open output file {plan.path!r} for writing: {e.strerror}")
    return ResultFile(fh, plan.path)


def _plan_resume(p: Path, prompts: str) -> tuple[Resume, int | None]:
    """Walk the results and the prompts side by side: the leading results that match the
    prompts one for one are done in place; the ones after them (an interrupt's out-of-order
    results) are held to be put back in their place. Returns the plan and where to cut the file
    (after the in-order part; None when nothing follows it)."""
    keys = (id_key(record_id(n, rec)) for n, (_, rec) in enumerate(read_records(prompts)))
    plan, in_order, prefix_end, pos, lineno = Resume(), True, 0, 0, 0
    size = p.stat().st_size
    with p.open("rb") as f:
        for raw in f:
            lineno += 1
            pos += len(raw)
            try:
                obj = json.loads(raw) if raw.endswith(b"\n") else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = None
            if obj is None:
                if pos < size:  # not the last line: this is not a torn write but a foreign file
                    raise UsageError(f"cannot resume: line {lineno} of {str(p)!r} is not valid JSON "
                                     f"(only a torn last line is repaired)")
                break  # a torn last line: cut
            if not isinstance(obj, dict) or "id" not in obj:
                raise UsageError(f"cannot resume: line {lineno} of {str(p)!r} is not a tinyllm result "
                                 f"(it has no 'id')")
            key = id_key(obj["id"])
            if in_order:
                if next(keys, None) == key:
                    plan.skip += 1
                    prefix_end = pos
                    continue
                in_order = False
            plan.tail.setdefault(key, deque()).append(raw.decode("utf-8"))
    if plan.tail:
        # The record that broke the match is consumed already: look for tail ids from the start
        # of the remainder again (a fresh pass over the prompts, ids only).
        missing = set(plan.tail)
        for n, (_, rec) in enumerate(read_records(prompts)):
            if n >= plan.skip:
                missing.discard(id_key(record_id(n, rec)))
                if not missing:
                    break
        if missing:
            raise UsageError(f"cannot resume: {str(p)!r} has results for ids that are not in {prompts!r} "
                             f"(e.g. {sorted(missing)[0]}); was it written for another prompts file?")
    return plan, (prefix_end if prefix_end < size else None)


def id_key(rid) -> str:
    return json.dumps(rid)
