"""When a periodic check runs: early windows geometrically, then every ``every`` windows.

A check that runs only every ``every`` windows misses a failure present from the first step
for ``every`` steps, and a short run never sees it. :func:`early_or_every` is also due on the
windows 1, 2, 4, 8, ... below ``every``: about ``log2(every)`` extra runs of the check in all.
"""

from __future__ import annotations

__all__ = ["early_or_every", "early_windows"]


def early_or_every(step: int, every: int) -> bool:
    """True for window ``step`` (1-based) when it is a power of two below ``every`` or a
    multiple of ``every``; never when ``every`` is 0 (the check is off)."""
    if every <= 0 or step < 1:
        return False
    return step % every == 0 or (step < every and step & (step - 1) == 0)


def early_windows(every: int) -> int:
    """How many early (power-of-two) windows lie below ``every``."""
    return (every - 1).bit_length() if every > 1 else 0
