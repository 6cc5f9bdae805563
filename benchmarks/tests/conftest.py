"""Fixtures for the benchmark tests: the product suite's tiny random checkpoints (``llama_dir``,
``qwen2_dir``, saved by transformers) and its private peak cache, taken from tests/conftest.py so
both suites test on the same models. tests/ is not a package, so that file is loaded by path under
a name of its own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tests" / "conftest.py"
_spec = importlib.util.spec_from_file_location("tinyllm_product_conftest", _PATH)
_product = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_product)

llama_dir = _product.llama_dir
qwen2_dir = _product.qwen2_dir
peak_cache = _product.peak_cache  # autouse: bench's peak measurements never touch ~/.cache
