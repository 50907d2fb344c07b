"""Exit codes of the ``dflash-flow`` commands, and the one way a user error ends a command."""

from __future__ import annotations

import sys
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILED = 1  # the program failed (a stage crashed, a stall): a traceback goes to summary.json
EXIT_USER_ERROR = 2  # the input is wrong (config, data, checkpoint, paths): one clear line, no traceback
EXIT_INTERRUPTED = 130  # SIGINT / SIGTERM


class UserError(Exception):
    """Raised by application code for a problem with the user's input; the CLI prints it and exits 2."""


def is_user_input_error(exc: BaseException) -> bool:
    """Errors that mean "your input is wrong" (exit code 2) rather than "the program failed" (1)."""
    from dflash_flow.core.errors import DflashFlowError
    from dflash_flow.data.records import DataError

    return isinstance(exc, (DataError, DflashFlowError, UserError))


def user_error(message: str) -> NoReturn:
    """Print ``message`` as one ``error:`` line on stderr and exit with code 2."""
    text = str(message)
    if not text.startswith("error:"):
        text = f"error: {text}"
    sys.stderr.write(text.rstrip("\n") + "\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_USER_ERROR)
