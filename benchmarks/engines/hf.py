"""transformers: the reference every engine's greedy tokens are scored against, and a batched
engine itself (``generate`` on one left-padded batch)."""

from __future__ import annotations

import json
from pathlib import Path

from ..common import Run
from ..workloads import total_tokens


class HFEngine:
    """transformers' padded ``generate`` in this process (what `tinyllm bench --baseline hf` runs)."""

    def __init__(self, model_dir: Path, dtype: str):
        import torch
        import transformers
        transformers.utils.logging.disable_progress_bar()  # one bar per run would bury the log
        self.model_dir, self.dtype = model_dir, getattr(torch, dtype)
        eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id", 0)
        self.pad = eos[0] if isinstance(eos, list) else eos

    def run(self, prompts, output_len) -> Run:
        import torch
        from tinyllm_cli.baselines import hf_generate_baseline
        r = hf_generate_baseline(str(self.model_dir), prompts, output_len, self.dtype, torch.device("cpu"), self.pad)
        return Run(r["elapsed_s"], total_tokens(prompts, output_len), r["token_ids"])

    def close(self) -> None:
        pass
