"""The installed package's version (``tinyllm --version``, the server's ``system_fingerprint``)."""

from __future__ import annotations

import functools


@functools.cache
def package_version() -> str:
    """The installed distribution's version; a source tree that was never installed has none.
    Read once per process: ``importlib.metadata`` finds and parses the METADATA file on every
    call (~0.1 ms), and the server's ``system_fingerprint`` names it in every streamed chunk."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tinyllm")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e . records it)"
