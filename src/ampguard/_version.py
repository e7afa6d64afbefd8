"""The package's version: the ground floor, imported by the facade and by any subpackage that
writes the version (a run folder's metadata, the lint SARIF, ``ampguard --version``).

It imports nothing, so no subpackage needs the top package ``ampguard`` to read it.
"""

__all__ = ["__version__"]

__version__ = "0.4.0"
