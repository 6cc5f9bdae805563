"""Requests, sampling parameters, the engine's per-sequence state, and outputs.

Invariants:
- ``Sequence.tokens`` is prompt + generated ids; ``num_cached`` of them have K/V in the cache.
  A step feeds ``tokens[num_cached:num_cached + n]``; a preempted sequence drops to
  ``num_cached = 0`` and is recomputed from all its tokens, so nothing it generated is lost.
- A sequence's random stream depends only on its seed and the index of the token being drawn,
  never on the batch it happens to run in (see ``sampler``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with one sentence naming the bad field."""
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens must be an integer >= 1"),
            (_num(self.temperature) and self.temperature >= 0, "temperature must be a number >= 0"),
            (_num(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0 (0 = off)"),
            (_num(self.min_p) and 0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed must be an integer"),
            (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (isinstance(self.stop_token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids), "stop_token_ids must be a list of integers"),
            (isinstance(self.ignore_eos, bool), "ignore_eos must be true or false"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        # Below 1e-5 dividing the logits overflows to inf/NaN; such a temperature *is* greedy.
        return self.temperature < 1e-5

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class Request:
    id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    index: int = 0  # position in the input, for input-order output
    error: str | None = None  # set when the request was bad before it reached the engine
    metadata: object = None  # echoed back untouched


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request: Request
    seed: int
    tokens: list[int]
    num_prompt: int
    status: Status = Status.WAITING
    num_cached: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    recomputed_tokens: int = 0
    lost_tokens: int = 0  # K/V dropped by the last preemption, not yet recomputed
    text: str = ""
    stream: object = None  # TextStream when the request has stop strings
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass
class RequestOutput:
    id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    stop_reason: str | int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    preemptions: int = 0
    seed: int | None = None
    metadata: object = None

    def to_json(self) -> dict:
        return {
            "id": self.id, "prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids, "finish_reason": self.finish_reason,
            "error": self.error, "stop_reason": self.stop_reason,
            "num_prompt_tokens": len(self.prompt_token_ids), "num_output_tokens": len(self.token_ids),
            "metrics": {"ttft_s": _r(self.ttft_s), "tpot_s": _r(self.tpot_s),
                        "latency_s": _r(self.latency_s), "preemptions": self.preemptions},
        } | ({"metadata": self.metadata} if self.metadata is not None else {})


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
