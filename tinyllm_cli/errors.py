"""User-facing errors: each carries one clear sentence and the exit code the CLI returns.

Exit codes: 2 for usage and configuration mistakes (nothing was run), 1 for runtime failures,
128 + the signal number for SIGINT (130) and SIGTERM (143).
Anything else that escapes is a bug and is reported as such (with a traceback under --debug).
"""

import signal


class TinyLLMError(Exception):
    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(TinyLLMError):
    exit_code = 2


class CheckpointError(TinyLLMError):
    exit_code = 1


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A ``BaseException`` (like ``KeyboardInterrupt``), so no
    ``except Exception`` swallows it: it unwinds through every ``finally`` (files are closed,
    finished results stay on disk) to the CLI, which prints ``message`` and exits 128 + signum.
    A command may set ``message`` on the way out to say what was saved."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        self.message: str | None = None

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"


class _Shield:
    """``with shield:`` defers SIGINT/SIGTERM until the block ends, so a result line is written
    and counted all or nothing. The CLI's signal handler calls ``interrupt``."""

    def __init__(self):
        self.depth = 0
        self.pending: int | None = None

    def interrupt(self, signum: int) -> None:
        if self.depth:
            self.pending = signum
            return
        raise Interrupted(signum)

    def __enter__(self):
        self.depth += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        self.depth -= 1
        if self.depth == 0 and self.pending is not None:
            signum, self.pending = self.pending, None
            if exc_type is None:  # an error already on its way out wins
                raise Interrupted(signum)
        return False


shield = _Shield()
