"""Argument types shared by the CLI subcommands (argparse reports their errors as usage errors)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["positive_int", "fail"]


def positive_int(text: str) -> int:
    """An integer >= 1, else ``argparse.ArgumentTypeError`` (exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def fail(command: str, error: object) -> int:
    """Print a user error as one line on stderr (``ampguard CMD: error: ...``); returns 2."""
    text = " ".join(str(error).split()) or type(error).__name__
    print(f"ampguard {command}: error: {text}", file=sys.stderr)
    return 2
