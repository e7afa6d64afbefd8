"""The one atomic file writer: a crash at any moment leaves the old file or the new one, whole.

:func:`atomic_write` creates a temporary file beside the target (``os.open`` with mode ``0o666``,
so the umask applies as for ``open(path, "w")``; an existing target's mode is kept), lets a
callback write it (streaming writers such as ``torch.save`` included), flushes and fsyncs it,
renames it over the target with ``os.replace`` and fsyncs the folder (POSIX). On any failure,
``KeyboardInterrupt`` included, the temporary is removed and the exception propagates unchanged.
:func:`write_bytes` and :func:`write_text` are the one-shot forms.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "write_bytes", "write_text", "default_temp_name", "fsync_dir"]

_TRIES = 100


def default_temp_name(target: Path) -> str:
    """``.<name>.<pid>-<hex8>.tmp``: hidden, beside the target, unique per writer."""
    return f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def atomic_write(
    path: str | os.PathLike[str],
    write: Callable[[IO[bytes]], object],
    *,
    temp_name: Callable[[Path], str] = default_temp_name,
) -> None:
    """Call ``write(fileobj)`` on a temporary beside ``path``, fsync, rename it over ``path``.

    ``temp_name(target)`` names the temporary (a name that exists is never reused: up to 100
    names are tried, then ``FileExistsError``). The folder must exist.
    Cost: one fsync of the file and one of the folder.
    """
    target = Path(path)
    folder = target.parent
    tmp, fd = _create_temp(folder, target, temp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            _keep_mode(target, f.fileno())
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    write_bytes(path, text.encode(encoding))


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """fsync a folder, so a rename in it survives power loss (a no-op where not POSIX)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(folder: Path, target: Path, temp_name: Callable[[Path], str]) -> tuple[Path, int]:
    # os.open with 0o666: the kernel applies the umask, as for open(path, "w")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(_TRIES):
        tmp = folder / temp_name(target)
        try:
            return tmp, os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(folder))


def _keep_mode(target: Path, fd: int) -> None:
    """Overwriting keeps the old file's mode, as ``open(path, "w")`` (truncate) does."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return
    if hasattr(os, "fchmod"):  # POSIX
        with contextlib.suppress(OSError):
            os.fchmod(fd, mode)
