"""``tinyllm inspect-blocks``: run a workload on the paged cache and show its memory at one moment
(block map, block tables, free list) plus the whole run's utilization / free-block timeline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.table import Table
from tqdm import tqdm

from .bench import check_workload, prompts_from_file, random_prompts, requests_for
from .commands import write_stats_file
from .config import Config
from .errors import TinyLLMError, UsageError
from .io import check_prompt_file
from .report import block_map, marks_line, moment, run_table, sparkline, stderr_console
from .runtime import load_runtime, make_engine


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
    cache = engine.cache
    by_id = {s.seq_id: s for s in engine.scheduler.running}
    owner: list[int | None] = [None] * cache.num_blocks
    tables = []
    for sid, table in cache.tables.items():
        for b in table:
            owner[b] = sid
        n, bs = cache.lens[sid], cache.block_size
        seq = by_id.get(sid)
        tables.append({"seq_id": sid, "request_id": seq.request.id if seq else None,
                       "fork": seq.fork if seq else None, "tokens": n, "blocks": list(table),
                       "last_block_fill": (n - (len(table) - 1) * bs) if table else 0,
                       "slots_allocated": len(table) * bs})
    u = cache.usage()
    refs = list(cache.pool.ref)
    holders: dict[int, list[int]] = {}
    for sid, table in cache.tables.items():
        for b in table:
            holders.setdefault(b, []).append(sid)
    shared = [{"block": b, "refs": refs[b], "seq_ids": sorted(h)} for b, h in sorted(holders.items()) if len(h) > 1]
    forks = {"forks": cache.forks, "cow_copies": cache.cow_copies, "fork_shared_blocks": u.fork_shared_blocks,
             "fork_refs": u.fork_refs}
    return {"step": step, "refs": refs, "shared_blocks": shared, "fork_sharing": forks,
            "cached_free": list(cache.pool.evictable), "prefix_caching": cache.prefix_caching, "blocks_used": u.blocks_used, "blocks_free": u.blocks_free,
            "tokens_stored": u.tokens_stored, "slots_allocated": u.slots_allocated,
            "utilization": round(u.utilization, 4), "block_size": cache.block_size,
            "num_blocks": cache.num_blocks, "scratch_block": cache.num_blocks,
            "owner": owner, "tables": tables, "free_list": cache.allocator.free_list()}


class Recorder:
    """Engine observer that keeps the snapshot asked for (peak, end, or step N).

    ``peak`` is the first step at which blocks used (held by sequences; cached free blocks do not
    count) reach their maximum: the figure the run table reports as "peak blocks used"."""

    def __init__(self, at: str | int):
        self.at, self.snap, self.best = at, None, -1

    def __call__(self, engine, plan) -> None:
        step = engine._step
        used = engine.cache.usage().blocks_used  # what the step's StepRecord holds
        if self.at == "peak" and used > self.best:
            self.best, self.snap = used, snapshot(engine, step)
        elif self.at == "end" and engine.cache.tables:
            self.snap = snapshot(engine, step)
        elif self.at == step:
            self.snap = snapshot(engine, step)


def run_inspect(cfg: Config, prompts: str | None, num_prompts: int, input_len: int, output_len: int,
                range_ratio: float, at: str, json_out: Path | None, chat: bool, quiet: bool,
                stats_json: Path | None = None, plot: Path | None = None, n: int = 1) -> int:
    when = parse_at(at)
    if prompts:
        check_prompt_file(prompts)
    check_workload(num_prompts, input_len, output_len, range_ratio)
    rt = load_runtime(cfg, progress=not quiet)
    workload = (prompts_from_file(prompts, rt, cfg, chat) if prompts
                else random_prompts(rt.model.cfg, num_prompts, input_len, range_ratio, 0))
    engine = make_engine(cfg, rt)
    rec = Recorder(when)
    engine.observers.append(rec)
    bar = tqdm(total=len(workload), desc="inspect", unit="req", file=sys.stderr, disable=quiet)
    for out in engine.run(requests_for(workload, output_len, n)):
        bar.update(1)
    bar.close()
    if rec.snap is None:
        raise TinyLLMError(f"the run had {engine._step} steps, so there is no step {when} to show")
    report = {"at": at, "snapshot": rec.snap, "summary": engine.stats.summary(),
              "preemption_steps": engine.stats.preemption_steps, "timeline": engine.stats.timeline()}
    write_stats_file(stats_json, report["summary"])
    if json_out is not None:
        text = json.dumps(report) + "\n"
        try:
            sys.stdout.write(text) if str(json_out) == "-" else json_out.write_text(text)
        except OSError as e:
            raise TinyLLMError(f"cannot write {json_out}: {e.strerror}")
    if plot is not None:
        from .plot import draw
        draw("inspect", report, plot)
    if not quiet:
        render(report)
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
