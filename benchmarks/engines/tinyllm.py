"""tinyllm: in this process through its Python API for the batched rows, and ``tinyllm generate``
as a process of its own for the single-stream and end-to-end rows (start-up counted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..common import REPO, Run, Skip
from ..workloads import SINGLE_PROMPT, total_tokens


class TinyEngine:
    """tinyllm in this process, through its Python API: the model is loaded once, and each run
    gets a fresh engine (``reconfigure``: a new KV pool, so no run reuses another's prefix cache)."""

    def __init__(self, model: str, dtype: str | None, config: Path | None, kv_gib: int | None = None):
        from tinyllm_cli import LLM
        settings = ({"dtype": dtype} if dtype else {}) | ({"kv_memory": f"{kv_gib}GiB"} if kv_gib else {})
        self.llm = LLM(model, config=config, device="cpu", progress=False, **settings)
        self._run([[5, 6, 7, 8]] * 2, 4)  # first-call costs (allocator, kernels) stay out of the timings

    def _run(self, prompts, output_len):
        from tinyllm_cli import SamplingParams
        self.llm.reconfigure()
        outs = self.llm.generate(prompts, SamplingParams(max_new_tokens=output_len, ignore_eos=True), use_tqdm=False)
        return self.llm.stats, [o.token_ids for o in outs]

    def run(self, prompts, output_len) -> Run:
        s, tokens = self._run(prompts, output_len)
        return Run(s["elapsed_s"], total_tokens(prompts, output_len), tokens)

    def facts(self) -> tuple:
        """(runtime, weight bytes per forward, K/V element bytes): what the limit table needs of
        this row's model (the runtime's settings stay readable after ``close``)."""
        from tinyllm_cli.roofline import runtime_bytes
        return (self.llm.runtime, *runtime_bytes(self.llm.runtime))

    def isa_check(self) -> dict:
        """The --isa cap as this process runs it (isa.tinyllm_check) and torch's libraries probed
        in a child with the same environment."""
        from .. import isa
        return isa.tinyllm_check(isa.torch_probe(Path(sys.executable), os.environ))

    def close(self) -> None:
        self.llm.close()


def tinyllm_env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


def tinyllm_generate(args: list[str], work: Path, timeout: float) -> tuple[float, dict, int]:
    """``tinyllm generate`` as its own process; (wall seconds from spawn to exit, stats, lines out)."""
    stats, out = work / "stats.json", work / "out.jsonl"
    cmd = [sys.executable, "-m", "tinyllm_cli", "generate", *args, "--quiet", "--output", str(out),
           "--stats-json", str(stats)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=tinyllm_env())
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise Skip(f"tinyllm generate failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return wall, json.loads(stats.read_text()), len(out.read_text().splitlines())


def tinyllm_single(config: Path | None, new_tokens: int, work: Path) -> dict:
    """One prompt on the default model; decode tok/s from TPOT, start-up split from the stats."""
    prompt = work / "single.txt"
    prompt.write_text(SINGLE_PROMPT + "\n")
    cfg = ["--config", str(config)] if config else []
    wall, st, _ = tinyllm_generate([*cfg, "--prompts", str(prompt), "--max-new-tokens", str(new_tokens),
                                    "--ignore-eos"], work, 900)
    tpot, ttft = st["tpot_s"]["p50"], st["ttft_s"]["p50"]
    rest = wall - st["load_s"] - st["elapsed_s"]
    return {"decode_tok_s": 1 / tpot, "tpot_s": tpot, "wall_s": wall, "load_s": st["load_s"], "first_step_s": ttft,
            "other_s": rest, "to_first_step_s": rest + st["load_s"] + ttft, "dtype": st.get("dtype"),
            "stats_startup": {k: st[k] for k in st if "import" in k or "startup" in k}}


def tinyllm_e2e(model_dir: Path, dtype: str, prompts, output_len: int, config: Path | None, work: Path) -> dict:
    f = work / "e2e.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    cfg = ["--config", str(config)] if config else []
    wall, st, n = tinyllm_generate([*cfg, "--prompts", str(f), "--model", str(model_dir), "--dtype", dtype,
                                    "--max-new-tokens", str(output_len), "--ignore-eos"], work, 1800)
    if n != len(prompts):
        raise Skip(f"tinyllm generate wrote {n} of {len(prompts)} results")
    # The stats hold no absolute times, so what precedes generation is wall - generation, which
    # also counts writing the last results and exiting: an upper bound on tinyllm's start-up.
    return {"wall_s": wall, "load_s": st["load_s"], "generate_s": st["elapsed_s"],
            "to_generate_s": wall - st["elapsed_s"]}
