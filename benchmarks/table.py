"""A run's tables: one row per (shape, bench, dtype) with each engine's median, tinyllm's ratio
to each other engine and each engine's greedy agreement; then where the limit is. Printed to
stderr with rich, or written as markdown.

Invariant: a ratio is tinyllm / other for tok/s and other / tinyllm for seconds, so above 1 is
always tinyllm ahead.
"""

from __future__ import annotations

from .agreement import agreement_text
from .common import ENGINE_NAMES, ENGINES
from .comparison import Comparison
from .engines.llamacpp import LLAMACPP_REPACK
from .machine import cpu_label
from .models import SHAPES, kv_gib
from .runs import engine_rates

RATIO_COLS = (("openvino", "tinyllm / OpenVINO"), ("vllm", "tinyllm / vLLM"), ("llamacpp", "tinyllm / llama.cpp"),
              ("hf", "tinyllm / transformers"))


def table_rows(cmp: Comparison) -> list[dict]:
    """One row per (shape, bench, dtype): each engine's median, tinyllm's ratio to the others (speed
    ratio for tok/s; for seconds the other's time over tinyllm's, so > 1 = tinyllm ahead) and
    each engine's greedy agreement with transformers (``agree <engine>``, see agreement())."""
    rows: dict[tuple, dict] = {}
    for c in cmp.cells.values():
        row = rows.setdefault((c.shape, c.bench, c.dtype),
                              {"shape": c.shape, "bench": c.bench, "dtype": c.dtype, "unit": c.unit})
        row[c.engine] = c.median if c.median is not None else (f"skipped: {c.note}" if c.note else None)
        if (ag := cmp.agreement.get((c.shape, c.bench, c.dtype, c.engine))) is not None:
            row[f"agree {c.engine}"] = ag
    for row in rows.values():
        if (limit := cmp.limits.get((row["shape"], row["bench"], row["dtype"]))) is not None:
            row["limit"] = limit
            for e in ENGINES:
                if isinstance(row.get(e), float):
                    row[f"rate {e}"] = engine_rates(limit, row[e])
        mine = row.get("tinyllm")
        for eng, col in RATIO_COLS:
            theirs = row.get(eng)
            if isinstance(mine, float) and isinstance(theirs, float) and mine and theirs:
                row[col] = round(mine / theirs if row["unit"] == "tok/s" else theirs / mine, 3)
    return list(rows.values())


def table_columns(rows: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """The engines, ratio and agreement columns that hold anything (an engine never run is left out)."""
    engines = [e for e in ENGINES if any(r.get(e) is not None for r in rows)]
    ratios = [c for _, c in RATIO_COLS if any(c in r for r in rows)]
    agree = [e for e in ENGINES if any(f"agree {e}" in r for r in rows)]
    return engines, ratios, agree


def markdown_table(cmp: Comparison, rows: list[dict]) -> str:
    """The table as markdown, headed by the CPU it ran on (one table per CPU seen)."""
    engines, ratios, agree = table_columns(rows)
    head = ["shape", "bench", "dtype", "unit", *(ENGINE_NAMES[e] for e in engines), *ratios,
            *(f"agree {ENGINE_NAMES[e]}" for e in agree)]
    lines = [f"### {cpu_label(cmp.cpu)}", "",
             f"median of {cmp.args.repeat} interleaved runs; agreement with transformers' greedy tokens on "
             "the same ids (sequences equal / prefix fraction; f32 reference for int4 rows)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], r["bench"], r["dtype"], r["unit"], *(_fmt(r.get(e)) for e in engines),
                 *(_fmt(r.get(c), "x") for c in ratios), *(agreement_text(r.get(f"agree {e}")) for e in agree)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = skip_notes(cmp) + run_notes(cmp)
    lines += ([""] + [f"- {n}" for n in notes]) if notes else []
    head, body = limit_table(rows)
    if body:
        lines += ["", f"Where the limit is, {cpu_label(cmp.cpu)}: achieved GFLOP/s (% of the matmul peak, % of the "
                      "read bandwidth) · % of the bound (the workload's least time on this CPU, each phase "
                      "at the slower of its FLOPs at the peak and its bytes at the bandwidth, over the "
                      "engine's time); the work is the workload's, the same for every engine", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def limit_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The where-the-limit-is table (header, rows of cells) of the rows that have a limit."""
    rows = [r for r in rows if "limit" in r]
    engines = [e for e in ENGINES if any(f"rate {e}" in r for r in rows)]
    head = ["shape", "bench", "dtype", "matmul peak", "bandwidth", *(ENGINE_NAMES[e] for e in engines)]
    body = []
    for r in rows:
        lim = r["limit"]
        cells = [r["shape"], r["bench"], r["dtype"], f"{lim['peak_gflops']:.0f} GFLOP/s ({lim['peak_path']})",
                 f"{lim['bandwidth_gbps']:.1f} GB/s"]
        for e in engines:
            x = r.get(f"rate {e}")
            cells.append(f"{x['gflops']:.0f} ({x['peak_frac']:.0%}, {x['bw_frac']:.0%}) · {x['bound_frac']:.0%}"
                         if x else "-")
        body.append(cells)
    return head, body


def run_notes(cmp: Comparison) -> list[str]:
    """What a reader needs to know about how the engines ran: versions, llama.cpp's repacking."""
    out = [f"{k} {v}" for k, v in cmp.versions.items()]
    if not LLAMACPP_REPACK["on"]:
        out.append("llama.cpp ran with weight repacking off: its AMX path crashed on this CPU (see LLAMACPP_REPACK)")
    return out


def skip_notes(cmp: Comparison) -> list[str]:
    """Why each engine or cell was skipped, once per distinct reason."""
    out = [f"{ENGINE_NAMES.get(e, e)} skipped: {n}" for e, n in cmp.notes.items()]
    seen = set()
    for c in cmp.cells.values():
        if c.note and (c.engine, c.note) not in seen:
            seen.add((c.engine, c.note))
            out.append(f"{ENGINE_NAMES.get(c.engine, c.engine)} {c.shape} {c.bench} {c.dtype} skipped: {c.note}")
    return out


def print_table(cmp: Comparison, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"tinyllm vs other engines · {cpu_label(cmp.cpu)} · median of {cmp.args.repeat}",
              header_style="bold", caption_justify="left")
    engines, ratios, agree = table_columns(rows)
    for col in ("shape", "bench", "dtype", "unit", *(ENGINE_NAMES[e] for e in engines), *ratios,
                *(f"agree {ENGINE_NAMES[e]}" for e in agree)):
        t.add_column(col, justify="left" if col in ("shape", "bench", "dtype", "unit") else "right")
    for row in rows:
        cells = [_fmt(row.get(e)) for e in engines] + [_fmt(row.get(c), "x") for c in ratios]
        cells += [agreement_text(row.get(f"agree {e}")) for e in agree]
        t.add_row(row["shape"], row["bench"], row["dtype"], row["unit"], *cells)
    notes = skip_notes(cmp) + startup_notes(cmp) + run_notes(cmp)[len(cmp.versions):]
    t.caption = "\n".join(notes + [caption(cmp)])
    con = Console(stderr=True, width=240)
    con.print(t)
    head, body = limit_table(rows)
    if body:
        lt = Table(title=f"where the limit is · {cpu_label(cmp.cpu)} · achieved GFLOP/s (% matmul peak, % read "
                         "bandwidth) · % of the bound (least time), the workload's work for every engine",
                   header_style="bold")
        for col in head:
            lt.add_column(col, justify="left" if col in ("shape", "bench", "dtype") else "right")
        for cells in body:
            lt.add_row(*cells)
        con.print(lt)


def startup_notes(cmp: Comparison) -> list[str]:
    """Where start-up goes, from each engine's median run."""
    out = []
    for c in cmp.cells.values():
        if not c.bench.startswith("start-up") or not c.values:
            continue
        i = c.values.index(sorted(c.values)[(len(c.values) - 1) // 2])  # the (lower) median run
        v, run = c.values[i], c.runs[i]
        if c.engine == "vllm":
            parts = f"import vllm {run['import_s']:.1f} s, engine init {run['init_s']:.1f} s"
        elif "first_step_s" in run:
            parts = (f"load {run['load_s']:.1f} s, first step {run['first_step_s']:.2f} s, "
                     f"interpreter/imports/exit {run['other_s']:.1f} s")
        else:
            parts = f"load {run['load_s']:.1f} s, interpreter/imports/exit {v - run['load_s']:.1f} s"
        out.append(f"{c.bench} {c.dtype}, {ENGINE_NAMES[c.engine]}: {v:.1f} s = {parts}")
    return out


def caption(cmp: Comparison) -> str:
    shapes = "; ".join(f"{s}: {SHAPES[s].title}, {kv_gib(cmp.args, s)} GiB KV" for s in cmp.args.shapes)
    versions = ", ".join(f"{k} {v}" for k, v in cmp.versions.items())
    return (f"W1/W2/long: total tok/s ({shapes}); e2e: seconds on the 135m shape; single: decode tok/s on the "
            "default model (llama.cpp on its Q4_1 file); start-up: process start to generation; llama.cpp "
            "batched rows are llama-batched-bench at the mean prompt length; agree: sequences equal to "
            "transformers' greedy output / prefix fraction (int4 rows against transformers f32)"
            + (f"; {versions}" if versions else "") + ".")


def _fmt(v, suffix: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return "skipped"
    return f"{v:.2f}{suffix}" if suffix or v < 100 else f"{v:.1f}"
