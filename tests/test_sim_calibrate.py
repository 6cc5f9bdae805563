"""simulate calibrate checks its own fit: outlier steps are retimed (a transient disturbance is
repaired), a fit that stays poor is warned about with its figures and marked in the profile, and
simulate warns once when it uses such a profile. The step times come through the calibration's
timing seam (``sim.cost.wall_time``) from a known linear model, disturbed on purpose, so the
tests do not depend on how busy this machine is."""

from __future__ import annotations

import json
import random

import pytest

from tinyllm_cli.sim import cost as costmod
from tinyllm_cli.sim.cost import fit_checked, judge

TRUE = [3e-3, 2e-4, 1e-7, 4e-5, 2e-8, 5e-4, 2e-6]


def true_time(f):
    return sum(a * b for a, b in zip(TRUE, f))


def synthetic_runs(rng, n_runs=6, steps=60):
    runs = []
    for _ in range(n_runs):
        run = []
        for _ in range(steps):
            rows, bs = rng.randint(1, 64), rng.choice([8, 16, 32])
            ctx = [rng.randint(1, 300) for _ in range(rows)]
            pre = rng.randint(0, 512) if rng.random() < 0.2 else 0
            f = [1.0, rows, sum(ctx), pre, pre * pre / 2, 1 if pre else 0, sum(-(-c // bs) for c in ctx)]
            run.append((f, true_time(f)))
        runs.append(run)
    return runs


def test_transient_disturbance_is_retimed_away():
    rng = random.Random(1)
    clean = synthetic_runs(rng)
    runs = [list(r) for r in clean]
    hit = 0
    for run in runs:  # a busy neighbour: 15% of the steps took 2-6x as long, once
        for j, (f, t) in enumerate(run):
            if rng.random() < 0.15:
                run[j] = (f, t * rng.uniform(2, 6))
                hit += 1
    reruns = []
    c, info = fit_checked(runs, lambda w: (reruns.append(w), clean[w])[1])
    assert hit > 30 and info["retimed"] == hit  # every disturbed step found and timed again
    assert sorted(reruns) == sorted(set(reruns)) and reruns  # each workload rerun at most once
    assert info["quality"] == "good" and "poor_because" not in info
    assert runs == clean
    assert len(c) == 1 and info["planes"] == 1  # a linear truth keeps one plane
    for a, b in zip(c[0], TRUE):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-12)


def test_persistent_disturbance_is_judged_poor():
    rng = random.Random(2)
    runs = synthetic_runs(rng)

    def noisy(run):  # every timing, first or second, is 1-3x too long on 40% of the steps
        return [(f, t * (rng.uniform(1, 3) if rng.random() < 0.4 else 1)) for f, t in run]

    clean = [list(r) for r in runs]
    runs = [noisy(r) for r in runs]
    c, info = fit_checked(runs, lambda w: noisy(clean[w]))
    assert info["quality"] == "poor"
    assert info["poor_because"] == judge(info) and info["poor_because"]
    assert info["median_rel_err"] > 0.10 or info["r2"] < 0.99 or abs(info["total_time_err"]) > 0.05


def test_judge_thresholds():
    good = {"r2": 0.998, "median_rel_err": 0.03, "total_time_err": -0.01}
    assert judge(good) == []
    assert judge(good | {"r2": 0.97}) == ["R^2 0.97 < 0.99"]
    assert judge(good | {"median_rel_err": 0.28}) == ["median step error 28.0% > 10%"]
    assert judge(good | {"total_time_err": 0.072}) == ["total time error +7.2% beyond 5%"]


class Disturbed:
    """A timing source: the true linear model's time for the step's features, times 4 on every
    ``every``-th of the first ``until`` steps timed (a busy spell that ends: retimings come
    after it), and times 1-3 on 40% of all steps (seeded) when ``persistent``."""

    def __init__(self, every: int, persistent: bool, until: int = 10**9):
        self.every, self.persistent, self.until, self.n = every, persistent, until, 0
        self.rng = random.Random(3)

    def __call__(self, f, wall_s):
        self.n += 1
        t = true_time(f) * (4 if self.n % self.every == 0 and self.n <= self.until else 1)
        if self.persistent and self.rng.random() < 0.4:
            t *= self.rng.uniform(1, 3)
        return t


def calibrate_cli(tmp_path, llama_dir, monkeypatch, source, gbps=(50.0, 50.0)) -> tuple[int, dict, str]:
    """``simulate calibrate`` with its steps timed by ``source`` and the host's read bandwidth
    read as ``gbps`` (the real host's moves, and says so)."""
    from tinyllm_cli import roofline
    from tinyllm_cli.cli import main
    monkeypatch.setattr(costmod, "wall_time", source)
    readings = iter(gbps)
    monkeypatch.setattr(roofline, "read_bandwidth", lambda budget=0.5, device=None: next(readings))
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as e:
        main(["simulate", "calibrate", "--output", str(out), "--model", str(llama_dir), "--device", "cpu",
              "--scale", "0.1", "--max-model-len", "256"])
    return e.value.code, json.loads(out.read_text()), out


def test_calibrate_retimes_a_transient_disturbance(tmp_path, llama_dir, monkeypatch, capsys):
    # the busy spell covers the first 40 steps timed: the first workloads, on both cache kinds in turn
    code, prof, _ = calibrate_cli(tmp_path, llama_dir, monkeypatch, Disturbed(7, persistent=False, until=40))
    err = capsys.readouterr().err
    assert code == 0
    assert prof["fit_quality"] == "good" and "warning" not in err, prof["fit"]
    # every disturbed step (and any clean one the disturbed first fit put over 10% off) timed again
    assert prof["fit"]["paged"]["retimed"] + prof["fit"]["slot"]["retimed"] >= 40 // 7
    assert prof["fit"]["paged"]["retimed"] > 0 and prof["fit"]["slot"]["retimed"] > 0 and "retiming outlier steps" in err
    assert prof["read_gbps"] == [50.0, 50.0]  # the host's read bandwidth around the calibration, said on stderr
    assert "host read bandwidth 50 GB/s before calibrating, 50 after" in err
    for kind in ("paged", "slot"):
        f = prof["fit"][kind]
        assert f["quality"] == "good" and f["r2"] > 0.999


def test_calibrate_warns_when_the_hosts_bandwidth_moved(tmp_path, llama_dir, monkeypatch, capsys):
    """A good fit made while the host's read bandwidth moved by over 20% is saved, with one
    warning that gives the figures; one that moved less gets none."""
    code, prof, path = calibrate_cli(tmp_path, llama_dir, monkeypatch, Disturbed(10**9, persistent=False),
                                     gbps=(45.0, 80.0))
    err = capsys.readouterr().err
    assert code == 0 and path.exists() and prof["fit_quality"] == "good" and prof["read_gbps"] == [45.0, 80.0]
    warn = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warn) == 1 and "bandwidth moved" in warn[0] and "45 GB/s before calibrating, 80 after" in warn[0]
    code, prof, _ = calibrate_cli(tmp_path, llama_dir, monkeypatch, Disturbed(10**9, persistent=False),
                                  gbps=(45.0, 52.0))
    assert code == 0 and "warning" not in capsys.readouterr().err


def test_bandwidth_moved_names_the_serving_phase():
    from tinyllm_cli.sim.cost import bandwidth_moved
    assert bandwidth_moved([50.0, 59.0]) is None and bandwidth_moved([50.0]) is None
    said = bandwidth_moved([50.0, 52.0, 77.0])
    assert "52 between its offline and served phases, 77 after" in said and "serving term" in said
    assert "serving term" not in bandwidth_moved([50.0, 77.0])


def test_calibrate_warns_and_marks_a_poor_fit(tmp_path, llama_dir, monkeypatch, capsys):
    from tinyllm_cli.cli import main
    code, prof, path = calibrate_cli(tmp_path, llama_dir, monkeypatch, Disturbed(7, persistent=True))
    err = capsys.readouterr().err
    assert code == 0
    assert prof["fit_quality"] == "poor"
    warn = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warn) == 1 and "poor fit" in warn[0]
    for kind, f in prof["fit"].items():
        if f["quality"] == "poor":
            assert all(why in warn[0] for why in f["poor_because"])
    # simulate with it: one warning, for a sweep of two points too
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--cost-profile", str(path), "--num-prompts", "8", "--input-len", "16",
              "--output-len", "8", "--sweep", "max_num_seqs=2,4", "-q"])
    assert e.value.code == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "poor fit" in err and str(path) in err
    # and a good profile (the shipped one) gives none
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--num-prompts", "8", "--input-len", "16", "--output-len", "8", "-q"])
    assert e.value.code == 0 and "warning" not in capsys.readouterr().err


def test_serving_term_is_charged_the_same_with_skip_ahead(llama_dir):
    """The serving section adds per-step, per-request and per-streamed-token time; skip-ahead's
    bulk decode windows charge exactly what stepping one by one does."""
    import dataclasses
    from tinyllm_cli.config import load_config, flat_overrides
    from tinyllm_cli.model.checkpoint import load_checkpoint
    from tinyllm_cli.sim.cost import CostModel
    from tinyllm_cli.sim.run import Simulation
    from tinyllm_cli.traces import generate_trace
    mcfg = load_checkpoint(str(llama_dir), progress=False).config
    cfg = load_config(None, flat_overrides(dict(num_blocks=60, block_size=4, max_num_seqs=6, max_model_len=256,
                                                model=str(llama_dir))))
    cost = CostModel(coefs={"paged": TRUE}, model="tiny", model_config=dataclasses.asdict(mcfg),
                     serving={"coefs": [1e-3, 2e-2, 4e-3]})
    items = list(generate_trace(60, 20, 24, arrivals="poisson", rate=30.0, seed=4))
    runs = {}
    for skip in (False, True):
        for serving in (False, True):
            sim = Simulation(cfg, cost, workers=1, skip_ahead=skip, serving=serving)
            outs = sorted((o.id, o.ttft_s, o.latency_s) for o in sim.run(items))
            runs[skip, serving] = (outs, sim.summary())
    for serving in (False, True):
        (a, sa), (b, sb) = runs[False, serving], runs[True, serving]
        assert sb["skipped_steps"] > 0 and sa["steps"] == sb["steps"]
        for x, y in zip(a, b):
            assert x[0] == y[0] and x[1] == pytest.approx(y[1], abs=1e-9) and x[2] == pytest.approx(y[2], abs=1e-9)
    plain, served = runs[False, False][1], runs[False, True][1]
    assert served["serving_overhead"] and not plain["serving_overhead"]
    # one step each: the same decisions when nothing queues, so the difference is the term itself
    assert served["elapsed_s"] > plain["elapsed_s"]


def test_serving_needs_a_serving_section(capsys):
    from tinyllm_cli.cli import main
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--serving", "-q"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "serving section" in err and "--serving" in err


def test_serving_coefficients_are_per_cache_kind():
    """A serving section measured per cache kind charges each cache its own coefficients; one
    without the simulated kind is a usage error (one sentence), never another kind's figures;
    a single list (an older profile) serves every kind."""
    from types import SimpleNamespace as NS

    from tinyllm_cli.errors import UsageError
    from tinyllm_cli.sim.cost import CostModel
    paged, slot = NS(kind="paged", block_size=16), NS(kind="slot", block_size=16)
    cost = CostModel(coefs={"paged": TRUE, "slot": TRUE},
                     serving={"coefs": {"paged": [3e-3, 0.0, 2e-4], "slot": [1e-3, 1e-3, 0.0]}})
    assert cost.for_cache(paged, serving=True).serve == [3e-3, 0.0, 2e-4]
    assert cost.for_cache(slot, serving=True).serve == [1e-3, 1e-3, 0.0]
    assert cost.for_cache(slot).serve == [0.0, 0.0, 0.0]
    only_paged = CostModel(coefs={"paged": TRUE, "slot": TRUE}, serving={"coefs": {"paged": [3e-3, 0.0, 2e-4]}})
    with pytest.raises(UsageError, match="no slot cache"):
        only_paged.for_cache(slot, serving=True)
    legacy = CostModel(coefs={"paged": TRUE}, serving={"coefs": [5e-3, 0.0, 1e-4]})
    assert legacy.for_cache(slot, serving=True).serve == legacy.for_cache(paged, serving=True).serve == [5e-3, 0.0, 1e-4]


def test_calibrate_serving_measures_a_live_server(tmp_path, llama_dir, capsys):
    """calibrate --serving runs serve's own app on 127.0.0.1 under tinyllm load and fits the
    serving section; simulate --serving then charges it."""
    pytest.importorskip("fastapi")
    from tinyllm_cli.cli import main
    from tinyllm_cli.commands.simulate import SERVING_LOADS
    from tinyllm_cli.sim.cost import FEATURES, SERVING_FEATURES
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as e:
        main(["simulate", "calibrate", "--output", str(out), "--model", str(llama_dir), "--device", "cpu",
              "--scale", "0.1", "--max-model-len", "512", "--serving"])
    assert e.value.code == 0
    prof = json.loads(out.read_text())
    sv = prof["serving"]
    assert set(sv["coefs"]) == set(prof["coefs"]) == {"paged", "slot"}  # measured per cache kind
    err = capsys.readouterr().err
    # the host's read bandwidth before, between the offline and served phases, and after
    assert len(prof["read_gbps"]) == 3 and min(prof["read_gbps"]) > 0
    assert f"{prof['read_gbps'][1]:g} between its offline and served phases" in err
    for kind, c in sv["coefs"].items():
        assert sv["fit"][kind]["steps"] > 10 and len(c) == len(SERVING_FEATURES) and all(x >= 0 for x in c)
        # the timed steps are kept, as the offline ones: features, serving features, seconds
        assert len(sv["samples"][kind]) == sv["fit"][kind]["steps"]
        assert all(len(x) == len(FEATURES) + len(SERVING_FEATURES) + 1 and x[-1] > 0 for x in sv["samples"][kind])
        assert f"calibrate serving {kind}: load {len(SERVING_LOADS)}/{len(SERVING_LOADS)}" in err
    stats = tmp_path / "s.json"
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--cost-profile", str(out), "--num-prompts", "8", "--input-len", "16", "--output-len", "8",
              "--serving", "--stats-json", str(stats), "-q"])
    assert e.value.code == 0 and json.loads(stats.read_text())["serving_overhead"] is True


def test_serving_timer_times_only_back_to_back_steps(monkeypatch):
    """A served step is timed only when it continues a sequence of the step before: after an
    idle wait, a first chunk that starts past a cached prefix (start > 0) is not a continuation,
    and the wait is charged to no step."""
    from types import SimpleNamespace as NS

    from tinyllm_cli.engine.scheduler import Chunk, Plan
    from tinyllm_cli.sim.cost import ServingTimer
    clock = iter([0.0, 0.010, 0.022, 5.0, 5.013, 5.030])
    monkeypatch.setattr(costmod.time, "perf_counter", lambda: next(clock))

    def seq(i, n=40, out=0):
        return NS(seq_id=i, num_tokens=n, num_output=out, pending=[])
    engine = NS(cache=NS(kind="slot"))
    a, b = seq(1), seq(2, n=8)
    timer = ServingTimer()
    steps = [Plan(prefill=[Chunk(a, 0, 40)]),           # after an idle wait: a new request
             Plan(decode=[a]),                            # 10 ms, continues a
             Plan(decode=[a], prefill=[Chunk(b, 0, 8)]),  # 12 ms, continues a, b starts
             Plan(prefill=[Chunk(seq(3), 32, 8)]),        # after a 5 s wait: prefix hit, start 32
             Plan(decode=[seq(3, 41, 1)]),                # 13 ms, continues 3
             Plan(decode=[seq(3, 42, 2)])]                # 17 ms
    for p in steps:
        timer(engine, p)
    assert [round(t, 6) for _, t in timer.samples] == [0.010, 0.012, 0.013, 0.017]
    assert [sf[1] for sf in timer.serving] == [0, 1, 0, 0]  # requests answered


def test_serving_features_count_each_request_once():
    """A request counts once, at the chunk that completes its prompt: not at an earlier chunk of
    a chunked prompt, also when a cached prefix let it start past position 0, and not again when
    a preempted request recomputes (it has output)."""
    from types import SimpleNamespace as NS

    from tinyllm_cli.engine.scheduler import Chunk, Plan
    from tinyllm_cli.sim.cost import serving_features

    def seq(i, n, out=0):
        return NS(seq_id=i, num_tokens=n, num_output=out, pending=[])
    long, hit, back = seq(1, 100), seq(2, 40), seq(3, 50, out=6)
    assert serving_features(Plan(prefill=[Chunk(long, 0, 64)]))[1] == 0   # first of two chunks
    assert serving_features(Plan(prefill=[Chunk(long, 64, 36)]))[1] == 1  # the prompt completes
    assert serving_features(Plan(prefill=[Chunk(hit, 32, 8)]))[1] == 1    # past a 32-token prefix hit
    assert serving_features(Plan(prefill=[Chunk(back, 0, 50)]))[1] == 0   # a preempted request's recompute
    both = serving_features(Plan(prefill=[Chunk(long, 64, 36), Chunk(hit, 32, 8)], decode=[seq(4, 9, 1)]))
    assert both == [1.0, 2, 3]  # the step, two requests answered, three rows sampled
