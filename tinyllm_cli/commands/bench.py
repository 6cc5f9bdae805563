"""``tinyllm bench``: one seeded workload, run once per cache kind x block size at equal KV bytes,
for each worker count asked for.

Invariants:
- Every run gets the identical list of prompt ids and output lengths (greedy, ``ignore_eos``),
  so runs differ only in the cache; the slot cache gets exactly the paged cache's KV bytes.
- One function (``timed_rows``) builds the rows for any worker count: an ``LLM`` per count (in
  this process for 1, Ray workers for more), reconfigured per row (fresh pool, same model).
- ``--n 1,4`` runs every row once per n: each prompt asks for n completions (greedy, so the n
  are identical; what differs is memory: the paged cache shares the prompt's blocks among the n
  forks, the slot cache copies the prompt into one slot per fork).
- Reference points (transformers baseline, ``--torch-profile``) measure the in-process engine, so they
  need worker count 1 in the sweep.
- Where the limit is (``roofline.py``): each in-process row carries its model work (FLOPs,
  bytes, from the counts its steps recorded) and achieved GFLOP/s and GB/s, and, with
  ``--roofline`` (the default), their fractions of this CPU's measured peak (cached per machine).
  Rows from Ray workers carry None there: the peak is this process's.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..config import Config
from ..errors import TinyLLMError, UsageError
from ..llm import LLM
from ..report import bench_table, stderr_console
from ..roofline import rates, runtime_bytes, runtime_peak, work_of_run
from ..runtime import kv_budget
from ..workload import Workload, requests_for
from .common import int_list, open_llm


@dataclass
class BenchSpec:
    block_sizes: list[int]
    caches: list[str]
    workload: Workload
    warmup: bool
    prefix_modes: tuple[bool, ...] = (True,)
    baseline: str | None = None
    roofline: bool = True
    remeasure_peak: bool = False
    torch_profile: bool = False
    repeat: int = 1
    workers: list[int] = dataclasses.field(default_factory=lambda: [1])  # 1: in-process; N: Ray workers
    n_values: tuple[int, ...] = (1,)

    @property
    def output_len(self) -> int:
        return self.workload.output_len

    @classmethod
    def parse(cls, cfg: Config, *, block_sizes: str | None, caches: str, workload: Workload, warmup: bool,
              prefix_cache: str = "on", baseline: str | None = None, roofline: bool = True,
              remeasure_peak: bool = False, torch_profile: bool = False, repeat: int = 1,
              n_values: str | None = None, workers: str | None = None) -> "BenchSpec":
        """The sweep form of the flags (comma lists) checked and split; one sentence per mistake."""
        sizes = int_list(block_sizes, "--block-size") if block_sizes else [cfg.cache.block_size]
        kinds = [c.strip() for c in caches.split(",") if c.strip()]
        bad = [k for k in kinds if k not in ("paged", "slot")]
        if bad or not kinds:
            raise UsageError(f"--cache takes a comma list of paged and slot, not {caches!r}")
        workload.check()
        modes = {"on": True, "off": False}
        picked = [m.strip() for m in prefix_cache.split(",") if m.strip()]
        if not picked or any(m not in modes for m in picked):
            raise UsageError(f"--prefix-cache takes on, off or on,off, not {prefix_cache!r}")
        if repeat < 1:
            raise UsageError(f"--repeat must be at least 1, not {repeat}")
        if baseline not in (None, "hf"):
            raise UsageError(f"--baseline takes hf (transformers generate), not {baseline!r}")
        ns = tuple(int_list(n_values, "--n")) if n_values else (1,)
        counts = int_list(workers, "--workers") if workers else [1]
        if (baseline or torch_profile) and (1 not in counts or cfg.parallel.ray_address is not None):
            raise UsageError("--baseline and --torch-profile measure the in-process engine: "
                             "include 1 in --workers (without --ray-address)")
        if remeasure_peak and not roofline:
            raise UsageError("--remeasure-peak measures the peak --roofline compares with: drop --no-roofline")
        return cls(block_sizes=sizes, caches=kinds, workload=workload, warmup=warmup,
                   prefix_modes=tuple(modes[m] for m in picked), baseline=baseline, roofline=roofline,
                   remeasure_peak=remeasure_peak, torch_profile=torch_profile, repeat=repeat, workers=counts,
                   n_values=ns)

    def combos(self) -> list[tuple[str, int, bool, int]]:
        out = []
        for n in self.n_values:
            for kind in self.caches:
                if kind == "slot":
                    out.append(("slot", 0, False, n))  # one row: no block size, no prefix sharing
                else:
                    out += [("paged", b, pc, n) for b in self.block_sizes for pc in self.prefix_modes]
        return out


def run_one(llm: LLM, base: Config, kind: str, block_size: int, budget: int, workload: list[list[int]],
            output_len: int, prefix_caching: bool = False, tokens_out: list | None = None,
            profile_into: dict | None = None, n: int = 1) -> dict:
    """One run of the workload on a fresh engine of ``llm`` with this cache; its stats. ``profile_into``:
    run it under the profiler (cache allocation stays outside) and put the breakdown there."""
    c = dataclasses.replace(base.cache, kind=kind, block_size=block_size or base.cache.block_size,
                            num_blocks=None, kv_memory=str(budget), prefix_caching=prefix_caching)
    llm.reconfigure(config=dataclasses.replace(base, cache=c))
    reqs = requests_for(workload, output_len, n, base.sampling)
    if profile_into is None:
        outs = list(llm.run(reqs))
    else:
        from ..profiling import profile_run
        outs = []
        profile_into |= profile_run(lambda: outs.extend(llm.run(reqs)), llm.runtime.device)
    outs.sort(key=lambda o: o.index)
    if tokens_out is not None:
        tokens_out[:] = [o.token_ids for o in outs]
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise TinyLLMError(f"bench request {failed[0].id} failed on the {kind} cache: {failed[0].error}")
    return dict(llm.stats) | {"n": n}


def timed_rows(spec: BenchSpec, llm: LLM, base: Config, budget: int, workload, quiet: bool):
    """Every combination ``spec.repeat`` times, round robin (so drift on a noisy machine hits all
    rows alike); each row is the run with the median elapsed time, with every run's time listed.
    The same for any engine behind ``llm``: in this process or on N Ray workers."""
    combos = spec.combos()
    if spec.warmup:  # first-call costs (allocator, kernels, every worker's) must not land on a row
        run_one(llm, base, "paged", spec.block_sizes[0], budget, workload[:2 * llm.runtime.workers], 4)
    runs: list[list[dict]] = [[] for _ in combos]
    first_tokens: list = []
    bar = tqdm(total=len(combos) * spec.repeat, desc="bench", unit="run", file=sys.stderr, disable=quiet)
    for r in range(spec.repeat):
        for i, (kind, bs, pc, n) in enumerate(combos):
            runs[i].append(run_one(llm, base, kind, bs, budget, workload, spec.output_len, pc,
                                   tokens_out=first_tokens if (r, i) == (0, 0) else None, n=n))
            bar.update(1)
    bar.close()
    rows = []
    for done in runs:
        times = [d["elapsed_s"] for d in done]
        median = sorted(done, key=lambda d: d["elapsed_s"])[(len(done) - 1) // 2]
        rows.append(median | {
            "num_prompts": len(workload), "output_len": spec.output_len,
            "mean_input_len": round(sum(map(len, workload)) / len(workload), 1),
            "repeats": spec.repeat, "elapsed_s_runs": times})
    return rows, first_tokens


def sweep(spec: BenchSpec, cfg: Config, quiet: bool) -> tuple[list[dict], dict, list[list[int]], int, str]:
    """Rows for every worker count (each its own ``LLM``), plus the reference points measured on
    the in-process one. Returns (rows, references, workload, KV budget, the runtime's description)."""
    rows, refs, workload, budget, described = [], {}, None, 0, ""
    parallel = spec.workers != [1] or cfg.parallel.ray_address is not None
    for w in spec.workers:
        wcfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, workers=w))
        with open_llm(wcfg, quiet) as llm:
            rt = llm.runtime
            if workload is None:
                workload = spec.workload.prompt_ids(rt.model_cfg, rt.tokenizer)
                sized = dataclasses.replace(cfg.cache, block_size=spec.block_sizes[0])
                budget = kv_budget(dataclasses.replace(cfg, cache=sized), rt.model_cfg, rt.dtype, rt.device).bytes
                described = rt.describe()
            got, first_tokens = timed_rows(spec, llm, wcfg, budget, workload, quiet)
            if rt.model is not None:  # the in-process engine: its rows get the work and references
                refs = reference_points(spec, wcfg, llm, budget, workload, first_tokens, got, quiet)
            else:
                got = [r | dict.fromkeys(WORK_KEYS) for r in got]
            if parallel:
                got = [r | {"workers": w, "worker_threads": _threads(r)} for r in got]
            rows += got
    if parallel:
        base = {(r["cache_kind"], r["block_size"], r["prefix_caching"], r["n"]): r for r in rows if r["workers"] == 1}
        for r in rows:
            b = base.get((r["cache_kind"], r["block_size"], r["prefix_caching"], r["n"]))
            r["scaling"] = round(r["total_tokens_per_s"] / b["total_tokens_per_s"], 3) if b else None
    for r in rows:
        r["reference"] = refs
    return rows, refs, workload, budget, described


WORK_KEYS = ("work", "achieved_gflops", "achieved_gbps", "roofline_frac", "bandwidth_frac")


def add_work(rows: list[dict], rt, peak: dict | None) -> None:
    """Put the ``WORK_KEYS`` on each in-process row: its model work (exact, from its steps'
    counts), achieved GFLOP/s and GB/s, and their fractions of ``peak`` (None without one)."""
    wb, kv = runtime_bytes(rt)
    for r in rows:
        w = work_of_run(rt.model_cfg, r, weight_bytes=wb, kv_elem_bytes=kv)
        r |= {"work": w.as_dict()} | rates(w, r["elapsed_s"], peak)


def tokens_at_peak(row: dict, peak: dict) -> float:
    """Total tok/s the row's workload would reach with all its FLOPs at the matmul peak (the
    plot's roofline line)."""
    per_token = row["work"]["flops"] / (row["prompt_tokens"] + row["output_tokens"])
    return round(peak["gemm_gflops"] * 1e9 / per_token, 1)


def _threads(row: dict) -> int:
    """Torch threads per engine: the first Ray worker's (its row in ``workers``), else this process's."""
    if isinstance(row.get("workers"), list):
        return row["workers"][0]["threads"]
    import torch
    return torch.get_num_threads()


def run_bench(cfg: Config, spec: BenchSpec, json_out: Path | None, csv_out: Path | None, quiet: bool,
              plot: Path | None = None) -> int:
    rows, refs, workload, budget, described = sweep(spec, cfg, quiet)
    write_rows(rows, json_out, csv_out)
    if plot is not None:
        from ..plot import draw
        draw("bench", rows, plot)
    if not quiet:
        title = (f"tinyllm bench · {described} · {len(workload)} prompts, "
                 f"~{rows[0]['mean_input_len']:.0f} in / {spec.output_len} out · KV {budget / 2**20:.0f} MiB"
                 + (f" · median of {spec.repeat} runs" if spec.repeat > 1 else ""))
        con = stderr_console()
        con.print(bench_table(rows, title))
        if refs.keys() - {"profile"}:
            con.print(reference_table(refs, rows))
        if "profile" in refs:
            con.print(profile_table(refs["profile"]))
    return 0


def reference_points(spec: BenchSpec, cfg: Config, llm: LLM, budget: int, workload, first_tokens, rows,
                     quiet) -> dict:
    """The measured peak, baseline and profile, after tinyllm's in-process runs; each row gets its
    work and rates against the peak (``add_work``) and ratios to the baseline."""
    from ..baselines import hf_generate_baseline
    rt = llm.runtime
    refs: dict = {}
    peak = None
    if spec.roofline:
        peak = runtime_peak(rt, refresh=spec.remeasure_peak)
    add_work(rows, rt, peak)
    if peak is not None:
        refs["roofline"] = peak | {"roofline_tokens_per_s": tokens_at_peak(rows[0], peak)}
    if spec.baseline == "hf":
        if not quiet:
            print("running the transformers baseline ...", file=sys.stderr)
        pad = (rt.model_cfg.eos_token_ids or [0])[0]
        base = hf_generate_baseline(cfg.model, workload, spec.output_len, rt.dtype, rt.device, pad, spec.repeat)
        theirs = base.pop("token_ids")
        base["greedy_match"] = sum(a == b for a, b in zip(theirs, first_tokens))
        base["num_prompts"] = len(workload)
        refs["hf"] = base
        for r in rows:
            r["vs_hf"] = round(r["total_tokens_per_s"] / base["total_tokens_per_s"], 3)
    if spec.torch_profile:
        refs["profile"] = profile_first(spec, cfg, llm, budget, workload)
    return refs


def profile_first(spec: BenchSpec, cfg: Config, llm: LLM, budget: int, workload) -> dict:
    """An extra, profiled run of the first row's configuration (see ``profiling.py``)."""
    kind, bs, pc, n = spec.combos()[0]
    prof: dict = {}
    summary = run_one(llm, cfg, kind, bs, budget, workload, spec.output_len, pc, profile_into=prof, n=n)
    return prof | {"run": f"{kind}/{summary['block_size']}", "phases_s": summary["phases_s"],
                   "engine_overhead_frac": summary["engine_overhead_frac"]}


def profile_table(p: dict):
    from rich.table import Table
    t = Table(title=f"where the time goes: profiled rerun of {p['run']} ({p['wall_s']:.2f} s under the profiler)",
              header_style="bold")
    t.add_column("category")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    for name, c in p["categories"].items():
        t.add_row(name, f"{c['s']:.3f}", f"{c['share']:.1%}")
    phases = "  ".join(f"{k} {v:.3f}" for k, v in p["phases_s"].items())
    t.caption = f"engine phases (s): {phases} · engine overhead {p['engine_overhead_frac']:.1%} of wall"
    return t


def reference_table(refs: dict, rows: list[dict]):
    from rich.table import Table
    t = Table(title="reference points (same workload, same process)", header_style="bold")
    t.add_column("reference")
    t.add_column("value", justify="right")
    t.add_column("tinyllm rows", justify="left")
    label = [f"{r['cache_kind']}/{r['block_size']}" for r in rows]
    if "hf" in refs:
        h = refs["hf"]
        t.add_row("transformers generate, padded batch",
                  f"{h['total_tokens_per_s']:.1f} total tok/s ({h['elapsed_s']:.2f} s)",
                  "  ".join(f"{l}: {r['vs_hf']:.2f}x" for l, r in zip(label, rows)))
        t.add_row("greedy outputs identical to tinyllm", f"{h['greedy_match']} / {h['num_prompts']}", "")
    if "roofline" in refs:
        p = refs["roofline"]
        merged = p.get("measurements", 1)  # roofline.measure_peak keeps each rate's best of these
        how = ", ".join(([f"{p['threads']} threads"] if p["threads"] else []) + (["cached"] if p["cached"] else [])
                        + ([f"best of {merged} measurements"] if merged > 1 else []))
        t.add_row(f"matmul peak: {p['gemm']} at {p['gemm_rows']} rows on {p['shape'][0]}x{p['shape'][1]}"
                  + (f" ({how})" if how else ""),
                  f"{p['gemm_gflops']:.0f} GFLOP/s = {p['roofline_tokens_per_s']:.0f} tok/s",
                  "  ".join(f"{l}: {r['roofline_frac']:.0%}" for l, r in zip(label, rows) if r["roofline_frac"]))
        t.add_row("memory bandwidth: sum over 512 MiB", f"{p['bandwidth_gbps']:.1f} GB/s",
                  "  ".join(f"{l}: {r['bandwidth_frac']:.0%}" for l, r in zip(label, rows) if r["bandwidth_frac"]))
        t.caption = f"peak measured on {p['device']} ({p['dtype']}); see docs/performance.md, Where the limit is"
    return t


CSV_SKIP = {"ttft_s", "tpot_s", "latency_s"}


def write_rows(rows: list[dict], json_out: Path | None, csv_out: Path | None) -> None:
    try:
        if json_out is not None:
            text = json.dumps(rows, indent=2) + "\n"
            sys.stdout.write(text) if str(json_out) == "-" else json_out.write_text(text)
        if csv_out is not None:
            flat = [{k: v for k, v in r.items() if k not in CSV_SKIP} |
                    {f"{k}_{p}": r[k][p] for k in CSV_SKIP for p in ("p50", "p90", "p99")} for r in rows]
            fh = sys.stdout if str(csv_out) == "-" else csv_out.open("w", newline="")
            w = csv.DictWriter(fh, fieldnames=list(flat[0]))
            w.writeheader()
            w.writerows(flat)
            if fh is not sys.stdout:
                fh.close()
    except OSError as e:
        raise TinyLLMError(f"cannot write bench results: {e.strerror}")
