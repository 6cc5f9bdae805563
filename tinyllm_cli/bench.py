"""``tinyllm bench``: one seeded workload, run once per cache kind x block size at equal KV bytes.

Invariants:
- Every run gets the identical list of prompt ids and output lengths (greedy, ``ignore_eos``),
  so runs differ only in the cache; the slot cache gets exactly the paged cache's KV bytes.
- The model is loaded once; each run builds a fresh cache and engine.
- ``--n 1,4`` runs every row once per n: each prompt asks for n completions (greedy, so the n
  are identical; what differs is memory: the paged cache shares the prompt's blocks among the n
  forks, the slot cache copies the prompt into one slot per fork).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .config import Config
from .engine.request import Request, SamplingParams
from .errors import TinyLLMError, UsageError
from .io import RequestBuilder, check_prompt_file, read_records, record_id
from .report import bench_table, stderr_console
from .runtime import Runtime, kv_budget, load_runtime, make_engine


@dataclass
class BenchSpec:
    block_sizes: list[int]
    caches: list[str]
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    prompts: str | None
    seed: int
    warmup: bool
    chat: bool
    prefix_len: int = 0
    num_prefixes: int = 1
    prefix_modes: tuple[bool, ...] = (True,)
    baseline: str | None = None
    roofline: bool = False
    profile: bool = False
    repeat: int = 1
    workers: list[int] = dataclasses.field(default_factory=lambda: [1])  # Ray worker counts (cluster.py)
    n_values: tuple[int, ...] = (1,)

    @classmethod
    def parse(cls, block_sizes, caches, num_prompts, input_len, output_len, range_ratio, prompts, seed,
              warmup, chat, cfg: Config, prefix_len: int = 0, num_prefixes: int = 1,
              prefix_cache: str = "on", baseline: str | None = None, roofline: bool = False,
              profile: bool = False, repeat: int = 1, n_values: str | None = None) -> "BenchSpec":
        sizes = _int_list(block_sizes, "--block-size") if block_sizes else [cfg.cache.block_size]
        kinds = [c.strip() for c in caches.split(",") if c.strip()]
        bad = [k for k in kinds if k not in ("paged", "slot")]
        if bad or not kinds:
            raise UsageError(f"--cache takes a comma list of paged and slot, not {caches!r}")
        check_workload(num_prompts, input_len, output_len, range_ratio)
        if prompts:
            check_prompt_file(prompts)
        if prefix_len < 0 or num_prefixes < 1:
            raise UsageError("--prefix-len must be >= 0 and --num-prefixes >= 1")
        modes = {"on": True, "off": False}
        picked = [m.strip() for m in prefix_cache.split(",") if m.strip()]
        if not picked or any(m not in modes for m in picked):
            raise UsageError(f"--prefix-cache takes on, off or on,off, not {prefix_cache!r}")
        if repeat < 1:
            raise UsageError(f"--repeat must be at least 1, not {repeat}")
        if baseline not in (None, "hf"):
            raise UsageError(f"--baseline takes hf (transformers generate), not {baseline!r}")
        ns = tuple(_int_list(n_values, "--n")) if n_values else (1,)
        return cls(sizes, kinds, num_prompts, input_len, output_len, range_ratio, prompts, seed, warmup, chat,
                   prefix_len, num_prefixes, tuple(modes[m] for m in picked), baseline, roofline, profile,
                   repeat, n_values=ns)

    def combos(self) -> list[tuple[str, int, bool, int]]:
        out = []
        for n in self.n_values:
            for kind in self.caches:
                if kind == "slot":
                    out.append(("slot", 0, False, n))  # one row: no block size, no prefix sharing
                else:
                    out += [("paged", b, pc, n) for b in self.block_sizes for pc in self.prefix_modes]
        return out


def check_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float) -> None:
    """The random-workload flags shared by bench and inspect-blocks."""
    for name, v in (("--num-prompts", num_prompts), ("--input-len", input_len), ("--output-len", output_len)):
        if v <= 0:
            raise UsageError(f"{name} must be a positive integer, not {v}")
    if not 0 <= range_ratio < 1:
        raise UsageError(f"--range-ratio must be in [0, 1), not {range_ratio}")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes a comma list of integers, not {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise UsageError(f"{flag} values must be positive integers, not {text!r}")
    return vals


def random_prompts(model_cfg, num: int, input_len: int, range_ratio: float, seed: int) -> list[list[int]]:
    """Seeded random-token prompts with lengths uniform in L*(1-r)..L*(1+r) (vLLM's convention),
    drawn above the special-token ids so no prompt contains an EOS."""
    g = torch.Generator().manual_seed(seed)
    lo = max(1, int(input_len * (1 - range_ratio)))
    hi = max(lo, int(input_len * (1 + range_ratio)))
    lens = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    vocab = model_cfg.vocab_size
    special = set(model_cfg.eos_token_ids) | {model_cfg.bos_token_id or 0}
    low = max(special) + 1 if max(special) < vocab // 2 else 0
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lens]


def random_workload(spec: BenchSpec, rt: Runtime) -> list[list[int]]:
    """Random prompts; with ``prefix_len`` each starts with one of ``num_prefixes`` shared
    random prefixes (round robin), as in vLLM's prefix-repetition benchmark."""
    suffixes = random_prompts(rt.model.cfg, spec.num_prompts, spec.input_len, spec.range_ratio, spec.seed)
    if not spec.prefix_len:
        return suffixes
    prefixes = random_prompts(rt.model.cfg, spec.num_prefixes, spec.prefix_len, 0.0, spec.seed + 1)
    return [prefixes[i % spec.num_prefixes] + s for i, s in enumerate(suffixes)]


def prompts_from_file(path: str, rt: Runtime, cfg: Config, chat: bool) -> list[list[int]]:
    builder = RequestBuilder(rt.tokenizer, chat, cfg.sampling)
    out = []
    for n, (lineno, rec) in enumerate(read_records(path)):
        req = builder.build(n, lineno, rec, record_id(n, rec))
        if req.error:
            raise UsageError(f"{path}: {req.error}")
        out.append(req.prompt_token_ids)
    if not out:
        raise UsageError(f"prompts file {path!r} has no prompts")
    return out


def requests_for(workload: list[list[int]], output_len: int, n: int = 1) -> list[Request]:
    return [Request(str(i), ids, SamplingParams(max_new_tokens=output_len, ignore_eos=True, n=n), index=i)
            for i, ids in enumerate(workload)]


def run_one(cfg: Config, rt: Runtime, kind: str, block_size: int, budget: int,
            workload: list[list[int]], output_len: int, prefix_caching: bool = False,
            tokens_out: list | None = None, profile_into: dict | None = None, n: int = 1) -> dict:
    """One engine run of the workload; its stats summary. ``profile_into``: run it under the
    profiler (cache allocation stays outside) and put the breakdown there."""
    c = dataclasses.replace(cfg.cache, kind=kind, block_size=block_size or cfg.cache.block_size,
                            num_blocks=None, kv_memory=str(budget), prefix_caching=prefix_caching)
    engine = make_engine(dataclasses.replace(cfg, cache=c), rt)
    reqs = requests_for(workload, output_len, n)
    if profile_into is None:
        outs = list(engine.run(reqs))
    else:
        from .profiling import profile_run
        outs = []
        profile_into |= profile_run(lambda: outs.extend(engine.run(reqs)), rt.device)
    outs.sort(key=lambda o: o.index)
    if tokens_out is not None:
        tokens_out[:] = [o.token_ids for o in outs]
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise TinyLLMError(f"bench request {failed[0].id} failed on the {kind} cache: {failed[0].error}")
    return engine.stats.summary() | {"n": n}


def timed_rows(spec: BenchSpec, cfg: Config, rt: Runtime, budget: int, workload, quiet: bool):
    """Every combination ``spec.repeat`` times, round robin (so drift on a noisy machine hits all
    rows alike); each row is the run with the median elapsed time, with every run's time listed."""
    combos = spec.combos()
    runs: list[list[dict]] = [[] for _ in combos]
    first_tokens: list = []
    bar = tqdm(total=len(combos) * spec.repeat, desc="bench", unit="run", file=sys.stderr, disable=quiet)
    for r in range(spec.repeat):
        for i, (kind, bs, pc, n) in enumerate(combos):
            runs[i].append(run_one(cfg, rt, kind, bs, budget, workload, spec.output_len, pc,
                                   tokens_out=first_tokens if (r, i) == (0, 0) else None, n=n))
            bar.update(1)
    bar.close()
    rows = []
    for done in runs:
        times = [d["elapsed_s"] for d in done]
        median = sorted(done, key=lambda d: d["elapsed_s"])[(len(done) - 1) // 2]
        rows.append(median | rt.facts() | {
            "num_prompts": len(workload), "output_len": spec.output_len,
            "mean_input_len": round(sum(map(len, workload)) / len(workload), 1),
            "repeats": spec.repeat, "elapsed_s_runs": times})
    return rows, first_tokens


def run_bench(cfg: Config, spec: BenchSpec, json_out: Path | None, csv_out: Path | None, quiet: bool,
              plot: Path | None = None) -> int:
    rt = load_runtime(cfg, progress=not quiet)
    workload = prompts_from_file(spec.prompts, rt, cfg, spec.chat) if spec.prompts else random_workload(spec, rt)
    budget = kv_budget(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, block_size=spec.block_sizes[0])),
                       rt.model.cfg, rt.dtype)
    if spec.warmup:  # first-call costs (allocator, kernels) must not land on the first row
        run_one(cfg, rt, "paged", spec.block_sizes[0], budget, workload[:2], 4)
    if spec.workers == [1] and cfg.parallel.ray_address is None:
        rows, first_tokens = timed_rows(spec, cfg, rt, budget, workload, quiet)
    else:
        from .cluster import parallel_bench_rows
        rows, first_tokens = parallel_bench_rows(spec, cfg, rt, budget, workload, quiet)
    refs = reference_points(spec, cfg, rt, workload, first_tokens, rows, quiet)
    if spec.profile:
        refs["profile"] = profile_first(spec, cfg, rt, budget, workload)
    write_rows(rows, json_out, csv_out)
    if plot is not None:
        from .plot import draw
        draw("bench", rows, plot)
    if not quiet:
        title = (f"tinyllm bench · {rt.describe()} · {len(workload)} prompts, "
                 f"~{rows[0]['mean_input_len']:.0f} in / {spec.output_len} out · KV {budget / 2**20:.0f} MiB"
                 + (f" · median of {spec.repeat} runs" if spec.repeat > 1 else ""))
        con = stderr_console()
        con.print(bench_table(rows, title))
        if refs.keys() - {"profile"}:
            con.print(reference_table(refs, rows))
        if "profile" in refs:
            con.print(profile_table(refs["profile"]))
    return 0


def reference_points(spec: BenchSpec, cfg: Config, rt: Runtime, workload, first_tokens, rows, quiet) -> dict:
    """Run the baseline / roofline after tinyllm's runs and attach ratios to every row."""
    from .baselines import hf_generate_baseline, measure_roofline
    refs: dict = {}
    if spec.roofline:
        refs["roofline"] = measure_roofline(rt.model.cfg, rt.dtype, rt.device, rt.model.gemm)
        if rt.model.gemm != "torch":  # the plain F.linear rate, for comparison with other tools
            refs["roofline_torch"] = measure_roofline(rt.model.cfg, rt.dtype, rt.device, "torch")
        for r in rows:
            r["roofline_frac"] = round(r["total_tokens_per_s"] / refs["roofline"]["roofline_tokens_per_s"], 3)
            r["achieved_gflops"] = round(r["total_tokens_per_s"] * refs["roofline"]["flops_per_token"] / 1e9, 1)
    if spec.baseline == "hf":
        if not quiet:
            print("running the transformers baseline ...", file=sys.stderr)
        pad = (rt.model.cfg.eos_token_ids or [0])[0]
        base = hf_generate_baseline(cfg.model, workload, spec.output_len, rt.dtype, rt.device, pad, spec.repeat)
        theirs = base.pop("token_ids")
        base["greedy_match"] = sum(a == b for a, b in zip(theirs, first_tokens))
        base["num_prompts"] = len(workload)
        refs["hf"] = base
        for r in rows:
            r["vs_hf"] = round(r["total_tokens_per_s"] / base["total_tokens_per_s"], 3)
    for r in rows:
        r["reference"] = refs
    return refs


def profile_first(spec: BenchSpec, cfg: Config, rt: Runtime, budget: int, workload) -> dict:
    """An extra, profiled run of the first row's configuration (see ``profiling.py``)."""
    kind, bs, pc, n = spec.combos()[0]
    prof: dict = {}
    summary = run_one(cfg, rt, kind, bs, budget, workload, spec.output_len, pc, profile_into=prof, n=n)
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
    names = {"roofline": "GEMM roofline, engine's {gemm} path ({gemm_rows} rows, model shapes)",
             "roofline_torch": "GEMM rate of plain F.linear ({gemm_rows} rows)"}
    for key, name in names.items():
        if key in refs:
            f = refs[key]
            t.add_row(name.format(**f), f"{f['gemm_gflops']:.0f} GFLOP/s = {f['roofline_tokens_per_s']:.0f} tok/s",
                      "  ".join(f"{l}: {r['total_tokens_per_s'] / f['roofline_tokens_per_s']:.0%}"
                                for l, r in zip(label, rows)))
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
