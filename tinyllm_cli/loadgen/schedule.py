"""Open-loop schedules: when each request is sent, and what it asks for.

A schedule is an iterator of ``Planned`` requests (send time in seconds from the run's start,
prompt, output length), fixed by the flags and the seeds alone: sending never waits on a
completion, so the times are the load *offered*, whatever the server makes of it.

Invariants:
- Seeded: the same seeds give the same send times (``seed``) and the same prompts
  (``Workload.seed``, as bench's and simulate's ``--workload-seed``), run after run of a sweep.
  The two come from separate generators: the times of one rate do not move its prompts.
- Send times: the first request at 0, then gaps drawn as vLLM's bench draws them, gamma with
  shape ``burstiness`` and mean 1/rate; shape 1 is Poisson, drawn exactly as serve-batch's
  ``--request-rate`` and ``simulate --trace --request-rate`` draw theirs (``expovariate`` on
  ``random.Random(seed)``), so the three send the same trace at the same times. Rate ``inf``
  sends everything at 0.
- Prompts of the random workload are ``simulate``'s (``traces.generate_trace`` lengths,
  ``traces.TokenMaker`` ids above the special tokens), token ids sent with ``ignore_eos`` so each
  request produces exactly its output length; a trace's prompts are made the same way. A sweep
  draws them once (``Prompts``): each rate sends new ones, so no rate meets a prefix cache
  warmed by the one before.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import UsageError
from ..traces import TokenMaker, generate_trace, prompt_salt, read_trace


@dataclass(slots=True)
class Planned:
    index: int
    at_s: float  # scheduled send time, seconds from the run's start
    prompt: list[int] | str | None  # token ids or text (completions)
    output_len: int
    messages: list | None = None  # chat
    prompt_len: int | None = None  # known for token ids


def gaps(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Inter-arrival gaps in seconds: gamma(shape=burstiness, mean=1/rate); 0 for rate inf."""
    if math.isinf(rate):
        return itertools.repeat(0.0)
    rng = random.Random(seed)
    if burstiness == 1.0:
        return (rng.expovariate(rate) for _ in itertools.count())
    theta = 1.0 / (rate * burstiness)
    return (rng.gammavariate(burstiness, theta) for _ in itertools.count())


def send_times(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """0, then the running sum of ``gaps``."""
    t = 0.0
    yield t
    for g in gaps(rate, burstiness, seed):
        t += g
        yield t


@dataclass(frozen=True)
class Workload:
    """What the requests ask for: the random workload, a trace, or a prompts file."""

    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.5
    prefix_len: int = 0
    num_prefixes: int = 1
    vocab_size: int = 49152
    trace: str | None = None
    prompts_file: str | None = None
    chat: bool = False  # sent to the chat endpoint (text prompts as user messages)
    seed: int = 0  # the random workload's (--workload-seed)


def read_prompts_file(path: str) -> list[str | list]:
    """Prompts of a .txt (one per line) or .jsonl file (``prompt``: text or token ids, or
    ``messages``); every other field is ignored. A bad line is one sentence."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [(n, ln.rstrip("\n")) for n, ln in enumerate(fh, 1) if ln.strip()]
    except OSError as e:
        raise UsageError(f"cannot read the prompts file {path}: {e.strerror}")
    except UnicodeDecodeError:
        raise UsageError(f"the prompts file {path} is not UTF-8 text")
    if not lines:
        raise UsageError(f"the prompts file {path} has no prompts")
    if not path.endswith((".jsonl", ".json")):
        return [ln for _, ln in lines]
    return [_jsonl_prompt(ln, f"{path} line {n}") for n, ln in lines]


def _jsonl_prompt(line: str, where: str):
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise UsageError(f"{where}: not valid JSON ({e.msg})")
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
        return rec["messages"]
    p = rec.get("prompt") if isinstance(rec, dict) else None
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        return p
    raise UsageError(f"{where}: a prompt line needs 'prompt' (text or token ids) or 'messages'")


def _file_prompts(w: Workload) -> Iterator[Planned]:
    prompts = read_prompts_file(w.prompts_file)
    for i, p in enumerate(itertools.cycle(prompts)):
        if isinstance(p, list) and p and isinstance(p[0], dict):  # messages
            yield Planned(i, 0.0, None, w.output_len, messages=p)
        elif w.chat:
            if not isinstance(p, str):
                raise UsageError("--endpoint chat needs text prompts; a prompts file line holds token ids")
            yield Planned(i, 0.0, None, w.output_len, messages=[{"role": "user", "content": p}])
        else:
            yield Planned(i, 0.0, p, w.output_len, prompt_len=len(p) if isinstance(p, list) else None)


class Prompts:
    """A sweep's prompts, drawn once: each rate takes the next ones from the same seeded stream,
    so no two requests of a sweep share more than the workload means them to (a shared prefix
    group) and a server's prefix cache finds nothing left over from an earlier rate. A trace is
    sent whole at every rate, its unique tokens new each time; a prompts file is sent from its
    first line at every rate (text repeats: a prefix-caching server will hit)."""

    def __init__(self, w: Workload):
        self.w = w
        self.maker = TokenMaker(w.vocab_size, prompt_salt(w.trace, w.seed))
        self.stream = None

    def next_run(self, time_scale: float = 1.0) -> Iterator[Planned]:
        """The requests of the next run, unscheduled (a trace's carry its own times)."""
        w = self.w
        if w.trace is not None:
            return (Planned(i, 0.0 if it.arrival_s is None else it.arrival_s * time_scale, ids, it.output_len,
                            prompt_len=len(ids))
                    for i, it in enumerate(read_trace(w.trace)) for ids in (self.maker.tokens(it),))
        if w.prompts_file is not None:
            return _file_prompts(w)
        if self.stream is None:
            self.stream = generate_trace(2**62, w.input_len, w.output_len, range_ratio=w.range_ratio,
                                         prefix_len=w.prefix_len, num_prefixes=w.num_prefixes, seed=w.seed)
        return (Planned(i, 0.0, ids, it.output_len, prompt_len=len(ids))
                for i, it in enumerate(self.stream) for ids in (self.maker.tokens(it),))


def plan(prompts: Prompts, rate: float | None, burstiness: float, seed: int, num_requests: int | None,
         duration_s: float | None, time_scale: float = 1.0) -> Iterator[Planned]:
    """The schedule of one rate: ``num_requests`` requests, or as many as are due within
    ``duration_s``. ``rate`` None: a trace's own ``arrival_s`` (times ``time_scale``; a line
    without one is sent at 0)."""
    reqs = prompts.next_run(time_scale)
    if rate is None:
        return _bounded(reqs, num_requests, duration_s)
    timed = (_at(p, t) for p, t in zip(reqs, send_times(rate, burstiness, seed)))
    return _bounded(timed, num_requests, duration_s)


def _at(p: Planned, t: float) -> Planned:
    p.at_s = t
    return p


def _bounded(reqs: Iterator[Planned], num: int | None, duration_s: float | None) -> Iterator[Planned]:
    if num is not None:
        reqs = itertools.islice(reqs, num)
    if duration_s is not None:
        reqs = itertools.takewhile(lambda p: p.at_s < duration_s, reqs)
    return reqs
