"""tinyllm simulate: the same scheduling decisions as a real engine, skip-ahead equal to stepping
one by one, trace readers that reject bad lines with one sentence, a waiting room bounded as serve's."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from tinyllm_cli.errors import UsageError
from tinyllm_cli.sim.cost import CostModel, fit
from tinyllm_cli.sim.run import Simulation
from tinyllm_cli.sim.trace import to_requests
from tinyllm_cli.traces import TraceItem, generate_trace, read_trace

COEFS = [2e-3, 1e-4, 1e-7, 5e-5, 1e-8, 1e-4, 3e-6]


# A second plane that crosses COEFS at about 8 decode rows (and at short prompt chunks), so a
# two-plane profile charges steps from both.
COMPUTE = [0.5e-3, 3e-4, 1e-7, 1.2e-4, 1e-8, 0.0, 0.0]


def tiny_cost(model_cfg, planes: int = 1) -> CostModel:
    c = COEFS if planes == 1 else [COEFS, COMPUTE]
    return CostModel(coefs={"paged": c, "slot": c}, model="tiny", model_config=dataclasses.asdict(model_cfg))


class Plans:
    """Each step's decisions: decode ids, prefill chunks, preempted ids, prefix-hit tokens so far."""

    def __init__(self):
        self.steps = []

    def __call__(self, engine, plan):
        self.steps.append(([s.seq_id for s in plan.decode], [(c.seq.seq_id, c.start, c.n) for c in plan.prefill],
                           [s.seq_id for s in plan.preempted], engine.cache.prefix_hits,
                           engine.cache.usage().blocks_used))

    def finish(self, engine):
        pass


def items_mixed(n, seed, groups=3, timed=False):
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        g = i % groups if rng.random() < 0.6 else None
        pl = rng.randint(5, 60)
        if timed:
            t += rng.expovariate(40.0)
        out.append(TraceItem(str(i), round(t, 6) if timed else None, pl + (12 if g is not None else 0),
                             rng.randint(1, 40), None, g, 12 if g is not None else 0))
    return out


@pytest.mark.parametrize("cache,blocks", [("paged", 24), ("paged", 200), ("slot", None)])
def test_same_decisions_as_real_engine(llama_dir, cache, blocks):
    from tinyllm_cli import LLM
    settings = dict(device="cpu", dtype="float32", cache=cache, block_size=4, max_num_seqs=6,
                    max_prefill_tokens=48, max_model_len=128, prefix_cache=True)
    if blocks:
        settings["num_blocks"] = blocks
    else:
        settings["kv_memory"] = str(4 * 128 * 2 * 3 * 2 * 16 * 4)  # four slots of 128 tokens
    with LLM(str(llama_dir), progress=False, **settings) as llm:
        items = items_mixed(30, seed=1)
        reqs = list(to_requests(items, llm.runtime.model_cfg.vocab_size))
        real = Plans()
        llm.engine.add_observer(real)
        outs = {o.id: o for o in llm.engine.run(reqs)}
        cost = tiny_cost(llm.runtime.model_cfg)
        sim = Simulation(llm.config, cost, workers=1, skip_ahead=False)
        simp = Plans()
        sim.engines[0].engine.add_observer(simp)
        souts = {o.id: o for o in sim.run(items)}
        assert real.steps == simp.steps
        assert {k: (len(o.token_ids), o.preemptions, o.finish_reason) for k, o in outs.items()} == \
               {k: (len(o.token_ids), o.preemptions, o.finish_reason) for k, o in souts.items()}
        a, b = llm.engine.stats.summary(), sim.summary()
        for k in ("steps", "preemptions", "peak_blocks_used", "prefill_tokens", "decode_tokens",
                  "prefix_cache_hits", "mean_block_utilization", "output_tokens"):
            assert a[k] == b[k], k
        ta = [(r["blocks_used"], r["running"], r["waiting"]) for r in llm.engine.stats.timeline()]
        tb = [(r["blocks_used"], r["running"], r["waiting"]) for r in sim.engines[0].engine.stats.timeline()]
        assert ta == tb
        if cache == "paged" and blocks == 24:
            assert a["preemptions"] > 0
        if blocks == 200:
            assert a["prefix_cache_hits"] > 0


@pytest.mark.parametrize("seed", range(6))
def test_skip_ahead_equals_step_by_step(llama_dir, seed):
    from tinyllm_cli.config import load_config, flat_overrides
    from tinyllm_cli.model.checkpoint import load_checkpoint
    rng = random.Random(seed)
    mcfg = load_checkpoint(str(llama_dir), progress=False).config
    kind = rng.choice(["paged", "paged", "slot"])
    over = dict(cache=kind, block_size=rng.choice([1, 2, 4, 16]), num_blocks=rng.choice([30, 80, 400]) if kind == "paged" else None,
                kv_memory="1MiB", max_num_seqs=rng.choice([3, 8, 24]), max_prefill_tokens=rng.choice([16, 64, 512]),
                max_model_len=256, prefix_cache=rng.random() < 0.5, model=str(llama_dir))
    cfg = load_config(None, flat_overrides(over))
    items = items_mixed(80, seed, timed=seed % 2 == 1)
    cost = tiny_cost(mcfg, planes=1 + seed % 3 // 2)  # seeds 2 and 5: two planes
    runs = []
    for skip in (False, True):
        sim = Simulation(cfg, cost, workers=1, skip_ahead=skip)
        outs = sorted(((o.id, o.ttft_s, o.latency_s, o.preemptions) for o in sim.run(items)))
        e = sim.engines[0]
        runs.append((outs, e.engine.stats.timeline(), sim.summary()["preemptions"], dict(e.engine.cache.tables),
                     e.skipped_steps))
    (o1, t1, p1, tb1, _), (o2, t2, p2, tb2, skipped) = runs
    assert skipped > 0  # the windows were taken, and changed nothing
    assert p1 == p2 and tb1 == tb2
    for x, y in zip(o1, o2):
        assert x[0] == y[0] and x[3] == y[3] and x[1] == pytest.approx(y[1], abs=1e-9) and x[2] == pytest.approx(y[2], abs=1e-9)
    assert len(t1) == len(t2)
    for a, b in zip(t1, t2):
        fa = {k: v for k, v in a.items() if k not in ("t", "forward_s")}
        fb = {k: v for k, v in b.items() if k not in ("t", "forward_s")}
        assert fa == fb
        assert a["t"] == pytest.approx(b["t"], abs=1e-5)


def test_workers_split_the_load(llama_dir):
    from tinyllm_cli.config import load_config, flat_overrides
    from tinyllm_cli.model.checkpoint import load_checkpoint
    mcfg = load_checkpoint(str(llama_dir), progress=False).config
    cfg = load_config(None, flat_overrides(dict(num_blocks=100, block_size=4, max_num_seqs=8, max_model_len=256)))
    items = list(generate_trace(200, 40, 30, arrivals="poisson", rate=200.0, seed=3))
    one = Simulation(cfg, tiny_cost(mcfg), workers=1)
    n1 = len(list(one.run(items)))
    two = Simulation(cfg, tiny_cost(mcfg), workers=2)
    n2 = len(list(two.run(items)))
    s1, s2 = one.summary(), two.summary()
    assert n1 == n2 == 200 and s2["num_requests"] == 200 and s2["num_workers"] == 2
    assert s2["elapsed_s"] < s1["elapsed_s"]
    assert s2["output_tokens"] == s1["output_tokens"]


BAD = [
    ('[1, 2]', "must be a JSON object"),
    ('{"output_len": 3}', "needs prompt_len or prompt_token_ids"),
    ('{"prompt_len": 0, "output_len": 3}', "prompt_len must be a positive integer"),
    ('{"prompt_len": 4}', "needs output_len"),
    ('{"prompt_len": 4, "output_len": "x"}', "output_len must be a positive integer"),
    ('{"prompt_len": 4, "output_len": 2, "arrival_s": -1}', "arrival_s must be"),
    ('{"prompt_token_ids": [1, "a"], "output_len": 2}', "prompt_token_ids must be"),
    ('{"prompt_len": 4, "output_len": 2, "prefix_group": 1, "prefix_len": 9}', "longer than the prompt"),
    ('{"prompt_len": 4, "output_len"', "not valid JSON"),
]


@pytest.mark.parametrize("line,msg", BAD)
def test_trace_rejects_bad_lines(tmp_path, line, msg):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt_len": 3, "output_len": 2}\n' + line + "\n")
    with pytest.raises(UsageError) as e:
        list(read_trace(str(p)))
    text = str(e.value)
    assert msg in text and "line 2" in text and "\n" not in text


def test_trace_accepts_real_outputs(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = [{"id": "a", "prompt_token_ids": [5, 6, 7], "token_ids": [1, 2], "num_output_tokens": 2},
             {"custom_id": "b", "response": {"status_code": 200, "body": {"usage": {"prompt_tokens": 9, "completion_tokens": 4}}}},
             {"prompt_len": 3, "output_len": 2, "arrival_s": 1.5}]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = list(read_trace(str(p)))
    assert [(g.id, g.prompt_len, g.output_len, g.arrival_s) for g in got] == [("a", 3, 2, None), ("b", 9, 4, None), ("2", 3, 2, 1.5)]
    p.write_text('{"prompt_len": 3, "output_len": 2, "arrival_s": 2}\n{"prompt_len": 3, "output_len": 2, "arrival_s": 1}\n')
    with pytest.raises(UsageError, match="earlier than the line before"):
        list(read_trace(str(p)))


def test_fit_recovers_coefficients():
    rng = random.Random(0)
    true = [3e-3, 2e-4, 1e-7, 4e-5, 2e-8, 5e-4, 2e-6]
    samples = []
    for _ in range(300):
        rows, bs = rng.randint(0, 64), rng.choice([8, 16, 32])
        ctx = [rng.randint(1, 300) for _ in range(rows)]
        f = [1.0, rows, sum(ctx), rng.randint(0, 512), rng.randint(0, 100000), rng.randint(0, 4),
             sum(-(-c // bs) for c in ctx)]
        samples.append((f, sum(a * b for a, b in zip(true, f))))
    c, info = fit(samples)
    assert info["r2"] > 0.999 and len(c) == 1  # linear steps: one plane, the true one
    for a, b in zip(c[0], true):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-12)


def test_fit_finds_two_planes_where_steps_are_bound_two_ways():
    """Steps timed as the larger of a memory-bound plane (a weight stream plus a little per row
    and context token) and a compute-bound one (per prompt token and row, the stream overlapped):
    the fit finds both, and its maximum predicts every step within 1%, where the best one plane
    misses prompt steps by far more."""
    from tinyllm_cli.sim.cost import one_plane, predict
    rng = random.Random(5)
    mem = [10e-3, 0.3e-3, 1e-6, 0.0, 0.0, 0.0, 1e-5]
    comp = [2.5e-3, 0.45e-3, 1e-6, 0.45e-3, 2e-7, 0.0, 0.0]
    samples = []
    for _ in range(400):
        rows, bs = rng.randint(0, 48), 16
        ctx = [rng.randint(1, 400) for _ in range(rows)]
        pre = rng.choice([0, 0, 0, rng.randint(1, 2048)])
        if rows == 0 and pre == 0:
            rows, ctx = 1, [10]
        f = [1.0, rows, sum(ctx), pre, pre * (pre + 1) / 2, 1 if pre else 0, sum(-(-c // bs) for c in ctx)]
        samples.append((f, max(sum(a * b for a, b in zip(mem, f)), sum(a * b for a, b in zip(comp, f)))))
    planes, info = fit(samples)
    assert len(planes) == 2 and info["planes"] == 2 and info["r2"] > 0.9999
    assert max(abs(predict(planes, f) - t) / t for f, t in samples) < 0.01
    linear = one_plane([f for f, _ in samples], [t for _, t in samples])
    prompts = [(f, t) for f, t in samples if 64 <= f[3] <= 256]
    assert prompts and max(abs(predict(linear, f) - t) / t for f, t in prompts) > 0.1


def test_cli_simulate_stats_keys_and_bad_trace(tmp_path, capsys):
    from tinyllm_cli.cli import main
    from tinyllm_cli.engine.stats import RunStats
    out = tmp_path / "s.json"
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--num-prompts", "50", "--input-len", "64", "--output-len", "16", "--arrivals", "poisson",
              "--request-rate", "5", "--ttft-slo", "1", "--stats-json", str(out), "-q"])
    assert e.value.code == 0
    s = json.loads(out.read_text())
    assert set(RunStats("paged", 16, 1, 1, 1).summary()) <= set(s)
    assert s["num_requests"] == 50 and s["simulated"] and "goodput_req_per_s" in s["slo"]
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"prompt_len": 3}\n')
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--trace", str(bad), "-q"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "line 1" in err and "output_len" in err


def test_cli_simulate_sweep(tmp_path):
    from tinyllm_cli.cli import main
    out = tmp_path / "rows.json"
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--num-prompts", "40", "--input-len", "64", "--output-len", "16", "--num-blocks", "64",
              "--sweep", "max_num_seqs=2,8", "--json", str(out), "-q"])
    assert e.value.code == 0
    rows = json.loads(out.read_text())
    assert [r["sweep"] for r in rows] == ["max_num_seqs=2", "max_num_seqs=8"]
    assert rows[1]["output_tokens_per_s"] > rows[0]["output_tokens_per_s"]


def test_replayed_arrivals_are_serve_batchs(tmp_path, capsys, monkeypatch, llama_dir):
    """``simulate --trace T --request-rate R --seed S`` feeds the lines when ``serve-batch
    --request-rate R --seed S`` lets them into its engine (the reference: the arrival times the
    real serve-batch stamps on its requests, relative to the first)."""
    from tinyllm_cli.cli import main
    from tinyllm_cli.engine.engine import LLMEngine
    from tinyllm_cli.sim.trace import serve_arrivals
    seen = []
    real_add = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request", lambda self, req: (seen.append((req.id, req.arrival)),
                                                                     real_add(self, req))[1])
    n, rate, seed = 6, 25.0, 7
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": {
        "prompt": list(range(5, 9 + i)), "max_tokens": 2, "ignore_eos": True}}) + "\n" for i in range(n)))
    with pytest.raises(SystemExit) as e:
        main(["serve-batch", "--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--model", str(llama_dir),
              "--device", "cpu", "--num-blocks", "64", "--request-rate", str(rate), "--seed", str(seed), "-q"])
    assert e.value.code == 0
    real = [a - seen[0][1] for _, a in seen]
    items = [TraceItem(f"r{i}", 99.0 + i, 4 + i, 2) for i in range(n)]  # its own arrival_s is replaced
    sim = [it.arrival_s for it in serve_arrivals(items, rate, seed)]
    assert [i for i, _ in seen] == [f"r{i}" for i in range(n)]
    assert sim[0] == 0.0 and sim == sorted(sim)
    assert max(abs(a - b) for a, b in zip(real, sim)) < 0.01  # the lines are read well before they are due
    # and the CLI: the same trace replayed at that rate takes at least until its last arrival
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": it.id, "prompt_len": it.prompt_len, "output_len": 2}) + "\n" for it in items))
    out = tmp_path / "s.json"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--trace", str(trace), "--request-rate", str(rate), "--seed", str(seed),
              "--stats-json", str(out), "-q"])
    assert e.value.code == 0
    assert json.loads(out.read_text())["elapsed_s"] >= sim[-1]


def test_version1_profile_reads_with_no_block_cost(tmp_path):
    """A profile made before the per-block feature loads, charging nothing per block."""
    p = tmp_path / "v1.json"
    p.write_text(json.dumps({"coefs": {"paged": COEFS[:6]}, "version": 1}))
    cm = CostModel.load(p)
    assert cm.coefs["paged"] == [COEFS[:6] + [0.0]]  # one plane


def test_one_plane_profiles_load_and_two_plane_profiles_round_trip(tmp_path):
    """A version-2 profile (one flat list a kind) is one plane; a profile of two planes charges
    each step the larger and reads back as it was written; a malformed plane is one sentence."""
    from types import SimpleNamespace as NS

    from tinyllm_cli.engine.scheduler import Plan
    from tinyllm_cli.errors import UsageError
    p = tmp_path / "v2.json"
    p.write_text(json.dumps({"coefs": {"paged": COEFS}, "version": 2}))
    assert CostModel.load(p).coefs["paged"] == [COEFS]
    two = CostModel(coefs={"paged": [COEFS, [0.0, 1.0] + [0.0] * 5]}, model="tiny")
    two.save(p)
    back = CostModel.load(p)
    assert back.coefs == two.coefs and len(back.coefs["paged"]) == 2
    c = back.for_cache(NS(kind="paged", block_size=16))
    seqs = [NS(num_tokens=10, seq_id=i) for i in range(3)]
    plan = Plan(decode=seqs)
    flat = CostModel(coefs={"paged": COEFS}).for_cache(NS(kind="paged", block_size=16))
    assert c.step_time(plan) == max(flat.step_time(plan), 3.0)
    assert c.decode_time(3, 30, 3) == pytest.approx(c.step_time(plan))
    p.write_text(json.dumps({"coefs": {"paged": [COEFS, [1.0, 2.0]]}}))
    with pytest.raises(UsageError, match="one or two lists of 7 numbers"):
        CostModel.load(p)


def test_block_size_costs_what_the_profile_says(llama_dir):
    """With a per-block cost, the same trace on smaller blocks takes longer (the same decisions
    otherwise: no preemption at this pool size)."""
    from tinyllm_cli.config import load_config, flat_overrides
    from tinyllm_cli.model.checkpoint import load_checkpoint
    mcfg = load_checkpoint(str(llama_dir), progress=False).config
    items = items_mixed(30, 3)
    elapsed = {}
    for bs in (4, 32):
        cfg = load_config(None, flat_overrides(dict(cache="paged", block_size=bs, kv_memory="4MiB", max_num_seqs=8,
                                                    max_model_len=256, prefix_cache=False, model=str(llama_dir))))
        sim = Simulation(cfg, tiny_cost(mcfg), workers=1)
        list(sim.run(items))
        s = sim.summary()
        assert s["preemptions"] == 0
        elapsed[bs] = s["elapsed_s"]
    assert elapsed[4] > elapsed[32]


def queue_reference(arrivals: list[float], steps_each: int, max_waiting: int) -> set[int]:
    """An independent M/D/1/K-style count on the engine's step grid: one sequence at a time,
    each ``steps_each`` steps of one second; arrivals join (or are refused, when ``max_waiting``
    already wait) at the first step boundary at or after them; an idle server jumps to the next
    arrival. Returns the indices refused."""
    from collections import deque
    t, i, refused = 0.0, 0, set()
    waiting, left = deque(), 0  # left: steps the running request still needs (0: none running)
    while True:
        while i < len(arrivals) and arrivals[i] <= t:
            if len(waiting) >= max_waiting:
                refused.add(i)
            else:
                waiting.append(i)
            i += 1
        if not left and not waiting:
            if i == len(arrivals):
                return refused
            t = max(t, arrivals[i])
            continue
        if not left:
            waiting.popleft()
            left = steps_each
        left -= 1
        t += 1.0


@pytest.mark.parametrize("max_waiting", [1, 3, 8])
def test_waiting_room_refuses_what_a_queue_reference_predicts(llama_dir, max_waiting):
    """An overloaded trace (arrivals 4x faster than service): exactly the requests the reference
    refuses are rejected, the rest complete, and the queue never holds more than the bound;
    without the bound it grows with the trace."""
    from tinyllm_cli.config import load_config, flat_overrides
    from tinyllm_cli.model.checkpoint import load_checkpoint
    mcfg = load_checkpoint(str(llama_dir), progress=False).config
    cfg = load_config(None, flat_overrides(dict(num_blocks=200, block_size=4, max_num_seqs=1, max_model_len=128,
                                                model=str(llama_dir))))
    cost = CostModel(coefs={"paged": [1.0] + [0.0] * 6}, model="tiny", model_config=dataclasses.asdict(mcfg))
    rng, t, items, out_len = random.Random(max_waiting), 0.0, [], 4
    for i in range(300):
        t += rng.expovariate(1.0)  # 1 req/s against 0.25 req/s of service
        items.append(TraceItem(str(i), t, rng.randint(3, 20), out_len))
    expected = queue_reference([it.arrival_s for it in items], out_len, max_waiting)
    sim = Simulation(cfg, cost, workers=1, max_waiting=max_waiting)
    outs = list(sim.run(items))
    rejected = {int(o.id) for o in outs if o.error and o.error.startswith("rejected")}
    s = sim.summary()
    assert 150 < len(expected) < 300  # overloaded, and not trivially so
    assert rejected == expected
    assert s["rejected"] == len(expected) and s["num_failed"] == len(expected) and s["num_requests"] == 300
    assert s["output_tokens"] == out_len * (300 - len(expected))
    assert s["peak_waiting"] <= max_waiting
    free = Simulation(cfg, cost, workers=1)  # no bound: the queue holds most of the trace
    list(free.run(items))
    assert free.summary()["rejected"] == 0 and free.summary()["peak_waiting"] > 150


def test_waiting_room_with_workers_bounds_the_drivers_queue(llama_dir):
    from tinyllm_cli.config import load_config, flat_overrides
    from tinyllm_cli.model.checkpoint import load_checkpoint
    mcfg = load_checkpoint(str(llama_dir), progress=False).config
    cfg = load_config(None, flat_overrides(dict(num_blocks=100, block_size=4, max_num_seqs=2, max_model_len=256)))
    items = list(generate_trace(400, 40, 30, arrivals="poisson", rate=2000.0, seed=5))
    sim = Simulation(cfg, tiny_cost(mcfg), workers=2, max_waiting=5)
    outs = list(sim.run(items))
    s = sim.summary()
    done = sum(o.finish_reason != "error" for o in outs)
    assert len(outs) == 400 and s["num_requests"] == 400
    assert s["rejected"] == 400 - done > 0 and s["peak_waiting"] <= 5


def test_cli_simulate_max_waiting(tmp_path, capsys):
    from tinyllm_cli.cli import main
    out = tmp_path / "s.json"
    args = ["simulate", "--num-prompts", "200", "--input-len", "64", "--output-len", "32", "--arrivals", "poisson",
            "--request-rate", "500", "--max-num-seqs", "2", "-q"]
    with pytest.raises(SystemExit) as e:
        main(args + ["--max-waiting", "4", "--stats-json", str(out)])
    assert e.value.code == 0
    s = json.loads(out.read_text())
    assert s["rejected"] > 0 and s["max_waiting"] == 4 and s["peak_waiting"] <= 4
    with pytest.raises(SystemExit) as e:
        main(args + ["--max-waiting", "0", "--stats-json", str(out)])
    assert e.value.code == 0
    s = json.loads(out.read_text())
    assert s["rejected"] == 0 and s["max_waiting"] is None
    with pytest.raises(SystemExit) as e:
        main(args + ["--max-waiting", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--max-waiting" in err
