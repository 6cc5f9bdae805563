"""``tinyllm inspect-blocks``: run a workload on the paged cache and show its memory at one moment
(block map, block tables, free list) plus the whole run's utilization / free-block timeline.

The moment is caught by a ``Recorder``, an engine observer that reads the cache's public
snapshot (``cache/snapshot.py``). On Ray workers each worker's engine runs its own recorder and
sends it back, so a cluster run shows every worker's pool.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.table import Table

from ..cache.snapshot import take
from ..config import Config
from ..errors import TinyLLMError, UsageError
from ..report import block_map, marks_line, moment, run_table, sparkline, stderr_console
from ..workload import Workload, requests_for
from .common import open_llm, write_json


def parse_at(at: str) -> str | int:
    if at in ("peak", "end"):
        return at
    try:
        step = int(at)
    except ValueError:
        raise UsageError(f"--at takes peak, end or a step number, not {at!r}")
    if step < 0:
        raise UsageError(f"--at step must be >= 0, not {step}")
    return step


def snapshot(engine, step: int) -> dict:
    """The engine's pool at ``step`` as the report's JSON: who owns each block, each table."""
    snap = take(engine.cache)
    seqs = engine.running_sequences()  # seq id -> (request id, fork)
    owner: list[int | None] = [None] * snap.num_blocks
    holders: dict[int, list[int]] = {}
    tables = []
    for sid, table in snap.tables.items():
        for b in table:
            owner[b] = sid
            holders.setdefault(b, []).append(sid)
        n, bs = snap.lens[sid], snap.block_size
        rid, fork = seqs.get(sid, (None, None))
        tables.append({"seq_id": sid, "request_id": rid, "fork": fork, "tokens": n, "blocks": list(table),
                       "last_block_fill": (n - (len(table) - 1) * bs) if table else 0,
                       "slots_allocated": len(table) * bs})
    u, refs = snap.usage, list(snap.refs)
    shared = [{"block": b, "refs": refs[b], "seq_ids": sorted(h)} for b, h in sorted(holders.items()) if len(h) > 1]
    forks = {"forks": snap.forks, "cow_copies": snap.cow_copies, "fork_shared_blocks": u.fork_shared_blocks,
             "fork_refs": u.fork_refs}
    return {"step": step, "refs": refs, "shared_blocks": shared, "fork_sharing": forks,
            "cached_free": list(snap.cached_free), "prefix_caching": snap.prefix_caching,
            "blocks_used": u.blocks_used, "blocks_free": u.blocks_free,
            "tokens_stored": u.tokens_stored, "slots_allocated": u.slots_allocated,
            "utilization": round(u.utilization, 4), "block_size": snap.block_size,
            "num_blocks": snap.num_blocks, "scratch_block": snap.num_blocks,
            "owner": owner, "tables": tables, "free_list": list(snap.free_list)}


class Recorder:
    """Engine observer that keeps the snapshot asked for (peak, end, or step N), and at the end
    of the run (``finish``) the engine's timeline and summary: one engine's report.

    ``peak`` is the first step at which blocks used (held by sequences; cached free blocks do not
    count) reach their maximum: the figure the run table reports as "peak blocks used"."""

    def __init__(self, at: str | int):
        self.at, self.snap, self.best = at, None, -1
        self.steps = 0
        self.timeline: list[dict] = []
        self.preemption_steps: list[int] = []
        self.summary: dict = {}

    def finish(self, engine) -> None:
        self.steps = engine.step_index
        self.timeline = engine.stats.timeline()
        self.preemption_steps = list(engine.stats.preemption_steps)
        self.summary = engine.stats.summary()

    def __call__(self, engine, plan) -> None:
        step = engine.step_index
        used = engine.cache.usage().blocks_used  # what the step's StepRecord holds
        if self.at == "peak" and used > self.best:
            self.best, self.snap = used, snapshot(engine, step)
        elif self.at == "end" and engine.cache.tables:
            self.snap = snapshot(engine, step)
        elif self.at == step:
            self.snap = snapshot(engine, step)


def run_inspect(cfg: Config, *, workload: Workload, at: str, json_out: Path | None, quiet: bool,
                stats_json: Path | None = None, plot: Path | None = None, n: int = 1) -> int:
    when = parse_at(at)
    workload.check()
    with open_llm(cfg, quiet) as llm:
        rt = llm.runtime
        prompts = workload.prompt_ids(rt.model_cfg, rt.tokenizer)
        llm.engine.add_observer(Recorder(when))
        for _ in llm.run(requests_for(prompts, workload.output_len, n, cfg.sampling), use_tqdm=not quiet,
                         total=len(prompts), desc="inspect"):
            pass
        recorders = llm.engine.observed()
        summary = llm.stats
    missing = [r for r in recorders if r.snap is None]
    if missing:
        raise TinyLLMError(f"the run had {missing[0].steps} steps, so there is no step {when} to show")
    reports = [{"at": at, "snapshot": r.snap, "summary": r.summary, "preemption_steps": r.preemption_steps,
                "timeline": r.timeline} for r in recorders]
    report = dict(reports[0])
    if len(reports) > 1:  # Ray workers: the first one's at the top (as a one-engine report), all listed
        report |= {"summary": summary, "workers": reports}
    write_json(summary, stats_json)
    write_json(report, json_out, indent=None)
    if plot is not None:
        from ..plot import draw
        draw("inspect", reports[0], plot)
    if not quiet:
        for i, r in enumerate(reports):
            if len(reports) > 1:
                stderr_console().rule(f"[bold]Ray worker {i}")
            render(r)
        if len(reports) > 1:
            stderr_console().print(run_table(summary, title="the whole run (all workers)"))
    return 0


def render(report: dict) -> None:
    con = stderr_console()
    snap, steps = report["snapshot"], report["timeline"]
    con.rule(f"block map at step {snap['step']} ({moment(report['at'], snap)}): {snap['blocks_used']} used, "
             f"{snap['blocks_free']} free of {snap['num_blocks']} x {snap['block_size']} tokens, "
             f"utilization {snap['utilization']:.1%}")
    con.print(block_map(snap["owner"] + [-1], snap["refs"] + [0], set(snap["cached_free"])))
    con.print("[dim]one cell per block: owning seq id (mod 61, as 0-9a-zA-Z) · free   ○ free but holding a "
              "cached prefix   2-9/+ shared by that many sequences (reverse video)   S scratch[/dim]")
    if snap["shared_blocks"]:
        sh = " ".join(f"{x['block']}(x{x['refs']})" for x in snap["shared_blocks"][:30])
        con.print(f"shared blocks ({len(snap['shared_blocks'])}): {sh}" +
                  (" ..." if len(snap["shared_blocks"]) > 30 else ""))
    fs = snap["fork_sharing"]
    if fs["forks"]:
        con.print(f"parallel sampling: {fs['fork_shared_blocks']} blocks shared by forks of one request "
                  f"({fs['fork_refs']} extra refs); {fs['forks']} forks and {fs['cow_copies']} copy-on-write "
                  f"copies so far")
    t = Table(title="block tables (logical -> physical)", header_style="bold")
    for col in ("seq", "request", "fork", "tokens", "blocks", "last block", "table"):
        t.add_column(col, justify="right" if col != "table" else "left")
    for row in snap["tables"]:
        mapping = " ".join(f"{j}→{b}" for j, b in enumerate(row["blocks"]))
        if len(mapping) > 80:
            mapping = mapping[:77] + "..."
        t.add_row(str(row["seq_id"]), str(row["request_id"]), str(row["fork"]), str(row["tokens"]), str(len(row["blocks"])),
                  f"{row['last_block_fill']}/{snap['block_size']}", mapping)
    con.print(t)
    free = snap["free_list"]
    con.print(f"free list ({len(free)}, next out first): " + " ".join(map(str, free[:40])) +
              (" ..." if len(free) > 40 else ""))
    if snap["cached_free"]:
        cf = snap["cached_free"]
        con.print(f"cached free blocks ({len(cf)}, evicted oldest first once the free list is empty): " +
                  " ".join(map(str, cf[:40])) + (" ..." if len(cf) > 40 else ""))
    n = len(steps)
    con.rule(f"timeline over {n} steps")
    con.print(f"utilization  {sparkline([s['utilization'] for s in steps], lo=0.0, hi=1.0)}")
    con.print(f"free blocks  {sparkline([s['blocks_free'] for s in steps], lo=0, hi=snap['num_blocks'])}")
    con.print(f"running      {sparkline([s['running'] for s in steps], lo=0)}")
    con.print(f"preemptions  {marks_line(n, report['preemption_steps'])}  "
              f"({report['summary']['preemptions']} at steps {report['preemption_steps'][:10]})")
    con.print(run_table(report["summary"], title="run"))
