"""vLLM CPU: a warm worker per row (``workers/vllm_worker.py serve``) and the end-to-end job
(``oneshot``: import, engine build and generate in one process, timed from spawn)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from .. import isa
from ..common import Skip
from ..guard import WorkerEngine
from ..workloads import longest_sequence

WORKER = Path(__file__).resolve().parent.parent / "workers" / "vllm_worker.py"


def vllm_settings(kv_gib: int) -> dict:
    """The environment vLLM's CPU engine needs here, in the batched rows and the serving comparison
    alike (see docs/performance.md): 2 threads bound to cores 0-1, ``kv_gib`` GiB of KV, offline."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_USE_AOT_COMPILE": "0",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}


def vllm_env(kv_gib: int, isa_name: str = "native") -> dict:
    env = isa.worker_env(os.environ, isa_name) | vllm_settings(kv_gib)
    return env | isa.vllm_env(isa_name, env)


def vllm_model_len(workloads: dict, benches) -> int:
    """vLLM's ``max_model_len`` for these workloads: 512 (W1/W2's), or the longest sequence's
    positions rounded up to its 128-token blocks (long: 2048, tinyllm's own default)."""
    need = longest_sequence(workloads, benches)
    return max(512, -(-need // 128) * 128)


class VLLMEngine(WorkerEngine):
    """vLLM's ``LLM.generate`` in workers/vllm_worker.py (block size 128, 2 threads bound to cores 0-1)."""

    name = "vLLM"

    def __init__(self, py: Path, model_dir: Path, dtype: str, logfile: Path, kv_gib: int, timeout: float,
                 max_model_len: int = 512, isa_name: str = "native"):
        cmd = [str(py), str(WORKER), "serve", "--model", str(model_dir), "--dtype", dtype,
               "--max-model-len", str(max_model_len)]
        self.py, self.isa_name = py, isa_name
        super().__init__(cmd, vllm_env(kv_gib, isa_name), logfile, timeout)

    def isa_check(self) -> dict | None:
        """The worker's own report (which ``_C`` build its processes mapped) and torch's libraries
        probed under the same environment (isa.vllm_check)."""
        if "isa_facts" not in self.info:
            return None
        return isa.vllm_check(self.info["isa_facts"], isa.torch_probe(self.py, vllm_env(1, self.isa_name)))


def vllm_e2e(py: Path, model_dir: Path, dtype: str, prompts, output_len: int, work: Path, logfile: Path,
             kv_gib: int, isa_name: str = "native") -> dict:
    f, out = work / "e2e.json", work / "e2e-vllm-out.json"
    f.write_text(json.dumps(prompts))
    cmd = [str(py), str(WORKER), "oneshot", "--model", str(model_dir), "--dtype", dtype, "--prompts", str(f),
           "--max-tokens", str(output_len), "--output", str(out)]
    t0, spawned = time.perf_counter(), time.time()
    with logfile.open("a") as fh:
        p = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=vllm_env(kv_gib, isa_name),
                           timeout=1800)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise Skip(f"the vLLM job failed (see {logfile})")
    r = json.loads(out.read_text())
    if len(r["token_ids"]) != len(prompts):
        raise Skip(f"the vLLM job returned {len(r['token_ids'])} of {len(prompts)} results")
    # Shutdown (vLLM's engine core is a second process) is not start-up, so it is measured
    # exactly: the worker writes the wall-clock time at which generate() started.
    return {"wall_s": wall, "import_s": r["import_s"], "init_s": r["init_s"], "generate_s": r["generate_s"],
            "to_generate_s": r["generate_started"] - spawned}
