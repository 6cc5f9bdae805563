"""A stand-in engine for the tests of the rounds and of the worker stops."""

from __future__ import annotations

from benchmarks.common import Run
from benchmarks.workloads import total_tokens


class FakeEngine:
    """Stands in for an engine: counts starts and closes, answers every run at once."""
    log: list = []

    def __init__(self, name):
        self.name = name
        FakeEngine.log.append(("start", name))

    def run(self, prompts, output_len):
        FakeEngine.log.append(("run", self.name))
        return Run(0.5, total_tokens(prompts, output_len), [[1] * output_len for _ in prompts])

    def close(self):
        FakeEngine.log.append(("close", self.name))
