"""torchao, imported quietly and only where asked: the one place that says what to install.

torchao (``pip install "ampguard[fp8]"``) is optional; its import logs warnings about CUDA
extensions a CPU machine cannot load, which :func:`quiet_logs` keeps out of the user's console.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["TORCHAO_PIN", "Fp8UnavailableError", "quiet_logs", "require_torchao"]

TORCHAO_PIN = "torchao==0.18.0"
_QUIET = ("torchao", "torch.utils._pytree", "torch._dynamo")


class Fp8UnavailableError(ImportError):
    """torchao (the fp8 training kernels) is not installed or cannot be imported."""


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Keep torchao's import-time log noise (at most ERROR) out of the console."""
    loggers = [logging.getLogger(n) for n in _QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def require_torchao() -> Any:
    """Import and return ``torchao.float8``, or raise :class:`Fp8UnavailableError` saying what
    to install."""
    try:
        with quiet_logs(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8 as float8
    except ImportError as exc:
        raise Fp8UnavailableError(
            f"precision='fp8' needs torchao (fp8 training): pip install \"ampguard[fp8]\" "
            f"(installs {TORCHAO_PIN}); import failed: {exc}"
        ) from exc
    return float8
