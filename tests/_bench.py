"""Load a script of ``benchmarks/`` as a module for a test (its folder on ``sys.path`` while the
module is in use, so its own ``_helpers`` import)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

__all__ = ["BENCH", "bench_module"]

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """``benchmarks/<name>.py`` loaded as module ``name``; the folder leaves ``sys.path`` after."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
