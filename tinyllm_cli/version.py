"""The installed package's version (``tinyllm --version``, the server's ``system_fingerprint``)."""

from __future__ import annotations


def package_version() -> str:
    """The installed distribution's version; a source tree that was never installed has none."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tinyllm")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e . records it)"
