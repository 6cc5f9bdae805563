"""The ``generate`` command: prompts file -> engine -> JSONL in input order -> run table."""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from .config import Config
from .errors import TinyLLMError
from .io import (OrderedWriter, RequestBuilder, check_prompt_file, count_records, id_key, open_output,
                 output_line, read_records, record_id)
from .report import run_table, stderr_console
from .runtime import load_runtime, make_engine


def write_stats_file(path: Path | None, stats: dict) -> None:
    if path is None:
        return
    import json
    try:
        path.write_text(json.dumps(stats, indent=2) + "\n")
    except OSError as e:
        raise TinyLLMError(f"cannot write stats to {path}: {e.strerror}")


def requests_from_file(path: str, builder: RequestBuilder, skip: set[str]):
    """Lazily build requests, skipping ids already done (``--resume``)."""
    index = 0
    for n, (lineno, rec) in enumerate(read_records(path)):
        rid = record_id(n, rec)
        if id_key(rid) in skip:
            continue
        yield builder.build(index, lineno, rec, rid)
        index += 1


def run_generate(cfg: Config, prompts: str, output: str | None, resume: bool, strict: bool,
                 chat: bool, quiet: bool, stats_json: Path | None) -> int:
    check_prompt_file(prompts)
    total = count_records(prompts)
    fh, name, done = open_output(output, resume)
    rt = load_runtime(cfg, progress=not quiet)
    engine = make_engine(cfg, rt)
    builder = RequestBuilder(rt.tokenizer, chat, cfg.sampling)
    writer = OrderedWriter(fh, name)
    todo = None if total is None else max(0, total - len(done))
    failed = 0
    bar = tqdm(total=todo, unit="req", desc="generate", file=sys.stderr, disable=quiet, dynamic_ncols=True)
    try:
        for out in engine.run(requests_from_file(prompts, builder, done)):
            writer.add(out.index, output_line(out))
            failed += out.finish_reason == "error"
            bar.update(1)
            st = engine.stats
            bar.set_postfix_str(f"{st.output_tokens / max(st.elapsed(), 1e-9):.1f} tok/s", refresh=False)
    finally:
        bar.close()
        if fh is not sys.stdout:
            fh.close()
    summary = engine.stats.summary() | {"model": rt.model_name, "load_s": round(rt.load_s, 3),
                                        "dtype": str(rt.dtype).removeprefix("torch."), "device": str(rt.device)}
    write_stats_file(stats_json, summary)
    if not quiet:
        stderr_console().print(run_table(summary, title=f"tinyllm generate · {rt.model_name}"))
    return 1 if strict and failed else 0
