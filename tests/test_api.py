"""The Python API (``tinyllm_cli.LLM``) and the determinism contract, in one process.

Determinism: a request's seed is a function of the run's seed and its own id alone (or its own
``seed``), so equal prompts under one run seed draw different samples, any input order gives
each request the same sample, and ``--resume`` continues as if never interrupted. The cluster's
side of the same contract is in ``test_cluster.py``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tinyllm_cli import LLM, RunSummary, SamplingParams, UsageError
from test_cli import cli

from conftest import wait_s

ROOT = Path(__file__).resolve().parents[1]


def rows(text: str) -> list[dict]:
    out = [json.loads(x) for x in text.splitlines()]
    for r in out:
        r.pop("metrics")
        for c in r.get("outputs", []):
            c.pop("metrics")
    return out


def write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


SAMPLED = ["--temperature", "1.0", "--max-new-tokens", "6", "-q", "--seed", "5"]


def test_api_generate_equals_the_generate_command_on_the_default_model(capsys):
    """Same prompts file, same settings: the same outputs (text, ids, seeds), in input order."""
    prompts = ROOT / "prompts" / "questions.txt"
    code, out, err = cli(capsys, "generate", "-p", prompts, "--max-new-tokens", "8", "-q")
    assert code == 0, err
    want = rows(out)
    lines = [x for x in prompts.read_text().splitlines() if x.strip()]
    with LLM(max_new_tokens=8, progress=False) as llm:
        got = llm.generate(lines, use_tqdm=False)
        stats = llm.stats
    assert [o.to_json()["text"] for o in got] == [r["text"] for r in want]
    assert [o.token_ids for o in got] == [r["token_ids"] for r in want]
    assert [o.seed for o in got] == [r["seed"] for r in want]
    assert [o.index for o in got] == list(range(len(lines)))
    assert isinstance(stats, RunSummary) and stats.num_requests == len(lines) == stats["num_requests"]
    assert stats.output_tokens == sum(len(o.token_ids) for o in got)


def test_stream_yields_every_output_once_and_stats_match_stats_json(llama_dir, tmp_path, capsys):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]] * 3
    with LLM(str(llama_dir), max_new_tokens=5, ignore_eos=True, progress=False) as llm:
        seen = [o.index for o in llm.stream(prompts, use_tqdm=False)]
        s = llm.stats
    assert sorted(seen) == list(range(9))
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": x} for x in prompts])
    code, _, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, "--max-new-tokens", 5, "--ignore-eos",
                       "-q", "--stats-json", tmp_path / "s.json", "-o", tmp_path / "o.jsonl")
    assert code == 0, err
    file = json.loads((tmp_path / "s.json").read_text())
    assert set(file) == set(s)  # the same keys
    for k in ("num_requests", "prompt_tokens", "output_tokens", "steps", "peak_blocks_used", "model", "dtype"):
        assert file[k] == s[k], k


def test_settings_are_validated_like_yaml_keys(llama_dir):
    with pytest.raises(UsageError, match="did you mean 'block_size'"):
        LLM(str(llama_dir), blok_size=8)
    with pytest.raises(UsageError, match="cache.block_size"):
        LLM(str(llama_dir), block_size=-1)
    with LLM(str(llama_dir), block_size=8, kv_memory="8MiB", progress=False) as llm:
        assert llm.config.cache.block_size == 8
        with pytest.raises(UsageError, match="cannot change on a live LLM"):
            llm.reconfigure(dtype="bfloat16")
        llm.reconfigure(block_size=4)
        assert llm.engine.cache.block_size == 4
    with pytest.raises(UsageError, match="closed"):
        llm.generate([[5, 6]])


@pytest.mark.parametrize("cache,attention", [("paged", "kernel"), ("paged", "gather"), ("slot", "auto")])
def test_reconfigure_takes_the_closed_pools_and_reads_nothing_they_held(llama_dir, cache, attention):
    """A reconfigured engine runs on the pools the closed one left (PoolMemory: no fresh pages to
    fault in), and nothing they held reaches it: the old pools are filled with NaN before the
    handover, and the outputs (sampled, with log-probabilities) equal a fresh LLM's, bit for bit."""
    first = [[5 + i, 9, 11, 13 + i, 2] * (1 + i % 3) for i in range(6)]
    prompts = [[7, 8 + i, 3, 4] * (1 + i % 2) for i in range(5)]
    params = SamplingParams(temperature=0.8, max_new_tokens=12, ignore_eos=True, logprobs=2)
    settings = dict(block_size=4, kv_memory="2MiB", cache=cache, attention=attention, seed=3, progress=False)
    with LLM(str(llama_dir), **settings) as fresh:
        want = fresh.generate(prompts, params, use_tqdm=False)
    with LLM(str(llama_dir), **settings) as llm:
        llm.generate(first, params, use_tqdm=False)
        old = llm.engine.runner.storage
        k_ptr = old.k.data_ptr()
        old.k.fill_(float("nan"))
        old.v.fill_(float("nan"))
        llm.reconfigure()
        new = llm.engine.runner.storage
        assert not old.has_tensors and new.k.data_ptr() == k_ptr  # the same memory, one live owner
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


def test_a_failed_reconfigure_leaves_the_llm_as_it_was(llama_dir):
    with LLM(str(llama_dir), block_size=4, kv_memory="2MiB", max_new_tokens=4, ignore_eos=True, progress=False) as llm:
        want = [o.token_ids for o in llm.generate([[5, 6, 7]], use_tqdm=False)]
        with pytest.raises(UsageError, match="holds no block"):
            llm.reconfigure(kv_memory="1KiB")
        assert llm.config.cache.kv_memory == "2MiB" and llm.engine.runner.storage.has_tensors
        assert [o.token_ids for o in llm.generate([[5, 6, 7]], use_tqdm=False)] == want


def test_engines_alive_together_never_share_pools(llama_dir):
    from tinyllm_cli.runtime import make_engine
    with LLM(str(llama_dir), kv_memory="2MiB", progress=False) as llm:
        rt = llm.runtime
        llm.engine.close()  # its pools become the spare
        a, b = make_engine(llm.config, rt), make_engine(llm.config, rt)  # the first takes them, the second cannot
        sa, sb = a.runner.storage, b.runner.storage
        assert sa.k.data_ptr() != sb.k.data_ptr() and rt.pool_memory.held_bytes == 0
        nbytes = 2 * sb.k.numel() * sb.k.element_size()
        b.close()
        assert rt.pool_memory.held_bytes == nbytes and not sb.has_tensors
        a.close()
        llm.engine = make_engine(llm.config, rt)
    assert rt.pool_memory.held_bytes == 0  # LLM.close frees the spare


def test_an_auto_pool_counts_the_spare_pools_as_available(llama_dir, monkeypatch):
    import tinyllm_cli.runtime as runtime
    from tinyllm_cli.runtime import kv_budget
    with LLM(str(llama_dir), progress=False) as llm:
        cfg, rt = llm.config, llm.runtime
        need = kv_budget(cfg, rt.model_cfg, rt.dtype, rt.device).bytes
    monkeypatch.setattr(runtime, "available_memory", lambda device: need)  # capped: the fraction of it
    capped = kv_budget(cfg, rt.model_cfg, rt.dtype, rt.device)
    assert capped.bytes < need and "capped" in capped.how
    assert kv_budget(cfg, rt.model_cfg, rt.dtype, rt.device, held=need).bytes > capped.bytes


def test_bad_prompts_are_error_outputs_and_the_rest_run(llama_dir):
    with LLM(str(llama_dir), max_new_tokens=3, ignore_eos=True, progress=False) as llm:
        outs = llm.generate([[5, 6], {"prompt_token_ids": [99999]}, {"prompt": 7}, [7, 8]], use_tqdm=False)
    assert [o.finish_reason for o in outs][1:3] == ["error", "error"]
    assert outs[0].token_ids and outs[3].token_ids and "vocabulary" in outs[1].error


def test_duplicate_prompts_under_a_run_seed_draw_different_samples(llama_dir, tmp_path, capsys):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [5, 6, 7, 8]}] * 4)
    code, out, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, *SAMPLED)
    assert code == 0, err
    got = rows(out)
    assert len({tuple(r["token_ids"]) for r in got}) > 1  # not four copies of one sample
    assert len({r["seed"] for r in got}) == 4
    # Each line's seed replays it: the same request alone, with that seed as its own, is identical.
    again = write_jsonl(tmp_path / "again.jsonl", [{"prompt_token_ids": [5, 6, 7, 8], "seed": got[2]["seed"]}])
    code, out, err = cli(capsys, "generate", "-p", again, "--model", llama_dir, *SAMPLED)
    assert rows(out)[0]["token_ids"] == got[2]["token_ids"]


def test_run_seed_changes_samples_and_explicit_seeds_win(llama_dir):
    prompts = [{"prompt_token_ids": [5, 6, 7, 8], "id": "a"}, {"prompt_token_ids": [5, 6, 7, 8], "id": "b", "seed": 11}]
    params = SamplingParams(temperature=1.0, max_new_tokens=6)

    def run(seed):
        with LLM(str(llama_dir), seed=seed, progress=False) as llm:
            return llm.generate(prompts, params, use_tqdm=False)
    one, same, other = run(1), run(1), run(2)
    assert [o.token_ids for o in one] == [o.token_ids for o in same]
    assert one[0].seed != other[0].seed and one[1].seed == other[1].seed == 11
    assert one[1].token_ids == other[1].token_ids


def test_shuffled_input_gives_each_request_the_same_sample(llama_dir, tmp_path, capsys):
    recs = [{"id": f"r{i}", "prompt_token_ids": [5 + i, 9, 11 + 2 * i], "n": 1 + i % 3}
            | ({"seed": 100 + i} if i % 2 else {}) for i in range(12)]
    shuffled = recs[:]
    random.Random(3).shuffle(shuffled)
    outs = []
    for name, rs in (("a", recs), ("b", shuffled)):
        code, out, err = cli(capsys, "generate", "-p", write_jsonl(tmp_path / f"{name}.jsonl", rs), "--model",
                             llama_dir, *SAMPLED, "--max-num-seqs", 3)
        assert code == 0, err
        outs.append({r["id"]: r for r in rows(out)})
    assert outs[0] == outs[1]


def test_resume_after_an_interruption_equals_an_uninterrupted_sampled_run(llama_dir, tmp_path, capsys):
    """Unseeded sampled requests (n > 1 among them): a results file cut after 5 lines, resumed,
    ends equal to the uninterrupted run (the seeds of the rest do not depend on what was skipped)."""
    recs = [{"prompt_token_ids": [5 + i, 7, 9 + i], "n": 1 + i % 2} for i in range(12)]
    p = write_jsonl(tmp_path / "p.jsonl", recs)
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    code, _, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, *SAMPLED, "-o", full)
    assert code == 0, err
    part.write_text("".join(full.read_text().splitlines(keepends=True)[:5]))
    code, _, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, *SAMPLED, "-o", part, "--resume")
    assert code == 0, err
    assert rows(part.read_text()) == rows(full.read_text())


def test_importing_the_package_loads_no_torch():
    code = "import sys, tinyllm_cli, tinyllm_cli.cli; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=wait_s(60),
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.stdout.strip() == "False", r.stderr


def test_loading_a_model_and_generating_never_imports_torch_dynamo(llama_dir):
    """Building the model on the meta device once ran init ops through ``torch._refs``, which
    import ``torch._dynamo``: 2 s and 100 MB of every start-up. Nothing on the plain path needs it."""
    code = ("import sys; from tinyllm_cli import LLM\n"
            f"with LLM(model={str(llama_dir)!r}, max_new_tokens=3, ignore_eos=True, progress=False) as llm:\n"
            "    out = llm.generate([[5, 6, 7]], use_tqdm=False)\n"
            "print(len(out[0].token_ids), 'torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=wait_s(300),
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["3", "False"], r.stdout + r.stderr[-2000:]
