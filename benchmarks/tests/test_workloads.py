"""The workloads: the prompt ids every engine gets, natural-text windows for the real shape, and
the context each workload needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common import Skip
from benchmarks.engines.vllm import vllm_model_len
from benchmarks.workloads import FULL, TEXT_SOURCES, longest_sequence, make_prompts, prompt_texts, text_windows

REPO = Path(__file__).resolve().parents[2]


def test_prompts_are_the_ones_tinyllm_bench_draws(llama_dir):
    from tinyllm_cli.workload import random_prompts
    from tinyllm_cli.model.checkpoint import load_checkpoint
    wl = FULL["W1"]
    cfg = load_checkpoint(str(llama_dir), progress=False).config
    ours = make_prompts(llama_dir, wl, 0)
    assert ours == random_prompts(cfg, wl.num_prompts, wl.input_len, wl.range_ratio, 0)
    assert len(ours) == 16 and all(64 <= len(p) <= 127 for p in ours)


def test_prompt_texts_and_text_windows(tmp_path):
    (tmp_path / "a.txt").write_text("Hello there.\n\nHello there.\nSecond line.\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "Second line."}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]}) + "\n")
    assert prompt_texts([tmp_path / "a.txt", tmp_path / "b.jsonl"]) == [
        "Hello there.", "Second line.", "Be brief.", "Why?"]
    stream = list(range(100))
    wins = text_windows(stream, [10, 20, 5], seed=3)
    assert [len(w) for w in wins] == [10, 20, 5]
    assert all(w == list(range(w[0], w[0] + len(w))) for w in wins)  # contiguous text
    assert wins == text_windows(stream, [10, 20, 5], seed=3)  # seeded: the same every run
    with pytest.raises(Skip):
        text_windows(stream, [101], seed=0)
    for path in TEXT_SOURCES:  # the real shape's sources are in the repository
        assert (REPO / path).exists(), path


def test_vllm_gets_the_context_the_chosen_workloads_need(llama_dir):
    """vLLM's worker defaults to a 512-position context; the long workload's prompt alone is 2000
    ids, so its row asks for what the longest sequence reaches (in vLLM's 128-token blocks)."""
    for bench, wl in FULL.items():  # the bound covers every prompt the seeded draw makes
        longest = max(map(len, make_prompts(llama_dir, wl, 0))) + wl.output_len
        assert longest <= longest_sequence(FULL, [bench]) <= longest + wl.input_len * wl.range_ratio + 2
    assert vllm_model_len(FULL, ["W1", "W2"]) == 512
    assert vllm_model_len(FULL, ["W1", "long"]) == 2048
