"""Requests, sampling parameters, the engine's per-sequence state, and outputs.

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
    n: int = 1  # completions per prompt, sharing the prompt's K/V blocks
    logprobs: int | bool | None = None  # per output token: true, or k top alternatives too
    top_logprobs: int | None = None  # k alternatives when logprobs is true (OpenAI chat style)
    prompt_logprobs: int | bool | None = None  # per prompt token (scoring): true, or k alternatives
    # Structured output (engine/constraints.py, needs tinyllm[structured]); at most one of these.
    json_schema: dict | None = None  # the output is JSON valid against this schema
    json_object: bool = False  # the output is any JSON object
    regex: str | None = None  # the output matches this regular expression (whole output)
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # the output is in this context-free grammar (GBNF / EBNF text)
    # OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}:
    # turned into json_object / json_schema above and cleared.
    response_format: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.response_format is not None:
            _apply_response_format(self)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with one sentence naming the bad field."""
        checks = [
            (_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens must be an integer >= 1"),
            (_num(self.temperature) and self.temperature >= 0, "temperature must be a number >= 0"),
            (_num(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (_int(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0 (0 = off)"),
            (_num(self.min_p) and 0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.seed is None or _int(self.seed), "seed must be an integer"),
            (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (isinstance(self.stop_token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids), "stop_token_ids must be a list of integers"),
            (isinstance(self.ignore_eos, bool), "ignore_eos must be true or false"),
            (_int(self.n) and self.n >= 1, "n must be an integer >= 1"),
            (_count_or_flag(self.logprobs), f"logprobs must be true, false or an integer from 0 to {MAX_LOGPROBS}"),
            (self.top_logprobs is None or (_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_LOGPROBS),
             f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}"),
            (self.top_logprobs is None or self.logprobs is True,
             "top_logprobs needs logprobs: true (or give logprobs as the number of alternatives)"),
            (_count_or_flag(self.prompt_logprobs),
             f"prompt_logprobs must be true, false or an integer from 0 to {MAX_LOGPROBS}"),
            (self.json_schema is None or isinstance(self.json_schema, dict), "json_schema must be a JSON object"),
            (isinstance(self.json_object, bool), "json_object must be true or false"),
            (self.regex is None or (isinstance(self.regex, str) and self.regex), "regex must be a non-empty string"),
            (self.choice is None or (isinstance(self.choice, list) and self.choice
                                     and all(isinstance(c, str) and c for c in self.choice)),
             "choice must be a non-empty list of non-empty strings"),
            (self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
             "grammar must be a non-empty string"),
            (len(self.constraint_fields) <= 1,
             f"give only one of {', '.join(self.constraint_fields)} (one constraint per request)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if self.constraint_fields:
            from .constraints import require
            require()  # ValueError naming the install command when the extra is missing

    @property
    def constraint_fields(self) -> list[str]:
        """The structured-output fields this request sets (at most one is valid)."""
        return [k for k in CONSTRAINTS if getattr(self, k) not in (None, False)]

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, canonical text) of the request's constraint, None when unconstrained: the key
        compiled grammars are cached by. Key order is kept: a schema's property order is the
        order the output writes them in."""
        kinds = self.constraint_fields
        if not kinds:
            return None
        k = kinds[0]
        v = getattr(self, k)
        if k in ("json_schema", "choice"):
            return k, json.dumps(v, ensure_ascii=False)
        return k, "" if k == "json_object" else v

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives reported per output token (0: the chosen token only); None: off."""
        return _alternatives(self.logprobs, self.top_logprobs)

    @property
    def num_prompt_logprobs(self) -> int | None:
        return _alternatives(self.prompt_logprobs, None)

    @property
    def greedy(self) -> bool:
        # Below 1e-5 dividing the logits overflows to inf/NaN; such a temperature *is* greedy.
        return self.temperature < 1e-5

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


MAX_LOGPROBS = 20  # the most alternatives per token, as vLLM's default max_logprobs
CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _apply_response_format(p: SamplingParams) -> None:
    """OpenAI's ``response_format`` -> ``json_object`` / ``json_schema`` (``strict`` is accepted:
    tinyllm always constrains strictly, so every output validates against the schema)."""
    rf, p.response_format = p.response_format, None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        p.json_object = True
        return
    if kind == "json_schema":
        inner = rf.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs {\"json_schema\": {\"schema\": {...}}}")
        p.json_schema = schema
        return
    raise ValueError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                     "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _count_or_flag(x) -> bool:
    return x is None or isinstance(x, bool) or (_int(x) and 0 <= x <= MAX_LOGPROBS)


def _alternatives(flag, k) -> int | None:
    if flag is None or flag is False:
        return None
    return (k or 0) if flag is True else flag


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
