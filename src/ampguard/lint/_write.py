"""Writing a fixed file back without ever losing a byte of it (``ampguard lint --fix``).

The new bytes go to a temporary file in the file's own folder, are fsynced, get the file's mode
(and its owner and group, where this user may set them), and replace the file with
``os.replace`` only after a last check that the file is still the one that was read (size,
mtime, inode and a hash of its content): the file is then either fully fixed or unchanged. A
file is never written through a symlink (the link may lead outside the paths given), and a
file with no write permission bit (``chmod 444``) is the user's "do not touch" and is left
alone. Replacing gives the file a new inode: a hard link elsewhere keeps the old content (it is
never written). Each refusal is one short reason; the caller names the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass

__all__ = ["Snapshot", "link_refusal", "refusal", "replace"]


@dataclass(frozen=True)
class Snapshot:
    """What a file was when it was read: compared again just before it is replaced."""

    size: int
    mtime_ns: int
    inode: int
    device: int
    digest: bytes

    @classmethod
    def of(cls, path: str, data: bytes) -> Snapshot:
        """``path``'s metadata now and the hash of ``data`` (the bytes read from it).

        Cost: one ``lstat`` and one hash of the bytes."""
        st = os.lstat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, _digest(data))

    def matches(self, path: str) -> bool:
        """``path`` still holds what was read. Cost: one ``lstat``, one read and hash."""
        try:
            st = os.lstat(path)
            if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) != (
                self.size,
                self.mtime_ns,
                self.inode,
                self.device,
            ):
                return False
            with open(path, "rb") as fh:
                return _digest(fh.read(self.size + 1)) == self.digest
        except OSError:
            return False


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def link_refusal(path: str) -> str | None:
    """The reason a symlink is never written (``None``: ``path`` is no link). Cost: ``lstat``."""
    if not os.path.islink(path):
        return None
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (
        f"a symlink (to {target!r}): --fix never writes through a link, which may lead "
        "outside the paths given; fix its target by its own path"
    )


def refusal(path: str) -> str | None:
    """Why ``path`` must not be written (``None``: it may be). Cost: one ``lstat``."""
    link = link_refusal(path)
    if link is not None:
        return link
    try:
        st = os.lstat(path)
    except OSError as err:
        return err.strerror or str(err)
    if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return f"the file is read-only (mode {stat.S_IMODE(st.st_mode):04o})"
    folder = os.path.dirname(path) or os.curdir
    with contextlib.suppress(OSError, AttributeError):
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "Read-only file system"
    if not os.access(path, os.W_OK):
        return "the file is not writable by this user"
    return None


def replace(path: str, data: bytes, snapshot: Snapshot) -> str | None:
    """Write ``data`` to ``path`` (temporary + fsync + ``os.replace``); ``None`` when done, else
    the reason it was not (the file is then unchanged and no temporary is left).

    Cost: one write and fsync of the file, one read and hash of the current file, a rename.
    """
    reason = refusal(path)
    if reason is not None:
        return reason
    if not snapshot.matches(path):
        return _CHANGED
    folder = os.path.dirname(path) or os.curdir
    st = os.lstat(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    except OSError as err:
        return f"cannot create a temporary file beside it: {err.strerror or err}"
    try:
        try:
            _write_all(fd, data)
            _keep_owner(fd, st)
            _keep_mode(fd, tmp, st)
            os.fsync(fd)
        finally:
            os.close(fd)
        if not snapshot.matches(path):
            os.unlink(tmp)
            return _CHANGED
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return err.strerror or str(err)
    _sync_folder(folder)
    return None


_CHANGED = "it changed while --fix ran (saved by another program?); run --fix again"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _keep_owner(fd: int, st: os.stat_result) -> None:
    """The file's owner and group on the new file, as far as this user may set them (nothing
    where the OS has no ``fchown``)."""
    fchown = getattr(os, "fchown", None)
    if fchown is None:
        return
    for uid in (st.st_uid, -1):
        try:
            fchown(fd, uid, st.st_gid)
            return
        except OSError:
            continue


def _keep_mode(fd: int, tmp: str, st: os.stat_result) -> None:
    """The file's permission bits on the new file (after the owner: a chown clears setuid)."""
    mode = stat.S_IMODE(st.st_mode)
    fchmod = getattr(os, "fchmod", None)
    if fchmod is not None:
        fchmod(fd, mode)
    else:  # pragma: no cover - Windows before Python 3.13
        os.chmod(tmp, mode)


def _sync_folder(folder: str) -> None:
    """fsync the folder so the rename itself is durable (best effort: not every OS allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
