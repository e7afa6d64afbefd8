"""Command-line front end: argument parsing and dispatch only, no logic of its own.

Heavy modules (torch, matplotlib) are imported inside the handlers, so ``ampguard lint`` starts
without importing torch.
"""

from ampguard.cli._main import build_parser, main

__all__ = ["main", "build_parser"]
