"""The ``generate`` command: prompts file -> ``LLM`` -> JSONL in input order -> run table.

Invariants:
- Prompts are streamed from the file and results are written as they come (see ``io``), so
  memory does not grow with the number of prompts; the progress bar's total is counted first
  (one cheap pass over the file), so its ETA is real.
- The output is opened only after the model loaded: a typo in ``--model`` or the config leaves
  an existing results file as it was; ``--output`` naming the prompts file is refused.
- However the run ends (done, Ctrl-C, SIGTERM, a write error), every finished result is on disk
  as whole JSONL lines and the file is closed.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..errors import Interrupted
from ..io import (OrderedWriter, RequestBuilder, Resume, check_prompt_file, id_key, open_output, output_line,
                  plan_output, read_records, record_id)
from .common import finish_run, open_llm


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


def run_generate(cfg: Config, *, prompts: str, output: str | None, resume: bool, strict: bool, chat: bool,
                 quiet: bool, stats_json: Path | None) -> int:
    total = check_prompt_file(prompts)  # also the number of prompts, for the progress bar
    plan = plan_output(output, resume, inputs=(prompts,), prompts=prompts)
    with open_llm(cfg, quiet) as llm:
        out = open_output(plan)
        builder = RequestBuilder(llm.tokenizer, chat, cfg.sampling.request_defaults())
        writer = OrderedWriter(out)
        todo = None if total is None else max(0, total - plan.done.skip - plan.done.num_tail)
        failed = 0
        try:
            for res in llm.run(requests_from_file(prompts, builder, plan.done, writer), use_tqdm=not quiet,
                               total=todo):
                writer.add(res.index, output_line(res))
                failed += res.finish_reason == "error"
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
            out.close()
        finish_run(llm.stats, f"tinyllm generate · {llm.runtime.describe()}", stats_json, quiet)
    return 1 if strict and failed else 0
