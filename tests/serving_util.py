"""A real ``tinyllm serve`` process for tests: started on a free loopback port, waited for on
its own words (the URL line on stderr, then ``/health``), stopped at the end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
START_S = 600  # loading a model on a busy 2-core host: bounded, not brittle
URL_LINE = re.compile(r"on (http://\S+)/v1 ")


class ServerProc:
    def __init__(self, *args, env: dict | None = None):
        cmd = [sys.executable, "-m", "tinyllm_cli", "serve", "--port", "0", *map(str, args)]
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                        **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._url = threading.Event()
        self.base = None
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_ready()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = URL_LINE.search(line)
            if m and self.base is None:
                self.base = m.group(1)
                self._url.set()
        self._url.set()  # the process ended: stop waiting

    def _wait_ready(self) -> None:
        if not self._url.wait(START_S) or self.base is None:
            self.stop()
            raise AssertionError("tinyllm serve did not start:\n" + "".join(self.lines[-20:]))
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("tinyllm serve never reported healthy")

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def metrics(self, headers=None) -> dict[str, float]:
        """The server's /metrics as {name{labels}: value} -> {name: value} (labels dropped)."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.base + "/metrics", headers=headers, timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def wait_metric(self, name: str, ok, what: str) -> dict:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            m = self.metrics()
            if ok(m.get(name)):
                return m
            time.sleep(0.05)
        raise AssertionError(f"{name} never {what}: {self.metrics().get(name)}")

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = START_S) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
