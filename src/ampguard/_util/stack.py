"""Where a warning points: at the user's line that called into ampguard, not at ampguard's own.

A fixed ``stacklevel`` is right for one call path only (the Guard reaches the same warning from
``step()``, from a lazy flag read in ``diagnostics()`` or from ``close()``); :func:`user_stacklevel`
counts the frames instead. Python 3.12's ``skip_file_prefixes`` does the same; this works on 3.10+.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

__all__ = ["user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by the caller of this function that
    names the first frame outside the ampguard package (its innermost caller in user code,
    a test, or a framework). Cost: a walk up the Python stack, host only."""
    frame: FrameType | None = sys._getframe(1)  # the caller of warnings.warn: stacklevel 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level
