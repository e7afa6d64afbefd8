"""``ampguard lint`` as a user runs it: one real subprocess (``python -m ampguard lint ...``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["lint_cli"]


def lint_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``ampguard lint *args`` in ``cwd``; stdout and stderr captured as text, 60 s at most."""
    return subprocess.run(
        [sys.executable, "-m", "ampguard", "lint", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
