"""Long-stream memory check: ``serve-batch`` on an open stdin pipe for many engine steps, with the
child's resident memory sampled after warm-up and at the end. A benchmark, not a test.

    python scripts/long_stream_memory.py --steps 200000

It saves a tiny random Llama (transformers, as tests/conftest.py does) in a temporary directory,
starts ``python -m tinyllm_cli serve-batch`` reading stdin, and keeps writing requests of
``--max-tokens`` tokens (``ignore_eos``) into the pipe until about ``--steps`` engine steps' worth
were answered (one running sequence: a request takes ``--max-tokens`` steps), then closes stdin and
reads the exact step count from ``--stats-json``. ``--max-inflight 4`` keeps the engine's waiting
queue short, as on a stream served at its own pace (otherwise every request read waits inside the
engine and the queue, not the statistics, is what grows). RSS is read with psutil every
``--sample-s`` seconds; the peak is the kernel's high-water mark (VmHWM) where there is one.
Needs transformers and psutil (the test extra).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from tinyllm_cli.machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def save_tiny_model(path: Path) -> Path:
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    return path


def request_line(i: int, max_tokens: int) -> bytes:
    prompt = [1] + [5 + (i + j) % 300 for j in range(7)]
    return (json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}}) + "\n").encode()


def hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200_000, help="engine steps to run (at least)")
    ap.add_argument("--max-tokens", type=int, default=50, help="tokens per request")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="share of the steps counted as warm-up")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the child (OMP_NUM_THREADS)")
    ap.add_argument("--pythonpath", default=str(ROOT), help="checkout to run (e.g. an older commit's worktree)")
    args = ap.parse_args()
    import psutil

    n_requests = -(-args.steps // args.max_tokens)
    warm_requests = max(1, int(n_requests * args.warmup_frac))
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "model")
        stats_json = Path(tmp) / "stats.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.pythonpath, os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS=str(args.threads))
        cmd = [sys.executable, "-m", "tinyllm_cli", "serve-batch", "--model", str(model), "--device", "cpu",
               "--num-blocks", "64", "--max-num-seqs", "1", "--max-inflight", "4", "--max-new-tokens", str(args.max_tokens),
               "--stats-json", str(stats_json), "-q"]
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        proc = psutil.Process(child.pid)
        answered = [0]
        errors = [0]

        def pump_out():
            for line in child.stdout:
                answered[0] += 1
                errors[0] += b'"error": null' not in line

        def feed():  # the pipe's back-pressure paces it; stdin stays open until the last request is written
            try:
                for i in range(n_requests):
                    child.stdin.write(request_line(i, args.max_tokens))
                child.stdin.flush()
                # Keep the pipe open until everything was answered, as an endless stream would.
                while answered[0] < n_requests and child.poll() is None:
                    time.sleep(0.2)
                child.stdin.close()
            except BrokenPipeError:
                pass

        err_chunks: list[bytes] = []
        threads = [threading.Thread(target=pump_out, daemon=True), threading.Thread(target=feed, daemon=True),
                   threading.Thread(target=lambda: err_chunks.append(child.stderr.read()), daemon=True)]
        for t in threads:
            t.start()
        warm_rss = warm_at = None
        peak_after_warm = 0
        final_hwm = None
        samples = []
        last_print = 0.0
        while child.poll() is None:
            time.sleep(args.sample_s)
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                break
            if not rss or child.poll() is not None:  # gone (a zombie reads 0)
                break
            done = answered[0]
            samples.append((time.perf_counter() - t0, done, rss))
            if warm_rss is None and done >= warm_requests:
                warm_rss, warm_at = rss, time.perf_counter()
                peak_after_warm = rss
            elif warm_rss is not None:
                peak_after_warm = max(peak_after_warm, rss)
            high = hwm(child.pid)
            if time.perf_counter() - last_print > 30:
                last_print = time.perf_counter()
                print(f"  {time.perf_counter() - t0:7.0f} s  {done * args.max_tokens:>8} steps ~  rss {rss / MiB:7.1f} MiB"
                      + (f"  hwm {high / MiB:7.1f} MiB" if high else ""), file=sys.stderr, flush=True)
            final_hwm = high or final_hwm
        child.wait()
        for t in threads:
            t.join(timeout=5)
        wall = time.perf_counter() - t0
        if child.returncode != 0 or not stats_json.exists():
            print(b"".join(err_chunks).decode(errors="replace")[-3000:], file=sys.stderr)
            print(f"serve-batch exited {child.returncode}", file=sys.stderr)
            return 1
        summ = json.loads(stats_json.read_text())
        if isinstance(summ, list):
            summ = summ[-1]
        steps = summ["steps"]
        end_rss = samples[-1][2]
        rate = steps / max(summ["elapsed_s"], 1e-9)
        growth = peak_after_warm - warm_rss
        steps_after_warm = steps - warm_requests * args.max_tokens
        rows = [("cpu", cpu_name()), ("engine steps", f"{steps}"), ("requests (error lines)", f"{summ['num_requests']} ({errors[0]})"),
                ("output tokens", f"{summ['output_tokens']}"), ("steps / s", f"{rate:.0f}"),
                ("wall", f"{wall:.0f} s"),
                ("RSS after warm-up", f"{warm_rss / MiB:.1f} MiB (after {warm_requests} requests, ~{warm_requests * args.max_tokens} steps)"),
                ("RSS at the end", f"{end_rss / MiB:.1f} MiB"),
                ("peak RSS after warm-up (sampled)", f"{peak_after_warm / MiB:.1f} MiB"),
                ("peak RSS, whole run (VmHWM)", f"{final_hwm / MiB:.1f} MiB" if final_hwm else "n/a"),
                ("growth after warm-up", f"{growth / MiB:.2f} MiB"),
                ("growth per 100k steps", f"{growth / MiB / max(steps_after_warm, 1) * 1e5:.2f} MiB"),
                ("latency p50 / p99", f"{summ['latency_s']['p50']} / {summ['latency_s']['p99']} s")]
        w = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{w}}  {v}")
        target = 50 * MiB
        print(f"target: growth under 50 MiB after warm-up: {'met' if growth < target else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
