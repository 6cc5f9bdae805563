"""The engine contract: what every engine offers its callers, in one process or on a cluster.

``LLMEngine`` (this process) and ``cluster.ClusterEngine`` (N Ray workers) both implement it, so
``LLM`` and every command drive either one the same way:

- ``add_request(req)``: queue it; returns an error output instead when it can never run.
- ``step()``: advance; returns the outputs of the requests that finished in this step.
- ``has_unfinished()``: whether anything queued or running is not finished yet.
- ``abort(id)``: drop an unfinished request between steps (its blocks are freed; no output).
- ``take_deltas()``: the new tokens of requests added with ``stream=True`` since the last call
  (``Delta``s, each saying where in its completion it starts); finished outputs still come
  from ``step``.
- ``load()``: what the engine holds now (requests running and waiting, KV blocks used and free,
  and the run's counters), for a server's metrics.
- ``run(requests)``: feed lazily and yield outputs as they finish (written here, once).
- ``stats``: the run's ``RunStats``; ``reset_stats()`` starts a new run on the same engine.
- ``add_observer(obs)`` / ``observed()``: watch every step from inside the engine (on a
  cluster, a copy runs in each worker and comes back).
- ``close()``: release what the engine holds.

Determinism is part of the contract: the seed a request samples with is a function of the run's
seed and the request's own identity (``request.id``) alone, unless the request brings its own
(``request_seed``). So one process, N workers, ``--resume`` and any arrival order agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .request import Delta, Request, RequestOutput
from .stats import RunStats


class Engine:
    """The shared half of the contract: the ``run`` loop over ``add_request`` / ``step``."""

    stats: RunStats

    def add_request(self, req: Request) -> RequestOutput | None:
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    def abort(self, request_id) -> bool:
        raise NotImplementedError

    def take_deltas(self) -> list[Delta]:
        raise NotImplementedError

    def load(self) -> dict:
        raise NotImplementedError

    def num_waiting(self) -> int:
        """Requests queued but not started: ``run`` keeps at most ``max_pending`` of them."""
        raise NotImplementedError

    def default_pending(self) -> int:
        raise NotImplementedError

    def reset_stats(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release by default (an in-process engine's pool goes with the object)."""

    def add_observer(self, observer) -> None:
        """``observer(engine, plan)`` is called after every step's forward pass, before finished
        sequences release their blocks; ``observer.finish(engine)`` once when ``observed`` is."""
        raise NotImplementedError

    def observed(self) -> list:
        """The observers after the run, finished: one per engine (one per Ray worker)."""
        raise NotImplementedError

    def run(self, requests: Iterable[Request], max_pending: int | None = None) -> Iterator[RequestOutput]:
        """Feed ``requests`` lazily (at most ``max_pending`` waiting) and yield outputs as they finish."""
        pending = max_pending or self.default_pending()
        it = iter(requests)
        exhausted = False
        while True:
            while not exhausted and self.num_waiting() < pending:
                req = next(it, None)
                if req is None:
                    exhausted = True
                    break
                out = self.add_request(req)
                if out is not None:
                    yield out
            if not self.has_unfinished():
                if exhausted:
                    break
                continue
            yield from self.step()
        self.stats.end = self.stats.clock()
