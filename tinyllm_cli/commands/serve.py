"""``tinyllm serve``: an OpenAI-compatible HTTP server over the same engine as ``generate``.

The socket is bound before the model loads, so a taken port or a refused address is one
sentence at once. SIGTERM (or a first SIGINT) drains: the listening socket closes, running
requests finish (bounded by ``--drain-timeout``), and the process exits 0 (130 after SIGINT); a
second SIGINT exits at once.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys

from ..config import Config
from ..errors import TinyLLMError, UsageError
from ..machine import installed
from .common import open_llm

INSTALL = 'pip install "tinyllm[serve]"'
LOOPBACK = {"localhost", "::1"}


def require_serve(command: str = "serve", modules=("fastapi", "uvicorn", "prometheus_client")) -> None:
    """What ``command`` needs of the serve extra (``serve``: FastAPI, uvicorn, prometheus_client;
    ``load``: aiohttp, prometheus_client), or one sentence naming the install command."""
    missing = [m for m in modules if not installed(m)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise UsageError(f"tinyllm {command} needs {', '.join(missing)}, which {verb} not installed: {INSTALL}")


def require_load() -> None:
    require_serve("load", ("aiohttp", "prometheus_client"))


def is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one), or one sentence."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} is not an address this machine can bind ({e.strerror})")
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_access(host: str, api_key: str | None, allow_no_auth: bool) -> None:
    if not is_loopback(host) and not api_key and not allow_no_auth:
        raise UsageError(f"--host {host} is reachable from other machines, so an API key is required: give "
                         f"--api-key (or TINYLLM_API_KEY), or --allow-no-auth to serve without one")


def served_name(model: str) -> str:
    """What clients send as ``model``: the default model's name, a file's or folder's name
    without its extension, or a Hub id as given."""
    from pathlib import Path

    from ..model.checkpoint import DEFAULT_FILE
    if model in (None, "", "default"):
        return DEFAULT_FILE.split(".")[0]
    p = Path(model)
    if p.exists():
        return p.name.removesuffix(".gguf")
    return model


def max_model_len_of(llm) -> int:
    eng = llm.engine
    if hasattr(eng, "max_model_len"):
        return eng.max_model_len
    return min(llm.config.cache.max_model_len, llm.runtime.model_cfg.max_position_embeddings)


def run_serve(cfg: Config, *, host: str, port: int, api_key: str | None, allow_no_auth: bool, max_waiting: int,
              max_body_bytes: int, drain_timeout: float, served_model_name: str | None, quiet: bool) -> int:
    require_serve()
    check_access(host, api_key, allow_no_auth)
    sock = bind(host, port)
    from ..serving.app import ServeSettings
    from ..serving.server import make_server
    llm = open_llm(cfg, quiet)
    try:
        llm.engine.reset_stats()
        name = served_model_name or served_name(cfg.model)
        settings = ServeSettings(name, api_key=api_key, max_waiting=max_waiting, max_body_bytes=max_body_bytes,
                                 run_seed=cfg.sampling.run_seed)
        server = make_server(llm.engine, llm.tokenizer, cfg.sampling.request_defaults(), settings,
                             max_model_len=max_model_len_of(llm), quiet=quiet, drain_timeout=drain_timeout)
        shown = f"[{sock.getsockname()[0]}]" if sock.family == socket.AF_INET6 else sock.getsockname()[0]
        print(f"tinyllm serve: {name} on http://{shown}:{sock.getsockname()[1]}/v1 "
              f"(up to {cfg.scheduler.max_num_seqs} sequences at once; Ctrl-C or SIGTERM drains and stops)",
              file=sys.stderr, flush=True)
        server.run_beside(server.front, [sock])
        if server.force_exit:
            return 130
        return 130 if signal.SIGINT in server.signals else 0
    except OSError as e:
        raise TinyLLMError(f"the server stopped: {e}")
    finally:
        sock.close()
        llm.close()
