"""The host-limits microbenchmark: built with nothing wider than AVX2 + FMA, and its figures are
rates a cache and a core can give (an L1 read faster than a memory stream)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import hostlimits


@pytest.fixture(scope="module")
def ops():
    return hostlimits.load_ops()


def built_library() -> Path:
    """The shared library load_ops built and loaded."""
    import torch
    return Path(next(p for p in torch.ops.loaded_libraries if "tinyllm_hostlimits" in p))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_the_microbenchmark_uses_no_register_wider_than_ymm(ops):
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(built_library())], capture_output=True,
                          text=True, timeout=120).stdout
    assert "vfmadd231ps" in text and "%ymm" in text
    assert "%zmm" not in text


def test_figures_are_rates_a_core_and_its_caches_give(ops):
    r = hostlimits.measure(threads=(1,), reps=2)["1t"]
    assert all(v > 0 for v in r.values())
    assert r["l1_load_gbps"] > r["stream_gbps"]
