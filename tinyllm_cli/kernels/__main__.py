"""``python -m tinyllm_cli.kernels``: build the CPU kernels ahead of time (``make setup`` does).

Exit status 0 when they are loaded, or when the PyTorch fallback was accepted explicitly
(``TINYLLM_ALLOW_NO_KERNELS=1``, or ``TINYLLM_KERNELS=0``); 1 when they did not build, so that
``make setup`` / ``make test`` cannot pass with the kernels silently off. Messages go to stderr.
"""

import sys

from . import build_key, cache_root, compiler, load, load_error, opted_out


def main() -> int:
    if load():
        print(f"tinyllm kernels: ready in {cache_root() / build_key()}", file=sys.stderr)
        return 0
    accepted = opted_out()
    if accepted:
        print(f"tinyllm kernels: not built ({load_error()}); {accepted}: tinyllm runs on the slower "
              f"PyTorch path", file=sys.stderr)
        return 0
    cxx = compiler()
    todo = (f"the C++ compiler here ({cxx}) failed: fix the build" if cxx
            else "no C++ compiler here: install g++ (or point CXX at one)")
    print(f"tinyllm kernels: not built ({load_error()}); {todo}, or set TINYLLM_ALLOW_NO_KERNELS=1 to accept "
          f"the slower PyTorch path", file=sys.stderr)
    return 1


sys.exit(main())
