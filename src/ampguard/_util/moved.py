"""Old import paths that moved: one ``DeprecationWarning`` at import, pointing at the importer.

A shim module calls :func:`warn_moved` once, at its top level; Python imports a module once, so
the warning is given once per process. The warning points at the line that imported the old path
(the frames of ampguard and of the import machinery, ``importlib.import_module`` included,
are skipped), so ``-W error`` and pytest's
warning filters name the user's file.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import FrameType

from ampguard._util.stack import _PACKAGE

__all__ = ["REMOVAL", "warn_moved"]

REMOVAL = "0.5"
"""The release that removes the old paths."""


def warn_moved(old: str, new: str) -> None:
    """Warn that module ``old`` moved to ``new`` and is removed in :data:`REMOVAL`."""
    warnings.warn(
        f"{old} is deprecated and will be removed in ampguard {REMOVAL}: import from {new} "
        "instead (the same objects)",
        DeprecationWarning,
        stacklevel=_importer_stacklevel(),
    )


_IMPORTLIB = importlib.__file__


def _importer_stacklevel() -> int:
    """The ``stacklevel`` that names the first frame outside ampguard and ``importlib``.

    ``warnings.warn`` skips the frozen ``importlib._bootstrap`` frames by itself, so they are
    not counted; ``importlib.import_module``'s own frame is."""
    frame: FrameType | None = sys._getframe(2)  # the shim that called warn_moved (level 2)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name):
            level += 1
            if not (name.startswith(_PACKAGE) or name == _IMPORTLIB):
                break
        frame = frame.f_back
    return level
