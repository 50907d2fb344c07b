"""Exit codes of the ``dflash-flow`` commands, and the one way a user error ends a command: one ``error:`` line
and exit code 2 (:func:`report_user_error` returns the code, :func:`user_error` exits)."""

from __future__ import annotations

import errno
import sys
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILED = 1  # the program failed (a stage crashed, a stall): a traceback goes to summary.json
EXIT_USER_ERROR = 2  # the input is wrong (config, data, checkpoint, paths): one clear line, no traceback
EXIT_INTERRUPTED = 130  # SIGINT / SIGTERM

# OSErrors of the user's machine, not bugs (a full disk, read-only, permissions, a path of the wrong kind).
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                                errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG})


def guard_console() -> None:
    """Console output survives a reader that went away (``dflash-flow run ... | head``): the command goes on."""
    from dflash_flow.observe.console import guard_console_streams

    guard_console_streams()


class UserError(Exception):
    """Raised by application code for a problem with the user's input; the CLI prints it and exits 2."""


def is_user_input_error(exc: BaseException) -> bool:
    """Whether ``exc`` means "your input (or your machine) is wrong" (exit 2), not "the program failed" (1)."""
    from dflash_flow.core.errors import DflashFlowError
    from dflash_flow.data.records import DataError

    return isinstance(exc, (DataError, DflashFlowError, UserError)) or (
        isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS)


def describe_os_error(exc: OSError) -> str:
    """``PATH: reason`` for an OSError (the reason alone when it names no file)."""
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename is not None else reason


def report_user_error(message: object) -> int:
    """Print ``message`` as one ``error:`` line on stderr; returns the exit code (2) to end with."""
    text = str(message).rstrip("\n")
    if not text.startswith("error:"):
        text = f"error: {text}"
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    return EXIT_USER_ERROR


def user_error(message: object) -> NoReturn:
    """Print ``message`` as one ``error:`` line on stderr and exit with code 2."""
    raise SystemExit(report_user_error(message))
