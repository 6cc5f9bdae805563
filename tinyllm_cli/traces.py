"""Request traces: requests as JSONL, one object a line, read lazily (memory flat). The format
``simulate`` replays and ``load`` sends to a live server; it imports nothing of the engine.

A line: ``arrival_s`` (seconds from the start; absent or null: an offline batch), ``prompt_len``
or ``prompt_token_ids``, ``output_len``, optional ``id``, ``prefix_group`` and ``prefix_len``
(requests of one group share their first ``prefix_len`` tokens). A real run's output is a trace
too: a ``generate`` line (``prompt_token_ids`` and ``token_ids`` / ``num_output_tokens``) or a
``serve-batch`` line (``response.body.usage``), so a measured run can be replayed.

A bad line is a ``UsageError`` of one sentence naming the file and line.

Generators (``generate_trace``): offline batches, Poisson arrivals and bursty (gamma) arrivals,
with prompt and output lengths uniform in L*(1-r)..L*(1+r), optionally behind shared prefixes.
``TokenMaker`` turns lengths into prompt token ids, the same ids for the same trace.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import UsageError


@dataclass(slots=True)
class TraceItem:
    id: str
    arrival_s: float | None
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    prefix_group: object = None
    prefix_len: int = 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_line(rec, where: str, n: int) -> TraceItem:
    """One trace object (or a real run's output line) -> ``TraceItem``; raises ``UsageError``."""
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: a trace line must be a JSON object, not {type(rec).__name__}")
    rid = str(rec.get("id", rec.get("custom_id", n)))
    body = (rec.get("response") or {}).get("body") if isinstance(rec.get("response"), dict) else None
    if isinstance(body, dict) and isinstance(body.get("usage"), dict):  # serve-batch output
        u = body["usage"]
        rec = {"id": rec.get("custom_id", rid), "prompt_len": u.get("prompt_tokens"),
               "output_len": u.get("completion_tokens"), "arrival_s": rec.get("arrival_s")}
    ids = rec.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
            raise UsageError(f"{where}: prompt_token_ids must be a non-empty list of non-negative integers")
        plen = len(ids)
    else:
        plen = rec.get("prompt_len", rec.get("num_prompt_tokens"))
        if plen is None:
            raise UsageError(f"{where}: a trace line needs prompt_len or prompt_token_ids")
        if not _is_int(plen) or plen < 1:
            raise UsageError(f"{where}: prompt_len must be a positive integer, not {plen!r}")
    out = rec.get("output_len", rec.get("num_output_tokens"))
    if out is None and isinstance(rec.get("token_ids"), list):
        out = len(rec["token_ids"])
    if out is None:
        raise UsageError(f"{where}: a trace line needs output_len")
    if not _is_int(out) or out < 1:
        raise UsageError(f"{where}: output_len must be a positive integer, not {out!r}")
    arr = rec.get("arrival_s")
    if arr is not None and (isinstance(arr, bool) or not isinstance(arr, (int, float)) or not arr >= 0
                            or arr == float("inf")):
        raise UsageError(f"{where}: arrival_s must be a finite number of seconds >= 0 or null, not {arr!r}")
    group, plen_shared = rec.get("prefix_group"), rec.get("prefix_len", 0)
    if group is not None:
        if not _is_int(plen_shared) or plen_shared < 0:
            raise UsageError(f"{where}: prefix_len must be an integer >= 0, not {plen_shared!r}")
        if plen_shared > plen:
            raise UsageError(f"{where}: prefix_len ({plen_shared}) is longer than the prompt ({plen} tokens)")
    return TraceItem(rid, None if arr is None else float(arr), plen, out, ids, group,
                     plen_shared if group is not None else 0)


def read_trace(path: str) -> Iterator[TraceItem]:
    """The trace's items in file order, lazily; arrival times must not go backwards."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read the trace {path}: {e.strerror}")
    last = None
    with fh:
        n = 0
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise UsageError(f"{where}: not valid JSON ({e.msg})")
            item = parse_line(rec, where, n)
            if item.arrival_s is not None:
                if last is not None and item.arrival_s < last:
                    raise UsageError(f"{where}: arrival_s {item.arrival_s} is earlier than the line before "
                                     f"({last}); sort the trace by arrival")
                last = item.arrival_s
            n += 1
            yield item
    if n == 0:
        raise UsageError(f"the trace {path} has no requests")


# ---- tokens ----------------------------------------------------------------------------------

def trace_salt(path: str) -> int:
    """The ``TokenMaker`` salt of a trace file: a digest of its bytes, so two traces (two rates'
    arrival times) get other prompts, and a trace gets the same ones in every process that reads
    it (``tinyllm load --trace`` and ``simulate --trace`` send the same ids)."""
    import zlib
    digest = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest = zlib.crc32(chunk, digest)
    except OSError as e:
        raise UsageError(f"cannot read the trace {path}: {e.strerror}")
    return digest


def prompt_salt(trace: str | None, workload_seed: int) -> int:
    """The ``TokenMaker`` salt of a run's prompts: the trace file's (``trace_salt``), or else
    the random workload's seed. ``tinyllm load`` and ``simulate`` both take it from here, so the
    same trace or seed makes the same ids in each."""
    return trace_salt(trace) if trace is not None else workload_seed


class TokenMaker:
    """Prompt token ids for items that give only lengths: a group's shared prefix, then tokens
    that make this request's prompt unique (its serial number), then filler. Ids stay in the
    vocabulary, above the special tokens. ``salt`` (a workload seed, or ``trace_salt``) moves
    every prefix and filler: the serial restarts at 1 in every process, so without it two runs
    of other seeds sent the same prompts, and a server's prefix cache found each run's prompts
    left over from the run before (salt 0 makes the ids it always made)."""

    def __init__(self, vocab: int, salt: int = 0):
        self.low = 4
        self.span = max(2, vocab - self.low)
        self.groups: dict[object, list[int]] = {}
        self.serial = 0
        self.shift = salt * 0x9E3779B97F4A7C15  # a salt's runs start far from the next salt's

    def _run(self, seed: int, n: int) -> list[int]:
        lo, span = self.low, self.span
        start = seed % span
        if start + n <= span:
            return list(range(lo + start, lo + start + n))
        return [lo + (start + i) % span for i in range(n)]

    def tokens(self, item: TraceItem) -> list[int]:
        if item.prompt_token_ids is not None:
            return list(item.prompt_token_ids)
        self.serial += 1
        prefix: list[int] = []
        if item.prefix_group is not None and item.prefix_len:
            g = self.groups.get(item.prefix_group)
            if g is None or len(g) < item.prefix_len:
                key = len(self.groups) + 1 if g is None else None
                base = g or []
                seed = 7 * (key or 1)
                g = base + self._run(seed * 1000003 + len(base) + self.shift, item.prefix_len - len(base))
                self.groups[item.prefix_group] = g
            prefix = g[:item.prefix_len]
        rest = item.prompt_len - len(prefix)
        s, tag = self.serial, []
        while s:
            tag.append(self.low + s % self.span)
            s //= self.span
        tag = tag[:rest]
        return prefix + tag + self._run(self.serial * 2654435761 + self.shift, rest - len(tag))


# ---- generators --------------------------------------------------------------------------------

def uniform_length(rng: random.Random, mean: int, ratio: float) -> int:
    """A length uniform in mean*(1-r)..mean*(1+r), at least 1 (vLLM's random-dataset convention)."""
    lo = max(1, int(mean * (1 - ratio)))
    hi = max(lo, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def generate_trace(num: int, input_len: int, output_len: int, *, arrivals: str = "offline", rate: float = 1.0,
                   burstiness: float = 1.0, range_ratio: float = 0.5, prefix_len: int = 0, num_prefixes: int = 1,
                   seed: int = 0) -> Iterator[TraceItem]:
    """Seeded synthetic requests. ``arrivals``: offline (all at once), poisson (``rate`` per
    second) or gamma (``rate`` per second, gaps with shape ``burstiness``: below 1 is burstier
    than Poisson, 1 is Poisson)."""
    if arrivals not in ("offline", "poisson", "gamma"):
        raise UsageError(f"arrivals must be offline, poisson or gamma, not {arrivals!r}")
    if rate <= 0 or burstiness <= 0:
        raise UsageError("the arrival rate and burstiness must be positive")
    rng = random.Random(seed)
    t = 0.0
    for i in range(num):
        arr = None
        if arrivals != "offline":
            shape = 1.0 if arrivals == "poisson" else burstiness
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
            arr = round(t, 6)
        g = i % num_prefixes if prefix_len else None
        plen = uniform_length(rng, input_len, range_ratio) + (prefix_len if prefix_len else 0)
        yield TraceItem(str(i), arr, plen, uniform_length(rng, output_len, range_ratio), None, g,
                        prefix_len if prefix_len else 0)


def write_trace(items, path: str) -> int:
    n = 0
    with open(path, "w") as f:
        for it in items:
            rec = {"id": it.id, "arrival_s": it.arrival_s, "prompt_len": it.prompt_len, "output_len": it.output_len}
            if it.prefix_group is not None:
                rec |= {"prefix_group": it.prefix_group, "prefix_len": it.prefix_len}
            f.write(json.dumps(rec) + "\n")
            n += 1
    return n
