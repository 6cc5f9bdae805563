"""``python -m tinyllm_cli.kernels``: build the CPU kernels ahead of time (``make setup`` does)."""

import sys

from . import build_key, cache_root, load, load_error

ok = load()
print(f"tinyllm kernels: {'ready in ' + str(cache_root() / build_key()) if ok else 'not built: ' + str(load_error())}",
      file=sys.stderr)
sys.exit(0 if ok else 1)
