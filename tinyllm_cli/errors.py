"""User-facing errors: each carries one clear sentence and the exit code the CLI returns.

Exit codes: 2 for usage and configuration mistakes (nothing was run), 1 for runtime failures.
Anything else that escapes is a bug and is reported as such (with a traceback under --debug).
"""


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
