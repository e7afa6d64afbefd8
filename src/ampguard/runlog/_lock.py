"""One run folder, one writer: the lock file ``RUN_DIR/.ampguard.lock``.

A writer (:class:`ampguard.Telemetry` attached to a Guard or a watched loop) takes the lock when
it opens the folder and releases it on ``close()``. The file holds the holder's pid, host and
start time (JSON), for the message a second writer gets. It is opened with ``O_NOFOLLOW``: a
symlink at its name is refused with an error naming it (never truncating the link's target, nor
creating a file outside the run folder through a dangling link). The lock itself is an exclusive
``flock`` on the file where the OS has it (POSIX): the kernel drops it when the holder dies, so a
lock file left by a dead process (a crash, ``SIGKILL``) is taken over, as stale checkpoint
temporaries are. Where there is no ``flock`` the file is created exclusively and a lock naming a
pid that no longer runs on this host is taken over.

A second writer, another Guard in the same process or another process, gets a
:class:`~ampguard.runlog.TelemetryError` naming the folder and the holder. A Guard that was
dropped without ``close()`` holds the lock until it is garbage collected: a conflict inside one
process runs the garbage collector once before giving up. This module imports no torch.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import stat
import time
import weakref
from pathlib import Path
from typing import Any

from ampguard.runlog._errors import TelemetryError

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK", "RunFolderLock", "holder_of"]

LOCK = ".ampguard.lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_HELD: dict[str, weakref.ref[RunFolderLock]] = {}  # real folder path -> lock held in this process


def holder_of(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """What the lock file of ``run_dir`` says about its holder (``pid``, ``host``, ``since``),
    or None when there is none or it cannot be read. Cost: one small read."""
    try:
        fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as fh:
            data = json.loads(fh.read(4096) or b"null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RunFolderLock:
    """The writer's hold on a run folder (see the module docstring); :meth:`release` is
    idempotent and also runs when the object is garbage collected."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self._key = os.path.realpath(self.run_dir)
        try:
            self._fd = self._acquire()
        except TelemetryError:
            gc.collect()  # a dropped, unclosed writer of this process may still hold it
            self._fd = self._acquire()
        _HELD[self._key] = weakref.ref(self)
        self._finalizer = weakref.finalize(self, _release_fd, self._fd, self.path, os.getpid())

    def _acquire(self) -> int:
        other = _HELD.get(self._key)
        if other is not None and other() is not None:
            raise self._busy(holder_of(self.run_dir), in_process=True)
        for _ in range(10):  # a holder releasing (unlinking) between our open and flock: retry
            fd = self._open()
            if self._lock(fd):
                _write_holder(fd, self.path)
                return fd
            os.close(fd)
        raise self._busy(holder_of(self.run_dir), in_process=False)

    def _open(self) -> int:
        # O_NOFOLLOW: a symlink at the lock's name is refused, never followed (it would
        # truncate its target, or create a file outside the run folder when dangling)
        flags = os.O_RDWR | os.O_CREAT | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        if fcntl is None:
            flags |= os.O_EXCL
            self._drop_stale()
        self._refuse_link()
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            raise self._busy(holder_of(self.run_dir), in_process=False) from None
        except OSError as exc:
            self._refuse_link()  # ELOOP: a link made between the check and the open
            raise TelemetryError(
                f"run folder {self.run_dir} is not writable: cannot create its lock file "
                f"{self.path.name}: {exc.strerror or exc}",
                str(self.run_dir),
            ) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise TelemetryError(
                f"run folder {self.run_dir}: its lock file {self.path.name} is not a regular "
                "file; remove it",
                str(self.run_dir),
            )
        return fd

    def _refuse_link(self) -> None:
        if not os.path.islink(self.path):
            return
        try:
            target = os.readlink(self.path)
        except OSError:
            target = "?"
        raise TelemetryError(
            f"run folder {self.run_dir}: its lock file {self.path} is a symlink (to {target!r}); "
            "ampguard never follows it (it would overwrite or create a file outside the run "
            "folder). Remove the link.",
            str(self.run_dir),
        )

    def _lock(self, fd: int) -> bool:
        """True when ``fd`` now holds the lock on the file that is at :attr:`path`."""
        if fcntl is None:
            return True  # created with O_EXCL
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:  # the holder may have unlinked the file we opened before releasing it
            return os.fstat(fd).st_ino == os.lstat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _drop_stale(self) -> None:
        """Without flock: remove a lock file whose pid no longer runs on this host."""
        holder = holder_of(self.run_dir)
        if holder is None or holder.get("host") != socket.gethostname():
            return
        pid = holder.get("pid")
        if isinstance(pid, int) and not _alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _busy(self, holder: dict[str, Any] | None, *, in_process: bool) -> TelemetryError:
        if in_process:
            who = f"another Guard (or ag.watch) in this process (pid {os.getpid()})"
        elif holder:
            who = f"pid {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')})"
        else:
            who = "another process"
        return TelemetryError(
            f"run folder {self.run_dir} is being written by {who}: a run folder has one writer "
            f"at a time (lock file {self.path.name}). Give this run its own folder, or close() "
            "the other Guard first.",
            str(self.run_dir),
        )

    @property
    def held(self) -> bool:
        """True until :meth:`release`."""
        return self._finalizer.alive

    def release(self) -> None:
        """Remove the lock file and drop the lock. Idempotent; never raises."""
        if self._finalizer.alive:
            ref = _HELD.get(self._key)
            if ref is not None and ref() is self:
                del _HELD[self._key]
            self._finalizer()


def _write_holder(fd: int, path: Path) -> None:
    data = json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    ).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:  # a full disk: the lock holds all the same, only the message is poorer
        pass


def _release_fd(fd: int, path: Path, owner: int) -> None:
    # unlink while still holding the lock, so nobody takes a lock on a file about to vanish
    # (a waiter that opened it re-checks the inode, see RunFolderLock._lock); a forked child
    # exiting (it shares the lock) never removes its parent's lock file
    if os.getpid() == owner:
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
