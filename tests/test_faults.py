"""The fault matrix: each fault a user, a careless user or a hostile input can cause, with the
outcome we promise, and the test that holds it. The table below is checked against the test
files (every named test exists), so it cannot drift from them; the faults without a home
elsewhere are tested here. Every outcome: each other request's output present exactly once and
equal to a clean run's, the exit code and the one-sentence message as documented.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from test_cli import cli, jsonl

TESTS = Path(__file__).resolve().parent

# (fault, promised outcome, "file::test")
FAULTS = [
    ("--model typo with an existing --output", "exit 2, one sentence; the file keeps its bytes",
     "test_faults.py::test_a_failed_start_leaves_the_output_as_it_was"),
    ("--output names the prompts file (or serve-batch's input)", "exit 2, one sentence; the input untouched",
     "test_faults.py::test_output_naming_an_input_is_refused"),
    ("KV pool runs out under a request", "finish_reason error with its tokens; --strict exits 1; serve-batch "
     "answers an error line, never a 200 body", "test_faults.py::test_pool_exhaustion_is_an_error_everywhere"),
    ("JSONL `true` where a number belongs", "that line's error result; the rest run",
     "test_faults.py::test_booleans_are_not_numbers"),
    ("an exception inside a Ray worker", "that request alone fails (after max_attempts, alone on a worker) "
     "with an error line; others equal a clean run; no worker marked dead",
     "test_cluster.py::test_a_request_that_raises_inside_a_worker_is_its_own_error_line"),
    ("SIGKILL of a Ray worker", "a new worker replaces it; every result once, equal to a clean run",
     "test_cluster.py::test_killed_worker_loses_nothing"),
    ("every Ray worker killed, no restarts left", "exit 1 'every Ray worker is gone'; finished lines kept, once each",
     "test_cluster.py::test_every_worker_gone_exits_1_keeping_finished_lines"),
    ("joining a remote Ray cluster without a token", "exit 2 naming the token variables and --ray-insecure",
     "test_cluster.py::test_a_remote_cluster_is_joined_only_with_a_token"),
    ("a wrong Ray token", "exit 1, one sentence", "test_cluster.py::test_token_cluster_refuses_a_driver_with_a_wrong_token"),
    ("SIGINT / SIGTERM of the driver", "exit 130 / 143; finished results on disk; --resume completes to a clean run",
     "test_hardening.py::test_interrupt_keeps_finished_results_and_resume_completes"),
    ("SIGINT with Ray workers, then --resume", "equal to a clean run", "test_cluster.py::test_sigint_then_resume_with_workers"),
    ("sampled run interrupted, then --resume", "equal to an uninterrupted run (seeds by id)",
     "test_api.py::test_resume_after_an_interruption_equals_an_uninterrupted_sampled_run"),
    ("disk full mid-line", "exit 1, one sentence; only whole lines in the file",
     "test_hardening.py::test_disk_full_mid_line_leaves_whole_lines"),
    ("a bad prompt line", "that line's error result; the run goes on", "test_hardening.py::test_bad_jsonl_lines_become_error_results"),
    ("a bad serve-batch line", "that line's error line; the stream goes on",
     "test_hardening.py::test_serve_batch_bad_lines_get_error_lines"),
    ("a line over the 16 MiB limit (serve-batch)", "that line's error line, never held in memory; the rest answered",
     "test_stream_memory.py::test_serve_batch_answers_an_oversized_line_with_its_error"),
    ("a prompt line over the limit (generate)", "that line's error result; the rest run",
     "test_stream_memory.py::test_generate_answers_an_oversized_prompt_line_with_its_error"),
    ("an endless stream", "bounded step history and sketched percentiles: memory flat (scripts/long_stream_memory.py)",
     "test_stream_memory.py::test_timeline_is_bounded_and_covers_the_whole_run"),
    ("crafted prompts forcing prefix-key collisions", "never a false prefix hit: keys are salted sha256 chains, "
     "hits checked against the stored entry", "test_block_keys.py::test_forced_collisions_never_serve_another_prefix"),
    ("a GGUF whose tensors alias one region", "exit 2, one sentence, before anything is dequantized; memory flat",
     "test_checkpoint_safety.py::test_aliased_tensor_data_does_not_grow_memory"),
    ("a truncated GGUF", "exit 2, one sentence", "test_checkpoint_safety.py::test_truncated_gguf_is_one_sentence_exit_2"),
    ("a truncated safetensors file", "exit 2, one sentence",
     "test_checkpoint_safety.py::test_truncated_safetensors_is_one_sentence_exit_2"),
    ("an index naming a shard outside the model directory", "exit 2, one sentence, no file touched",
     "test_checkpoint_safety.py::test_shard_names_are_checked_without_touching_the_files"),
    ("a model larger than the free memory", "one sentence naming both numbers",
     "test_checkpoint_safety.py::test_memory_refusal_names_both_numbers"),
    ("the first kernel build killed midway", "the next run rebuilds; nothing blocks",
     "test_kernels.py::test_a_build_killed_midway_does_not_block_the_next"),
    ("another process is building the kernels", "waited for (bounded), its library loaded",
     "test_kernels.py::test_a_live_build_is_waited_for_and_its_library_loaded"),
]


def defined_tests(filename: str) -> set[str]:
    tree = ast.parse((TESTS / filename).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_fault_names_a_test_that_exists():
    missing = [ref for _, _, ref in FAULTS if ref.split("::")[1] not in defined_tests(ref.split("::")[0])]
    assert missing == []


def one_sentence(err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and all(n in lines[0] for n in needles), err
    return lines[0]


def test_a_failed_start_leaves_the_output_as_it_was(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6]}\n')
    out = tmp_path / "results.jsonl"
    before = b'{"id": 0, "text": "an earlier run"}\n'
    for command, io_flag in (("generate", "-p"), ("serve-batch", "-i")):
        out.write_bytes(before)
        code, stdout, err = cli(capsys, command, io_flag, prompts, "--model", tmp_path / "typo", "-o", out, "-q")
        assert code == 2 and stdout == ""
        one_sentence(err, "typo")
        assert out.read_bytes() == before


def test_output_naming_an_input_is_refused(capsys, tmp_path, llama_dir):
    prompts = tmp_path / "p.jsonl"
    text = '{"prompt_token_ids": [5, 6]}\n'
    prompts.write_text(text)
    for command, io_flag in (("generate", "-p"), ("serve-batch", "-i")):
        code, stdout, err = cli(capsys, command, io_flag, prompts, "--model", llama_dir, "-o", prompts, "-q")
        assert code == 2 and stdout == ""
        one_sentence(err, "also an input")
        assert prompts.read_text() == text


def test_pool_exhaustion_is_an_error_everywhere(capsys, tmp_path, llama_dir):
    """Two requests that each outgrow a 16-token pool, beside one that fits."""
    pool = ["--num-blocks", 4, "--block-size", 4, "--max-num-seqs", 2, "--ignore-eos", "-q"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": "big", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 40},
        {"id": "small", "prompt_token_ids": [8, 9], "max_new_tokens": 3})))
    code, out, err = cli(capsys, "generate", "-p", prompts, "--model", llama_dir, *pool)
    assert code == 0, err
    res = {r["id"]: r for r in jsonl(out)}
    assert res["big"]["finish_reason"] == "error" and "pool" in res["big"]["error"] and res["big"]["token_ids"]
    assert res["small"]["finish_reason"] == "length" and len(res["small"]["token_ids"]) == 3
    code, _, err = cli(capsys, "generate", "-p", prompts, "--model", llama_dir, *pool, "--strict")
    assert code == 1
    batch = tmp_path / "in.jsonl"
    batch.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                                         "body": {"prompt": ids, "max_tokens": n}}) + "\n"
                             for cid, ids, n in (("big", [5, 6, 7], 40), ("small", [8, 9], 3))))
    code, out, err = cli(capsys, "serve-batch", "-i", batch, "--model", llama_dir, *pool)
    assert code == 0, err
    res = {r["custom_id"]: r for r in jsonl(out)}
    assert res["big"]["response"] is None and "pool" in res["big"]["error"]["message"]
    assert res["small"]["response"]["status_code"] == 200 and res["small"]["error"] is None
    code, _, _ = cli(capsys, "serve-batch", "-i", batch, "--model", llama_dir, *pool, "--strict")
    assert code == 1


def test_booleans_are_not_numbers(capsys, tmp_path, llama_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": "a", "prompt_token_ids": [5, 6], "max_new_tokens": True},
        {"id": "b", "prompt_token_ids": [5, 6], "top_k": False},
        {"id": "c", "prompt_token_ids": [5, 6], "max_new_tokens": 2})))
    code, out, err = cli(capsys, "generate", "-p", prompts, "--model", llama_dir, "-q")
    assert code == 0, err
    res = {r["id"]: r for r in jsonl(out)}
    assert res["a"]["finish_reason"] == "error" and "max_new_tokens must be an integer" in res["a"]["error"]
    assert res["b"]["finish_reason"] == "error" and "top_k" in res["b"]["error"]
    assert res["c"]["finish_reason"] == "length" and len(res["c"]["token_ids"]) == 2
