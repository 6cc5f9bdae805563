"""Sampling parameters: what a request asks of the sampler, validated on construction. Config
(``config.py``), the engine and the front ends all use this one type; it sits below them and
imports nothing of the package but ``machine`` (whether xgrammar is installed; ``engine.request``
re-exports it).

Invariants:
- A ``SamplingParams`` that exists is valid: ``__post_init__`` validates, and each bad field is
  one ValueError sentence naming it.
- At most one structured-output field is set; setting one needs the xgrammar package, and its
  absence is a ValueError naming the install command (``require_structured``).
- ``response_format`` (OpenAI's spelling) is turned into ``json_object`` / ``json_schema`` and cleared.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, fields

from .machine import installed

STRUCTURED_INSTALL = "pip install 'tinyllm[structured]'"


@functools.cache
def structured_available() -> bool:
    """Whether the structured-output extra (xgrammar) is installed."""
    return installed("xgrammar")


def require_structured() -> None:
    """Raise ValueError (one sentence, with the install command) when xgrammar is missing."""
    if not structured_available():
        raise ValueError(f"structured output (json_schema, json_object, regex, choice, grammar) needs the "
                         f"xgrammar package: {STRUCTURED_INSTALL}")


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
            require_structured()  # ValueError naming the install command when the extra is missing

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
