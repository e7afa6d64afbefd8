"""Deprecated old import path of :mod:`ampguard.forensics.islands` (removed in 0.5).

Importing it warns once with a ``DeprecationWarning``; the names are the same objects as in
:mod:`ampguard.forensics.islands`.
"""

from ampguard._util.moved import warn_moved
from ampguard.forensics.islands import *  # noqa: F403
from ampguard.forensics.islands import __all__ as __all__

warn_moved("ampguard.fp32_islands", "ampguard.forensics.islands")
