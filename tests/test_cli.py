"""The commands as users run them: results on stdout/files, tables on stderr, clear errors."""

from __future__ import annotations

import json

import pytest

from tinyllm_cli.cli import main


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def jsonl(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture
def id_prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    rows = [{"id": f"r{i}", "prompt_token_ids": list(range(5 + i, 15 + 3 * i)), "max_new_tokens": 4 + i}
            for i in range(6)]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_generate_default_model_answers(capsys, tmp_path):
    prompts = tmp_path / "q.txt"
    prompts.write_text("What is the capital of France?\n\nWhat is 2+2?\n")
    stats = tmp_path / "stats.json"
    code, out, err = cli(capsys, "generate", "--prompts", prompts, "--max-new-tokens", 24, "--stats-json", stats)
    assert code == 0
    rows = jsonl(out)
    assert [r["id"] for r in rows] == [0, 1]  # blank line skipped, input order
    assert "Paris" in rows[0]["text"]
    for r in rows:
        assert r["finish_reason"] in ("stop", "length") and r["error"] is None
        assert r["num_output_tokens"] == len(r["token_ids"]) and r["num_prompt_tokens"] == len(r["prompt_token_ids"])
        assert r["prompt_token_ids"][:2] == [1, 9690]  # chat template applied: <|im_start|>system
    assert "output tok/s" in err and "{" not in err.splitlines()[-1]
    s = json.loads(stats.read_text())
    for key in ("num_requests", "num_failed", "prompt_tokens", "output_tokens", "elapsed_s", "output_tokens_per_s",
                "total_tokens_per_s", "cache_kind", "block_size", "num_blocks", "kv_bytes", "peak_running",
                "peak_blocks_used", "mean_block_utilization", "preemptions", "recomputed_tokens"):
        assert key in s
    assert s["num_requests"] == 2 and s["output_tokens"] == sum(r["num_output_tokens"] for r in rows)
    assert set(s["ttft_s"]) >= {"p50", "p90", "p99"}


def test_generate_raw_skips_chat_template(capsys, tmp_path):
    prompts = tmp_path / "q.txt"
    prompts.write_text("The capital of France is\n")
    code, out, _ = cli(capsys, "generate", "-p", prompts, "--raw", "--max-new-tokens", 4, "-q")
    (row,) = jsonl(out)
    assert code == 0 and row["prompt_token_ids"][0] != 1 and len(row["prompt_token_ids"]) < 10


def test_generate_tiny_model_slot_and_paged_agree(capsys, llama_dir, id_prompts):
    outs = {}
    for kind in ("paged", "slot"):
        code, out, err = cli(capsys, "generate", "-p", id_prompts, "--model", llama_dir, "--cache", kind,
                             "--block-size", 4, "--max-model-len", 64, "--ignore-eos", "-q")
        assert code == 0 and err == ""
        outs[kind] = jsonl(out)
    assert [r["token_ids"] for r in outs["paged"]] == [r["token_ids"] for r in outs["slot"]]
    assert [r["num_output_tokens"] for r in outs["paged"]] == [4 + i for i in range(6)]
    assert outs["paged"][0]["text"] is None  # no tokenizer files: ids only


def test_generate_bad_lines_are_errors_not_crashes(capsys, llama_dir, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 3}\n'
                 'not json\n'
                 '{"id": "b", "prompt_token_ids": [5, 99999]}\n'
                 '{"id": "c", "temprature": 0.5, "prompt_token_ids": [5]}\n'
                 '{"id": "d", "prompt_token_ids": [5, 6], "max_new_tokens": "many"}\n'
                 '{"id": "e", "prompt_token_ids": [8, 9], "max_new_tokens": 2}\n')
    code, out, err = cli(capsys, "generate", "-p", p, "--model", llama_dir, "-q")
    rows = jsonl(out)
    assert code == 0
    assert [r["finish_reason"] for r in rows] == ["length", "error", "error", "error", "error", "length"]
    assert "not valid JSON" in rows[1]["error"]
    assert "vocabulary" in rows[2]["error"]
    assert "temperature" in rows[3]["error"]
    assert "max_new_tokens" in rows[4]["error"]
    code, _, _ = cli(capsys, "generate", "-p", p, "--model", llama_dir, "-q", "--strict")
    assert code == 1


def test_resume_appends_only_missing(capsys, llama_dir, id_prompts, tmp_path):
    full = tmp_path / "full.jsonl"
    args = ["generate", "-p", id_prompts, "--model", llama_dir, "--ignore-eos", "-q"]
    assert cli(capsys, *args, "-o", full)[0] == 0
    lines = full.read_text().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    part.write_text("".join(lines[:2]) + lines[2][:15])  # two results and a torn third line
    assert cli(capsys, *args, "-o", part, "--resume")[0] == 0
    strip = lambda rows: [{k: v for k, v in r.items() if k != "metrics"} for r in rows]
    assert strip(jsonl(part.read_text())) == strip(jsonl(full.read_text()))


@pytest.mark.parametrize("yaml_text, needle", [
    ("cache:\n  block_sise: 8\n", "did you mean 'cache.block_size'"),
    ("cache:\n  block_size: 0\n", "cache.block_size"),
    ("cache:\n  block_size: eight\n", "line 2"),
    ("sampling: {temperature: [1\n", "not valid YAML"),
    ("modle: default\n", "did you mean 'model'"),
    ("cache:\n  kind: ring\n", "paged"),
    ("cache:\n  num_blocks: 2\nscheduler:\n  max_num_seqs: 4\n", "max_num_seqs"),
])
def test_config_errors_exit_2_with_one_sentence(capsys, tmp_path, yaml_text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    code, out, err = cli(capsys, "generate", "-p", prompts, "--config", cfg)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_flags_override_config(capsys, llama_dir, id_prompts, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {llama_dir}\ncache:\n  block_size: 4\nsampling:\n  max_new_tokens: 2\n  ignore_eos: true\n")
    stats = tmp_path / "s.json"
    code, out, _ = cli(capsys, "generate", "-p", id_prompts, "-c", cfg, "--block-size", 8, "-q", "--stats-json", stats)
    s = json.loads(stats.read_text())
    assert code == 0 and s["block_size"] == 8
    # Per-request max_new_tokens in the JSONL wins over the config default.
    assert [r["num_output_tokens"] for r in jsonl(out)] == [4 + i for i in range(6)]


def test_default_config_file_matches_builtin():
    from tinyllm_cli.config import Config, load_config
    assert load_config("configs/default.yaml") == Config()


@pytest.mark.parametrize("args, code, needle", [
    (["generate", "-p", "/nonexistent.txt"], 2, "does not exist"),
    (["generate", "-p", "."], 2, "directory"),
    (["generate", "-p", "prompts/questions.txt", "--model", "/no/such/model"], 2, "not found"),
    (["generate", "-p", "prompts/questions.txt", "--device", "tpu"], 2, "device"),
    (["generate", "-p", "prompts/questions.txt", "--resume"], 2, "--output"),
    (["bench", "--block-size", "8,x"], 2, "--block-size"),
    (["bench", "--repeat", "0"], 2, "--repeat"),
    (["inspect-blocks", "--at", "soon"], 2, "--at"),
    (["inspect-blocks", "--num-prefixes", "0"], 2, "--num-prefixes"),
    (["bench", "--profile", "--torch-profile"], 2, "give --torch-profile only"),
    (["simulate", "--num-requests", "5", "--num-prompts", "5"], 2, "give --num-prompts only"),
    (["simulate", "--sweep", "block_size=8,16", "--stats-json", "s.json"], 2, "--json"),
])
def test_usage_errors(capsys, args, code, needle):
    got, out, err = cli(capsys, *args)
    assert got == code and needle in err and "Traceback" not in err and out == ""


def test_bench_rows(capsys, llama_dir, tmp_path):
    js, cs = tmp_path / "b.json", tmp_path / "b.csv"
    code, out, err = cli(capsys, "bench", "--model", llama_dir, "--block-size", "4,16", "--cache", "paged,slot",
                         "--num-prompts", 6, "--input-len", 20, "--output-len", 8, "--max-model-len", 64,
                         "--kv-memory", "256KiB", "--json", js, "--csv", cs)
    assert code == 0 and out == ""
    rows = json.loads(js.read_text())
    assert [(r["cache_kind"], r["block_size"]) for r in rows] == [("paged", 4), ("paged", 16), ("slot", 64)]
    # Equal memory: every run's pool is the 256 KiB budget rounded down to whole blocks (slots of 64
    # for the slot cache) of 768 bytes a token (K and V, 3 layers x 2 KV heads x 16 dims, float32).
    block_bytes = [r["block_size"] * 768 for r in rows]
    assert [r["kv_bytes"] for r in rows] == [256 * 1024 // b * b for b in block_bytes]
    assert all(r["output_tokens"] == 6 * 8 for r in rows)  # identical work in every run
    paged, slot = rows[0], rows[2]
    assert paged["peak_running"] > slot["peak_running"]  # the point of paging, at equal memory
    assert "tinyllm bench" in err and "paged" in err and len(cs.read_text().splitlines()) == 4


def test_inspect_blocks_snapshot(capsys, llama_dir, tmp_path):
    js = tmp_path / "i.json"
    code, out, err = cli(capsys, "inspect-blocks", "--model", llama_dir, "--num-prompts", 6, "--input-len", 20,
                         "--output-len", 10, "--num-blocks", 12, "--block-size", 4, "--max-num-seqs", 6,
                         "--json", js)
    assert code == 0
    rep = json.loads(js.read_text())
    snap = rep["snapshot"]
    assert snap["blocks_used"] == sum(o is not None for o in snap["owner"]) == sum(len(t["blocks"]) for t in snap["tables"])
    assert snap["blocks_used"] + len(snap["free_list"]) == 12
    assert rep["summary"]["preemptions"] > 0 and rep["preemption_steps"]
    assert len(rep["timeline"]) == rep["summary"]["steps"]
    assert "block map" in err and "free list" in err
    code, _, err = cli(capsys, "inspect-blocks", "--model", llama_dir, "--num-prompts", 2, "--at", 100000, "-q")
    assert code == 1 and "no step" in err
    st = tmp_path / "s.json"
    code, _, _ = cli(capsys, "inspect-blocks", "--model", llama_dir, "--num-prompts", 2, "-q", "--stats-json", st)
    assert code == 0 and json.loads(st.read_text())["num_requests"] == 2


def test_bench_old_stats_json_spelling_writes_the_rows(capsys, llama_dir, tmp_path):
    """bench's --stats-json is a deprecated spelling of --json: the same rows, and a note."""
    args = ("bench", "--model", llama_dir, "--num-prompts", 3, "--input-len", 8, "--output-len", 4,
            "--max-model-len", 64, "-q", "--no-roofline", "--no-warmup")
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    code, out, err = cli(capsys, *args, "--stats-json", old)
    assert code == 0 and out == "" and "--stats-json is deprecated" in err
    code, _, err = cli(capsys, *args, "--json", new)
    assert code == 0 and "deprecated" not in err
    rows, again = json.loads(old.read_text()), json.loads(new.read_text())
    assert [r["cache_kind"] for r in rows] == ["paged", "slot"]
    assert all(r["num_requests"] == 3 and r["output_tokens"] == 12 for r in rows)
    same = ("cache_kind", "block_size", "num_requests", "prompt_tokens", "output_tokens", "kv_bytes")
    assert [{k: r[k] for k in same} for r in rows] == [{k: r[k] for k in same} for r in again]


def test_workload_flags_have_one_default_each():
    """Every command that takes a workload flag parses it to the same default."""
    import typer.main
    from tinyllm_cli.cli import app
    root = typer.main.get_command(app)
    flags = ("--num-prompts", "--input-len", "--output-len", "--range-ratio", "--prefix-len", "--num-prefixes",
             "--workload-seed")
    seen: dict[str, dict] = {}
    for name in ("bench", "inspect-blocks", "simulate"):
        for p in root.commands[name].params:
            if p.opts[0] in flags:
                seen.setdefault(p.opts[0], {})[name] = p.default
    assert set(seen) == set(flags)
    assert seen["--num-prompts"] == {"bench": 32, "inspect-blocks": 32, "simulate": 32}
    for flag, per_command in seen.items():
        assert len(set(per_command.values())) == 1, (flag, per_command)


def test_simulate_json_is_rows_and_old_spellings_still_work(capsys, tmp_path):
    """simulate --json writes the rows (one per sweep point, bench's shape); --num-requests and
    --profile still work as deprecated spellings of --num-prompts and --cost-profile."""
    from tinyllm_cli.sim.cost import default_profile_path
    base = ("simulate", "--input-len", 16, "--output-len", 8, "-q")
    rows, stats = tmp_path / "rows.json", tmp_path / "stats.json"
    code, _, err = cli(capsys, *base, "--num-prompts", 6, "--cost-profile", default_profile_path(),
                       "--json", rows, "--stats-json", stats)
    assert code == 0 and err == ""
    (row,) = json.loads(rows.read_text())
    assert row == json.loads(stats.read_text()) | {"sim_wall_s": row["sim_wall_s"]}
    assert row["num_requests"] == 6
    code, _, err = cli(capsys, *base, "--num-requests", 6, "--profile", default_profile_path(), "--stats-json", stats)
    assert code == 0 and "--num-requests is deprecated" in err and "--profile is deprecated" in err
    again = json.loads(stats.read_text())
    assert {k: again[k] for k in ("num_requests", "prompt_tokens", "output_tokens", "steps")} == \
        {k: row[k] for k in ("num_requests", "prompt_tokens", "output_tokens", "steps")}
    code, _, _ = cli(capsys, *base, "--num-prompts", 4, "--sweep", "block_size=8,16", "--json", rows)
    assert code == 0 and [r["sweep"] for r in json.loads(rows.read_text())] == ["block_size=8", "block_size=16"]


def test_bench_references_and_profile(capsys, llama_dir, tmp_path):
    """--baseline hf runs transformers on the same prompt ids; --roofline compares each row with
    this CPU's measured matmul peak; --torch-profile's categories partition the profiled run's wall time."""
    js = tmp_path / "b.json"
    code, out, err = cli(capsys, "bench", "--model", llama_dir, "--cache", "paged", "--num-prompts", 4,
                         "--input-len", 12, "--output-len", 6, "--max-model-len", 64, "--baseline", "hf",
                         "--roofline", "--torch-profile", "--repeat", 3, "--json", js)
    assert code == 0 and out == ""
    (row,) = json.loads(js.read_text())
    assert row["repeats"] == 3 and sorted(row["elapsed_s_runs"])[1] == row["elapsed_s"]  # the median run
    ref = row["reference"]
    assert len(ref["hf"]["elapsed_s_runs"]) == 3 and sorted(ref["hf"]["elapsed_s_runs"])[1] == ref["hf"]["elapsed_s"]
    assert ref["hf"]["num_prompts"] == 4 and ref["hf"]["greedy_match"] == 4  # same tokens as transformers
    assert row["vs_hf"] == pytest.approx(row["total_tokens_per_s"] / ref["hf"]["total_tokens_per_s"], rel=1e-2)
    assert ref["roofline"]["gemm"] in ("torch", "onednn", "onednn-f32", "panel") and ref["roofline"]["gemm_gflops"] > 0
    assert 0 < row["roofline_frac"]
    cats = ref["profile"]["categories"]
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0, abs=2e-3)
    assert cats["weight matmuls"]["s"] > 0 and cats["attention kernels"]["s"] > 0
    assert "where the time goes" in err and "transformers generate" in err


def test_help_shows_bracketed_text_as_written(capsys, monkeypatch):
    """Typer renders help as rich markup, where ``[plot]`` is a tag and vanishes: the install
    command a missing extra asks for must read as the user would type it."""
    monkeypatch.setenv("COLUMNS", "400")  # one option per line, nothing wrapped
    code, out, _ = cli(capsys, "bench", "--help")
    assert code == 0
    text = " ".join(out.split())
    for written in ("tinyllm[plot]", "tinyllm[structured]", "ORG/NAME[@REVISION]"):
        assert written in text, written
