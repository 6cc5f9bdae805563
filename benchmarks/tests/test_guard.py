"""Worker processes and their guard: a worker that dies or hangs is a note, a loaded worker is
stopped while another engine is timed, and no stopped worker outlives the comparison, however
the comparison ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.common import Skip
from benchmarks.guard import GUARD, WorkerEngine, WorkerGuard
from benchmarks.runs import only

from .fakes import FakeEngine

REPO = Path(__file__).resolve().parents[2]


def test_a_worker_that_exits_is_skipped_with_its_last_words(tmp_path):
    """An engine worker (OpenVINO GenAI, vLLM) that dies before answering: the row is skipped
    with the last line it wrote (its exception's message); one that stays silent past the
    timeout is 'hung'."""
    log = tmp_path / "runs.log"
    log.write_text("an earlier worker's output\n")
    crash = [sys.executable, "-c", "import sys; sys.stderr.write('Traceback (most recent call last):\\n"
             "RuntimeError: expect kvcache type f32, current: bf16\\n\\n'); sys.exit(1)"]
    with pytest.raises(Skip, match=r"worker exited: RuntimeError: expect kvcache type f32, current: bf16 \(see "):
        WorkerEngine(crash, dict(os.environ), log, timeout=60)
    silent = [sys.executable, "-c", "import time; time.sleep(5)"]
    with pytest.raises(Skip, match="worker hung"):
        WorkerEngine(silent, dict(os.environ), log, timeout=0.5)


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (T: stopped, Z: exited, waiting for its parent); None
    when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _states(pids, want_stopped: bool) -> list[str]:
    """The processes' state letters, polled up to 5 s until each is (or is not) stopped: a signal
    is acted on after kill() returns."""
    def states():
        return [_state(p) for p in pids]
    deadline = time.monotonic() + 5
    while any((s == "T") != want_stopped for s in states()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return states()


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(signal, "SIGSTOP"), reason="needs /proc and SIGSTOP")
def test_only_the_timed_engine_runs_the_others_workers_are_stopped(tmp_path):
    """A loaded worker is stopped, with the processes it started (vLLM's engine core), while
    another engine runs, and continued for its own runs; closing a stopped worker ends it."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('@@RESULT ' + json.dumps({'child': child.pid}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    n = json.loads(line)['max_tokens']\n"
        "    print('@@RESULT ' + json.dumps({'elapsed_s': 0.25, 'token_ids': [[1] * n]}), flush=True)\n"
        "child.kill()\n")
    log = tmp_path / "runs.log"
    a = WorkerEngine([sys.executable, str(script)], dict(os.environ), log, timeout=60)
    b = WorkerEngine([sys.executable, str(script)], dict(os.environ), log, timeout=60)
    pids = {"a": (a.proc.pid, a.info["child"]), "b": (b.proc.pid, b.info["child"])}
    try:
        engines = {"tinyllm": FakeEngine("tinyllm"), "a": a, "b": b}
        only(engines, "a")
        assert _states(pids["b"], True) == ["T", "T"] and "T" not in _states(pids["a"], False)
        assert a.run([[5, 6]], 3).token_ids == [[1, 1, 1]]
        only(engines, "b")
        assert _states(pids["a"], True) == ["T", "T"] and "T" not in _states(pids["b"], False)
        assert b.run([[5, 6]], 2).token_ids == [[1, 1]]
        only(engines, "tinyllm")
        assert _states([p for pair in pids.values() for p in pair], True) == ["T"] * 4
    finally:
        a.close()
        b.close()
        GUARD.close()
    assert a.proc.returncode == 0 and b.proc.returncode == 0  # continued, read the end of input, exited


def _gone(pids) -> bool:
    """Whether every process has exited (no /proc entry, or a zombie waiting for its new parent),
    polled up to 20 s."""
    def alive(p):
        return _state(p) not in (None, "Z")
    deadline = time.monotonic() + 20
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(alive, pids))


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(signal, "SIGKILL"), reason="needs /proc and SIGKILL")
def test_workers_stopped_by_a_script_killed_outright_are_continued_and_end(tmp_path):
    """SIGKILL gives the script no chance to continue the workers it stopped: the guard process
    does, and each one, with the process it started, then reads the end of its input and exits."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE)\n"
        "print('@@RESULT ' + json.dumps({'child': child.pid}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    pass\n"
        "child.stdin.close()\n"
        "child.wait()\n")
    code = (f"import os, sys, time; sys.path.insert(0, {str(REPO)!r})\n"
            "from pathlib import Path\n"
            "from benchmarks.guard import WorkerEngine\n"
            f"w = WorkerEngine([sys.executable, {str(worker)!r}], dict(os.environ), Path({str(tmp_path / 'runs.log')!r}), 60)\n"
            "w.pause()\n"
            "print(w.proc.pid, w.info['child'], flush=True)\n"
            "time.sleep(60)\n")
    script = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in script.stdout.readline().split()]
        assert len(pids) == 2 and _states(pids, True) == ["T", "T"]
    finally:
        script.kill()
        script.wait()
        script.stdout.close()
    ended = _gone(pids)
    for p in pids if not ended else []:  # leave no stopped process behind a failure
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    assert ended, "a worker stopped by the killed script was left running or stopped"


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(signal, "SIGSTOP"), reason="needs /proc and SIGSTOP")
def test_the_guard_continues_every_group_it_holds_even_after_being_restarted():
    """The guard continues the groups it was given when its input ends, not the ones it was told
    to forget; a guard that was killed is replaced by one that learns every group still held."""
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
                for _ in range(3)]
    pids = [p.pid for p in sleepers]
    guard = WorkerGuard()
    try:
        for pid in pids:
            os.killpg(pid, signal.SIGSTOP)
        guard.add(pids[0])
        guard.add(pids[1])
        first = guard.proc
        first.kill()
        first.wait()
        guard.add(pids[2])
        assert guard.proc is not first and guard.proc.poll() is None
        guard.discard(pids[2])
        guard.close()  # its input ends: what this script's exit does
        assert "T" not in _states(pids[:2], False)
        assert _states(pids[2:], True) == ["T"]  # forgotten: left as it was
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
