"""Failing peers: ampguard's own process group with its own timeout, and a roll call that names
the ranks that did not arrive.

ampguard's collectives (the found_inf consensus, the audit, a repair's broadcasts) run on a group
of their own, created once per Guard with ``timeout=peer_timeout``, so a rank that crashed or hangs
makes them fail after at most ``peer_timeout`` seconds instead of the default group's 30 minutes.
A communication error raised anywhere in the Guard's step (also from DDP's or FSDP2's own
collectives in ``Guard.autocast()`` / ``Guard.backward()``) becomes a
:class:`~ampguard.distributed.PeerFailureError`; before raising, every surviving rank writes its
name into the rendezvous store and waits a short while for the others: those that never answer
are the failed ranks, named in the error on every survivor.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ampguard._util.checks import is_number

__all__ = [
    "DEFAULT_PEER_TIMEOUT",
    "ROLL_CALL_CAP",
    "check_peer_timeout",
    "is_comm_error",
    "Peers",
    "failed_ranks",
]

DEFAULT_PEER_TIMEOUT = 600.0  # seconds; the contract says "at most 10 minutes"
_CREATE = 1800.0  # seconds the ranks may take to all build their Guard (torch's gloo default)
ROLL_CALL_CAP = 10.0  # seconds a survivor waits for the others' names, at most
_POLL = 1.0  # seconds between a responder thread's checks of the store

# torch raises gloo's failures as plain RuntimeErrors; these say "communication", not "your code"
_MARKERS = (
    "gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "NCCL",
    "ProcessGroup",
    "monitoredBarrier",
    "DistBackendError",
)


def check_peer_timeout(value: Any) -> float:
    """``peer_timeout`` as float seconds; ``ValueError`` naming the argument otherwise."""
    if not is_number(value) or not 0 < value <= 86400:
        raise ValueError(
            f"peer_timeout must be a number of seconds > 0 and <= 86400, got {value!r}"
        )
    return float(value)


def is_comm_error(exc: BaseException) -> bool:
    """True for a failed collective (a peer crashed, exited or timed out), not a user error."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS)


def _own_group(ranks: tuple[int, ...], backend_of: Any, timeout: float) -> Any:
    """A group of ``ranks`` whose collectives time out after ``timeout`` seconds.

    Created with a generous timeout (ranks build their Guards at different moments, e.g. one
    still loading data), then set to ``timeout`` for the collectives.
    """
    c10d = dist.distributed_c10d
    group = dist.new_group(
        ranks=list(ranks),
        timeout=timedelta(seconds=max(timeout, _CREATE)),
        backend=dist.get_backend(backend_of),
        use_local_synchronization=True,
    )
    setter = getattr(c10d, "_set_pg_timeout", None)  # torch private, absent on old versions
    if setter is not None:
        setter(timedelta(seconds=timeout), group)
    return group


class Peers:
    """The Guard's own process group (``timeout=peer_timeout``) and the roll call.

    ``group`` has the ranks and backend of the training group. Creating it is a collective of
    those ranks only (every rank builds its Guard in the same order, as with any torch group).

    A rank blocked inside a collective that another survivor already gave up on cannot answer a
    roll call itself (gloo leaves it waiting until its own timeout), so with 3 or more ranks a
    daemon thread answers for it while the main thread is inside :meth:`waiting`: such a rank is
    reported as waiting, not as failed. Cost: one thread that checks one store key every
    second (no host sync, nothing on the training thread).
    """

    def __init__(self, ranks: tuple[int, ...], rank: int, backend_of: Any, timeout: float) -> None:
        self.ranks = ranks
        self.rank = rank  # global rank of this process
        self.timeout = timeout
        # long enough for the responder threads' poll, short enough to stay a bounded wait
        self.wait = min(max(timeout, 3 * _POLL), ROLL_CALL_CAP)
        self.group = _own_group(ranks, backend_of, timeout)
        self._prefix = f"ampguard/rollcall/{getattr(self.group, 'group_name', '')}/"
        self._calls = 0
        self.waiting_in: str | None = None  # set while the main thread waits in a collective
        self._store = _default_store()
        # with 2 ranks nobody can be left blocked by a third; the thread polls, so it never sits
        # in a blocking store call when the interpreter exits
        if len(ranks) > 2 and self._store is not None and hasattr(self._store, "clone"):
            thread = threading.Thread(
                target=_respond,
                args=(weakref.ref(self), self._prefix, self._store.clone(), rank),
                daemon=True,
                name=f"ampguard-rollcall-{rank}",
            )
            thread.start()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Mark the block as "waiting in a collective" for the roll call. Cost: none."""
        outer, self.waiting_in = self.waiting_in, what
        try:
            yield
        finally:
            self.waiting_in = outer

    def roll_call(self) -> dict[int, str | None] | None:
        """Every rank's answer (None: no answer within ``wait`` s); None if the store is gone.

        Every survivor of a failure calls this once; the n-th call of each rank meets the n-th
        call of the others (and their responder threads) under the same store keys.
        Cost: store round trips, at most ``wait`` seconds.
        """
        self.waiting_in = None  # this rank is not waiting any more: it reports
        self._calls += 1
        prefix = f"{self._prefix}{self._calls}/"
        store = self._store
        if store is None:
            return None
        try:
            store.set(prefix + str(self.rank), "failed")
            store.set(prefix + "open", "1")  # wakes the responders
            deadline = time.monotonic() + self.wait
            while True:
                answered = [r for r in self.ranks if store.check([prefix + str(r)])]
                if len(answered) == len(self.ranks) or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            return {
                r: (store.get(prefix + str(r)).decode() if r in answered else None)
                for r in self.ranks
            }
        except Exception:  # noqa: BLE001 - the store itself is unreachable (its host died)
            return None

    def describe(self, answers: dict[int, str | None] | None) -> str:
        """The sentences of the error message that name the failed ranks."""
        if answers is None:
            return (
                "the rendezvous store did not answer either, so the failed rank could not be "
                "named (under tcp:// or env:// init without torchrun it lives on rank "
                f"{self.ranks[0]}: that rank probably died)"
            )
        missing = failed_ranks(answers)
        if not missing:
            return (
                "every rank answered the roll call: the others stopped waiting for THIS "
                "rank (it was slower than peer_timeout, e.g. a long pause on this rank)"
            )
        text = (
            f"rank(s) {', '.join(map(str, missing))} did not answer within {self.wait:g} s "
            "(crashed, exited, or hung outside ampguard's collectives; see their logs)"
        )
        blocked = {
            r: a[len("waiting in ") :]
            for r, a in answers.items()
            if a is not None and a.startswith("waiting in ")
        }
        if blocked:
            text += "; still blocked in the failed collective: " + ", ".join(
                f"rank {r} ({what})" for r, what in sorted(blocked.items())
            )
        return text


def failed_ranks(answers: dict[int, str | None] | None) -> list[int]:
    """The ranks that did not answer the roll call (none known when the store is gone)."""
    return [] if answers is None else sorted(r for r, a in answers.items() if a is None)


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()  # torch private: no public getter
    except Exception:  # noqa: BLE001 - no default group (a group without a store)
        return None


def _respond(peers: weakref.ref, prefix: str, store: Any, rank: int) -> None:
    """Answer roll call n for this rank while its main thread waits in a collective."""
    n = 1
    while not _EXITING:
        time.sleep(_POLL)
        try:
            if peers() is None:
                return  # the Guard is gone
            if not store.check([f"{prefix}{n}/open"]):
                continue
            deadline = time.monotonic() + ROLL_CALL_CAP
            while time.monotonic() < deadline and not _EXITING:
                owner = peers()
                what = None if owner is None else owner.waiting_in
                del owner
                if what is not None:
                    store.set(f"{prefix}{n}/{rank}", f"waiting in {what}")
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone: nobody will call the roll
            return
        n += 1


def _stop_responders() -> None:
    global _EXITING
    _EXITING = True


_EXITING = False
atexit.register(_stop_responders)
