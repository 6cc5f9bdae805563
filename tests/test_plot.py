"""Pictures (``--plot``, ``tinyllm plot``) drawn from real small runs, checked as files: a PNG's
signature and size, an SVG parsed as XML with every expected series present by its id; and the
rough edges a new user hits first (adaptive max_num_seqs, the peak the map shows, --version)."""

from __future__ import annotations

import json
import struct
import sys
import xml.etree.ElementTree as ET

import pytest

from tinyllm_cli.config import build_config, load_config
from tinyllm_cli.errors import UsageError

from test_cli import cli

SMALL = ["--num-prompts", 4, "--input-len", 12, "--output-len", 4, "--max-model-len", 64, "-q"]


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    from PIL import Image  # an independent decoder reads the whole image
    with Image.open(path) as im:
        im.load()
        assert im.size == struct.unpack(">II", data[16:24])
        return im.size


def svg_ids_and_text(path) -> tuple[set[str], str]:
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    ids = {el.get("id") for el in root.iter() if el.get("id")}
    text = " ".join(t for el in root.iter() if el.tag.endswith("text") for t in el.itertext())
    return ids, text


@pytest.fixture
def shared_prompts(tmp_path):
    """Six prompts sharing a 12-token prefix (three 4-token blocks): in a 16-block pool they share
    blocks and preempt."""
    p = tmp_path / "shared.jsonl"
    rows = [{"id": f"r{i}", "prompt_token_ids": list(range(10, 22)) + [100 + 7 * i + j for j in range(3 + i)]}
            for i in range(6)]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_bench_plot_png_then_svg_from_its_json(capsys, llama_dir, tmp_path):
    png, js, svg = tmp_path / "b.png", tmp_path / "b.json", tmp_path / "b.svg"
    code, out, _ = cli(capsys, "bench", "--model", llama_dir, "--block-size", "4,8", "--cache", "paged,slot",
                       "--prefix-cache", "on,off", "--kv-memory", "128KiB", "--no-warmup", "--no-roofline", "--json", js,
                       "--plot", png, *SMALL)
    assert code == 0 and out == ""
    w, h = png_size(png)
    assert (w, h) == (1300, 750) and 20_000 < png.stat().st_size < 300_000
    code, out, err = cli(capsys, "plot", js, "-o", svg)
    assert code == 0 and out == "" and "bench" in err
    ids, text = svg_ids_and_text(svg)
    rows = json.loads(js.read_text())
    assert len(rows) == 5
    for r in rows:
        series = "slot" if r["cache_kind"] == "slot" else f"paged-prefix-{'on' if r['prefix_caching'] else 'off'}"
        where = "slot" if r["cache_kind"] == "slot" else r["block_size"]
        for key in ("total_tokens_per_s", "output_tokens_per_s", "mean_block_utilization",
                    "peak_block_utilization", "mean_wasted_slots", "peak_wasted_slots", "peak_running",
                    "preemptions"):
            assert f"{key}/{series}/{where}" in ids
    assert "baseline/hf" not in ids and "roofline" not in ids  # not measured, not drawn
    for label in ("paged, prefix on", "paged, prefix off", "slot", "block size (tokens)", "tokens / s",
                  rows[0]["model"], rows[0]["dtype"], rows[0]["device"], "4 prompts"):
        assert label in text


def test_bench_plot_draws_baseline_and_roofline_when_measured(tmp_path):
    from tinyllm_cli.plot import draw
    row = {"cache_kind": "paged", "block_size": 16, "prefix_caching": True, "total_tokens_per_s": 100.0,
           "output_tokens_per_s": 40.0, "mean_block_utilization": 0.9, "peak_block_utilization": 0.95,
           "mean_wasted_slots": 10.0, "peak_wasted_slots": 15, "peak_running": 4, "preemptions": 0,
           "num_requests": 4, "kv_bytes": 2**20,
           "reference": {"hf": {"total_tokens_per_s": 50.0},
                         "roofline": {"roofline_tokens_per_s": 1000.0, "gemm": "torch"}}}
    svg = tmp_path / "r.svg"
    draw("bench", [row], svg)
    ids, text = svg_ids_and_text(svg)
    assert {"baseline/hf", "roofline"} <= ids
    assert "transformers generate: 50 total tok/s" in text and "1000 tok/s (above the scale)" in text


def test_inspect_plot_timeline_and_map(capsys, llama_dir, tmp_path, shared_prompts):
    svg, js, st = tmp_path / "i.svg", tmp_path / "i.json", tmp_path / "s.json"
    code, _, _ = cli(capsys, "inspect-blocks", "--model", llama_dir, "--prompts", shared_prompts, "--output-len", 12,
                     "--num-blocks", 16, "--block-size", 4, "--json", js, "--stats-json", st, "--plot", svg, "-q")
    assert code == 0
    rep = json.loads(js.read_text())
    snap, steps = rep["snapshot"], rep["timeline"]
    # The picture's data: sharing and preemption both happened in this run.
    assert rep["preemption_steps"] and max(s["shared_blocks"] for s in steps) > 0
    # shared_blocks (kept incrementally by the pool) agrees with the snapshot's reference counts.
    assert steps[snap["step"]]["shared_blocks"] == sum(r > 1 for r in snap["refs"])
    ids, text = svg_ids_and_text(svg)
    assert {"blocks/single", "blocks/shared", "blocks/cached-free", "seqs/running", "seqs/waiting",
            "blocks/snapshot", "seqs/snapshot", "block-map"} <= ids
    for p in rep["preemption_steps"]:
        assert f"blocks/preemption/{p}" in ids and f"seqs/preemption/{p}" in ids
    for t in snap["tables"]:
        assert f"seq {t['seq_id']}" in text
    assert f"block map at step {snap['step']} (first step at peak blocks used, 16 of 16)" in text
    png = tmp_path / "i.png"
    assert cli(capsys, "plot", js, "-o", png)[0] == 0 and png_size(png)[0] == 1200
    run_svg = tmp_path / "run.svg"
    code, _, err = cli(capsys, "plot", st, "-o", run_svg)
    assert code == 0 and "run stats" in err
    ids, text = svg_ids_and_text(run_svg)
    assert {"output_tokens_per_s", "total_tokens_per_s", "ttft_s/p50", "tpot_s/p99", "latency_s/p90",
            "mean_block_utilization", "phase/forward"} <= ids
    assert "per-request latency percentiles" in text


def test_inspect_peak_is_the_tables_peak(capsys, llama_dir, tmp_path):
    """--at peak shows the first step where blocks used reach the run's peak blocks used (cached
    free blocks do not count), so map and run table agree."""
    js = tmp_path / "i.json"
    code, _, err = cli(capsys, "inspect-blocks", "--model", llama_dir, "--num-prompts", 6, "--num-blocks", 40,
                       "--max-num-seqs", 6, "--block-size", 8, "--input-len", 48, "--output-len", 24, "--json", js)
    assert code == 0
    rep = json.loads(js.read_text())
    peak = rep["summary"]["peak_blocks_used"]
    used = [s["blocks_used"] for s in rep["timeline"]]
    assert rep["snapshot"]["blocks_used"] == peak == max(used)
    assert rep["snapshot"]["step"] == used.index(peak)
    assert f"(first step at peak blocks used, {peak} of 40): {peak} used" in err
    assert f"peak blocks used" in err and f"{peak} / 40" in err


@pytest.mark.parametrize("args", [
    ["bench", "--model", "/no/such/model", "--plot", "{tmp}/b.png"],
    ["inspect-blocks", "--model", "/no/such/model", "--plot", "{tmp}/i.svg"],
    ["plot", "/no/such/stats.json", "-o", "{tmp}/p.png"],
])
def test_missing_matplotlib_is_one_sentence_before_anything_loads(capsys, monkeypatch, tmp_path, args):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    code, out, err = cli(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert code == 2 and out == ""
    assert err.strip() == ('error: plotting needs matplotlib, which is not installed; install it with '
                           'pip install "tinyllm[plot]"')
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("content, needle", [
    (None, "does not exist"),
    ("{not json", "cannot read"),
    ("[1, 2, 3]", "not a file tinyllm can draw"),
    ('{"snapshot": {}, "timeline": [], "summary": {}, "at": "peak"}', "missing or has bad fields"),
])
def test_plot_bad_stats_files(capsys, tmp_path, content, needle):
    stats = tmp_path / "s.json"
    if content is not None:
        stats.write_text(content)
    code, out, err = cli(capsys, "plot", stats, "-o", tmp_path / "p.png")
    assert code == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("args", [
    ["bench", "--model", "/no/such/model", "--plot", "b.pdf"],
    ["inspect-blocks", "--model", "/no/such/model", "--plot", "i"],
    ["plot", "/no/such/stats.json", "-o", "p.jpg"],
    ["bench", "--model", "/no/such/model", "--plot", "/no/such/dir/b.png"],
])
def test_plot_path_checked_first(capsys, args):
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert ".png or .svg" in err or "folder does not exist" in err


# ---- rough edges ------------------------------------------------------------------------------

def test_default_max_num_seqs_adapts_to_a_small_pool():
    assert build_config({}, overrides={"cache.num_blocks": 24}).scheduler.max_num_seqs == 24
    assert build_config({"cache": {"num_blocks": 8}}).scheduler.max_num_seqs == 8
    assert build_config({}, overrides={"cache.num_blocks": 100}).scheduler.max_num_seqs == 64  # no need
    # slot caches have no blocks to run out of
    assert build_config({"cache": {"kind": "slot", "num_blocks": 8}}).scheduler.max_num_seqs == 64


@pytest.mark.parametrize("data, overrides", [
    ({}, {"cache.num_blocks": 24, "scheduler.max_num_seqs": 32}),          # both flags
    ({"scheduler": {"max_num_seqs": 32}}, {"cache.num_blocks": 24}),        # file + flag
    ({"cache": {"num_blocks": 24}, "scheduler": {"max_num_seqs": 32}}, {}),  # both in the file
])
def test_both_set_by_the_user_is_still_refused(data, overrides):
    with pytest.raises(UsageError, match="fewer than scheduler.max_num_seqs"):
        build_config(data, overrides=overrides)


def test_command_default_pool_gives_way_to_the_user():
    small = {"cache.num_blocks": 64}
    assert build_config({}, command_defaults=small).cache.num_blocks == 64
    # a user max_num_seqs above the command's default pool grows the pool, not an error
    cfg = build_config({}, overrides={"scheduler.max_num_seqs": 100}, command_defaults=small)
    assert (cfg.cache.num_blocks, cfg.scheduler.max_num_seqs) == (100, 100)
    # a pool the user sized (in blocks or in bytes, in a file or by flag) is never replaced
    assert build_config({"cache": {"num_blocks": 8}}, command_defaults=small).cache.num_blocks == 8
    assert build_config({}, overrides={"cache.kv_memory": "1MiB"}, command_defaults=small).cache.num_blocks is None


def test_inspect_blocks_honours_the_config_files_pool(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  num_blocks: 20\n")
    cfg = load_config(f, command_defaults={"cache.num_blocks": 64})
    assert (cfg.cache.num_blocks, cfg.scheduler.max_num_seqs) == (20, 20)


def test_small_pools_run_from_the_command_line(capsys, llama_dir, tmp_path):
    js = tmp_path / "b.json"
    code, _, err = cli(capsys, "bench", "--model", llama_dir, "--num-blocks", 24, "--block-size", 4,
                       "--cache", "paged", "--no-warmup", "--json", js, *SMALL)
    assert code == 0, err
    (row,) = json.loads(js.read_text())
    assert row["max_num_seqs"] == 24 and row["num_blocks"] == 24
    code, _, err = cli(capsys, "inspect-blocks", "--model", llama_dir, "--num-blocks", 32, "--num-prompts", 3,
                       "--input-len", 8, "--output-len", 4, "-q")
    assert code == 0, err
    code, _, err = cli(capsys, "inspect-blocks", "--model", llama_dir, "--num-blocks", 32, "--max-num-seqs", 40)
    assert code == 2 and "fewer than scheduler.max_num_seqs (command-line flag) = 40" in err


def test_version(capsys, monkeypatch):
    from importlib import metadata
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out == f"tinyllm {metadata.version('tinyllm')}\n"

    from tinyllm_cli.version import package_version
    reads = []

    def missing(name):
        reads.append(name)
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", missing)
    package_version.cache_clear()
    try:
        for _ in range(2):
            code, out, _ = cli(capsys, "--version")
            assert code == 0 and out.startswith("tinyllm unknown (not installed")
        assert reads == ["tinyllm"]  # read once per process: the server names it in every streamed chunk
    finally:
        package_version.cache_clear()


def test_simulate_sweep_plot_is_labelled_by_the_swept_setting(capsys, tmp_path):
    """A `simulate --sweep num_blocks=...` figure puts the pool sizes on the x axis (not the one
    block size every point shares) and says it was simulated."""
    js, svg = tmp_path / "s.json", tmp_path / "s.svg"
    code, _, _ = cli(capsys, "simulate", "--num-prompts", 24, "--input-len", 32, "--output-len", 16,
                     "--sweep", "num_blocks=24,48,96", "--json", js, "-q")
    assert code == 0
    code, _, err = cli(capsys, "plot", js, "-o", svg)
    assert code == 0, err
    ids, text = svg_ids_and_text(svg)
    assert {f"total_tokens_per_s/paged-prefix-on/num_blocks={n}" for n in (24, 48, 96)} <= ids
    assert "num blocks" in text and "tinyllm simulate" in text and "block size (tokens)" not in text
