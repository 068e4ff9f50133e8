"""One exception type for mistakes a user can fix (a bad value, a missing file), and one handler.

Every user-facing error class of the suite derives from :class:`UserError` (TraceError,
CheckpointError, ConfigMismatchError, RunFolderError, the engines' not-installed errors). The
entry points (``python -m bench.harness.cli``, ``bench.report.collect``, ``bench.harness.simulate``, ``bench.traces.format``)
print such an error as one line, ``error: <what is wrong and how to fix it>``, and exit with
status 2; any other exception is a bug and keeps its traceback. ``SPECROLLOUT_DEBUG=1`` shows the
traceback of user errors too.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

DEBUG_ENV = "SPECROLLOUT_DEBUG"
EXIT_USER_ERROR = 2
T = TypeVar("T")


class UserError(Exception):
    """A mistake in the input (config value, path, file); the message names the value and the fix."""


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(exc: BaseException) -> str:
    """The error's message on one line (whitespace runs, newlines included, become one space)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def exit_on_user_error(exc: UserError) -> None:
    """Print ``exc`` as one line on stderr and exit with status 2 (re-raise it under debug)."""
    if debug_enabled():
        raise exc
    print(f"error: {one_line(exc)}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def run_main(main: Callable[[], T]) -> T:
    """Call an entry point's ``main``; a UserError ends the process with one line (see above)."""
    try:
        return main()
    except UserError as exc:
        exit_on_user_error(exc)
        raise  # unreachable: exit_on_user_error exits or re-raises
