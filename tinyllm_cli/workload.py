"""Prompt workloads for ``bench``, ``inspect-blocks`` and ``simulate``: the workload flags as one
``Workload``, seeded random-token prompts (optionally behind shared prefixes) or the prompts of a
file as token ids, the greedy requests that run them, and serve-batch's Poisson arrival gaps.
The same seed gives the same workload, so runs differ only in what is measured."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .engine.request import Request, SamplingParams
from .errors import UsageError
from .io import RequestBuilder, check_prompt_file, read_records, record_id


@dataclass(frozen=True)
class Workload:
    """The workload flags, as every command that takes them reads them (their defaults live in
    the CLI's option table, once). ``prompts``: a prompts file that replaces the random-token
    prompts (``chat``: wrap its plain prompts in the chat template); the other fields describe
    the seeded synthetic workload."""
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int
    num_prefixes: int
    seed: int
    prompts: str | None = None
    chat: bool = False

    def check(self) -> None:
        """Every flag in range, or one sentence naming it (a usage error: nothing has run)."""
        for name, v in (("--num-prompts", self.num_prompts), ("--input-len", self.input_len),
                        ("--output-len", self.output_len)):
            if v <= 0:
                raise UsageError(f"{name} must be a positive integer, not {v}")
        if not 0 <= self.range_ratio < 1:
            raise UsageError(f"--range-ratio must be in [0, 1), not {self.range_ratio}")
        if self.prefix_len < 0 or self.num_prefixes < 1:
            raise UsageError("--prefix-len must be >= 0 and --num-prefixes >= 1")
        if self.prompts:
            check_prompt_file(self.prompts)

    def prompt_ids(self, model_cfg, tokenizer) -> list[list[int]]:
        """The prompts as token ids: the file's, else the seeded random ones."""
        if self.prompts:
            return prompts_from_file(self.prompts, tokenizer, self.chat)
        return shared_prefix_prompts(model_cfg, self.num_prompts, self.input_len, self.range_ratio, self.seed,
                                     self.prefix_len, self.num_prefixes)


def random_prompts(model_cfg, num: int, input_len: int, range_ratio: float, seed: int) -> list[list[int]]:
    """Seeded random-token prompts with lengths uniform in L*(1-r)..L*(1+r) (vLLM's convention),
    drawn above the special-token ids so no prompt contains an EOS."""
    g = torch.Generator().manual_seed(seed)
    lo = max(1, int(input_len * (1 - range_ratio)))
    hi = max(lo, int(input_len * (1 + range_ratio)))
    lens = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    vocab = model_cfg.vocab_size
    special = set(model_cfg.eos_token_ids) | {model_cfg.bos_token_id or 0}
    low = max(special) + 1 if max(special) < vocab // 2 else 0
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lens]


def shared_prefix_prompts(model_cfg, num: int, input_len: int, range_ratio: float, seed: int,
                          prefix_len: int = 0, num_prefixes: int = 1) -> list[list[int]]:
    """Random prompts; with ``prefix_len`` each starts with one of ``num_prefixes`` shared
    random prefixes (round robin), as in vLLM's prefix-repetition benchmark."""
    suffixes = random_prompts(model_cfg, num, input_len, range_ratio, seed)
    if not prefix_len:
        return suffixes
    prefixes = random_prompts(model_cfg, num_prefixes, prefix_len, 0.0, seed + 1)
    return [prefixes[i % num_prefixes] + s for i, s in enumerate(suffixes)]


def prompts_from_file(path: str, tokenizer, chat: bool) -> list[list[int]]:
    """Every prompt of a prompts file as token ids; a bad line is a usage error here (a benchmark
    of a file with holes would not be the file's)."""
    builder = RequestBuilder(tokenizer, chat, SamplingParams())
    out = []
    for n, (lineno, rec) in enumerate(read_records(path)):
        req = builder.build(n, lineno, rec, record_id(n, rec))
        if req.error:
            raise UsageError(f"{path}: {req.error}")
        out.append(req.prompt_token_ids)
    if not out:
        raise UsageError(f"prompts file {path!r} has no prompts")
    return out


def requests_for(workload: list[list[int]], output_len: int, n: int = 1,
                 sampling: SamplingParams | None = None) -> list[Request]:
    """Greedy requests that generate exactly ``output_len`` tokens each (EOS ignored), unless
    ``sampling`` (the config's section) carries a structured-output constraint: then each output
    ends when its constraint is complete, at ``output_len`` tokens at most."""
    con = {k: getattr(sampling, k) for k in sampling.constraint_fields} if sampling is not None else {}
    return [Request(str(i), ids, SamplingParams(max_new_tokens=output_len, ignore_eos=True, n=n, **con), index=i)
            for i, ids in enumerate(workload)]


def poisson_gaps(rate: float, seed: int):
    """Exponential inter-arrival gaps (seconds) of a Poisson process with ``rate`` per second:
    serve-batch's ``--request-rate`` arrivals, and ``simulate``'s replay of them."""
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(rate)
