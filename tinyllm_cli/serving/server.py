"""uvicorn's server with ``tinyllm serve``'s signal rules."""

from __future__ import annotations

import signal
import sys
import threading

import uvicorn

SWITCH_S = 0.0005


def make_server(engine, tokenizer, defaults, settings, *, max_model_len: int | None, quiet: bool,
                drain_timeout: float = 30.0) -> "Server":
    """``tinyllm serve``'s app over ``engine`` (its loop on the calling thread: ``run_beside``)
    in our uvicorn server; the one way both ``serve`` and ``simulate calibrate --serving`` build it."""
    from .app import create_app
    app = create_app(engine, tokenizer, defaults, settings, max_model_len=max_model_len, engine_thread=False)
    server = Server(uvicorn.Config(app, log_level="warning" if quiet else "info",
                                   timeout_graceful_shutdown=drain_timeout, access_log=not quiet),
                    on_first_signal=app.state.front.stop_accepting)
    server.front = app.state.front
    return server


class Server(uvicorn.Server):
    """uvicorn's server with our signal rules: the first SIGINT/SIGTERM drains, a second SIGINT
    exits at once, and the signal is not raised again afterwards (the command chooses the exit
    code). It runs on a thread of its own (``run_beside``), where uvicorn installs no handlers
    of its own; ``run_beside`` installs ours on the main thread."""

    def __init__(self, config, on_first_signal):
        super().__init__(config)
        self.signals: list[int] = []
        self.on_first_signal = on_first_signal

    def run_beside(self, front, sockets) -> None:
        """HTTP on a thread of its own, the engine loop (``front.run``) on this one (the main
        thread: see ``EngineFront``); our signal rules are installed here, where Python delivers
        signals. Returns once the HTTP side has shut down and the engine loop has stopped."""
        def http() -> None:
            try:
                self.run(sockets=sockets)
            finally:
                front.close()  # also after a forced exit, which skips the app's own shutdown
        old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        # Two busy Python threads hand the GIL over every switch interval (5 ms by default): each
        # request and each streamed chunk crosses between them, so hand it over sooner.
        sys.setswitchinterval(SWITCH_S)
        t = threading.Thread(target=http, name="tinyllm-http", daemon=True)
        try:
            t.start()
            front.run()
            t.join()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self.signals.append(sig)
        if not self.should_exit:
            self.on_first_signal()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
