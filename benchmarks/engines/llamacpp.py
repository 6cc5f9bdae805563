"""llama.cpp: ``llama-batched-bench`` for the batched rows, ``llama-bench`` for the single stream,
``llama-quantize`` for the int4 rows' Q4_1 files, and an untimed greedy pass
(``workers/llamacpp_worker.py``) for the agreement column, since its timed runs print no tokens.

Invariant: once llama.cpp has died of SIGILL or SIGSEGV (its AMX repacking on one VM), every later
llama.cpp process runs without weight repacking, and the results say so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from .. import isa
from ..common import Run, Skip, log
from ..venvs import run_logged

LLAMACPP_WORKER = Path(__file__).resolve().parent.parent / "workers" / "llamacpp_worker.py"
LLAMACPP_Q4 = "Q4_1"  # the default model's own format: 4-bit layers, asymmetric, blocks of 32


def quantize_gguf(bindir: Path, src: Path, out: Path, logfile: Path) -> Path:
    """llama-quantize's Q4_1 of an f32 GGUF, laid out as the default model's own file: Q4_1 layers
    and a Q8_0 embedding (which is also the tied output layer)."""
    if out.exists():
        return out
    log(f"quantizing {src.name} to {LLAMACPP_Q4} with llama-quantize ...")
    tmp = out.with_suffix(".tmp")
    cmd = [bindir / "llama-quantize", "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0",
           src, tmp, LLAMACPP_Q4, "2"]
    if not run_logged(cmd, logfile):
        raise Skip(f"llama-quantize {LLAMACPP_Q4} failed (see {logfile})")
    tmp.rename(out)
    return out


def parse_batched_bench(text: str) -> list[dict]:
    """The result lines of ``llama-batched-bench --output-format jsonl`` (one JSON object per
    PP x TG x B combination; every other line is log)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed"' in line:
            rows.append(json.loads(line))
    return rows


def parse_llama_bench(text: str) -> list[dict]:
    """``llama-bench -o json`` prints one JSON array (possibly after log lines); its records."""
    start = text.find("[")
    if start < 0:
        return []
    return json.loads(text[start:text.rindex("]") + 1])


# Whether llama.cpp may repack weights into its "extra" buffer types. On an AMX CPU a Q4_1 file's
# weights go to its AMX buffer type, whose kernel died on a Sapphire Rapids VM (SIGILL at a
# `tilezero` in a worker thread, or SIGSEGV in ggml_backend_amx_mul_mat, depending on the batch);
# after one such crash every later llama.cpp process here runs
# with repacking off (F32, BF16 and Q4_1 have no other repacked form on x86, so nothing else
# changes), and the runs say so ("repack": false).
LLAMACPP_REPACK = {"on": True}


def run_llamacpp(make_cmd, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a llama.cpp process built by ``make_cmd(repack)``, once more without repacking if it
    died of an illegal instruction or a segmentation fault (see LLAMACPP_REPACK)."""
    def go(repack: bool):
        return subprocess.run(make_cmd(repack), capture_output=True, text=True, timeout=timeout, env=env)
    out = go(LLAMACPP_REPACK["on"])
    if out.returncode in (-signal.SIGILL, -signal.SIGSEGV) and LLAMACPP_REPACK["on"]:
        log(f"llama.cpp died of signal {-out.returncode} (its AMX path); running it without weight repacking")
        LLAMACPP_REPACK["on"] = False
        out = go(False)
    return out


def llamacpp_tokens(py: Path, bindir: Path, gguf: Path, prompts, output_len: int, work: Path) -> list[list[int]]:
    """llama.cpp's greedy tokens for the prompts (workers/llamacpp_worker.py; untimed)."""
    f, out = work / "llamacpp-prompts.json", work / "llamacpp-tokens.json"
    f.write_text(json.dumps(prompts))
    sdist = bindir.parents[3]  # <sdist>/vendor/llama.cpp/build/bin
    env = os.environ | {"PYTHONPATH": str(sdist), "LLAMA_CPP_LIB_PATH": str(bindir)}
    cmd = [str(py), str(LLAMACPP_WORKER), "--gguf", str(gguf), "--prompts", str(f), "--max-tokens", str(output_len),
           "--output", str(out)]
    p = run_llamacpp(lambda repack: cmd if repack else [*cmd, "--no-repack"], 3600, env)
    if p.returncode != 0:
        raise Skip(f"llama.cpp's token check failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.read_text())["token_ids"]


class LlamaCppEngine:
    """llama-batched-bench on a GGUF, one process per run: B = number of prompts, PP = their mean
    length (rounded), TG = new tokens, 2 threads; 'speed' is total tok/s."""

    def __init__(self, bindir: Path, gguf: Path, threads: int = 2):
        self.bindir, self.gguf, self.threads = bindir, gguf, threads

    def run(self, prompts, output_len) -> Run:
        b, pp = len(prompts), round(sum(map(len, prompts)) / len(prompts))
        cmd = [str(self.bindir / "llama-batched-bench"), "-m", str(self.gguf), "-c", str(b * (pp + output_len) + 64),
               "-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(output_len), "-npl", str(b),
               "-t", str(self.threads), "-tb", str(self.threads), "--output-format", "jsonl"]
        out = run_llamacpp(lambda repack: cmd if repack else [*cmd, "--no-repack"], 1800)
        rows = parse_batched_bench(out.stdout + "\n" + out.stderr)
        if out.returncode != 0 or not rows:
            tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
            raise Skip(f"llama-batched-bench failed (exit status {out.returncode}): {tail[0]}")
        r = rows[0]
        return Run(r["t"], r["n_kv"], None, {"pp": r["pp"], "tg": r["tg"], "pl": r["pl"], "speed": r["speed"],
                                             "t_pp": r["t_pp"], "t_tg": r["t_tg"], "repack": LLAMACPP_REPACK["on"]})

    def isa_check(self) -> dict:
        """The CPU features of the build it runs, checked against the AVX2 + FMA cap (isa.llamacpp_check)."""
        return isa.llamacpp_check(isa.llamacpp_system_info(isa.llamacpp_features(self.bindir)))

    def close(self) -> None:
        pass


def llamacpp_single(bindir: Path, gguf: Path, new_tokens: int) -> dict:
    cmd = [str(bindir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", "2", "-r", "1",
           "-o", "json"]
    out = run_llamacpp(lambda repack: cmd if repack else [*cmd, "--repack", "0"], 900)
    rows = parse_llama_bench(out.stdout)
    if out.returncode != 0 or not rows:
        raise Skip(f"llama-bench failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return {"decode_tok_s": rows[0]["avg_ts"], "build": rows[0].get("build_commit"), "type": rows[0].get("model_type"),
            "repack": LLAMACPP_REPACK["on"]}
