"""Prompt files in, JSONL results out, resume.

Invariants:
- Input is streamed: prompts are read and tokenized lazily, one line at a time, so memory does
  not grow with the number of prompts.
- A bad line never stops the run: it becomes a request that carries its error and is answered
  with ``finish_reason: "error"``.
- Each result is one complete line written with a single ``write`` and flushed, so an
  interrupted run leaves valid JSONL; ``--resume`` first cuts a torn last line, if any.
"""

from __future__ import annotations

import codecs
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from .config import SamplingConfig
from .engine.request import Request, SamplingParams
from .errors import TinyLLMError, UsageError
from .model.tokenizer import Tokenizer

REQUEST_KEYS = {"id", "prompt", "messages", "prompt_token_ids", "metadata"}
SAMPLING_KEYS = SamplingParams.field_names()
ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}


def check_prompt_file(path: str) -> None:
    """Fail early (exit 2) on a file that is missing, a directory, or not UTF-8."""
    if path == "-":
        return
    p = Path(path)
    if not p.exists():
        raise UsageError(f"prompts file {path!r} does not exist")
    if p.is_dir():
        raise UsageError(f"prompts file {path!r} is a directory, not a file")
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with p.open("rb") as f:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise UsageError(f"prompts file {path!r} is not UTF-8 text (bad byte at offset {e.start})")
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path!r}: {e.strerror}")


def _lines(path: str) -> Iterator[str]:
    if path == "-":
        yield from sys.stdin
        return
    with open(path, encoding="utf-8") as f:
        yield from f


def read_records(path: str) -> Iterator[tuple[int, object]]:
    """(line number, record) for every non-blank line: a str (text file), a dict (JSONL), or an
    error sentence wrapped as ``{"__error__": ...}``."""
    suffix = Path(path).suffix.lower() if path != "-" else ""
    mode = "jsonl" if suffix in (".jsonl", ".json", ".ndjson") else ("txt" if suffix else None)
    for lineno, line in enumerate(_lines(path), 1):
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
    """Turns records into Requests: chat template, tokenization, per-request sampling."""

    def __init__(self, tokenizer: Tokenizer | None, chat: bool, sampling: SamplingConfig):
        self.tok, self.chat, self.sampling = tokenizer, chat, sampling

    def build(self, index: int, lineno: int, rec, rid) -> Request:
        try:
            req = self._build(index, lineno, rid, rec)
            if isinstance(rec, dict):
                req.metadata = rec.get("metadata")
            return req
        except (ValueError, TypeError, KeyError) as e:
            prompt = rec.get("prompt") if isinstance(rec, dict) else rec
            return Request(rid, [], SamplingParams(), prompt if isinstance(prompt, str) else None, index,
                           error=f"line {lineno}: {e}" if not str(e).startswith("line ") else str(e))

    def _build(self, index, lineno, rid, rec) -> Request:
        if isinstance(rec, str):
            return Request(rid, self.encode_prompt(rec), self.sampling.params(), rec, index)
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
        base = {k: v for k, v in vars(self.sampling).items()}
        return SamplingParams(**(base | over))

    def encode_prompt(self, text: str) -> list[int]:
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
        return self.tok.encode_chat(messages)


def output_line(out) -> str:
    return json.dumps(out.to_json(), ensure_ascii=False) + "\n"


def count_records(path: str) -> int | None:
    """Non-blank lines, for a progress bar with a real ETA (None for stdin)."""
    if path == "-":
        return None
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


class OrderedWriter:
    """Writes results in input order as soon as every earlier one is done."""

    def __init__(self, fh: TextIO, name: str, first_index: int = 0):
        self.fh, self.name = fh, name
        self.next = first_index
        self.pending: dict[int, str] = {}
        self.written = 0

    def add(self, index: int, line: str) -> None:
        self.pending[index] = line
        while self.next in self.pending:
            self._write(self.pending.pop(self.next))
            self.next += 1

    def _write(self, line: str) -> None:
        try:
            self.fh.write(line)
            self.fh.flush()
        except OSError as e:
            raise TinyLLMError(f"cannot write results to {self.name}: {e.strerror or e}; "
                               f"the {self.written} results before this one are intact")
        self.written += 1


def open_output(path: str | None, resume: bool) -> tuple[TextIO, str, set[str]]:
    """Open the results file; with ``resume``, repair a torn tail and return the ids done."""
    if path in (None, "-"):
        return sys.stdout, "stdout", set()
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"output path {path!r} is a directory")
    done: set[str] = set()
    if resume and p.exists():
        done = _repair_and_collect(p)
    try:
        fh = p.open("a" if resume else "w", encoding="utf-8")
    except OSError as e:
        raise TinyLLMError(f"cannot open output file {path!r} for writing: {e.strerror}")
    return fh, path, done


def _repair_and_collect(p: Path) -> set[str]:
    done, good_end = set(), 0
    with p.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                break
            if isinstance(obj, dict) and "id" in obj:
                done.add(id_key(obj["id"]))
            good_end += len(raw)
    if good_end < p.stat().st_size:
        with p.open("r+b") as f:
            f.truncate(good_end)
    return done


def id_key(rid) -> str:
    return json.dumps(rid)
