"""A comparison's state: every run of every engine per (shape, bench, dtype, engine) cell, the
notes of what was skipped and why, greedy tokens and their agreement, versions and limits.

Invariant: a cell's ``median`` is the median of its ``values``, one per round; a cell with a note
has no further runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .common import ENGINE_NAMES, Skip, log
from .engines.llamacpp import LLAMACPP_REPACK
from .machine import cpu_label


@dataclass
class Cell:
    """Every run of one engine on one (shape, bench, dtype); the median is what the table shows."""
    bench: str
    dtype: str
    engine: str
    unit: str
    shape: str = "135m"
    values: list[float] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    note: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None


class Comparison:
    def __init__(self, args, cpu: dict):
        self.args, self.cpu = args, cpu
        self.cells: dict[tuple, Cell] = {}
        self.notes: dict[str, str] = {}  # engine -> why it was skipped
        self.tokens: dict[tuple, list] = {}  # (shape, bench, dtype, engine) -> first-round token ids
        self.agreement: dict[tuple, dict] = {}  # (shape, bench, dtype, engine) -> agreement() with transformers
        self.versions: dict[str, str] = {}
        self.runtimes: dict[tuple, tuple] = {}  # (shape, dtype) -> tinyllm's (runtime, weight bytes, K/V bytes)
        self.limits: dict[tuple, dict] = {}  # (shape, bench, dtype) -> workload_limit()
        self.isa_checks: dict[str, dict] = {}  # engine -> what verified its --isa cap (isa.py), first run
        self.host_limits: dict | None = None  # hostlimits.measure() under --isa avx2

    def cell(self, bench: str, dtype: str, engine: str, unit: str = "tok/s", shape: str = "135m") -> Cell:
        key = (shape, bench, dtype, engine)
        if key not in self.cells:
            self.cells[key] = Cell(bench, dtype, engine, unit, shape)
        return self.cells[key]

    def attempt(self, bench: str, dtype: str, engine: str, unit: str, fn, shape: str = "135m"):
        """Run one measurement; a Skip is recorded as the cell's note instead of stopping everything."""
        c = self.cell(bench, dtype, engine, unit, shape)
        if c.note:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (any engine failure is a note, never the end of the comparison)
            c.note = str(e) if isinstance(e, Skip) else f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{ENGINE_NAMES.get(engine, engine)} {shape} {bench} {dtype}: skipped: {c.note}")
            return None

    def add(self, bench: str, dtype: str, engine: str, value: float, run: dict, unit: str = "tok/s") -> None:
        c = self.cell(bench, dtype, engine, unit)
        c.values.append(round(value, 3))
        c.runs.append(run)

    def to_json(self) -> dict:
        return {"cpu": self.cpu, "cpu_label": cpu_label(self.cpu), "versions": self.versions,
                "llamacpp_repack": LLAMACPP_REPACK["on"],
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()},
                "skipped": self.notes,
                "agreement_vs_transformers": {"/".join(k): v for k, v in self.agreement.items()},
                "limits": {"/".join(k): v for k, v in self.limits.items()},
                "isa": self.args.isa, "isa_checks": self.isa_checks, "host_limits": self.host_limits,
                "cells": [{"shape": c.shape, "bench": c.bench, "dtype": c.dtype, "engine": c.engine, "unit": c.unit,
                           "median": c.median, "values": c.values, "runs": c.runs, "note": c.note}
                          for c in self.cells.values()]}
