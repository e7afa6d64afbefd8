"""A griffe extension for the docs build: doctest blocks (``>>>`` lines and their output) in
ampguard's docstrings become fenced Python code, so Markdown neither quotes them nor reads
``['AG310']`` as a link. The docstrings themselves stay plain (``help()`` shows them as written).
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Wrap each run of ``>>>``/``...`` lines plus the output lines after it in a code fence."""
    out: list[str] = []
    block = False
    for line in text.splitlines():
        stripped = line.strip()
        starts = stripped.startswith((">>>", "... ")) or stripped == "..."
        if starts and not block:
            out.append("```python")
            block = True
        elif block and not starts and not stripped:
            out.append("```")
            block = False
        out.append(line)
    if block:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctest blocks of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
