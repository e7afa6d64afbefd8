"""Checkpoint files on disk: the atomic write, stale temporaries, file mode, and integrity.

- :func:`atomic_write` writes a temporary file beside the target (created with mode ``0o666``,
  so the umask applies exactly as for ``torch.save``; an existing target's mode is kept), fsyncs
  it and renames it over the target. Before it writes, it removes the temporaries that earlier
  *killed* saves of the same target left behind (only names of its own pattern, see
  :func:`stale_temporaries`).
- :func:`verify_zip` checks the CRC-32 of every member of a ``torch.save`` zip file (torch's own
  reader does not), so a flipped bit in any byte torch will read is a :class:`CheckpointError`
  naming the file and the member. It covers checkpoints written by every ampguard version.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ampguard._util import atomic as _atomic
from ampguard._util.stack import user_stacklevel

__all__ = ["CheckpointError", "atomic_write", "stale_temporaries", "verify_zip", "temp_name"]

# a temporary of another host may belong to a live writer there; after this long without a write
# it cannot (a save writes continuously), so it is stale
_FOREIGN_STALE_S = 3600.0
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the reason."""


CheckpointError.__module__ = "ampguard.checkpoint"  # its public home (re-exported there)


# ---------------------------------------------------------------------- writing
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"


def temp_name(target: Path) -> str:
    """``.<name>.<host>-<pid>-<hex8>.tmp``: who wrote it, so a later save can tell it is stale."""
    return f".{target.name}.{_host()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _temp_pattern(target: Path) -> re.Pattern[str]:
    # the optional group absent: ampguard 0.1's tempfile.mkstemp names (8 chars of [a-z0-9_])
    return re.compile(
        rf"\.{re.escape(target.name)}\."
        r"(?:(?P<host>[A-Za-z0-9_]+)-(?P<pid>[0-9]+)-[0-9a-f]{8}|[a-z0-9_]{8})\.tmp"
    )


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another thread of this process may be saving right now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def stale_temporaries(target: Path) -> list[Path]:
    """Temporaries of earlier saves of ``target`` whose writer is gone.

    Only names matching this module's own pattern for ``target``:
    ``.<name>.<host>-<pid>-<hex8>.tmp`` (stale when ``<host>`` is this host and process ``<pid>``
    no longer exists, or when another host's file was not written for an hour) and ampguard
    0.1's ``.<name>.<8 chars>.tmp`` (always stale: 0.1 wrote no owner). Never anything else.
    """
    folder = target.parent
    pattern, host, now = _temp_pattern(target), _host(), time.time()
    stale = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        path = folder / name
        try:
            st = path.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if m["pid"] is None:
            stale.append(path)
        elif m["host"] == host:
            if not _alive(int(m["pid"])):
                stale.append(path)
        elif now - st.st_mtime > _FOREIGN_STALE_S:
            stale.append(path)
    return stale


def atomic_write(target: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(fileobj)`` on a temp file beside ``target``, fsync, then rename over it.

    A crash at any moment leaves the previous ``target`` intact; stale temporaries of earlier
    killed saves of ``target`` are removed first. The new file's mode follows the umask (like
    ``torch.save``), or stays that of the file it replaces. Any failure, including an OS error
    (the cause is chained), is a :class:`CheckpointError` naming ``target``. The writing itself
    is :func:`ampguard._util.atomic.atomic_write` with this module's temporary names.
    """
    target = Path(target)
    out: _Recording | None = None

    def recorded(f: IO[bytes]) -> None:
        nonlocal out
        out = _Recording(f)
        write(out)  # type: ignore[arg-type]

    try:
        _make_folder(target.parent, target)
        for old in stale_temporaries(target):
            with contextlib.suppress(OSError):
                old.unlink()
        _atomic.atomic_write(target, recorded, temp_name=temp_name)
    except BaseException as exc:
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            raise
        # torch.save may wrap the OS error of a failed write in its own RuntimeError
        cause = out.error if out is not None and out.error is not None else exc
        raise CheckpointError(f"{target}: could not be written: {_describe(cause)}") from cause


class _Recording:
    """The temp file as ``torch.save`` sees it; keeps the OS error of a failed write."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


def _make_folder(folder: Path, target: Path) -> None:
    if target.is_dir():
        raise CheckpointError(f"{target}: could not be written: it is a folder")
    try:
        mode = target.lstat().st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        # renaming over a device or a pipe would replace it (think /dev/null as root)
        raise CheckpointError(
            f"{target}: could not be written: it exists and is not a regular "
            "file (a device, pipe or socket); it was left as it is"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:  # the folder, or one above it, is a file
        blocker = next(
            (p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder
        )
        raise CheckpointError(
            f"{target}: could not be written: {blocker} exists and is not a folder"
        ) from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror} [errno {exc.errno}]{where}"
    return str(exc) or type(exc).__name__


# ---------------------------------------------------------------------- integrity
def is_zip(path: Path) -> bool:
    """Whether ``path`` starts like a zip file (``torch.save``'s format since torch 1.6)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def verify_zip(path: Path) -> int:
    """Check the CRC-32 of every member of the zip file ``path``; return the bytes checked.

    Raises :class:`CheckpointError` naming ``path`` and the damaged member. Members written
    without a CRC-32 (``torch.serialization.set_crc32_options(False)``) load with a warning.
    Cost: one read of the file (from the page cache, usually) and a CRC-32 over it.
    """
    checked, unverified = 0, []
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.CRC == 0 and info.file_size > 0:  # written with CRC-32s switched off
                    unverified.append(info.filename)
                    continue
                checked += _check_member(zf, info, path)
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{path}: could not be read: {_describe(exc)}") from exc
    except Exception as exc:  # BadZipFile, EOFError, struct/zlib errors: the zip structure
        raise CheckpointError(
            f"{path}: corrupt or truncated file: its zip structure is broken ({_first_line(exc)})"
        ) from exc
    if unverified:
        warnings.warn(
            f"{path}: {len(unverified)} member(s) carry no CRC-32 (the file was written "
            "with torch.serialization.set_crc32_options(False)) and load unverified: "
            f"{', '.join(unverified[:3])}",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
    return checked


def _check_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> int:
    try:
        with zf.open(info) as member:  # ZipExtFile checks the CRC-32 when it reaches the end
            n = 0
            while chunk := member.read(_CHUNK):
                n += len(chunk)
    except OSError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{path}: corrupt file: member {info.filename!r} fails its CRC-32 "
            f"integrity check ({_first_line(exc)}); the file changed after "
            "it was written (disk, copy or transfer error)"
        ) from exc
    return n


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]
