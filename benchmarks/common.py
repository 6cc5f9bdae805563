"""What every part of the comparison shares: the engine and workload names, the log, the Skip
that turns any engine failure into a note, and a run's result.

Invariant: nothing here imports an engine or tinyllm_cli; every other module may import this one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINES = ("tinyllm", "hf", "openvino", "vllm", "llamacpp")
ENGINE_NAMES = {"tinyllm": "tinyllm", "hf": "transformers", "openvino": "OpenVINO GenAI", "vllm": "vLLM CPU",
                "llamacpp": "llama.cpp"}
BENCHES = ("W1", "W2", "long", "single", "e2e")
BATCHED = ("W1", "W2", "long")  # the rows every engine runs on each shape and dtype
DTYPES = ("float32", "bfloat16", "int4", "q4_1")
DEFAULT_DTYPES = ("float32", "bfloat16", "int4")
# "int4": each shape's own weights in 4 bits per engine: tinyllm (configs/fast.yaml's settings) and
# llama.cpp on one Q4_1 GGUF that llama-quantize makes from the f32 GGUF, OpenVINO GenAI on its
# NNCF int4 export; no transformers / vLLM row (transformers fp32 is the reference it is scored on).
INT4 = "int4"
# "q4_1": the batched rows on the default model itself: llama.cpp on its Q4_1 GGUF as shipped, tinyllm with
# --config (whatever that config does with the weights); no transformers / vLLM on this row.
Q4 = "q4_1"


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


class Skip(Exception):
    """An engine cannot run here; the message is the one-sentence note for the table."""


@dataclass
class Run:
    elapsed_s: float
    total_tokens: int
    token_ids: list | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.total_tokens / self.elapsed_s


def lazy(fn):
    """Set-up that happens once, on first use, and remembers a Skip."""
    state: dict = {}

    def get(*args):
        if args not in state:
            try:
                state[args] = fn(*args)
            except Skip as e:
                state[args] = e
        if isinstance(state[args], Skip):
            raise state[args]
        return state[args]
    return get
