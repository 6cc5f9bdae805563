"""Engines in worker processes (another venv's Python) and the guard that keeps them from being
left stopped.

A loaded worker is stopped (SIGSTOP to its own process group) while another engine is timed, so
its idle polling does not take the timed engine's cores. Invariant: every group this process
stopped is continued again, by ``WorkerEngine.close`` normally, or by the guard process
(``WorkerGuard``) should this process die however it dies, SIGKILL included; every server group
registered with ``kill_on_exit`` (servers.py) is killed by the guard in that case.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .common import Run, Skip
from .workloads import total_tokens


class WorkerGuard:
    """A small process, in a session of its own, that continues every worker group the comparison
    stopped once the comparison's process is gone, however it ended (a SIGKILL included: the kernel closes the
    pipe it reads). A continued worker then reads the end of its own input and exits; a stopped one
    would have waited forever. A server group (``kill_on_exit``) listens on a port rather than
    reading its input, so it is killed instead. Started at the first ``add``; one per process
    (``GUARD``)."""

    CODE = """
import os, signal, sys
groups, kills = set(), set()
for line in sys.stdin:
    op, group = line[0], int(line[1:])
    if op == "+":
        groups.add(group)
    elif op == "*":
        kills.add(group)
    else:
        groups.discard(group)
        kills.discard(group)
for group, sig in [(g, signal.SIGCONT) for g in groups] + [(g, signal.SIGKILL) for g in kills]:
    try:
        os.killpg(group, sig)
    except OSError:
        pass
"""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.groups: set[int] = set()
        self.kills: set[int] = set()

    def add(self, pgid: int) -> None:
        self.groups.add(pgid)
        self._tell(f"+{pgid}")

    def kill_on_exit(self, pgid: int) -> None:
        """Kill this process group (a server) should the comparison's process end without stopping it."""
        self.kills.add(pgid)
        self._tell(f"*{pgid}")

    def discard(self, pgid: int) -> None:
        """Forget a closed worker's or stopped server's group: its number may be reused by another."""
        if pgid in self.groups or pgid in self.kills:
            self.groups.discard(pgid)
            self.kills.discard(pgid)
            self._tell(f"-{pgid}")

    def _tell(self, line: str) -> None:
        if self.proc is None or self.proc.poll() is not None:  # not started yet, or killed
            self._drop()
            self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdin=subprocess.PIPE, text=True,
                                         start_new_session=True)
            known = [f"+{g}" for g in self.groups] + [f"*{g}" for g in self.kills]
            line = "\n".join(known) or line  # a new guard learns every group
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died just now: the next line starts another
            self._drop()

    def _drop(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc = None

    def close(self) -> None:
        """End the guard (at the comparison's normal end, every worker closed): the end of its input,
        then its exit."""
        proc = self.proc
        self._drop()
        if proc is not None:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


GUARD = WorkerGuard()


class WorkerEngine:
    """One long-lived worker process (another venv's Python) serving every run of a (shape, dtype):
    requests as JSON lines on its stdin, answers as ``@@RESULT`` lines on its stdout. The first
    answer says it is built and warm; its payload is kept as ``info``."""

    name = "worker"

    def __init__(self, cmd: list[str], env: dict, logfile: Path, timeout: float):
        self.timeout = timeout
        self.log = logfile.open("a", buffering=1)  # line-buffered: the log is readable while it runs
        self.log.write(f"\n$ {' '.join(cmd)}\n")
        self.log_start = self.log.tell()  # where this worker's own output begins in the shared log
        # Its own process group (a new session), so that pause() reaches the processes it starts
        # (vLLM's engine core) and not the comparison's process.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, start_new_session=True)
        self.paused = False
        self.results: queue.Queue = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()
        self.info = self._answer()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@RESULT "):
                self.results.put(json.loads(line[len("@@RESULT "):]))
            else:
                self.log.write(line)
        self.results.put(None)

    def _answer(self) -> dict:
        try:
            msg = self.results.get(timeout=self.timeout)
        except queue.Empty:  # silent past the timeout
            self.close()
            raise Skip(f"the {self.name} worker hung (see {self.log.name})") from None
        if msg is None:  # its stdout closed: it exited
            self.close()
            why = self.last_words()
            raise Skip(f"the {self.name} worker exited{f': {why}' if why else ''} (see {self.log.name})")
        return msg

    def last_words(self) -> str | None:
        """The last non-blank line this worker wrote to the log (an exception's message, typically),
        cut to 200 characters; None when it wrote nothing."""
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            f.seek(self.log_start)
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        return lines[-1][:200] if lines else None

    def run(self, prompts, output_len) -> Run:
        """The worker times its ``generate`` call alone; the pipe's round trip is not counted."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": output_len}) + "\n")
        self.proc.stdin.flush()
        msg = self._answer()
        return Run(msg["elapsed_s"], total_tokens(prompts, output_len), msg["token_ids"])

    def pause(self) -> None:
        """Stop every process of the worker (SIGSTOP to its group) while other engines run; where
        the OS has no SIGSTOP (Windows) it keeps running. ``close`` continues it first, and should
        the comparison's process die without closing it (a SIGKILL), the guard continues it (``WorkerGuard``)."""
        if hasattr(signal, "SIGSTOP") and self.proc.poll() is None and not self.paused:
            GUARD.add(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()  # a stopped worker would never read the end of its input
        try:
            self.proc.stdin.close()  # the end of its input: it exits
        except OSError:  # a broken pipe: it stopped reading (a no-op once it has exited)
            self.proc.kill()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        GUARD.discard(self.proc.pid)
        # The pump reads the worker's last lines, then the end of its output; where a process the
        # worker started still holds that open, both stay open rather than wait for it.
        self.pump.join(timeout=2)
        if not self.pump.is_alive():
            self.proc.stdout.close()
            self.log.close()
        else:
            self.log.flush()
