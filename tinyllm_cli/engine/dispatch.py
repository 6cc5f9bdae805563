"""The pull-based dispatch rule shared by the Ray cluster driver (``cluster.ClusterEngine``) and
the simulator's workers (``sim.run``), so a simulated "how many workers" answer places requests
exactly as the cluster would: a worker holds at most ``capacity`` requests (waiting + running),
and the head of the queue goes to the least loaded worker with room (the first such on a tie).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

W = TypeVar("W")


def least_loaded(workers: Iterable[W], load: Callable[[W], int], capacity: int) -> W | None:
    """The worker that takes the next request, or None while every one is full."""
    best, best_load = None, capacity
    for w in workers:
        n = load(w)
        if n < best_load:
            best, best_load = w, n
    return best
