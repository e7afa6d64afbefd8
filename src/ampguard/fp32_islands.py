"""Old import path of :mod:`ampguard.forensics.islands`, kept because the README documented it."""

from ampguard.forensics.islands import *  # noqa: F403
from ampguard.forensics.islands import __all__ as __all__
