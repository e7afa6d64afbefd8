"""How a CLI command that runs the user's code fails: their error as theirs, a usage error as one
line, ampguard's own bug with its traceback."""

from __future__ import annotations

import sys
from typing import Any

from ampguard.cli._types import fail

__all__ = ["failure", "user_code"]


def user_code(command: str, err: Exception) -> int:
    """The user's own code raised: their traceback, marked as theirs; exit status 1."""
    from ampguard.cli._loader import user_traceback

    print(
        f"ampguard {command}: error: {err} (in your code, not in ampguard; its traceback follows)",
        file=sys.stderr,
    )
    print(user_traceback(err), file=sys.stderr, end="")  # type: ignore[arg-type]
    return 1


def failure(command: str, ref: str, raw: Any, exc: Exception) -> int:
    """Exit status for ``exc``: the user's code raised (1, their traceback), a usage error
    (2, one line); anything else is ampguard's own bug and is raised with its traceback."""
    from ampguard.cli._loader import UserCodeError, raised_in_module_of
    from ampguard.fp8 import Fp8UnavailableError

    if isinstance(exc, Fp8UnavailableError):  # says what to install
        return fail(command, exc)
    if isinstance(exc, UserCodeError):
        return user_code(command, exc)
    if raw is not None and raised_in_module_of(exc, raw):
        return user_code(
            command,
            UserCodeError(f"your experiment ({ref}) raised {type(exc).__name__}: {exc}", exc),
        )
    if isinstance(exc, (ValueError, TypeError)):
        return fail(command, exc)
    raise exc
