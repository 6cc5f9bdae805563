"""The cross-engine comparison: tinyllm against transformers, OpenVINO GenAI, vLLM CPU and llama.cpp
on the same prompt ids (``python -m benchmarks.compare``), its stored results
(``benchmarks/results/*.json``) and the tables rendered from them (``python -m benchmarks.report``).

Benchmarks are not the product: this package imports ``tinyllm_cli``, and nothing in
``tinyllm_cli`` imports it (tests/test_structure.py checks that).
"""
