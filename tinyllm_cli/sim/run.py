"""Driving simulated engines over a trace: one engine, or N data-parallel ones behind the Ray
cluster's pull-based dispatch, on one virtual clock.

- One engine: requests are fed as ``Engine.run`` feeds a real engine (an offline batch: at most
  ``4 * max_num_seqs`` waiting; timed requests: each enters at the first step boundary at or after
  its ``arrival_s``); an idle engine jumps to the next arrival.
- N engines: the driver holds every request until a worker has room (fewer than
  ``max_num_seqs`` in flight) and gives it to the least loaded one, as ``cluster.ClusterEngine``
  does; the worker with the earliest clock steps next, so all share one timeline.
- The waiting room is bounded as ``tinyllm serve``'s (``max_waiting``): a timed request that
  arrives while ``max_waiting`` requests already wait (in the engine, or in the driver's queue
  with N workers, as ``serve`` counts them) is refused, never queued. It is answered with an
  error output and counted in ``rejected`` (serve's 429, ``tinyllm:requests_rejected_total``).
  An offline batch (no ``arrival_s``) is fed as ``generate`` feeds it and never refused.
- Memory is flat: the trace is read lazily and only requests in flight are held (with the
  bound, at most ``max_waiting`` waiting however fast requests arrive); the stats are
  ``RunStats``'s (whose step history another module bounds).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator

import torch

from ..config import Config
from ..engine.dispatch import least_loaded
from ..engine.request import Request, RequestOutput
from ..engine.stats import RunStats, RunSummary, merge_worker_summaries
from ..errors import UsageError
from ..runtime import Runtime, make_blocks, pool_size
from .cost import CostModel
from .engine import SimEngine
from .trace import to_requests


def sim_runtime(cost: CostModel) -> Runtime:
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cost.dtype, torch.float32)
    return Runtime(cost.model_cfg(), None, cost.model, torch.device("cpu"), dt, "sim", "none", False, 0.0)


def make_sim_engine(cfg: Config, cost: CostModel, skip_ahead: bool = True, serving: bool = False) -> SimEngine:
    rt = sim_runtime(cost)
    return SimEngine(rt.model_cfg, make_blocks(cfg, rt, pool_size(cfg, rt)), cost, max_num_seqs=cfg.scheduler.max_num_seqs,
                     max_prefill_tokens=cfg.scheduler.max_prefill_tokens, max_model_len=cfg.cache.max_model_len,
                     skip_ahead=skip_ahead, serving=serving)


class Simulation:
    def __init__(self, cfg: Config, cost: CostModel, workers: int | None = None, skip_ahead: bool = True,
                 max_waiting: int | None = None, serving: bool = False):
        if cfg.speculative.method != "none":
            raise UsageError(f"simulate does not model speculative decoding (its step-cost model has no verify rows); "
                             f"set speculative.method to none, not {cfg.speculative.method!r}")
        self.cfg, self.cost = cfg, cost
        n = workers or cfg.parallel.workers
        self.engines = [make_sim_engine(cfg, cost, skip_ahead, serving) for _ in range(n)]
        self.serving = serving  # steps also pay the profile's serving section (tinyllm serve's HTTP cost)
        self.per_worker = cfg.scheduler.max_num_seqs
        self.max_waiting = max_waiting  # None: no bound (serve-batch and generate refuse nothing)
        self.rejected = 0
        self.peak_waiting = 0  # the most requests waiting at a step boundary
        blocks = self.engines[0].engine.cache
        self.stats = RunStats(blocks.kind, blocks.block_size, blocks.num_blocks, blocks.kv_bytes, self.per_worker,
                              start=0.0, clock=self._end)

    def _end(self) -> float:
        return max(e.now for e in self.engines)

    def run(self, items: Iterable, salt: int = 0) -> Iterator[RequestOutput]:
        """The items' outputs as they finish; ``salt``: the ``TokenMaker`` salt of prompts given
        by length (as ``tinyllm load`` would send them for the same workload seed or trace)."""
        vocab = self.engines[0].engine.model.cfg.vocab_size
        reqs = to_requests(items, vocab, salt=salt)
        if len(self.engines) == 1:
            yield from self._run_one(self.engines[0], reqs)
        else:
            yield from self._run_many(reqs)
        self.stats.end = self._end()

    def _run_one(self, eng: SimEngine, reqs: Iterator[Request]) -> Iterator[RequestOutput]:
        pending = eng.engine.default_pending()
        nxt = next(reqs, None)
        while True:
            # Everything due by now (timed) and as much of an offline batch as run() would feed.
            while nxt is not None and (nxt.arrival is None and eng.num_waiting() < pending
                                       or nxt.arrival is not None and nxt.arrival <= eng.now):
                if self._full(nxt, eng.num_waiting()):
                    yield self._reject(nxt, eng.num_waiting(), eng.engine.stats)
                else:
                    out = eng.add_request(nxt)
                    if out is not None:
                        yield self._record(out)
                nxt = next(reqs, None)
            self.peak_waiting = max(self.peak_waiting, eng.num_waiting())
            timed = nxt is not None and nxt.arrival is not None
            eng.next_arrival = nxt.arrival if timed else math.inf
            if not eng.has_unfinished():
                if nxt is None:
                    return
                if timed:
                    eng.now = max(eng.now, nxt.arrival)
                continue
            for out in eng.step():
                yield self._record(out)

    def _record(self, out: RequestOutput) -> RequestOutput:
        self.stats.record_request(out)
        return out

    def _full(self, req: Request, waiting: int) -> bool:
        """Would serve refuse ``req`` now? Only timed requests meet the bound."""
        return req.arrival is not None and self.max_waiting is not None and waiting >= self.max_waiting

    def _reject(self, req: Request, waiting: int, stats: RunStats) -> RequestOutput:
        """Refuse ``req`` as serve's full waiting room does (a 429): an error output, counted in
        ``stats`` (as a failed request) and in ``rejected``."""
        self.rejected += 1
        out = RequestOutput.failed(req, f"rejected: {waiting} requests are already waiting "
                                        f"(--max-waiting {self.max_waiting})")
        stats.record_request(out)
        return out

    def _run_many(self, reqs: Iterator[Request]) -> Iterator[RequestOutput]:
        engines = self.engines
        inflight = [0] * len(engines)
        owner: dict[int, int] = {}
        queue: deque[Request] = deque()
        nxt = next(reqs, None)
        while True:
            busy = [i for i, e in enumerate(engines) if e.has_unfinished()]
            t_busy = min((engines[i].now for i in busy), default=math.inf)
            t_arr = math.inf if nxt is None else (nxt.arrival or 0.0)
            if nxt is None and not busy and not queue:
                return
            if nxt is not None and t_arr <= t_busy:  # the next arrival comes first: queue it
                if self._full(nxt, len(queue)):
                    yield self._reject(nxt, len(queue), self.stats)
                else:
                    queue.append(nxt)
                nxt = next(reqs, None)
                now = t_arr
            else:
                if not busy:  # queued work waits for room no one will free: cannot happen
                    raise RuntimeError("simulated workers idle with requests queued")
                i = min(busy, key=lambda j: engines[j].now)
                eng = engines[i]
                eng.next_arrival = math.inf if nxt is None else (nxt.arrival or 0.0)
                for out in eng.step():
                    inflight[owner.pop(out.index, i)] -= 1
                    yield self._record(out)
                now = eng.now
            while queue:  # pull-based: the least loaded worker with room takes the head
                j = least_loaded(range(len(engines)), inflight.__getitem__, self.per_worker)
                if j is None:
                    break
                req = queue.popleft()
                e = engines[j]
                if not e.has_unfinished():
                    e.now = max(e.now, now)
                out = e.add_request(req)
                if out is not None:
                    yield self._record(out)
                    continue
                inflight[j] += 1
                owner[req.index] = j
            self.peak_waiting = max(self.peak_waiting, len(queue))

    def summary(self) -> RunSummary:
        """The run's figures with the keys of a real run's ``--stats-json``."""
        if len(self.engines) == 1:
            e = self.engines[0].engine
            e.stats.end = self.stats.end
            out = e.stats.summary()
        else:
            el = max(self.stats.elapsed(), 1e-9)
            sums = []
            for e in self.engines:
                e.engine.stats.end = self.stats.end
                sums.append(e.engine.stats.summary())
            out = self.stats.summary() | merge_worker_summaries(sums, el)
            out["workers"] = [{"worker": i, "steps": s["steps"], "preemptions": s["preemptions"],
                               "peak_blocks_used": s["peak_blocks_used"], "output_tokens": s["output_tokens"]}
                              for i, s in enumerate(sums)]
        c = self.cost
        out |= {"model": c.model, "load_s": 0.0, "dtype": c.dtype, "gemm": "sim", "quant": "none",
                "native_kernels": False, "device": c.device, "num_workers": len(self.engines),
                "simulated": True, "serving_overhead": self.serving, "rejected": self.rejected, "max_waiting": self.max_waiting,
                "peak_waiting": self.peak_waiting, "profile_cpu": c.cpu, "skipped_steps": sum(e.skipped_steps for e in self.engines)}
        return RunSummary(out)
