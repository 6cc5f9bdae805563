"""The ``generate`` command: prompts file -> engine -> JSONL in input order -> run table.

Invariants:
- Prompts are streamed from the file and results are written as they come (see ``io``), so
  memory does not grow with the number of prompts; the progress bar's total is counted first
  (one cheap pass over the file), so its ETA is real.
- However the run ends (done, Ctrl-C, SIGTERM, a write error), every finished result is on disk
  as whole JSONL lines and the file is closed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from .config import Config
from .errors import Interrupted, TinyLLMError
from .io import (OrderedWriter, RequestBuilder, Resume, check_prompt_file, id_key, open_output,
                 output_line, read_records, record_id)
from .cluster import open_cluster, wants_cluster
from .report import print_worker_table, run_table, stderr_console
from .runtime import load_runtime, make_engine


def write_stats_file(path: Path | None, stats: dict) -> None:
    if path is None:
        return
    try:
        path.write_text(json.dumps(stats, indent=2) + "\n")
    except OSError as e:
        raise TinyLLMError(f"cannot write stats to {path}: {e.strerror}")


def requests_from_file(path: str, builder: RequestBuilder, resume: Resume, writer: OrderedWriter):
    """Lazily build requests. With ``--resume``: the first ``resume.skip`` records are done, and
    a record whose result was written out of order is handed straight to the writer."""
    index = 0
    for n, (lineno, rec) in enumerate(read_records(path)):
        if n < resume.skip:
            continue
        rid = record_id(n, rec)
        if resume.tail and (line := resume.take(id_key(rid))) is not None:
            writer.add(index, line)
        else:
            yield builder.build(index, lineno, rec, rid)
        index += 1


def run_generate(cfg: Config, prompts: str, output: str | None, resume: bool, strict: bool,
                 chat: bool, quiet: bool, stats_json: Path | None) -> int:
    total = check_prompt_file(prompts)  # also the number of prompts, for the progress bar
    out, plan = open_output(output, resume, prompts)
    try:
        if wants_cluster(cfg):
            rt, engine = open_cluster(cfg, quiet)
        else:
            rt = load_runtime(cfg, progress=not quiet)
            engine = make_engine(cfg, rt)
    except BaseException:
        out.close()
        raise
    builder = RequestBuilder(rt.tokenizer, chat, cfg.sampling)
    writer = OrderedWriter(out)
    todo = None if total is None else max(0, total - plan.skip - plan.num_tail)
    failed = 0
    bar = tqdm(total=todo, unit="req", desc="generate", file=sys.stderr, disable=quiet, dynamic_ncols=True)
    try:
        for res in engine.run(requests_from_file(prompts, builder, plan, writer)):
            writer.add(res.index, output_line(res))
            failed += res.finish_reason == "error"
            bar.update(1)
            st = engine.stats
            bar.set_postfix_str(f"{st.output_tokens / max(st.elapsed(), 1e-9):.1f} tok/s", refresh=False)
    except Interrupted as e:
        writer.flush_pending()
        e.message = (f"interrupted ({e.signal_name}): {writer.written} finished results are in {out.name}; "
                     f"rerun with --resume to finish the rest" if out.name != "stdout" else
                     f"interrupted ({e.signal_name}): {writer.written} finished results were written")
        raise
    except BaseException:
        writer.flush_pending()
        raise
    finally:
        bar.close()
        out.close()
    summary = engine.stats.summary() | rt.facts()
    if wants_cluster(cfg):
        engine.close()  # the Ray workers (an interrupted run's are stopped by Ray at exit)
    write_stats_file(stats_json, summary)
    if not quiet:
        stderr_console().print(run_table(summary, title=f"tinyllm generate · {rt.describe()}"))
        print_worker_table(summary)
    return 1 if strict and failed else 0
