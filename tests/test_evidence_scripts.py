"""The evidence scripts' own logic, on crafted inputs whose answer is known by construction:
scripts/tree_figures.py's wide-tuple counter and room ranks, and scripts/bits_check.py's
``--compare`` (its exit status, and where it says two files part)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SOURCE = '''
from typing import Tuple

def four_literal(x):
    if x:
        return 1, 2, 3, 4
    return None

def three_literal():
    return 1, 2, 3

def annotated() -> tuple[int, int, str, float, bytes]:
    return make()

def quoted() -> "Tuple[int, int, int, int]":
    return make()

def open_tuple() -> tuple[int, ...]:
    return (1, 2, 3, 4, 5)

def nested_only():
    def inner():
        return 1, 2, 3, 4
    return inner

class C:
    def method(self) -> tuple[int, int]:
        return (self, self, self, self)
'''


def test_wide_tuples_counts_literals_and_annotations_but_not_nested_functions(tmp_path):
    tf = script("tree_figures")
    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    found = {w.split()[1] for w in tf.wide_tuple_functions(path, tmp_path)}
    # open_tuple's literal is wider than 3 (it counts though its annotation is open); nested_only
    # returns a function, its inner function counts for itself.
    assert found == {"four_literal", "annotated", "quoted", "open_tuple", "inner", "method"}


def test_room_ranks_put_every_room_above_what_it_imports():
    tf = script("tree_figures")
    rooms = {"leaf": set(), "mid": {"leaf"}, "top": {"mid", "leaf"}, "side": {"leaf"}}
    assert tf.ranks(rooms) == {"leaf": 0, "mid": 1, "top": 2, "side": 1}


def test_tree_figures_refuses_a_directory_that_is_not_a_checkout(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPTS / "tree_figures.py"), str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "not a tinyllm checkout" in p.stderr


def bits_file(path: Path, paths: dict) -> Path:
    path.write_text(json.dumps({"meta": {"commit": path.stem}, "paths": paths}))
    return path


def rec(*seqs):
    return [{"completions": [{"token_ids": list(s), "finish_reason": "length"} for s in seqs]}]


def compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / "bits_check.py"), "--compare", str(a), str(b)],
                          capture_output=True, text=True)


def test_bits_compare_passes_identical_files_and_names_the_first_difference(tmp_path):
    same = {"paged/greedy": rec([1, 2, 3]), "slot/n2": rec([4, 5], [6, 7])}
    a = bits_file(tmp_path / "a.json", same)
    assert compare(a, bits_file(tmp_path / "b.json", same)).returncode == 0
    changed = same | {"slot/n2": rec([4, 5], [6, 8])}
    p = compare(a, bits_file(tmp_path / "c.json", changed))
    assert p.returncode == 1
    lines = {line.split("|")[1].strip(): line for line in p.stdout.splitlines() if line.startswith("| ") and "/" in line}
    assert "identical" in lines["paged/greedy"]
    assert "DIFFERS at prompt 0 completion 1 token 1" in lines["slot/n2"]


def test_bits_compare_fails_on_a_path_missing_from_one_side(tmp_path):
    a = bits_file(tmp_path / "a.json", {"paged/greedy": rec([1])})
    b = bits_file(tmp_path / "b.json", {"paged/greedy": rec([1]), "paged/json": rec([2])})
    p = compare(a, b)
    assert p.returncode == 1 and "only in" in p.stdout


def test_bits_compare_refuses_an_unreadable_file_in_one_sentence(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    p = compare(bad, bad)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1


def live_figures(tok_s, ttft50, ttft90, tpot50, preemptions):
    return {"out tok/s": tok_s, "TTFT p50 s": ttft50, "TTFT p90 s": ttft90, "TPOT p50 s": tpot50,
            "preemptions": preemptions, "num_failed": 0}


def test_sim_vs_live_repeats_compare_with_the_live_medians_and_show_their_range():
    svl = script("sim_vs_live")
    runs = [live_figures(100.0, 0.2, 0.5, 0.010, 5), live_figures(90.0, 0.4, 0.3, 0.030, 9),
            live_figures(110.0, 0.3, 0.4, 0.020, 4)]
    med, spread = svl.median_runs(runs)
    assert med == live_figures(100.0, 0.3, 0.4, 0.020, 5)  # each figure's own median, not one run's
    assert spread["TTFT p50 s"] == [0.2, 0.4] and spread["preemptions"] == [4, 9]
    sim = live_figures(110.0, 0.3, 0.2, 0.025, 6)
    err = svl.errors(med, sim)
    assert err == {"out tok/s": 0.1, "TTFT p50 s": 0.0, "TTFT p90 s": -0.5, "TPOT p50 s": 0.25}
    row = {"cache": "slot", "rate": 4.0, "live": med, "sim": sim, "err": err, "live_range": spread,
           "load_before": [0.5, 0.7, 0.6], "load_after": [1.0, 0.9, 1.2], "read_gbps": [50.0, 80.0, 60.0, 70.0, 55.0, 85.0]}
    line = svl.table([row]).splitlines()[-1]
    assert "0.3 [0.2-0.4] / 0.3 (+0%)" in line and "5 [4-9] / 6" in line
    assert "0.50 / 1.20" in line and "50-85" in line  # the passes' lowest load before, highest after
