"""``python -m benchmarks.report``: the comparison tables of docs/performance.md, rendered from the
stored results (``benchmarks/results/*.json``, see results.py) as markdown on stdout (``--summary``:
the front page's short table; ``--serving``: the serving comparison, serving_results.py);
``--write FILE`` puts each between the file's markers instead.

One table per CPU class; a class of runs capped to AVX2 on a wider host (``compare --isa avx2``)
also shows greedy agreement, how each engine was capped and what verified it, the host's AVX2
limits and each engine's fraction of them (render_capped). Invariant: each row (shape, bench, dtype) comes whole from the latest
run that measured it, so the figures and ratios of a row are always from one run (figures of
different runs are never divided); its ``run`` column names that run, described under the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .agreement import agreement_text
from .common import ENGINE_NAMES, ENGINES
from .results import RESULTS_DIR, Result, ResultError, load
from .serving_results import BEGIN as SERVING_BEGIN
from .serving_results import END as SERVING_END
from .serving_results import SERVING_DIR
from .serving_results import block as serving_block
from .serving_results import load as load_serving
from .serving_results import render as render_serving

BEGIN = "<!-- results: rendered by python -m benchmarks.report from benchmarks/results; do not edit by hand -->"
END = "<!-- end of results -->"
SUMMARY_BEGIN = "<!-- summary: rendered by python -m benchmarks.report --summary; do not edit by hand -->"
SUMMARY_END = "<!-- end of summary -->"
SUMMARY_DTYPES = ("float32", "bfloat16", "int4")
SHAPE_ORDER = ("135m", "1.5b", "real")
BENCH_ORDER = ("W1", "W2", "long", "single", "e2e", "start-up", "start-up, default model")
DTYPE_ORDER = ("float32", "bfloat16", "int4", "q4_1")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _rank(value: str, order: tuple) -> tuple:
    return (order.index(value), "") if value in order else (len(order), value)


def row_key(fig: dict) -> tuple:
    return fig["shape"], fig["bench"], fig["dtype"]


def sort_key(key: tuple) -> tuple:
    shape, bench, dtype = key
    return _rank(shape, SHAPE_ORDER), _rank(bench, BENCH_ORDER), _rank(dtype, DTYPE_ORDER)


def latest_rows(results: list[Result]) -> dict[tuple, tuple[Result, dict]]:
    """(shape, bench, dtype) -> (the latest run that measured the row, its figures by engine)."""
    rows: dict[tuple, tuple[Result, dict]] = {}
    for res in results:  # oldest first: a later run replaces a row whole
        mine: dict[tuple, dict] = {}
        for fig in res.data["figures"]:
            mine.setdefault(row_key(fig), {})[fig["engine"]] = fig
        rows.update({k: (res, figs) for k, figs in mine.items()})
    return rows


def fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f}" if value >= 100 else f"{value:.2f}"


def ratio(mine: dict | None, theirs: dict | None) -> str:
    """tinyllm / other for tok/s, other / tinyllm for seconds: above 1 is tinyllm ahead."""
    if theirs and theirs["value"] is None:
        return "n/a"  # the other engine cannot run this row (its note says why)
    if not mine or not theirs or mine["value"] is None:
        return "-"
    r = mine["value"] / theirs["value"] if mine["unit"] == "tok/s" else theirs["value"] / mine["value"]
    return f"{r:.2f}x"


def run_line(letter: str, res: Result) -> str:
    """What one run was: when, which commit, where, how, with what; its notes."""
    d, cpu, s = res.data, res.data["cpu"], res.data["settings"]
    commit = f"commit {d['commit']}" if d["commit"] else "commit not recorded"
    where = f"CPU: {cpu['cores']} cores of {cpu['model_name']}" + (
        f" (family {cpu['family']} model {cpu['model']})" if cpu.get("family") is not None else "")
    how = [f"`{s['command']}`" if s.get("command") else None,
           f"{s.get('statistic', 'median')} of {s['rounds']} interleaved rounds" if s.get("rounds") else None]
    versions = ", ".join(f"{k} {v}" for k, v in d["versions"].items() if v)
    parts = [f"Recorded {d['recorded'].replace('T', ' ').replace('Z', ' UTC')}", commit, where, *filter(None, how)]
    line = f"- **{letter}**: " + "; ".join(parts) + "."
    if versions:
        line += f" Versions: {versions}."
    if d["source"] != "measured":
        line += f" {d['source'][0].upper()}{d['source'][1:]}."
    notes = list(d["notes"]) + [f"{ENGINE_NAMES[f['engine']]} {f['shape']} {f['bench']} {f['dtype']}: {f['note']}"
                                for f in d["figures"] if f.get("note")]
    return line + "".join(f" {n.rstrip('.')}." for n in notes)


def render_class(cls: str, results: list[Result], agree: bool = False) -> str:
    """The markdown of one CPU class: heading, table (``agree``: with each engine's greedy
    agreement), then the runs its rows come from."""
    rows = latest_rows(results)
    keys = sorted(rows, key=sort_key)
    engines = [e for e in ENGINES if any(e in rows[k][1] for k in keys)]
    others = sorted((e for e in engines if e != "tinyllm"), key=lambda e: e == "hf")  # transformers last
    agreeing = [e for e in engines if agree and any("agree" in rows[k][1].get(e, {}) for k in keys)]
    letters = run_letters(rows, keys)
    head = ["shape", "bench", "dtype", "unit", *(ENGINE_NAMES[e] for e in engines),
            *(f"/ {ENGINE_NAMES[e]}" for e in others if "tinyllm" in engines),
            *(f"agree {ENGINE_NAMES[e]}" for e in agreeing), "run"]
    lines = [f"### {cls}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        res, figs = rows[k]
        unit = next(iter(figs.values()))["unit"]
        cells = [*k, unit, *(fmt(figs[e]["value"]) if e in figs else "-" for e in engines)]
        if "tinyllm" in engines:
            cells += [ratio(figs.get("tinyllm"), figs.get(e)) for e in others]
        cells += [agreement_text(figs.get(e, {}).get("agree")) for e in agreeing]
        lines.append("| " + " | ".join([*cells, letters[res.path]]) + " |")
    by_path = {r.path: r for r in results}
    lines += [""] + [run_line(letter, by_path[p]) for p, letter in letters.items()]
    return "\n".join(lines) + "\n"


def run_letters(rows: dict, keys: list) -> dict[Path, str]:
    """a, b, c, ... for the runs the rows come from, in the rows' order."""
    letters: dict[Path, str] = {}
    for k in keys:
        letters.setdefault(rows[k][0].path, LETTERS[len(letters)])
    return letters


def is_capped(res: Result) -> bool:
    return bool(res.data["cpu"].get("isa_cap"))


def render_capped(cls: str, results: list[Result]) -> str:
    """A class of runs capped to AVX2 on a wider host (compare --isa avx2): the table with greedy
    agreement, then per run how each engine was capped and what verified it; then this host's AVX2
    limits (the best each run measured: a busy moment can only lower a measurement) and, on the
    float32 rows, each engine's rates as fractions of them."""
    rows = latest_rows(results)
    keys = sorted(rows, key=sort_key)
    letters = run_letters(rows, keys)
    by_path = {r.path: r for r in results}
    out = [render_class(cls, results, agree=True)]
    for path, letter in letters.items():
        res = by_path[path]
        out.append(f"How each engine was capped in run **{letter}**, and what verified it:\n\n"
                   + "\n".join(cap_line(e, c) for e, c in res.data.get("isa", {}).get("engines", {}).items()) + "\n")
    measured = [(letter, by_path[p]) for p, letter in letters.items() if by_path[p].data.get("host_limits")]
    if measured:
        best = best_limits([res.data["host_limits"] for _, res in measured])
        out.append(limits_text(best, [letter for letter, _ in measured], rows, keys, letters))
    return "\n".join(out)


FIGURES = ("fma_gflops", "l1_load_gbps", "stream_gbps")


def best_limits(measurements: list[dict]) -> dict:
    """Per thread count (``1t``, ``2t``), each figure the best any measurement reached."""
    best: dict[str, dict] = {}
    for hl in measurements:
        for t, v in hl.items():
            if isinstance(v, dict):
                best[t] = {k: max(best.get(t, {}).get(k, 0.0), v[k]) for k in FIGURES}
    return {"instructions": measurements[-1].get("instructions"), **best}


def limits_text(best: dict, sources: list[str], rows: dict, keys: list, letters: dict) -> str:
    """The host's AVX2 + FMA limits, and on each float32 row each engine's GFLOP/s as a fraction of
    the 2-thread FMA limit and its GB/s of the 2-thread memory stream (an int4 row's arithmetic is
    integer dot products, not f32 FMAs, so it is left out)."""
    two = best.get("2t") or best.get("1t") or {}
    per = "; ".join(f"{t}: FMA {v['fma_gflops']} GFLOP/s, L1 loads {v['l1_load_gbps']} GB/s, memory stream "
                    f"{v['stream_gbps']} GB/s" for t, v in best.items() if isinstance(v, dict))
    lines = [f"This host's AVX2 + FMA limits (benchmarks/hostlimits, {best.get('instructions')}; each figure the "
             f"best that runs {', '.join(f'**{x}**' for x in sources)} measured; 1t / 2t = threads): {per}.", ""]
    engines = [e for e in ENGINES if any(e in rows[k][1] for k in keys)]
    head = ["shape", "bench", "dtype", "FLOP/token", "bytes/token",
            *(f"{ENGINE_NAMES[e]} GFLOP/s (% FMA) · GB/s (% stream)" for e in engines), "run"]
    table = []
    for k in keys:
        res, figs = rows[k]
        w = (res.data.get("limits") or {}).get("/".join(k))
        if k[2] != "float32" or not w:
            continue
        cells = [*k, f"{w['flops_per_token'] / 1e6:.0f} M", f"{w['bytes_per_token'] / 1e6:.1f} MB"]
        for e in engines:
            f = figs.get(e)
            if not f or not f["value"] or f["unit"] != "tok/s":
                cells.append("-")
                continue
            gflops, gbps = f["value"] * w["flops_per_token"] / 1e9, f["value"] * w["bytes_per_token"] / 1e9
            cells.append(f"{gflops:.0f} ({gflops / two['fma_gflops']:.0%}) · {gbps:.1f} ({gbps / two['stream_gbps']:.0%})")
        table.append("| " + " | ".join([*cells, letters[res.path]]) + " |")
    if table:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *table, ""]
    return "\n".join(lines)


def cap_line(engine: str, check: dict) -> str:
    """One engine's cap as stored (results.capped_parts): how, whether verified, what was wider."""
    state = {True: "verified", False: "**not fully capped**", None: "not verified in this run"}[check.get("ok")]
    seen = [f"{k} {', '.join(v) if isinstance(v, list) else v}" for k, v in check.items()
            if k in ("panel_isa", "torch_cpu_capability", "vllm_c_libs")]
    probe = check.get("torch_probe") or {}
    if probe.get("onednn_isa"):
        seen.append(f"oneDNN reports {probe['onednn_isa']}")
    if "nodes_by_isa" in check:
        seen.append("CPU plugin nodes by ISA " + ", ".join(f"{k}: {v}" for k, v in check["nodes_by_isa"].items()))
    if "system_info" in check:
        seen.append("system_info " + ", ".join(k for k, v in check["system_info"].items() if v))
    wider = f"; still wider: {check['uncapped']}" if check.get("uncapped") else ""
    return f"- {ENGINE_NAMES.get(engine, engine)}: {check.get('how') or '?'}. {state}" + (
        f" ({'; '.join(seen)})" if seen else "") + wider + "."


def render(results: list[Result]) -> str:
    """Every CPU class's table, the class with the most recent run first."""
    classes: dict[str, list[Result]] = {}
    for res in results:
        classes.setdefault(res.cpu_class, []).append(res)
    order = sorted(classes, key=lambda c: max(r.order for r in classes[c]), reverse=True)
    return "\n".join(render_capped(c, classes[c]) if any(map(is_capped, classes[c])) else render_class(c, classes[c])
                     for c in order)


def summary(results: list[Result]) -> str:
    """The front page's table: per CPU class and precision, the 135m shape's W1 and W2 as tinyllm's
    ratio to each other engine (from the same rows as the full tables). Runs capped to AVX2 on a
    wider host are left to docs/performance.md: they approximate another CPU, with caveats per
    engine that a one-line summary cannot carry."""
    classes: dict[str, list[Result]] = {}
    for res in results:
        if not is_capped(res):
            classes.setdefault(res.cpu_class, []).append(res)
    others = ("openvino", "vllm", "llamacpp")
    head = ["CPU", "dtype", "tinyllm W1 tok/s", *(f"/ {ENGINE_NAMES[e]} (W1, W2)" for e in others), "recorded"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cls in sorted(classes, key=lambda c: max(r.order for r in classes[c]), reverse=True):
        rows = latest_rows(classes[cls])
        for dtype in SUMMARY_DTYPES:
            w1, w2 = rows.get(("135m", "W1", dtype)), rows.get(("135m", "W2", dtype))
            if not w1 or "tinyllm" not in w1[1]:
                continue
            pairs = [", ".join(ratio(r[1].get("tinyllm"), r[1].get(e)) if r else "-" for r in (w1, w2)) for e in others]
            dates = sorted({r[0].data["recorded"][:10] for r in (w1, w2) if r})
            lines.append("| " + " | ".join([cls, dtype, fmt(w1[1]["tinyllm"]["value"]), *pairs, " / ".join(dates)]) + " |")
    return "\n".join(lines) + "\n"


def block(results: list[Result]) -> str:
    return f"{BEGIN}\n\n{render(results)}\n{END}"


def summary_block(results: list[Result]) -> str:
    return f"{SUMMARY_BEGIN}\n\n{summary(results)}\n{SUMMARY_END}"


def replace_block(text: str, new_block: str, name: str = "the file", begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the part between the markers (markers included) replaced by ``new_block``."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ResultError(f"{name} needs the markers {begin!r} and {end!r}, once each, in that order")
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[:start] + new_block + text[stop:]


def write_into(path: Path, results: list[Result], serving_dir: Path = SERVING_DIR) -> None:
    """Replace the tables' block, the summary's block, the serving comparison's block (rendered
    from ``serving_dir``), whichever ``path`` holds."""
    text = path.read_text()
    blocks = [(BEGIN, END, block), (SUMMARY_BEGIN, SUMMARY_END, summary_block),
              (SERVING_BEGIN, SERVING_END, lambda _: serving_block(load_serving(serving_dir)))]
    present = [(b, e, f) for b, e, f in blocks if b in text or e in text]
    if not present:
        raise ResultError(f"{path} has none of the tables', the summary's or the serving comparison's markers "
                          f"({BEGIN!r}, {SUMMARY_BEGIN!r}, {SERVING_BEGIN!r})")
    for b, e, f in present:
        text = replace_block(text, f(results), str(path), b, e)
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                description="Render the comparison tables (markdown, one per CPU class) from the "
                                            "stored results; stdout, or --write into a file's marked block.")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="the results directory (default %(default)s)")
    p.add_argument("--summary", action="store_true", help="the front page's short table instead (README.md)")
    p.add_argument("--serving", action="store_true",
                   help="the serving comparison instead (from benchmarks/results/serving)")
    p.add_argument("--write", type=Path, action="append", default=[],
                   help="replace the marked blocks of this markdown file instead of printing (repeatable: "
                        "docs/performance.md, README.md)")
    a = p.parse_args(argv)
    try:
        results = load(a.results)
        if not results:
            raise ResultError(f"no result files in {a.results}")
        for path in a.write:
            write_into(path, results, a.results / "serving")
            print(f"wrote what {len(results)} stored runs give into {path}", file=sys.stderr)
        if a.serving and not a.write:
            sys.stdout.write(render_serving(load_serving(a.results / "serving")))
        elif not a.write:
            sys.stdout.write(summary(results) if a.summary else render(results))
    except (ResultError, OSError) as e:
        print(f"benchmarks.report: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
