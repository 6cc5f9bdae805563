"""``tinyllm load``: the schedule (seeded, open loop, the right rate), the client against
transports that answer, fail and vanish, the summary recomputed from its own records, the
server's /metrics, the CLI's errors and the figure; and a live run against ``tinyllm serve``."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from tinyllm_cli.cli import main
from tinyllm_cli.loadgen import metrics
from tinyllm_cli.loadgen.records import RequestRecord, parse_goodput, percentiles, summarize
from tinyllm_cli.loadgen.client import new_session
from tinyllm_cli.loadgen.run import GONE, Target, run_rate
from tinyllm_cli.loadgen.schedule import Prompts, Workload, plan, send_times
from tinyllm_cli.traces import generate_trace

from conftest import wait_s
from serving_util import ServerProc  # noqa: E402  (tests/: a real tinyllm serve process)

URL = "http://load.test/v1"  # a figure's label only


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


# ---- the schedule, without a server ---------------------------------------------------------

@pytest.mark.parametrize("rate,burstiness", [(4.0, 1.0), (25.0, 1.0), (10.0, 0.5), (10.0, 3.0)])
def test_mean_gap_is_one_over_the_rate(rate, burstiness):
    planned = plan(Prompts(Workload()), rate, burstiness, seed=3, num_requests=2001, duration_s=None)
    times = [p.at_s for p in planned]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(gaps) == 2000 and times[0] == 0.0
    assert abs(statistics.fmean(gaps) - 1 / rate) <= 0.05 / rate
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)  # gamma(k): cv = 1/sqrt(k)
    assert abs(cv - 1 / math.sqrt(burstiness)) < 0.15 / math.sqrt(burstiness)


def test_same_seed_same_schedule_and_prompts_other_seed_other_times():
    a = list(plan(Prompts(Workload()), 5.0, 1.0, seed=1, num_requests=50, duration_s=None))
    b = list(plan(Prompts(Workload()), 5.0, 1.0, seed=1, num_requests=50, duration_s=None))
    c = list(plan(Prompts(Workload()), 5.0, 1.0, seed=2, num_requests=50, duration_s=None))
    assert [(p.at_s, p.prompt, p.output_len) for p in a] == [(p.at_s, p.prompt, p.output_len) for p in b]
    assert [p.at_s for p in a] != [p.at_s for p in c]
    assert [p.prompt for p in a] == [p.prompt for p in c]  # prompts follow --workload-seed alone
    other = list(plan(Prompts(Workload(seed=9)), 5.0, 1.0, seed=1, num_requests=50, duration_s=None))
    assert [p.prompt for p in a] != [p.prompt for p in other]


def test_other_workload_seeds_and_other_traces_share_no_prompt_prefix(tmp_path):
    """Each run of a sweep made of separate ``tinyllm load`` processes (benchmarks/serving: one per
    rate, its own --workload-seed, every prompt 128 tokens) sends prompts of its own: no two
    runs' prompts share a first block, so a prefix-caching server finds nothing left over. The
    serial that keeps a run's prompts apart restarts in every process, and until the seed moved
    the ids, request k of every seed was the same prompt. Two traces (two rates' arrival times)
    likewise; one trace gives the same ids to ``tinyllm load`` and to ``simulate``."""
    from tinyllm_cli.sim.trace import to_requests
    from tinyllm_cli.traces import read_trace, trace_salt, write_trace

    def first_blocks(w, n=40):
        return {tuple(p.prompt[:16]) for p in plan(Prompts(w), None, 1.0, seed=0, num_requests=n, duration_s=None)}
    one, two = (first_blocks(Workload(input_len=128, range_ratio=0.0, seed=s)) for s in (1, 2))
    assert len(one) == len(two) == 40 and not one & two
    assert first_blocks(Workload(input_len=128, range_ratio=0.0, seed=1)) == one  # the same seed, the same prompts
    traces = []
    for rate in (1.0, 4.0):
        path = tmp_path / f"t{rate:g}.jsonl"
        write_trace(generate_trace(20, 64, 8, arrivals="poisson", rate=rate, seed=0), str(path))
        traces.append(path)
    sent = [[p.prompt for p in plan(Prompts(Workload(trace=str(t), vocab_size=49152)), None, 1.0, seed=0,
                                      num_requests=None, duration_s=None)] for t in traces]
    assert not {tuple(x[:16]) for x in sent[0]} & {tuple(x[:16]) for x in sent[1]}
    for t, ids in zip(traces, sent):
        simulated = [r.prompt_token_ids for r in to_requests(read_trace(str(t)), 49152, salt=trace_salt(str(t)))]
        assert simulated == ids


def test_a_sweep_sends_new_prompts_at_each_rate_reproducibly_and_inf_all_at_once():
    def sweep():
        prompts = Prompts(Workload(prefix_len=6, num_prefixes=2))
        return [list(plan(prompts, r, 1.0, seed=0, num_requests=20, duration_s=None)) for r in (2.0, math.inf)]
    slow, burst = sweep()
    assert all(p.at_s == 0.0 for p in burst) and slow[-1].at_s > 0
    assert [p.prompt for run in sweep() for p in run] == [p.prompt for p in slow + burst]  # reproducible
    unique = {tuple(p.prompt[6:]) for p in slow + burst}  # past the shared prefix, no two alike
    assert len(unique) == 40
    assert {tuple(p.prompt[:6]) for p in slow + burst} == {tuple(p.prompt[:6]) for p in slow}  # same groups


def test_random_workload_is_simulates():
    w = Workload(input_len=40, output_len=12, range_ratio=0.5, prefix_len=8, num_prefixes=2, vocab_size=1000, seed=5)
    got = list(plan(Prompts(w), 1.0, 1.0, seed=0, num_requests=30, duration_s=None))
    want = list(generate_trace(30, 40, 12, range_ratio=0.5, prefix_len=8, num_prefixes=2, seed=5))
    assert [len(p.prompt) for p in got] == [it.prompt_len for it in want]
    assert [p.output_len for p in got] == [it.output_len for it in want]
    assert all(4 <= t < 1000 for p in got for t in p.prompt)
    groups = {}
    for p, it in zip(got, want):  # a prefix group's prompts share their first prefix_len tokens
        groups.setdefault(it.prefix_group, set()).add(tuple(p.prompt[:8]))
    assert all(len(v) == 1 for v in groups.values()) and len(groups) == 2


def test_poisson_times_are_serve_batchs():
    from tinyllm_cli.workload import poisson_gaps  # serve-batch's --request-rate arrivals
    gaps = poisson_gaps(3.0, 11)
    t, want = 0.0, [0.0]
    for _ in range(99):
        t += next(gaps)
        want.append(t)
    assert list(zip(range(100), send_times(3.0, 1.0, 11))) == list(enumerate(want))


def test_trace_keeps_its_times_scaled_or_takes_a_rate(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": 0.5 * i, "prompt_len": 5 + i, "output_len": 3}) + "\n"
                             for i in range(6)))
    w = Workload(trace=str(trace), vocab_size=500)
    own = list(plan(Prompts(w), None, 1.0, seed=0, num_requests=None, duration_s=None, time_scale=2.0))
    assert [p.at_s for p in own] == [1.0 * i for i in range(6)]
    assert [len(p.prompt) for p in own] == [5 + i for i in range(6)]
    paced = list(plan(Prompts(w), 10.0, 1.0, seed=0, num_requests=None, duration_s=None))
    assert [p.at_s for p in paced] == list(x for _, x in zip(range(6), send_times(10.0, 1.0, 0)))
    assert [p.at_s for p in plan(Prompts(w), None, 1.0, seed=0, num_requests=None, duration_s=1.2)] == [0.0, 0.5, 1.0]


def test_duration_bounds_the_schedule():
    got = [p.at_s for p in plan(Prompts(Workload()), 50.0, 1.0, seed=0, num_requests=None, duration_s=2.0)]
    assert got and max(got) < 2.0 and 60 < len(got) < 140


# ---- a server that answers as each test says -----------------------------------------------------

def sse(chunks: list[str], usage: dict | None = None, done: bool = True, error: str | None = None) -> bytes:
    lines = [f"data: {json.dumps({'choices': [{'index': 0, 'text': c}]})}\n\n" for c in chunks]
    if error:
        lines.append(f"data: {json.dumps({'error': {'message': error}})}\n\n")
    if usage:
        lines.append(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def events(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="text/event-stream")


async def stream(request, parts) -> web.StreamResponse:
    """An SSE answer written part by part as ``parts`` (an async iterator of bytes) yields them."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    async for part in parts:
        await resp.write(part)
    await resp.write_eof()
    return resp


FAKE = web.RequestKey("fake", object)  # each request carries its server, for go_away


class Fake:
    """A real HTTP server on 127.0.0.1 (aiohttp's low-level one) whose answers come from
    ``handler(request)``; ``go_away`` makes it die as a killed server does: nothing listens any
    more (connections are refused) and every open connection drops."""

    def __init__(self, handler):
        self.handler = handler
        self.server = RawTestServer(self._handle, host="127.0.0.1")

    async def _handle(self, request):
        request[FAKE] = self
        return await self.handler(request)

    async def go_away(self) -> None:
        for site in list(self.server.runner.sites):
            await site.stop()
        for conn in self.server.runner.server.connections:
            conn.force_close()


def run(handler, planned, *, slo=None, concurrency=None, server_metrics=False, api_key=None, chat=False):
    async def go():
        fake = Fake(handler)
        await fake.server.start_server()
        try:
            async with new_session() as client:
                target = Target(str(fake.server.make_url("/v1")), "m", chat=chat, api_key=api_key,
                                max_concurrency=concurrency, server_metrics=server_metrics, slo=slo or {})
                return await run_rate(client, target, planned)
        finally:
            await fake.server.close()
    return asyncio.run(go())


def schedule(n, rate=200.0, output_len=4):
    return plan(Prompts(Workload(output_len=output_len, input_len=8, vocab_size=100)), rate, 1.0, seed=0,
                num_requests=n, duration_s=None)


def test_sending_never_waits_for_completions():
    """Every request is sent before any is answered: the transport holds all answers until it
    has seen the last request."""
    n = 40
    seen, all_sent = [], asyncio.Event()

    async def handler(request):
        seen.append(await request.json())
        if len(seen) == n:
            all_sent.set()
        await all_sent.wait()
        return events(sse(["a", "b"], {"prompt_tokens": 8, "completion_tokens": 2}))

    res = run(handler, schedule(n, rate=100.0))
    assert len(seen) == n and res.summary["num_completed"] == n
    latest_send = max(r.sent_s for r in res.records)
    assert all(r.sent_s + r.latency_s >= latest_send for r in res.records)  # none finished before the last send


def test_requests_carry_the_key_the_body_and_go_where_asked(tmp_path):
    seen = []

    async def handler(request):
        seen.append((request.path, request.headers.get("authorization"), json.loads(await request.read() or b"{}")))
        if request.path == "/metrics":
            return web.Response(text="")
        return events(sse(["a", "b"], {"prompt_tokens": 3, "completion_tokens": 2}))

    planned = list(schedule(3, output_len=7))
    run(handler, planned, api_key="sekret", server_metrics=True)
    assert {auth for _, auth, _ in seen} == {"Bearer sekret"}
    bodies = [b for path, _, b in seen if path == "/v1/completions"]
    assert [(b["prompt"], b["max_tokens"]) for b in bodies] == [(p.prompt, p.output_len) for p in planned]
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 and b["stream_options"]["include_usage"]
               for b in bodies)
    prompts = tmp_path / "q.txt"
    prompts.write_text("hello there\nsecond one\n")
    seen.clear()
    chat = list(plan(Prompts(Workload(prompts_file=str(prompts), chat=True, output_len=5)), math.inf, 1.0,
                     seed=0, num_requests=3, duration_s=None))
    run(handler, chat, chat=True)
    assert [path for path, _, _ in seen] == ["/v1/chat/completions"] * 3
    assert [b["messages"][0]["content"] for _, _, b in seen] == ["hello there", "second one", "hello there"]


def test_max_concurrency_holds_requests_back():
    inflight, peak = [0], [0]

    async def handler(request):
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        await asyncio.sleep(0.02)
        inflight[0] -= 1
        return events(sse(["x"], {"prompt_tokens": 1, "completion_tokens": 1}))

    res = run(handler, schedule(12, rate=math.inf), concurrency=3)
    assert peak[0] == 3 and res.summary["num_completed"] == 12
    assert res.summary["send_lag_s"]["p99"] > 0.02  # the held-back ones say so


async def varied(request):
    """Answers that differ per request: prompt tokens from the body, a few chunk gaps."""
    body = await request.json()
    k = body["prompt"][0] % 5

    async def parts():
        await asyncio.sleep(0.004 * k)
        for i in range(body["max_tokens"]):
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n".encode()
            await asyncio.sleep(0.002 * (k % 3))
        yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': len(body['prompt']), 'completion_tokens': body['max_tokens']}})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return await stream(request, parts())


def test_goodput_recomputed_from_the_records_equals_the_reported_figure():
    slo = parse_goodput(["ttft:10 tpot:3", "e2el:40"])
    assert slo == {"ttft_s": 0.01, "tpot_s": 0.003, "latency_s": 0.04}
    res = run(varied, schedule(60, rate=400.0, output_len=6), slo=slo)
    good = 0
    for r in res.records:
        d = r.to_json()
        within = (d["error"] is None and d["ttft_s"] <= 0.01 and d["latency_s"] <= 0.04
                  and (d["tpot_s"] is None or d["tpot_s"] <= 0.003))
        good += within
    s = res.summary
    assert 0 < good < 60  # the SLOs split the requests, so the check means something
    assert s["slo"]["num_good"] == good
    assert s["slo"]["goodput_req_per_s"] == round(good / s["elapsed_s"], 4)
    assert s["slo"]["slo_attainment"] == round(good / 60, 4)


def test_records_give_the_latency_figures():
    planned = list(schedule(30, rate=500.0, output_len=5))
    want = {p.index: p.output_len for p in planned}
    res = run(varied, planned)
    assert len(set(want.values())) > 1
    for r in res.records:
        n = want[r.index]
        assert r.output_tokens == n and len(r.itl_s) == n - 1
        if n > 1:  # times kept to the µs
            assert r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / (n - 1), abs=2e-6)
        else:
            assert r.tpot_s is None
        assert r.ttft_s + sum(r.itl_s) <= r.latency_s + 1e-5
    s = res.summary
    assert s["ttft_s"] == percentiles([r.ttft_s for r in res.records])
    assert s["output_tokens"] == sum(want.values()) and s["prompt_tokens"] == sum(r.prompt_tokens for r in res.records)


def test_percentiles_are_the_engines():
    from tinyllm_cli.engine.stats import percentiles as engine_percentiles
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.15]
    assert percentiles(xs) == engine_percentiles(xs)


def test_failed_requests_are_counted_and_never_end_the_run():
    async def handler(request):
        i = (await request.json())["prompt"][0] % 4
        if i == 0:
            return web.json_response({"error": {"message": "prompt too long", "type": "invalid_request_error"}},
                                     status=400)
        if i == 1:
            return events(sse(["a"], error="engine failed"))
        if i == 2:
            return events(sse(["a", "b"], done=False))
        return events(sse(["a", "b"], {"prompt_tokens": 3, "completion_tokens": 2}))

    planned = list(schedule(40, rate=math.inf))
    kinds = [p.prompt[0] % 4 for p in planned]
    res = run(handler, planned)
    s = res.summary
    assert res.gone is None and s["num_requests"] == 40
    assert s["num_failed"] == sum(k != 3 for k in kinds) and s["num_completed"] == kinds.count(3)
    assert s["errors"]["HTTP 400: prompt too long"] == kinds.count(0)
    assert s["errors"]["error event: engine failed"] == kinds.count(1)
    assert s["errors"]["stream ended without [DONE]"] == kinds.count(2)
    assert s["latency_s"]["p50"] is not None


def test_a_server_that_goes_away_ends_the_run_with_the_records_kept():
    state = {"n": 0}

    async def handler(request):
        state["n"] += 1
        if state["n"] == 10:  # the tenth answer is the last: the server dies once it is sent
            asyncio.get_running_loop().call_soon(asyncio.ensure_future, request[FAKE].go_away())
        return events(sse(["a", "b"], {"prompt_tokens": 8, "completion_tokens": 2}))

    # 20 ms apart: the answers are instant, so none is in flight when the server dies, and
    # the next request finds nothing listening
    res = run(handler, schedule(50, rate=50.0))
    assert res.gone and "refused" in res.gone
    s = res.summary
    assert s["num_completed"] == 10 and s["num_requests"] < 50  # the rest were never sent
    assert all(r.ok or r.error for r in res.records)
    assert sum(r.ok for r in res.records) == 10


def test_a_stream_cut_by_a_dying_server_ends_the_run():
    """Every request is streaming when the server dies: each stream is cut, the liveness probe
    finds nothing listening, and the run ends with the records kept."""
    n, streaming, cut = 20, [0], asyncio.Event()

    async def handler(request):
        async def parts():
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'a'}]})}\n\n".encode()
            streaming[0] += 1
            if streaming[0] == n:  # the last one began: the server dies now
                cut.set()
            await cut.wait()
            await request[FAKE].go_away()  # mid-stream: every open stream drops
        return await stream(request, parts())

    res = run(handler, schedule(n, rate=math.inf))
    assert res.gone and "cut short" in res.gone
    assert res.summary["num_requests"] == n and res.summary["num_completed"] == 0
    assert {r.error.split(":")[0] for r in res.records} <= {"stream cut short", GONE.split(":")[0]}


# ---- the server's /metrics ---------------------------------------------------------------------

PROM = """# HELP vllm:num_preemptions_total Preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{model_name="m"}} {pre}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m"}} {kv}
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{model_name="m"}} {q}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{model_name="m"}} {h}
"""


def test_server_metrics_report_counter_differences_and_gauge_peaks():
    scrapes = iter([dict(pre=2, kv=0.1, q=100, h=10), dict(pre=3, kv=0.8, q=150, h=30)]
                   + [dict(pre=5, kv=0.3, q=200, h=50)] * 1000)

    calls, looked = [0], asyncio.Event()

    async def handler(request):
        if request.path == "/metrics":
            calls[0] += 1
            if calls[0] == 2:  # the first look during the run
                looked.set()
            return web.Response(text=PROM.format(**next(scrapes)))
        await asyncio.wait_for(looked.wait(), 60)  # answer once the sampler has looked mid-run
        return events(sse(["a"], {"prompt_tokens": 1, "completion_tokens": 1}))

    res = run(handler, schedule(3, rate=math.inf), server_metrics=True)
    server = res.summary["server"]
    assert server["preemptions"] == 3 and server["prefix_cache_queries"] == 100
    assert server["prefix_cache_hits"] == 40 and server["prefix_cache_hit_rate"] == 0.4
    assert server["peak_kv_cache_usage"] == 0.8


def test_a_server_without_metrics_gets_a_note():
    async def handler(request):
        if request.path == "/metrics":
            return web.Response(status=404)
        return events(sse(["a"], {"prompt_tokens": 1, "completion_tokens": 1}))

    res = run(handler, schedule(2), server_metrics=True)
    assert "no readable Prometheus metrics" in res.summary["server"]["note"]
    assert metrics.metrics_url("http://h:1/v1/") == "http://h:1/metrics"


# ---- the command ---------------------------------------------------------------------------------

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_server_is_one_sentence_and_exit_1(capsys, tmp_path):
    out_json = tmp_path / "l.json"
    code, out, err = cli(capsys, "load", "--url", f"http://127.0.0.1:{free_port()}/v1", "--json", out_json)
    assert code == 1 and out == ""
    assert err.startswith("error: no server answers at") and len(err.strip().splitlines()) == 1
    assert json.loads(out_json.read_text())["runs"] == []


def test_without_aiohttp_is_one_sentence_naming_the_install(tmp_path):
    hide = ("import sys\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'aiohttp' or name.startswith('aiohttp.'):\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from tinyllm_cli.cli import main\n"
            "main(sys.argv[1:])\n")
    out_json = tmp_path / "l.json"
    r = subprocess.run([sys.executable, "-c", hide, "load", "--url", f"http://127.0.0.1:{free_port()}/v1", "--json",
                        str(out_json)], capture_output=True, text=True, timeout=wait_s(120))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        'error: tinyllm load needs aiohttp, which is not installed: pip install "tinyllm[serve]"']
    assert not out_json.exists()


@pytest.mark.parametrize("args,words", [
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--goodput", "ttfb:10"], "--goodput"),
    (["--goodput", "ttft:-1"], "--goodput ttft"),
    (["--endpoint", "chat"], "--prompts"),
    (["--endpoint", "grpc"], "--endpoint"),
    (["--num-requests", "5", "--duration", "3"], "not both"),
    (["--duration", "3"], "finite"),
    (["--url", "127.0.0.1:8000"], "http://"),
    (["--json", "/nonexistent-dir/x.json"], "folder"),
])
def test_usage_errors_exit_2(capsys, args, words):
    base = ["load", "--url", "http://127.0.0.1:9/v1"]
    code, out, err = cli(capsys, *base, *args)
    assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1


def test_plot_draws_and_redraws_a_load_json(tmp_path):
    pytest.importorskip("matplotlib")
    from tinyllm_cli.plot import load_figure, plot_saved, stats_kind

    def one(rate):
        recs = [RequestRecord(i, 0.1 * i, 0.1 * i + 0.001, 8, 4, 0.02, 0.01, 0.05, [0.01] * 3) for i in range(5)]
        recs.append(RequestRecord(5, 0.5, 0.5, error="HTTP 429: busy"))
        return {"request_rate": rate, "burstiness": 1.0, "max_concurrency": None,
                "summary": summarize(recs, 1.0, {"ttft_s": 0.5}), "records": [r.to_json() for r in recs]}
    report = {"kind": "load", "url": URL, "endpoint": "completions", "model": "m", "runs": [one("1"), one("inf")]}
    saved = tmp_path / "load.json"
    saved.write_text(json.dumps(report))
    assert stats_kind(report) == "load"
    assert plot_saved(saved, tmp_path / "load.svg") == "load"
    svg = (tmp_path / "load.svg").read_text()
    for gid in ("ttft_s/p99", "latency_s/p50", "goodput_req_per_s", "request/5/failed", "request/0/streaming"):
        assert f'id="{gid}"' in svg
    load_figure(report)


# ---- live, against a real tinyllm serve ---------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with ServerProc() as s:  # the default model
        yield s


def load_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyllm_cli", "load", *map(str, args)], capture_output=True,
                          text=True, timeout=wait_s(600))


def test_live_sweep_goodput_from_records_and_the_servers_own_counts(server, tmp_path):
    out_json = tmp_path / "load.json"
    before = server.metrics()["vllm:generation_tokens_total"]
    r = load_cli("--url", server.v1, "--request-rate", "4,inf", "--num-requests", 8, "--input-len", 32,
                 "--output-len", 12, "--goodput", "ttft:400 tpot:60", "--server-metrics", "--json", out_json)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "rate sweep" in r.stderr
    report = json.loads(out_json.read_text())
    assert [run["request_rate"] for run in report["runs"]] == ["4", "inf"]
    sent_tokens = 0
    prompts = Prompts(Workload(input_len=32, output_len=12))  # the sweep's own, drawn again
    for run, rate in zip(report["runs"], (4.0, math.inf)):
        s, recs = run["summary"], run["records"]
        planned = list(plan(prompts, rate, 1.0, seed=0, num_requests=8, duration_s=None))
        assert [(x["scheduled_s"], x["prompt_tokens"], x["output_tokens"]) for x in recs] == \
            [(p.at_s, p.prompt_len, p.output_len) for p in planned]  # as the server counted them
        assert s["num_requests"] == 8 and s["num_failed"] == 0
        good = sum(1 for x in recs if x["error"] is None and x["ttft_s"] <= 0.4
                   and (x["tpot_s"] is None or x["tpot_s"] <= 0.06))
        assert s["slo"]["num_good"] == good
        assert s["slo"]["goodput_req_per_s"] == round(good / s["elapsed_s"], 4)
        assert s["ttft_s"] == percentiles([x["ttft_s"] for x in recs])
        assert all(len(x["itl_s"]) <= x["output_tokens"] - 1 for x in recs)
        assert s["server"]["server_generation_tokens"] == s["output_tokens"]
        assert s["server"]["server_prompt_tokens"] == s["prompt_tokens"]
        sent_tokens += s["output_tokens"]
    assert server.metrics()["vllm:generation_tokens_total"] - before == sent_tokens
    burst = report["runs"][1]["records"]
    assert max(x["sent_s"] for x in burst) < min(x["sent_s"] + x["latency_s"] for x in burst)  # open loop


def test_live_failed_requests_are_counted(server, tmp_path):
    """Requests that can never fit (over max_model_len) are refused by the server; the run goes on."""
    trace = tmp_path / "t.jsonl"
    lines = [{"arrival_s": 0.05 * i, "prompt_len": 16, "output_len": 100000 if i % 3 == 0 else 8} for i in range(9)]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out_json = tmp_path / "load.json"
    r = load_cli("--url", server.v1, "--trace", trace, "--json", out_json)
    assert r.returncode == 0, r.stderr
    s = json.loads(out_json.read_text())["runs"][0]["summary"]
    assert s["num_requests"] == 9 and s["num_failed"] == 3 and s["num_completed"] == 6
    assert all(k.startswith("HTTP 400") for k in s["errors"])
    assert s["output_tokens"] == 6 * 8


def test_live_server_that_goes_away_mid_run(tmp_path):
    out_json = tmp_path / "load.json"
    # A schedule of 2000 requests (11 minutes at 3 req/s) far outlasts the wait for the server's
    # first tokens, even on a slow or busy host, so the kill lands mid-run; the run ends when the
    # server goes, not when the schedule does.
    with ServerProc() as victim:
        args = ["--url", victim.v1, "--request-rate", "3", "--num-requests", "2000", "--input-len", "16",
                "--output-len", "16", "--json", out_json]
        load = subprocess.Popen([sys.executable, "-m", "tinyllm_cli", "load", *map(str, args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        victim.wait_metric("vllm:generation_tokens_total", lambda v: v is not None and v >= 32,
                           "counted two requests' tokens")
        victim.stop()  # SIGKILL, mid-run
        out, err = load.communicate(timeout=wait_s(300))
    assert load.returncode == 1 and out == ""
    errors = [ln for ln in err.splitlines() if ln.startswith("error")]  # after the partial rate's table
    assert errors == [err.strip().splitlines()[-1]] and "went away after" in errors[0] and str(out_json) in errors[0]
    run = json.loads(out_json.read_text())["runs"][0]
    s = run["summary"]
    assert s["num_completed"] >= 2 and s["num_requests"] < 2000
    assert s["num_failed"] == sum(1 for x in run["records"] if x["error"] is not None) >= 1
