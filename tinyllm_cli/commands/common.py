"""Finishing code every command shares, written once: JSON to a file or stdout, the stats file,
the run table (and the per-worker table on a cluster). Tables go to stderr; stdout is results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import Config
from ..errors import TinyLLMError, UsageError
from ..llm import LLM
from ..report import print_worker_table, run_table, stderr_console


def open_llm(cfg: Config, quiet: bool) -> LLM:
    return LLM(config=cfg, progress=not quiet)


def write_json(obj, path: Path | str | None, indent: int | None = 2) -> None:
    """``obj`` as JSON into ``path`` ('-' is stdout; None writes nothing)."""
    if path is None:
        return
    text = json.dumps(obj, indent=indent) + "\n"
    try:
        if str(path) == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            Path(path).write_text(text)
    except OSError as e:
        raise TinyLLMError(f"cannot write {path}: {e.strerror}")


def finish_run(summary: dict, title: str, stats_json: Path | None, quiet: bool, extra_rows=()) -> None:
    """The stats file, then (unless quiet) the run table with ``extra_rows`` and the worker table."""
    write_json(summary, stats_json)
    if quiet:
        return
    table = run_table(summary, title=title)
    for name, value in extra_rows:
        table.add_row(name, value)
    stderr_console().print(table)
    print_worker_table(summary)


def int_list(text: str, flag: str) -> list[int]:
    """A flag's comma list of positive integers (``--block-size 8,16,32``), or one sentence."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes a comma list of integers, not {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise UsageError(f"{flag} values must be positive integers, not {text!r}")
    return vals
