"""What machine a measurement ran on, for performance tables and profiles (every table names
its CPU): one reading of /proc/cpuinfo, with the platform's word where there is none."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
