"""Pictures of run stats: bench sweeps, inspect-blocks timelines and block maps, run summaries,
load sweeps.

Like ``report.py`` this only reads the stats dicts the tables read (bench rows, the inspect-blocks
report, a run summary) and computes nothing the engine did not record.

Invariants:
- matplotlib is an optional extra (``tinyllm[plot]``), imported only here and only through
  ``require_matplotlib``, which commands call before any model loads; it uses the Agg backend, so
  no display is ever needed.
- The output format follows the file's extension (.png or .svg). SVG keeps text as text and every
  data series carries a ``gid`` naming it, so a figure can be searched and checked as XML.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import TinyLLMError, UsageError

INSTALL = 'pip install "tinyllm[plot]"'
FORMATS = (".png", ".svg")
FREE, CACHED_FREE, SHARED = "#e4e4e4", "#b0b0b0", "#222222"  # sequences take tab20's other colours


def require_matplotlib():
    """Import matplotlib with the Agg backend, or stop with the install command (exit 2)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(f"plotting needs matplotlib, which is not installed; install it with {INSTALL}")
    return plt


def check_plot_path(path: Path) -> None:
    """Usage checks on a --plot / -o path, made before anything runs."""
    if path.suffix.lower() not in FORMATS:
        raise UsageError(f"a plot file must end in .png or .svg (the format follows the extension), not {str(path)!r}")
    if not path.parent.is_dir():
        raise UsageError(f"cannot write the plot {str(path)!r}: its folder does not exist")


def prepare(path: Path | None):
    """What a command does with its --plot option before loading anything."""
    if path is not None:
        check_plot_path(path)
        require_matplotlib()


def save(fig, path: Path) -> None:
    plt = require_matplotlib()
    try:
        with plt.rc_context({"svg.fonttype": "none"}):  # text stays text in SVG: findable, and smaller
            fig.savefig(path, dpi=100)
    except OSError as e:
        raise TinyLLMError(f"cannot write the plot {path}: {e.strerror or e}")
    finally:
        plt.close(fig)


def _figure(width: float, height: float, **kw):
    plt = require_matplotlib()
    return plt.figure(figsize=(width, height), layout="constrained", **kw)


# ---- bench ----------------------------------------------------------------------------------

def _series(row: dict) -> str:
    if row["cache_kind"] == "slot":
        return "slot"
    return f"paged, prefix {'on' if row.get('prefix_caching') else 'off'}"


def _gid(key: str, row: dict) -> str:
    """The SVG id of one row's artist in one panel, e.g. ``total_tokens_per_s/paged-prefix-on/16``
    (a simulate sweep's point instead of the block size: ``.../num_blocks=48``)."""
    series = _series(row).replace(", ", "-").replace(" ", "-")
    point = row.get("sweep") or ('slot' if row['cache_kind'] == 'slot' else row['block_size'])
    return f"{key}/{series}/{point}"


def _category(row: dict) -> str:
    if row.get("sweep"):  # a simulate sweep: x is the swept setting's value
        return row["sweep"].partition("=")[2]
    # The slot cache has no block size: its one reservation per sequence is max_model_len.
    return f"slot\n({row['block_size']}/seq)" if row["cache_kind"] == "slot" else str(row["block_size"])


def _x_label(rows: list[dict]) -> str:
    sweep = rows[0].get("sweep")
    return sweep.partition("=")[0].replace("_", " ") if sweep else "block size (tokens)"


def _bench_title(rows: list[dict]) -> str:
    r = rows[0]
    facts = " · ".join(str(r[k]) for k in ("model", "dtype") if k in r)
    facts += f" · gemm {r['gemm']}" if "gemm" in r else ""
    facts += f" · {r['device']}" if "device" in r else ""
    load = (f"{r['num_prompts']} prompts, ~{r['mean_input_len']:.0f} tokens in / {r['output_len']} out"
            if "num_prompts" in r else f"{r['num_requests']} requests")
    what = "simulate (step-cost profile)" if r.get("simulated") else "bench"
    kv = sorted({x["kv_bytes"] for x in rows})
    kv_text = _mib(kv[0]) if len(kv) == 1 else f"{_mib(kv[0])} to {_mib(kv[-1])}"
    return f"tinyllm {what} · {facts}\n{load} · KV {kv_text} per run"


def _mib(b: int) -> str:
    mib = b / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2g} MiB"


class _Bars:
    """Grouped bars: x = block size (and a slot category), one bar per series within a group."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.x_label = _x_label(rows)
        self.cats = list(dict.fromkeys(_category(r) for r in rows))
        self.series = list(dict.fromkeys(_series(r) for r in rows))
        self.colors = {s: f"C{i}" for i, s in enumerate(self.series)}
        self.x = {}  # row index -> x position, groups centred on their category
        width = 0.8 / max(1, max(sum(_category(r) == c for r in rows) for c in self.cats))
        for ci, c in enumerate(self.cats):
            members = [i for i, r in enumerate(rows) if _category(r) == c]
            for j, i in enumerate(members):
                self.x[i] = ci + (j - (len(members) - 1) / 2) * width
        self.width = width

    def draw(self, ax, key: str, unit: str, scale: float = 1.0, fmt: str = "{:.0f}", alpha: float = 1.0,
             label: str | None = "edge"):
        """One bar per row; ``label`` puts its value on the bar's top edge or (where a peak tick
        sits above the bar) in its centre."""
        for i, r in enumerate(self.rows):
            v = r[key] * scale
            bars = ax.bar(self.x[i], v, self.width * 0.92, color=self.colors[_series(r)], alpha=alpha)
            bars.patches[0].set_gid(_gid(key, r))
            if label and len(self.rows) <= 12:
                ax.bar_label(bars, [fmt.format(v)], fontsize=7, padding=1, label_type=label,
                             color="white" if label == "center" else "black")
        ax.set_ylabel(unit)

    def peaks(self, ax, key: str, scale: float = 1.0):
        """Black ticks for the peak of a quantity whose mean the bars show."""
        for i, r in enumerate(self.rows):
            line, = ax.plot([self.x[i]], [r[key] * scale], marker="_", markersize=14, mew=2, color="black")
            line.set_gid(_gid(key, r))

    def axis(self, ax, title: str, integer: bool = False):
        from matplotlib.ticker import MaxNLocator
        if integer:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(self.cats)), self.cats)
        ax.set_xlabel(self.x_label)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)


def _reference_lines(ax, rows: list[dict]) -> None:
    """The transformers baseline and the GEMM roofline as horizontal lines; a roofline far above
    every bar would flatten them, so then it stays in the legend, marked off the scale."""
    ref = rows[0].get("reference") or {}
    top = max(r["total_tokens_per_s"] for r in rows)
    if "hf" in ref:
        v = ref["hf"]["total_tokens_per_s"]
        top = max(top, v)
        ax.axhline(v, color="tab:red", ls="--", lw=1.2, gid="baseline/hf",
                   label=f"transformers generate: {v:.0f} total tok/s")
    if "roofline" in ref:
        v = ref["roofline"]["roofline_tokens_per_s"]
        far = v > 2.5 * top
        ax.axhline(v, color="black", ls=":", lw=1.2, gid="roofline",
                   label=f"GEMM roofline ({ref['roofline'].get('gemm', '')}): {v:.0f} tok/s"
                         + (" (above the scale)" if far else ""))
        ax.set_ylim(0, (top if far else max(top, v)) * 1.25)


def bench_figure(rows: list[dict]):
    """One panel per quantity; per panel one bar per sweep row (colour = cache kind and prefix
    setting, x = block size); means as bars with peaks as black ticks."""
    from matplotlib.patches import Patch
    fig = _figure(13, 7.5)
    axes = fig.subplots(2, 3)
    b = _Bars(rows)
    ax = axes[0, 0]
    b.draw(ax, "total_tokens_per_s", "tokens / s", alpha=0.35)
    b.draw(ax, "output_tokens_per_s", "tokens / s")
    _reference_lines(ax, rows)
    b.axis(ax, "throughput: total (pale) and output (solid)")
    ax = axes[0, 1]
    b.draw(ax, "mean_block_utilization", "% of allocated slots holding tokens", scale=100, fmt="{:.0f}%",
           label="center")
    b.peaks(ax, "peak_block_utilization", scale=100)
    ax.set_ylim(0, 112)
    b.axis(ax, "block utilization: mean (bar), peak (tick)")
    ax = axes[0, 2]
    b.draw(ax, "mean_wasted_slots", "token slots allocated but empty", label="center")
    b.peaks(ax, "peak_wasted_slots")
    b.axis(ax, "wasted slots: mean (bar), peak (tick)")
    ax = axes[1, 0]
    b.draw(ax, "peak_running", "sequences")
    b.axis(ax, "peak concurrent sequences", integer=True)
    ax = axes[1, 1]
    b.draw(ax, "preemptions", "preemptions (recompute)")
    ax.set_ylim(bottom=0, top=max(1, max(r["preemptions"] for r in rows)) * 1.2)
    b.axis(ax, "preemptions", integer=True)
    ax = axes[1, 2]
    ax.axis("off")
    handles = [Patch(color=b.colors[s], label=s) for s in b.series]
    handles += [Patch(color="grey", alpha=0.35, label="total tok/s (pale)"),
                Patch(color="grey", label="output tok/s (solid)")]
    ref_handles, _ = axes[0, 0].get_legend_handles_labels()
    ax.legend(handles=handles + ref_handles, loc="upper left", fontsize=9, title="rows of the sweep",
              frameon=False)
    fig.suptitle(_bench_title(rows), fontsize=11)
    return fig


# ---- inspect-blocks -------------------------------------------------------------------------

def _map_shape(n: int) -> tuple[int, int]:
    cols = min(n, 64) if n <= 64 * 16 else math.ceil(math.sqrt(n * 4))
    return math.ceil(n / cols), cols


SEQ_COLORS = [i for i in range(20) if i not in (14, 15)]  # tab20 without its greys (free, cached)


def _seq_color(sid: int):
    from matplotlib import colormaps
    return colormaps["tab20"](SEQ_COLORS[sid % len(SEQ_COLORS)])


def inspect_figure(report: dict):
    """Top: blocks in use per step, stacked (held by one sequence, shared, cached but free) under
    the pool size; middle: running and waiting sequences; preemptions marked in both; the
    snapshot's step marked. Bottom: the block map at that step, one cell per block."""
    from .report import moment
    snap, steps, summary = report["snapshot"], report["timeline"], report["summary"]
    rows, cols = _map_shape(snap["num_blocks"])
    fig = _figure(12, 6.5 + min(rows, 16) * 0.28)
    grid = fig.add_gridspec(3, 1, height_ratios=[2.2, 1.3, 0.6 + min(rows, 16) * 0.35])
    ax_b, ax_s, ax_m = (fig.add_subplot(grid[i]) for i in range(3))
    x = [s["step"] for s in steps]
    shared = [s.get("shared_blocks", 0) for s in steps]
    single = [s["blocks_used"] - sh for s, sh in zip(steps, shared)]
    cached = [s.get("cached_free", 0) for s in steps]
    polys = ax_b.stackplot(x, single, shared, cached, step="post",
                           colors=["tab:blue", SHARED, CACHED_FREE],
                           labels=["held by one sequence", "shared by several sequences (prefix cache)",
                                   "free, still holding a cached prefix"])
    for p, gid in zip(polys, ("blocks/single", "blocks/shared", "blocks/cached-free")):
        p.set_gid(gid)
    ax_b.axhline(snap["num_blocks"], color="black", lw=1, ls="--", label=f"pool: {snap['num_blocks']} blocks")
    ax_b.set_ylim(0, snap["num_blocks"] * 1.12)
    ax_b.set_ylabel(f"blocks ({snap['block_size']} tokens each)")
    ax_b.set_title(f"blocks in use per step (peak {summary['peak_blocks_used']} of {snap['num_blocks']})",
                   fontsize=10)
    ax_s.step(x, [s["running"] for s in steps], where="post", color="tab:green", label="running", gid="seqs/running")
    ax_s.step(x, [s["waiting"] for s in steps], where="post", color="tab:orange", label="waiting", gid="seqs/waiting")
    ax_s.set_ylabel("sequences")
    ax_s.set_xlabel("engine step")
    ax_s.set_title("running and waiting sequences", fontsize=10)
    from matplotlib.ticker import MaxNLocator
    for ax, panel in ((ax_b, "blocks"), (ax_s, "seqs")):
        _mark_steps(ax, panel, report.get("preemption_steps", []), snap["step"])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(x[0] if x else 0, (x[-1] + 1) if x else 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    _block_map(ax_m, snap, rows, cols)
    ax_m.set_title(f"block map at step {snap['step']} ({moment(report['at'], snap)}): {snap['blocks_used']} used, "
                   f"{snap['blocks_free']} free, utilization {snap['utilization']:.1%}", fontsize=10)
    fig.suptitle(f"tinyllm inspect-blocks · {summary['num_requests']} requests · paged cache "
                 f"{snap['num_blocks']} x {snap['block_size']} tokens · {summary['preemptions']} preemptions",
                 fontsize=11)
    return fig


def _mark_steps(ax, panel: str, preemptions: list[int], at_step: int) -> None:
    for i, p in enumerate(preemptions):
        ax.axvline(p, color="tab:red", lw=1, alpha=0.8, gid=f"{panel}/preemption/{p}",
                   label="preemption" if i == 0 else None)
    ax.axvline(at_step, color="black", lw=1.2, ls=":", gid=f"{panel}/snapshot", label=f"map's step ({at_step})")


def _block_map(ax, snap: dict, rows: int, cols: int) -> None:
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch
    n = snap["num_blocks"]
    cached = set(snap["cached_free"])
    img = [[(0.0, 0.0, 0.0, 0.0)] * cols for _ in range(rows)]  # cells past the pool stay blank
    for b in range(n):
        owner, refs = snap["owner"][b], snap["refs"][b]
        color = (FREE if owner is None and b not in cached else CACHED_FREE if owner is None
                 else SHARED if refs > 1 else _seq_color(owner))
        img[b // cols][b % cols] = to_rgba(color)
    im = ax.imshow(img, aspect="auto", interpolation="nearest", extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
    im.set_gid("block-map")
    ax.set_xticks([c - 0.5 for c in range(1, cols)], minor=True)  # white lines between cells
    ax.set_yticks([r - 0.5 for r in range(1, rows)], minor=True)
    ax.grid(which="minor", color="white", lw=0.8 if cols <= 64 else 0.3)
    ax.tick_params(which="minor", length=0)
    if n <= 256:  # cells are big enough to name their owner (or share count)
        for b in range(n):
            owner, refs = snap["owner"][b], snap["refs"][b]
            if owner is not None:
                ax.text(b % cols, b // cols, f"x{refs}" if refs > 1 else str(owner), ha="center", va="center",
                        fontsize=6, color="white" if refs > 1 else "black")
    ax.set_xticks([])
    ax.set_yticks(range(rows), [f"{r * cols}" for r in range(rows)] if rows <= 16 else [""] * rows)
    ax.set_ylabel("first block\nof the row", fontsize=8)
    owners = sorted({t["seq_id"] for t in snap["tables"]})
    handles = [Patch(color=_seq_color(s), label=f"seq {s}") for s in owners[:18]]
    handles += [Patch(color=SHARED, label="shared (x refs)"), Patch(color=CACHED_FREE, label="cached, free"),
                Patch(facecolor=FREE, edgecolor="grey", label="free")]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False,
              ncols=2 if len(handles) > 8 else 1,
              title=f"owner (first 18 of {len(owners)} seqs)" if len(owners) > 18 else "owner", title_fontsize=8)


# ---- a single run's summary (generate / serve-batch / inspect-blocks --stats-json) -----------

def run_figure(s: dict):
    fig = _figure(12, 7)
    axes = fig.subplots(2, 2)
    ax = axes[0, 0]
    bars = ax.bar(["output", "total"], [s["output_tokens_per_s"], s["total_tokens_per_s"]],
                  color=["tab:blue", "tab:cyan"])
    for p, gid in zip(bars.patches, ("output_tokens_per_s", "total_tokens_per_s")):
        p.set_gid(gid)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"throughput ({s['prompt_tokens']} prompt + {s['output_tokens']} output tokens "
                 f"in {s['elapsed_s']:.2f} s)", fontsize=10)
    ax.margins(y=0.15)
    ax = axes[0, 1]
    names = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("latency_s", "latency")]
    for j, p in enumerate(("p50", "p90", "p99")):
        vals = [(s[k][p] or 0) * 1000 for k, _ in names]
        bars = ax.bar([i + (j - 1) * 0.27 for i in range(3)], vals, 0.25, label=p, color=f"C{j}")
        for patch, (k, _) in zip(bars.patches, names):
            patch.set_gid(f"{k}/{p}")
    ax.set_xticks(range(3), [n for _, n in names])
    ax.set_yscale("log")
    ax.set_ylabel("milliseconds (log scale)")
    ax.set_title("per-request latency percentiles", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    labels = ["block utilization\nmean", "block utilization\npeak", "pool used\nat peak"]
    vals = [s["mean_block_utilization"] * 100, s["peak_block_utilization"] * 100,
            100 * s["peak_blocks_used"] / max(1, s["num_blocks"])]
    bars = ax.bar(labels, vals, color=["tab:green", "tab:green", "tab:purple"])
    for patch, gid in zip(bars.patches, ("mean_block_utilization", "peak_block_utilization", "peak_blocks_used")):
        patch.set_gid(gid)
    ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    ax.set_ylim(0, 115)
    ax.set_ylabel("%")
    ax.set_title(f"memory: {s['cache_kind']} {s['num_blocks']} x {s['block_size']} tokens, peak "
                 f"{s['peak_blocks_used']} blocks, {s['peak_running']} seqs, {s['preemptions']} preemptions",
                 fontsize=10)
    ax = axes[1, 1]
    phases = s.get("phases_s") or {}
    if phases:
        bars = ax.barh(list(phases), list(phases.values()), color="tab:gray")
        for patch, k in zip(bars.patches, phases):
            patch.set_gid(f"phase/{k}")
        ax.bar_label(bars, fmt="%.3f s", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds of wall time")
        ax.margins(x=0.2)
    ax.set_title("where the wall time went (engine phases)", fontsize=10)
    facts = " · ".join(str(s[k]) for k in ("model", "dtype", "device") if k in s)
    fig.suptitle(f"tinyllm run · {s['num_requests']} requests ({s['num_failed']} failed)"
                 + (f" · {facts}" if facts else ""), fontsize=11)
    return fig


# ---- a tinyllm load run (load --json) --------------------------------------------------------

LOAD_PANELS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("latency_s", "end-to-end latency"))


def load_figure(report: dict):
    """Top: each latency's p50 / p90 / p99 against the offered request rate (rates evenly
    spaced, so inf has a place), and achieved throughput and goodput against it. Bottom: one
    run's per-request timeline (the highest rate's): each request from its scheduled send to
    its end, waiting for the first token in grey, streaming in colour, failures in red."""
    runs = report["runs"]
    fig = _figure(13, 8)
    grid = fig.add_gridspec(2, 4, height_ratios=[1, 1.15])
    x = list(range(len(runs)))
    labels = [str(r["request_rate"]) for r in runs]
    for i, (key, name) in enumerate(LOAD_PANELS):
        ax = fig.add_subplot(grid[0, i])
        for j, p in enumerate(("p50", "p90", "p99")):
            ys = [(r["summary"][key][p] or math.nan) * 1000 for r in runs]
            ax.plot(x, ys, marker="o", color=f"C{j}", label=p, gid=f"{key}/{p}")
        _rate_axis(ax, x, labels)
        ax.set_ylabel("milliseconds")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
    ax = fig.add_subplot(grid[0, 3])
    ax.plot(x, [r["summary"]["requests_per_s"] for r in runs], marker="o", color="tab:blue",
            label="completed req/s", gid="requests_per_s")
    if any("slo" in r["summary"] for r in runs):
        ax.plot(x, [r["summary"].get("slo", {}).get("goodput_req_per_s", math.nan) for r in runs], marker="s",
                color="tab:green", label="goodput req/s", gid="goodput_req_per_s")
    _rate_axis(ax, x, labels)
    ax.set_ylabel("requests / s")
    ax.set_title("throughput and goodput", fontsize=10)
    ax.legend(fontsize=8)
    _load_timeline(fig.add_subplot(grid[1, :]), runs[-1])
    fig.suptitle(f"tinyllm load · {report.get('model')} · {report.get('endpoint')} · {report.get('url')}", fontsize=11)
    return fig


def _rate_axis(ax, x: list[int], labels: list[str]) -> None:
    ax.set_xticks(x, labels)
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylim(bottom=0)


def _load_timeline(ax, run: dict) -> None:
    recs = sorted(run["records"], key=lambda r: r["scheduled_s"])
    for y, r in enumerate(recs):
        start = r["sent_s"] if r["sent_s"] is not None else r["scheduled_s"]
        if r["error"] is not None or r["latency_s"] is None:
            ax.plot([r["scheduled_s"], start], [y, y], color="tab:red", lw=1.5, gid=f"request/{r['index']}/failed")
            ax.plot([start], [y], marker="x", color="tab:red", ms=3)
            continue
        first = start + (r["ttft_s"] or 0.0)
        ax.plot([r["scheduled_s"], first], [y, y], color="0.7", lw=1.5, gid=f"request/{r['index']}/waiting")
        ax.plot([first, start + r["latency_s"]], [y, y], color="tab:blue", lw=1.5,
                gid=f"request/{r['index']}/streaming")
    ax.set_xlabel("seconds from the run's start")
    ax.set_ylabel("request (by send time)")
    s = run["summary"]
    ax.set_title(f"per-request timeline at rate {run['request_rate']}: scheduled send to first token (grey), "
                 f"streaming (blue), failed (red) · {s['num_completed']} completed, {s['num_failed']} failed",
                 fontsize=10)


# ---- a saved JSON, drawn again --------------------------------------------------------------

def stats_kind(data) -> str | None:
    """What a saved JSON is: 'bench' (bench --json rows), 'inspect' (inspect-blocks --json),
    'run' (a --stats-json summary) or 'load' (load --json); None for anything else."""
    if isinstance(data, list) and data and all(isinstance(r, dict) and {"cache_kind", "block_size",
                                                                       "total_tokens_per_s"} <= r.keys()
                                               for r in data):
        return "bench"
    if isinstance(data, dict) and {"snapshot", "timeline", "summary", "at"} <= data.keys():
        return "inspect"
    if isinstance(data, dict) and {"num_requests", "output_tokens_per_s", "ttft_s", "cache_kind"} <= data.keys():
        return "run"
    if isinstance(data, dict) and data.get("kind") == "load" and isinstance(data.get("runs"), list) and data["runs"]:
        return "load"
    return None


FIGURES = {"bench": bench_figure, "inspect": inspect_figure, "run": run_figure, "load": load_figure}


def draw(kind: str, data, path: Path) -> None:
    """Draw stats of a known kind (see ``stats_kind``) into ``path``."""
    save(FIGURES[kind](data), path)


def plot_saved(stats_path: Path, out: Path) -> str:
    """Draw a saved stats JSON into ``out``; returns the kind drawn."""
    check_plot_path(out)
    require_matplotlib()
    try:
        data = json.loads(stats_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"stats file {str(stats_path)!r} does not exist")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"cannot read {str(stats_path)!r} as JSON: {getattr(e, 'strerror', None) or e}")
    kind = stats_kind(data)
    if kind is None:
        raise UsageError(f"{str(stats_path)!r} is not a file tinyllm can draw: it takes the JSON of bench --json, "
                         f"inspect-blocks --json, load --json or a --stats-json run summary")
    try:
        fig = FIGURES[kind](data)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise UsageError(f"{str(stats_path)!r} looks like {kind} stats but is missing or has bad fields ({e!r})")
    save(fig, out)
    return kind
