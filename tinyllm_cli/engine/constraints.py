"""Structured output: grammar-constrained sampling with xgrammar (the ``structured`` extra).

A constraint (a JSON schema, any JSON object, a regex, a choice among strings, or a context-free
grammar) is compiled once per tokenizer into a token-level automaton; each constrained sequence
carries a ``GrammarState`` (a matcher: where it is in the grammar). Before a step samples, every
constrained row's state writes the tokens it allows into one packed bitmask (32 tokens per int32),
and one masked fill sets the other logits of those rows to -inf; the sampler then runs as usual.
After sampling, each state accepts its row's token.

Invariants:
- Importing this module needs nothing beyond torch; xgrammar is imported on first use, so the core
  works without the extra, and a request that asks for a constraint fails with one sentence naming
  the install command (``require``) before it reaches the engine.
- Compiled grammars are cached per tokenizer by (kind, canonical text): a million requests with
  one schema compile it once. A constraint that does not compile is cached as its error too.
- A state depends only on the tokens its sequence has accepted, never on the KV cache: preemption
  by recompute keeps the tokens and so the state; a sequence without a state (a fork, or one whose
  state was dropped) gets one rebuilt by replaying its output tokens (``GrammarState.replay``).
- Unconstrained rows are never touched: a step without constrained rows costs nothing here.
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from ..params import STRUCTURED_INSTALL, require_structured, structured_available


INSTALL = STRUCTURED_INSTALL
CACHE_SIZE = 512  # compiled grammars kept per tokenizer (least recently used go first)


available = structured_available
require = require_structured


def _xgr():
    import xgrammar
    return xgrammar


# ---- the tokenizer's vocabulary, as the grammar engine needs it ------------------------------

def _vocab_type(tokenizer):
    """xgrammar's name for how the vocabulary spells bytes (GPT-2 byte-level, byte fallback, raw)."""
    xgr = _xgr()
    decoder = json.loads(tokenizer.tok.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in parts if isinstance(d, dict)}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in types:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


class Compiler:
    """One tokenizer's grammar compiler and cache of compiled grammars (see ``compiler_for``)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        xgr = _xgr()
        t0 = time.perf_counter()
        vocab = [tokenizer.token(i) or "" for i in range(tokenizer.vocab_size)]
        self.info = xgr.TokenizerInfo(vocab, _vocab_type(tokenizer), vocab_size=vocab_size,
                                      stop_token_ids=sorted(eos_ids))
        # Our own cache below counts hits and keeps errors; xgrammar's would duplicate it.
        self.xgc = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache: OrderedDict = OrderedDict()
        self.lock = threading.Lock()
        self.info_s = time.perf_counter() - t0
        self.compiles = self.hits = 0
        self.compile_s = 0.0

    def get(self, key: tuple[str, str]):
        """The compiled grammar for ``key`` (from ``SamplingParams.constraint``); raises
        ValueError with one sentence when the constraint is invalid."""
        with self.lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                self.hits += 1
            else:
                t0 = time.perf_counter()
                try:
                    hit = self._compile(*key)
                except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
                    hit = ValueError(_first_line(key[0], e))
                self.compile_s += time.perf_counter() - t0
                self.compiles += 1
                self.cache[key] = hit
                if len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
        if isinstance(hit, Exception):
            raise hit
        return hit

    def _compile(self, kind: str, text: str):
        c = self.xgc
        if kind == "json_schema":
            # any_whitespace=False: the compact form, so no tokens go to runs of blank space.
            return c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            alts = " | ".join(_ebnf_string(s) for s in json.loads(text))
            return c.compile_grammar(f"root ::= {alts}")
        if kind == "grammar":
            return c.compile_grammar(text)
        raise ValueError(f"unknown constraint kind {kind!r}")


def _ebnf_string(s: str) -> str:
    """``s`` as an EBNF string literal (JSON escapes, which xgrammar's EBNF reads)."""
    return json.dumps(s, ensure_ascii=False)


def _first_line(kind: str, e: Exception) -> str:
    msg = re.sub(r"\[[\d:]+\] \S+:\d+: ", "", " ".join(str(e).split()))[:300] or type(e).__name__
    return f"the {kind.replace('_', ' ')} constraint is invalid: {msg}"


_COMPILERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, eos_ids) -> Compiler:
    """The tokenizer's ``Compiler``, built once per tokenizer object (in each process: a Ray
    worker unpickles its own tokenizer and builds its own on its first constrained request)."""
    with _COMPILERS_LOCK:
        c = _COMPILERS.get(tokenizer)
        if c is None or c.vocab_size != vocab_size:
            c = _COMPILERS[tokenizer] = Compiler(tokenizer, vocab_size, eos_ids)
        return c


# ---- per-sequence state ----------------------------------------------------------------------

class GrammarState:
    """Where one sequence is in its grammar."""

    __slots__ = ("matcher", "compiled")

    def __init__(self, compiled):
        self.compiled = compiled
        self.matcher = _xgr().GrammarMatcher(compiled)

    @classmethod
    def replay(cls, compiled, tokens) -> "GrammarState":
        """A state that has accepted ``tokens`` (rebuilding a lost one)."""
        st = cls(compiled)
        for t in tokens:
            if not st.accept(t):
                break
        return st

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    @property
    def complete(self) -> bool:
        """The output so far is a whole match (it may end here)."""
        return self.matcher.is_completed()


# ---- masks -----------------------------------------------------------------------------------

# Bits of each byte value, low bit first: a little-endian int32 bitmask viewed as bytes unpacks
# with one table lookup (token 32w + 8k + j is bit j of byte k of word w).
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def fill_masks(states: list, vocab: int) -> Tensor:
    """[len(states), ceil(vocab / 32)] int32 over all of a step's sampling rows: bit b of word w
    set when token 32w + b is allowed; a row whose state is None allows everything."""
    bitmask = torch.full((len(states), (vocab + 31) // 32), -1, dtype=torch.int32)
    for i, st in enumerate(states):
        if st is not None:
            st.matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask


def apply_masks(logits: Tensor, bitmask: Tensor) -> None:
    """Set ``logits[r, t]`` to -inf for every token t that row r's mask forbids, in place, in one
    masked fill over the rows (no gather or scatter of rows: on CPU those cost more than the fill)."""
    rows, vocab = logits.shape
    table = _BYTE_BITS.to(logits.device)
    allowed = table[bitmask.to(logits.device, non_blocking=True).view(torch.uint8).long()].reshape(rows, -1)
    logits.masked_fill_(~allowed[:, :vocab], float("-inf"))
