"""Requests, the engine's per-sequence state, and outputs (``SamplingParams`` lives in
``params.py`` and is re-exported here).

Invariants:
- ``Sequence.tokens`` is prompt + generated ids; ``num_cached`` of them have K/V in the cache.
  A step feeds ``tokens[num_cached:num_cached + n]``; a preempted sequence drops to
  ``num_cached = 0`` and is recomputed from all its tokens, so nothing it generated is lost.
- A sequence's random stream depends only on its seed and the index of the token being drawn,
  never on the batch it happens to run in (see ``sampler``).
- A request's seed is its own ``params.seed`` when given, else a digest of the run's seed and
  the request's id (``request_seed``): never a draw from a shared stream, so it does not depend
  on which engine or worker runs the request, on arrival order, or on what ran before.
- A request with ``n`` > 1 is a ``Group`` of n sequences: fork 0 prefills the prompt and carries
  the other n - 1 as ``pending`` until its prompt is done; then they fork from it (sharing its
  blocks) and run as ordinary sequences. Fork i draws from ``fork_seed(seed, i)``, and fork 0's
  seed is the request's own, so completion i equals the same request run with n = 1 and that seed.
"""

from __future__ import annotations

import enum
import hashlib
import json
import time
from dataclasses import dataclass, field

from ..params import CONSTRAINTS, MAX_LOGPROBS, SamplingParams  # noqa: F401  (re-exported: the engine's names)


_FORK_MIX = 0xD1B54A32D192ED03  # odd 64-bit constant, distinct from the sampler's row mixing


def fork_seed(seed: int, i: int) -> int:
    """Seed of completion ``i`` of a request with ``seed``: the seed itself for i = 0, else
    ``(seed + i * 0xD1B54A32D192ED03) mod 2**63``. Completion i of an n-way request equals the
    same request run with n = 1 and ``seed = fork_seed(seed, i)``."""
    return (seed + i * _FORK_MIX) & ((1 << 63) - 1)


def request_seed(run_seed: int, req: "Request") -> int:
    """The seed ``req`` samples with: its own ``params.seed`` if set, else a 63-bit digest of the
    run's seed and the request's id. Two requests with equal prompts but different ids draw
    different samples; the same id under the same run seed draws the same sample anywhere."""
    if req.params.seed is not None:
        return req.params.seed
    key = json.dumps([run_seed, req.id], default=str).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


@dataclass
class Request:
    id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    index: int = 0  # position in the input, for input-order output
    error: str | None = None  # set when the request was bad before it reached the engine
    metadata: object = None  # echoed back untouched
    # When the request arrived, on the engine's clock (``time.perf_counter`` for a real engine,
    # virtual seconds for the simulator); None: when ``add_request`` is called. TTFT and latency
    # count from it, so a caller that holds requests until a step boundary (serve-batch) still
    # counts the wait for the step in flight. Meaningful only in the process that set it.
    arrival: float | None = None
    # Report each step's new tokens as ``Delta``s (``Engine.take_deltas``), for a caller that
    # streams text as it is generated (``tinyllm serve``); the output at the end is unchanged.
    stream: bool = False
    # Refuse it up front when prompt + max_new_tokens could never fit (max_model_len, or the
    # whole KV pool alone), instead of cutting it short later: a server answers 400 before it
    # streams anything, as vLLM's does. Off: ``generate`` stops such a request at the limit.
    whole: bool = False


@dataclass
class Delta:
    """New tokens of one completion of a streaming request, since its previous delta.

    ``start`` is the position of ``token_ids[0]`` in the completion's output, so a consumer can
    drop what it has already seen (a request retried on another worker regenerates the same
    tokens from the start: its seed fixes them)."""

    id: object  # the request's id
    index: int  # the completion (fork) index
    start: int
    token_ids: list[int]
    logprobs: list | None = None  # JSON-ready entries for these tokens, when the request asked
    # Set on the completion's last delta (its sequence finished in this step): why, and its final
    # text when a stop string cut it (the text a consumer decoded from the ids runs past it).
    finish_reason: str | None = None
    text: str | None = None


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
    fork: int = 0  # completion index within the request
    group: "Group | None" = None
    pending: list["Sequence"] = field(default_factory=list)  # forks waiting for this prompt (fork 0)
    grammar: object = None  # constraints.GrammarState of a constrained request (one per fork)
    logprobs: list | None = None  # per output token: (logprob, [(alt id, alt logprob), ...])
    draft_state: object = None  # speculative decoding: the n-gram drafter's index of these tokens
    reported: int = 0  # output tokens already handed out in deltas (streaming requests)

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
class Group:
    """The n sequences of one request; its output is built when the last one finishes."""

    request: Request
    seqs: list[Sequence]
    finished: int = 0
    # Entry j is prompt token j's (logprob, alternatives); entry 0 is None (nothing predicts it).
    prompt_logprobs: list | None = None

    @property
    def scoring_prompt(self) -> bool:
        """Still needs logits for prompt rows (so its prompt must be computed, not cache hits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.request.prompt_token_ids)


@dataclass
class Completion:
    """One of a request's n completions."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stop_reason: str | int | None = None
    seed: int | None = None
    logprobs: list | None = None  # JSON-ready entries, one per output token, when asked
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    preemptions: int = 0

    def to_json(self) -> dict:
        out = {"index": self.index, "text": self.text, "token_ids": self.token_ids,
               "finish_reason": self.finish_reason, "stop_reason": self.stop_reason, "seed": self.seed,
               "metrics": {"ttft_s": _r(self.ttft_s), "tpot_s": _r(self.tpot_s),
                           "latency_s": _r(self.latency_s), "preemptions": self.preemptions}}
        return out | ({"logprobs": self.logprobs} if self.logprobs is not None else {})


@dataclass
class RequestOutput:
    id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    # "stop" | "length" | "error" (refused, or cut short: ``error`` says why) | "constraint_unfinished"
    # (a structured-output request ran out of max_new_tokens / max_model_len before its
    # constraint was complete: the text is a prefix of a valid output, not a valid output).
    finish_reason: str
    error: str | None = None
    stop_reason: str | int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    preemptions: int = 0
    seed: int | None = None
    metadata: object = None
    # Every completion (one when n = 1, mirroring the flat fields above, which are completion 0's).
    completions: list[Completion] = field(default_factory=list)
    n: int = 1
    logprobs: list | None = None  # completion 0's, when asked
    prompt_logprobs: list | None = None

    @classmethod
    def failed(cls, req: "Request", error: str) -> "RequestOutput":
        """The answer to a request that never produced a token, because ``error``."""
        c = Completion(index=0, token_ids=[], text=None, finish_reason="error", seed=req.params.seed)
        return cls(id=req.id, index=req.index, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
                   token_ids=[], text=None, finish_reason="error", error=error, seed=req.params.seed,
                   metadata=req.metadata, completions=[c])

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens over all completions."""
        return sum(len(c.token_ids) for c in self.completions) if self.completions else len(self.token_ids)

    def to_json(self) -> dict:
        """n = 1: the flat shape (text, token_ids, ... at the top; ``logprobs`` only when asked).
        n > 1: ``outputs``, one object per completion, and request-level fields at the top."""
        extra = {"prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else {}
        meta = {"metadata": self.metadata} if self.metadata is not None else {}
        if self.n > 1:
            return {
                "id": self.id, "prompt": self.prompt, "prompt_token_ids": self.prompt_token_ids,
                "outputs": [c.to_json() for c in self.completions], "error": self.error,
                "num_prompt_tokens": len(self.prompt_token_ids), "num_output_tokens": self.num_output_tokens,
                "metrics": {"ttft_s": _r(self.ttft_s), "latency_s": _r(self.latency_s),
                            "preemptions": self.preemptions},
            } | extra | meta
        if self.logprobs is not None:
            extra = {"logprobs": self.logprobs} | extra
        return self._flat() | extra | meta

    def _flat(self) -> dict:
        return {
            "id": self.id, "prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids, "finish_reason": self.finish_reason,
            "error": self.error, "stop_reason": self.stop_reason, "seed": self.seed,
            "num_prompt_tokens": len(self.prompt_token_ids), "num_output_tokens": len(self.token_ids),
            "metrics": {"ttft_s": _r(self.ttft_s), "tpot_s": _r(self.tpot_s),
                        "latency_s": _r(self.latency_s), "preemptions": self.preemptions},
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
