"""Deprecated old import path of :mod:`ampguard.distributed.hooks` (removed in 0.5).

Importing it warns once with a ``DeprecationWarning``; the names are the same objects as in
:mod:`ampguard.distributed.hooks`.
"""

from ampguard._util.moved import warn_moved
from ampguard.distributed.hooks import *  # noqa: F403
from ampguard.distributed.hooks import __all__ as __all__

warn_moved("ampguard.distributed_hooks", "ampguard.distributed.hooks")
