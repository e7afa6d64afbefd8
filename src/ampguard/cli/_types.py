"""Argument types shared by the CLI subcommands (argparse reports their errors as usage errors)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["positive_int", "seed", "fail", "Parser", "usable_out"]


def positive_int(text: str) -> int:
    """An integer >= 1, else ``argparse.ArgumentTypeError`` (exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**32 - 1] (what numpy, torch and random all take)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**32 - 1, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see: {self.prog} --help)\n")


def fail(command: str, error: object) -> int:
    """Print a user error as one line on stderr (``ampguard CMD: error: ...``); returns 2."""
    text = " ".join(str(error).split()) or type(error).__name__
    print(f"ampguard {command}: error: {text}", file=sys.stderr)
    return 2


def usable_out(out: str) -> None:
    """``ValueError`` unless ``out`` is a folder or can become one (checked before any work)."""
    import os

    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(
            f"--out {out!r} exists and is not a folder; name a folder (it is created if missing)"
        )
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out!r}: {parent!r} is not a folder")
    if not os.path.isdir(out) and not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r}: cannot create a folder in {parent!r} (permission denied)")
