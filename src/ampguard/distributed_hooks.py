"""Old import path of :mod:`ampguard.distributed.hooks`, kept because the README documented it."""

from ampguard.distributed.hooks import *  # noqa: F403
from ampguard.distributed.hooks import __all__ as __all__
