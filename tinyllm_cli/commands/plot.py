"""``tinyllm plot``: draw a saved bench, inspect-blocks, load or run JSON again, without rerunning."""

from __future__ import annotations

import sys
from pathlib import Path

from ..plot import plot_saved


def run_plot(stats: Path, output: Path) -> int:
    kind = plot_saved(stats, output)
    print(f"drew {kind} stats from {stats} into {output}", file=sys.stderr)
    return 0
