"""``tinyllm simulate``: a trace through the real scheduler and cache bookkeeping, with a measured
step-cost model in place of the forward pass (``sim/``). Same config keys, same ``--stats-json``
keys, same run table and plots as a real run; sweeps like ``bench``'s (``--json`` writes one row
per point, bench's shape); an SLO view.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from ..config import Config
from ..errors import TinyLLMError, UsageError
from ..llm import LLM
from ..report import stderr_console
from ..sim.cost import CostModel, bandwidth_moved, bandwidth_words, calibrate, default_profile_path
from ..sim.run import Simulation
from ..sim.trace import serve_arrivals
from ..traces import generate_trace, prompt_salt, read_trace, write_trace
from .common import finish_run, int_list, write_json

SWEEPS = {"block_size": ("cache", "block_size"), "num_blocks": ("cache", "num_blocks"),
          "max_num_seqs": ("scheduler", "max_num_seqs"), "max_prefill_tokens": ("scheduler", "max_prefill_tokens"),
          "workers": ("parallel", "workers")}


def load_profile(path: Path | None) -> CostModel:
    """The cost profile; one warning on stderr when its calibration judged its own fit poor."""
    path = path or default_profile_path()
    cost = CostModel.load(path)
    if cost.fit_quality == "poor":
        print(f"warning: the cost profile {path} was calibrated with a poor fit ({fit_figures(cost)}); "
              f"its times may be far off: recalibrate on a quiet machine", file=sys.stderr)
    return cost


def fit_figures(cost: CostModel) -> str:
    """Each cache kind's fit in one phrase: why it is poor, or its figures."""
    parts = []
    for kind, f in cost.fit.items():
        why = f.get("poor_because") or [f"R^2 {f.get('r2')}", f"median step error {f.get('median_rel_err', 0):.1%}"]
        parts.append(f"{kind}: {', '.join(why)}")
    return "; ".join(parts)


def trace_items(trace: str | None, gen: dict, replay_rate: float | None = None, seed: int = 0):
    """A fresh iterator over the trace (read lazily; with ``replay_rate``, on serve-batch's
    arrival times for that rate and seed) or the generated workload."""
    if trace and replay_rate is not None:
        return lambda: serve_arrivals(read_trace(trace), replay_rate, seed)
    if trace:
        return lambda: read_trace(trace)
    return lambda: generate_trace(**gen)


def slo_view(summary: dict, ttft_slo: float | None, tpot_slo: float | None, goodput: dict | None) -> list[tuple]:
    rows = []  # the percentiles are in the run table already
    if goodput is not None:
        rows.append((f"goodput (TTFT <= {ttft_slo} s, TPOT <= {tpot_slo} s)",
                     f"{goodput['goodput_req_per_s']:.2f} req/s ({goodput['slo_attainment']:.1%} of requests)"))
    return rows


def run_one(cfg: Config, cost: CostModel, items, ttft_slo, tpot_slo, skip_ahead=True,
            max_waiting: int | None = None, serving: bool = False, salt: int = 0) -> dict:
    sim = Simulation(cfg, cost, skip_ahead=skip_ahead, max_waiting=max_waiting, serving=serving)
    t0 = time.perf_counter()
    good = total = 0
    for out in sim.run(items(), salt=salt):
        total += 1
        ok = out.finish_reason != "error"
        if ttft_slo is not None:
            ok = ok and out.ttft_s is not None and out.ttft_s <= ttft_slo
        if tpot_slo is not None:
            ok = ok and (out.tpot_s is None or out.tpot_s <= tpot_slo)
        good += ok
    s = dict(sim.summary())
    s["sim_wall_s"] = round(time.perf_counter() - t0, 3)
    if ttft_slo is not None or tpot_slo is not None:
        el = max(s["elapsed_s"], 1e-9)
        s["slo"] = {"ttft_s": ttft_slo, "tpot_s": tpot_slo, "goodput_req_per_s": round(good / el, 3),
                    "slo_attainment": round(good / max(total, 1), 4)}
    return s


def _sweep_configs(cfg: Config, sweep: str | None) -> list[tuple[str, Config]]:
    if not sweep:
        return [("", cfg)]
    key, _, values = sweep.partition("=")
    if key.replace("-", "_") not in SWEEPS or not values:
        raise UsageError(f"--sweep takes KEY=V1,V2,... with KEY one of {', '.join(SWEEPS)}, not {sweep!r}")
    section, field = SWEEPS[key.replace("-", "_")]
    vals = int_list(values, "--sweep")
    out = []
    for v in vals:
        sec = dataclasses.replace(getattr(cfg, section), **{field: v})
        out.append((f"{field}={v}", dataclasses.replace(cfg, **{section: sec})))
    return out


def run_simulate(cfg: Config, *, trace: str | None, cost_profile: Path | None, gen: dict, sweep: str | None,
                 replay_rate: float | None = None,
                 ttft_slo: float | None, tpot_slo: float | None, save_trace: str | None, quiet: bool,
                 stats_json: Path | None, json_out: Path | None = None, plot: Path | None = None,
                 skip_ahead: bool = True, max_waiting: int | None = None, serving: bool = False) -> int:
    """One simulated run (its stats in ``stats_json``) or one per sweep point; ``json_out`` gets
    the rows either way. A sweep is many runs, so it has no one run's stats to write."""
    if sweep and stats_json is not None:
        raise UsageError("--sweep makes one run per point: write its rows with --json FILE, not --stats-json")
    cost = load_profile(cost_profile)
    items = trace_items(trace, gen, replay_rate, cfg.sampling.run_seed)
    salt = prompt_salt(trace, gen["seed"])  # the prompts tinyllm load sends for them
    if save_trace:
        n = write_trace(items(), save_trace)
        if not quiet:
            print(f"wrote {n} trace lines to {save_trace}", file=sys.stderr)
    points = _sweep_configs(cfg, sweep)
    rows = []
    for label, c in points:
        s = run_one(c, cost, items, ttft_slo, tpot_slo, skip_ahead, max_waiting, serving, salt)
        rows.append(s | ({"sweep": label} if label else {}))
        if not quiet and len(points) > 1:
            print(f"simulated {label}: {s['num_requests']} requests, {s['elapsed_s']:.1f} s simulated "
                  f"in {s['sim_wall_s']:.1f} s", file=sys.stderr)
    title = (f"tinyllm simulate · {cost.model} · {cost.dtype} · profile of {cost.device} ({cost.cpu})")
    if len(rows) == 1:
        s = rows[0]
        extra = [("simulated in", f"{s['sim_wall_s']:.2f} s wall ({s['skipped_steps']} of {s['steps']} steps skipped ahead)")]
        if s["rejected"]:
            extra.append(("rejected (waiting room full)", f"{s['rejected']} of {s['num_requests']} requests "
                                                          f"(--max-waiting {max_waiting})"))
        extra += slo_view(s, ttft_slo, tpot_slo, s.get("slo"))
        write_json(rows, json_out)
        finish_run(s, title, stats_json, quiet, extra)
        if plot is not None:
            from ..plot import draw
            draw("run", s, plot)
        return 0
    write_json(rows, json_out)
    if plot is not None:
        from ..plot import draw
        draw("bench", rows, plot)
    if not quiet:
        stderr_console().print(sweep_table(rows, title))
    return 0


def sweep_table(rows: list[dict], title: str):
    from rich.table import Table
    t = Table(title=title, header_style="bold")
    for col in ("point", "out tok/s", "TTFT p50/p99 s", "TPOT p50/p99 s", "preempt", "peak blocks", "goodput req/s"):
        t.add_column(col, justify="right")
    for r in rows:
        g = r.get("slo", {}).get("goodput_req_per_s")
        t.add_row(r["sweep"], f"{r['output_tokens_per_s']:.1f}",
                  _pair(r["ttft_s"]), _pair(r["tpot_s"]), str(r["preemptions"]), str(r["peak_blocks_used"]),
                  "-" if g is None else f"{g:.2f}")
    return t


def _pair(p: dict) -> str:
    return "-" if p.get("p50") is None else f"{p['p50']:.3f} / {p['p99']:.3f}"


# Loads for the serving calibration: (rate req/s, requests, mean prompt, mean output), from
# many requests with few tokens to few requests with many, so the per-request and per-token
# costs are told apart; the second runs one or two rows a step (a lightly loaded server), the
# last 8-16 (a saturated one), so the per-row cost is measured across the range serve runs.
SERVING_LOADS = ((4.0, 24, 64, 8), (2.0, 16, 32, 64), (8.0, 32, 128, 24), (3.0, 24, 256, 16),
                 (12.0, 48, 64, 48))


def measure_serving(llm, cfg: Config, prof: CostModel, quiet: bool, scale: float = 1.0) -> dict:
    """The serving section of a profile, per cache kind of the offline calibration (their
    served steps differ: the paged cache's prefix caching, on in ``serve``, is off in the offline
    workloads): ``tinyllm serve``'s own app and server over ``llm``'s engine (configured as
    ``cfg`` with that cache), driven with ``SERVING_LOADS`` (``serve_loads``), every step timed
    (``ServingTimer``) and what it took beyond that kind's offline coefficients fitted to
    ``serving_features``."""
    from ..sim.cost import SERVING_FEATURES, fit_serving
    coefs, fits, samples = {}, {}, {}
    for kind in prof.coefs:
        kcfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kind=kind))
        timer = serve_loads(llm, kcfg, kind, quiet, scale)
        coefs[kind], fits[kind] = fit_serving(timer, prof.coefs[kind])
        samples[kind] = [[round(x, 3) for x in f + sf] + [round(t, 6)]
                         for (f, t), sf in zip(timer.samples, timer.serving)]
    return {"coefs": coefs, "features": list(SERVING_FEATURES), "fit": fits,
            "loads": [list(x) for x in SERVING_LOADS], "samples": samples}


def serve_loads(llm, cfg: Config, kind: str, quiet: bool, scale: float):
    """``SERVING_LOADS`` through ``tinyllm serve``'s own app and server over ``llm``'s engine
    (configured as ``cfg``; its loop on this thread, HTTP beside it, as ``serve`` runs) on
    127.0.0.1, sent by ``tinyllm load`` in another process (as a client would be); returns the
    ``ServingTimer`` that timed the steps (the first load, a warm-up, untimed)."""
    import os
    import subprocess
    import threading

    from ..serving.app import ServeSettings
    from ..serving.server import make_server
    from ..sim.cost import ServingTimer
    from .serve import bind, max_model_len_of
    llm.reconfigure(config=cfg)
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server = make_server(llm.engine, llm.tokenizer, cfg.sampling.request_defaults(), ServeSettings("calibration"),
                         max_model_len=max_model_len_of(llm), quiet=True)
    timer = ServingTimer()
    failed: list[str] = []

    def drive() -> None:
        try:
            deadline = time.monotonic() + 300  # a model-loaded server starts in well under a second
            while not server.started:
                if time.monotonic() > deadline or server.should_exit:
                    failed.append("the server did not start")
                    return
                time.sleep(0.05)
            for i, (rate, num, inp, out) in enumerate(SERVING_LOADS):
                cmd = [sys.executable, "-m", "tinyllm_cli", "load", "--url", url, "--request-rate", str(rate),
                       "--num-requests", str(max(4, int(num * scale))), "--input-len", str(inp),
                       "--output-len", str(out), "--workload-seed", str(500 + i),
                       "--vocab-size", str(llm.runtime.model_cfg.vocab_size), "-q"]
                if i == 1:  # the first load warms up: its first-call costs are not timed
                    llm.engine.add_observer(timer)
                p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                if p.returncode:
                    failed.append((p.stderr.strip().splitlines() or ["?"])[-1])
                    return
                if not quiet:
                    print(f"calibrate serving {kind}: load {i + 1}/{len(SERVING_LOADS)} ({rate:g} req/s, {num} x "
                          f"{inp} in / {out} out), {len(timer.samples)} steps timed", file=sys.stderr)
        finally:
            server.should_exit = True

    threading.Thread(target=drive, name="tinyllm-calibrate-load", daemon=True).start()
    try:
        server.run_beside(server.front, [sock])
    finally:
        sock.close()
    if failed:
        raise TinyLLMError(f"the serving calibration's load failed: {failed[0]}")
    return timer


def run_calibrate(cfg: Config, output: Path, quiet: bool, scale: float = 1.0, source=None,
                  serving: bool = False) -> int:
    """Calibrate and save the profile; a poor fit is saved too (marked ``fit_quality: poor``,
    which ``simulate`` warns about) and warned about here, with its figures, even when quiet.
    ``serving``: then measure ``tinyllm serve``'s HTTP cost too (``measure_serving``)."""
    from ..roofline import read_bandwidth
    with LLM(config=cfg, progress=not quiet) as llm:
        gbps = [read_bandwidth(device=llm.runtime.device)]
        prof = calibrate(llm, quiet=quiet, scale=scale, source=source)
        if serving:  # the serving term is the served steps over the offline fit: both phases' bandwidth
            gbps.append(read_bandwidth(device=llm.runtime.device))
            prof.serving = measure_serving(llm, cfg, prof, quiet, scale)
        prof.read_gbps = gbps + [read_bandwidth(device=llm.runtime.device)]
    prof.save(output)
    if serving and not quiet:
        for kind, c in prof.serving["coefs"].items():
            f = prof.serving["fit"][kind]
            print(f"serving {kind}: {f['steps']} steps, {c[0] * 1e3:.2f} ms a step, {c[1] * 1e3:.2f} ms a request, "
                  f"{c[2] * 1e3:.2f} ms a streamed token; served steps' median / total time error "
                  f"{f['offline_model']['median_rel_err']:.1%} / {f['offline_model']['total_time_err']:+.1%} by the "
                  f"offline model, {f['with_serving']['median_rel_err']:.1%} / "
                  f"{f['with_serving']['total_time_err']:+.1%} with these", file=sys.stderr)
    if not quiet:
        for kind, f in prof.fit.items():
            print(f"{kind}: {f['steps']} steps ({f['retimed']} retimed, {f['outliers_dropped']} dropped), "
                  f"R^2 {f['r2']}, median step error {f['median_rel_err']:.1%}, "
                  f"total time error {f['total_time_err']:+.1%}: {f['quality']} fit", file=sys.stderr)
        print(f"host read bandwidth {bandwidth_words(prof.read_gbps)}", file=sys.stderr)
        print(f"wrote {output}", file=sys.stderr)
    moved = bandwidth_moved(prof.read_gbps)
    if moved:
        print(f"warning: {moved}", file=sys.stderr)
    if prof.fit_quality == "poor":
        print(f"warning: poor fit even after retiming its outlier steps ({fit_figures(prof)}); was the machine "
              f"busy? {output} is marked fit_quality: poor, and simulate will warn when it is used", file=sys.stderr)
    return 0
