"""Comparison results stored as data: one JSON file per run under ``benchmarks/results/``.

A result file (schema 1) holds:

- ``recorded``: the date (``YYYY-MM-DD``) or UTC time (``YYYY-MM-DDTHH:MM:SSZ``) of the run;
- ``commit``: the tinyllm commit measured (``-dirty`` when the tree had changes), null if unknown;
- ``cpu``: ``model_name``, ``family``, ``model``, ``uarch``, ``cores`` and the instruction sets
  (``avx512f``, ``avx512_bf16``, ``amx``; null where unknown), and ``cpu_class``, the key results
  are grouped by (``machine.cpu_class``);
- ``versions`` of the engines and libraries, ``settings`` (the command, the statistic and number
  of rounds, threads, KV memory, workloads), ``source`` (``measured``, or where a transcribed run
  was copied from) and free-text ``notes``;
- ``figures``: one per engine x shape x workload x dtype: ``value`` (the median, or the mean where
  ``settings.statistic`` says so; null with a ``note`` when the engine could not run), ``unit``
  and, for measured runs, every round's ``values`` and the greedy ``agree``ment;
- only for a capped run (``settings.isa`` other than ``native``, ``cpu.isa_cap``): ``isa`` (per
  engine: ``how`` it was capped, ``ok`` whether that was verified, what verified it, and
  ``uncapped``: what still ran wider), ``host_limits`` (benchmarks/hostlimits) and ``limits``
  (per ``shape/bench/dtype``: the work per total token, runs.workload_limit).

Invariants: a file is never rewritten once committed (a new run is a new file); a field the run
did not record is null, never guessed. ``load`` refuses a file that breaks the schema, naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .common import ENGINES, REPO
from .isa import HOW, UNCAPPED_HOW
from .machine import cpu_class
from .models import kv_gib

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCHEMA = 1
UNITS = ("tok/s", "s")
TOP_KEYS = ("schema", "recorded", "commit", "cpu", "versions", "settings", "source", "figures", "notes")
FIGURE_KEYS = ("shape", "bench", "dtype", "engine", "unit", "value")


class ResultError(Exception):
    """A stored result that breaks the schema; the message names the file and the field."""


@dataclass(frozen=True)
class Result:
    path: Path
    data: dict

    @property
    def cpu_class(self) -> str:
        return self.data["cpu"]["cpu_class"]

    @property
    def order(self) -> tuple:
        """Later runs sort after earlier ones: by the recorded date or time, then the file name
        (runs of one day without a time are numbered in their names)."""
        return (self.data["recorded"][:10], self.data["recorded"][10:], self.path.name)


# ---- writing a measured run ------------------------------------------------------------------

def git_commit(repo: Path = REPO) -> str | None:
    """The checkout's short commit, ``-dirty`` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 1 else "")


def library_versions() -> dict:
    """The versions of what tinyllm and transformers run on here (the external engines' own
    versions come from their venvs)."""
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def figure_of(cell, agreement: dict | None) -> dict:
    """One stored figure from a comparison cell (see comparison.Cell)."""
    fig = {"shape": cell.shape, "bench": cell.bench, "dtype": cell.dtype, "engine": cell.engine, "unit": cell.unit,
           "value": cell.median, "values": list(cell.values)}
    if cell.note:
        fig["note"] = cell.note
    if agreement is not None:
        fig["agree"] = agreement
    return fig


def record(cmp, argv: list[str], now: datetime, commit: str | None, interrupted: bool = False) -> dict:
    """A measured comparison as a result record (schema 1)."""
    a = cmp.args
    figures = [figure_of(c, cmp.agreement.get((c.shape, c.bench, c.dtype, c.engine))) for c in cmp.cells.values()
               if c.values or c.note]  # a cell the run never reached says nothing
    settings = {"command": " ".join(["python -m benchmarks.compare", *argv]), "statistic": "median",
                "rounds": a.repeat, "interleaved": True, "threads": 2, "quick": a.quick,
                "kv_gib": {s: kv_gib(a, s) for s in a.shapes},
                "config": _rel(a.config), "batch_config": _rel(a.batch_config), "isa": a.isa}
    notes = [f"{e} skipped: {n}" for e, n in cmp.notes.items()]
    cpu = cmp.cpu | ({"isa_cap": a.isa} if a.isa != "native" else {})
    if interrupted:
        notes.append("interrupted: the figures are the rounds measured before it stopped")
    return {"schema": SCHEMA, "recorded": now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit, "cpu": cpu | {"cpu_class": cpu_class(cpu)},
            "versions": library_versions() | dict(cmp.versions), "settings": settings, "source": "measured",
            "figures": figures, "notes": notes} | capped_parts(cmp)


def capped_parts(cmp) -> dict:
    """Under --isa: how each engine was capped and what verified it (``isa``), this host's limits
    (``host_limits``) and each row's work per token (``limits``), for the report's AVX2 table."""
    a = cmp.args
    if a.isa == "native":
        return {}
    engines = sorted({c.engine for c in cmp.cells.values()} | set(cmp.isa_checks))
    how = {e: UNCAPPED_HOW if e in a.uncapped else HOW.get(e) for e in engines}
    return {"isa": {"isa": a.isa, "uncapped": list(a.uncapped),
                    "engines": {e: {"how": how[e]} | cmp.isa_checks.get(e, {"ok": None}) for e in engines}},
            "host_limits": cmp.host_limits, "limits": {"/".join(k): v for k, v in cmp.limits.items()}}


def _rel(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def file_name(rec: dict) -> str:
    """``<recorded>-<cpu class>.json``, e.g. ``2026-12-05T010500Z-zen-4-avx-512-avx512-bf16-no-amx.json``."""
    stamp = rec["recorded"].replace(":", "")
    slug = "".join(ch if ch.isalnum() else "-" for ch in rec["cpu"]["cpu_class"].lower())
    return f"{stamp}-{'-'.join(filter(None, slug.split('-')))}.json"


def write_new(rec: dict, directory: Path) -> Path:
    """Store an already validated record as a new file in ``directory``, never over an existing
    one (a second run in the same second gets ``-2``, ``-3``, ...)."""
    directory.mkdir(parents=True, exist_ok=True)
    path, n = directory / file_name(rec), 1
    while path.exists():
        n += 1
        path = directory / file_name(rec).replace(".json", f"-{n}.json")
    path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return path


def write(rec: dict, directory: Path) -> Path:
    """Store a record as a new file (never over an existing one)."""
    validate(rec, "the record")
    return write_new(rec, directory)


# ---- reading ----------------------------------------------------------------------------------

def validate(data: dict, where: str) -> None:
    """Raise ResultError unless ``data`` is a schema-1 result."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ResultError(f"{where}: {what}")
    need(isinstance(data, dict), "not a JSON object")
    missing = [k for k in TOP_KEYS if k not in data]
    need(not missing, f"no {', '.join(missing)}")
    need(data["schema"] == SCHEMA, f"schema {data['schema']!r}, not {SCHEMA}")
    rec = data["recorded"]
    need(isinstance(rec, str) and _parses(rec), f"recorded {rec!r} is no YYYY-MM-DD date or UTC time")
    need(isinstance(data["cpu"], dict) and bool(data["cpu"].get("cpu_class")), "no cpu.cpu_class")
    need(isinstance(data["cpu"].get("cores"), int), "no cpu.cores")
    need(isinstance(data["figures"], list) and bool(data["figures"]), "no figures")
    for i, fig in enumerate(data["figures"]):
        gaps = [k for k in FIGURE_KEYS if k not in fig]
        need(not gaps, f"figure {i} has no {', '.join(gaps)}")
        need(fig["engine"] in ENGINES, f"figure {i}: unknown engine {fig['engine']!r}")
        need(fig["unit"] in UNITS, f"figure {i}: unit {fig['unit']!r} is not one of {', '.join(UNITS)}")
        value = fig["value"]
        need(value is None or (isinstance(value, (int, float)) and value > 0), f"figure {i}: value {value!r}")
        need(value is not None or bool(fig.get("note")), f"figure {i}: no value and no note saying why")


def _parses(text: str) -> bool:
    for fmt in ("%Y-%m-%d", "%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%MZ"):
        try:
            datetime.strptime(text, fmt)
            return True
        except ValueError:
            pass
    return False


def load(directory: Path = RESULTS_DIR) -> list[Result]:
    """Every stored result, oldest first (see ``Result.order``)."""
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ResultError(f"{path.name}: not readable JSON ({e})") from None
        validate(data, path.name)
        out.append(Result(path, data))
    return sorted(out, key=lambda r: r.order)
