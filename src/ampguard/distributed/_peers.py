"""Failing peers: ampguard's own process group with its own timeout, and a roll call that names
the ranks that did not arrive.

ampguard's collectives (the found_inf consensus, the audit, a repair's broadcasts, a distributed
checkpoint's gathers) run on a group of their own, created once per Guard with
``timeout=peer_timeout``, so a rank that crashed or hangs makes them fail after at most
``peer_timeout`` seconds instead of the default group's 30 minutes. Creating that group is bounded
by ``peer_timeout`` too: every rank first checks in under a store key of its own, and a rank that
never arrives (it died, or its own ``Guard()`` raised, before building its group) is named in a
:class:`~ampguard.distributed.PeerFailureError` after ``peer_timeout`` seconds.
``peer_timeout`` left unset defaults to the process group's own timeout when the user set one
(``init_process_group(timeout=...)``), else to 10 minutes (:func:`resolve_peer_timeout`); a
group timeout above one day is kept at the one-day cap, with a ``RuntimeWarning``.
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
import warnings
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ampguard._util.checks import is_number
from ampguard._util.stack import user_stacklevel
from ampguard.distributed._errors import PeerFailureError

__all__ = [
    "DEFAULT_PEER_TIMEOUT",
    "MAX_PEER_TIMEOUT",
    "ROLL_CALL_CAP",
    "check_peer_timeout",
    "resolve_peer_timeout",
    "group_timeout",
    "is_comm_error",
    "Peers",
    "failed_ranks",
]

DEFAULT_PEER_TIMEOUT = 600.0  # seconds; the contract says "at most 10 minutes"
MAX_PEER_TIMEOUT = 86400.0  # one day: the longest peer_timeout (a group's longer one is capped)
_ARRIVE_POLL = 0.05  # seconds between a rank's checks that the others arrived at group creation
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
    if not is_number(value) or not 0 < value <= MAX_PEER_TIMEOUT:
        raise ValueError(
            f"peer_timeout must be a number of seconds > 0 and <= {MAX_PEER_TIMEOUT:g}, "
            f"got {value!r}"
        )
    return float(value)


def is_comm_error(exc: BaseException) -> bool:
    """True for a failed collective (a peer crashed, exited or timed out), not a user error."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS)


def resolve_peer_timeout(value: Any, process_group: Any = None) -> float:
    """``peer_timeout`` as float seconds; ``None``: the group's own timeout when the user set one.

    "Set" means it differs from torch's default for the backend (30 min for gloo, 10 min for
    NCCL): ``init_process_group(timeout=timedelta(seconds=20))`` gives 20 s. Otherwise (no
    group, or torch's default) it is :data:`DEFAULT_PEER_TIMEOUT`. ``ValueError`` naming the
    argument for a bad value. Cost: none (reads the group's options).
    """
    if value is not None:
        return check_peer_timeout(value)
    user = group_timeout(process_group)
    if user is None or not user > 0:
        return DEFAULT_PEER_TIMEOUT
    if user > MAX_PEER_TIMEOUT:  # the user wants long waits: the longest allowed, said so
        warnings.warn(
            f"the process group's timeout ({user:g} s) is above peer_timeout's cap of "
            f"{MAX_PEER_TIMEOUT:g} s (one day): ampguard's collectives time out after "
            f"{MAX_PEER_TIMEOUT:g} s; pass peer_timeout= to choose",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return MAX_PEER_TIMEOUT
    return user


def group_timeout(process_group: Any = None) -> float | None:
    """The timeout (s) the user gave ``process_group`` (default: the default group), or None when
    there is no group or it has torch's default timeout. Reads torch's private backend options,
    so None where they are absent."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    c10d = dist.distributed_c10d
    try:
        group = process_group if process_group is not None else c10d._get_default_group()
        default = c10d._get_default_timeout(dist.get_backend(group)).total_seconds()
        for device in ("cpu", "cuda"):
            try:
                backend = group._get_backend(torch.device(device))
            except Exception:  # noqa: BLE001 - no backend for this device type
                continue
            timeout = getattr(getattr(backend, "options", None), "_timeout", None)
            if timeout is not None:
                seconds = float(timeout.total_seconds())
                return None if seconds == default else seconds
    except Exception:  # noqa: BLE001 - torch privates changed: fall back to the default
        return None
    return None


_GENERATIONS: dict[tuple[int, ...], int] = {}  # groups of these ranks built by this process


def _arrive(ranks: tuple[int, ...], rank: int, timeout: float, store: Any) -> int:
    """Check in for the next group of ``ranks``; wait at most ``timeout`` s for the others.

    Each rank counts the groups of ``ranks`` it built; the n-th of each rank meets the n-th of
    the others under the same store keys. A rank that never arrives raises
    :class:`PeerFailureError` naming it (and the count stays, so a retry meets the same keys).
    Cost: one store write, then store checks every 50 ms until all arrived (at most ``timeout``).
    """
    n = _GENERATIONS.get(ranks, 0) + 1
    prefix = f"ampguard/arrive/{'-'.join(map(str, ranks))}/{n}/"
    store.set(prefix + str(rank), "1")
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in ranks if not store.check([prefix + str(r)])]
        if not missing:
            _GENERATIONS[ranks] = n
            return n
        if time.monotonic() >= deadline:
            raise PeerFailureError(
                f"building the Guard's process group on rank {rank} of {len(ranks)} timed out "
                f"after peer_timeout={timeout:g} s: rank(s) {', '.join(map(str, missing))} "
                "never reached Guard(...) (crashed, exited, raised before building its Guard, "
                "or still busy before it; see their logs). Every rank builds its Guard at about "
                "the same point; raise peer_timeout if one rank legitimately takes longer",
                ranks=missing,
                what="building the Guard's process group",
            )
        time.sleep(_ARRIVE_POLL)


def _own_group(ranks: tuple[int, ...], rank: int, backend_of: Any, timeout: float) -> Any:
    """A group of ``ranks`` whose creation and collectives time out after ``timeout`` seconds.

    The ranks first check in through the rendezvous store (:func:`_arrive`, bounded, naming the
    absent ranks); only then is the group built, with ``timeout`` as its own timeout.
    """
    store = _default_store()
    if store is not None:
        _arrive(ranks, rank, timeout, store)
    return dist.new_group(
        ranks=list(ranks),
        timeout=timedelta(seconds=timeout),
        backend=dist.get_backend(backend_of),
        use_local_synchronization=True,
    )


class Peers:
    """The Guard's own process group (``timeout=peer_timeout``) and the roll call.

    ``group`` has the ranks and backend of the training group. Creating it is a collective of
    those ranks only (every rank builds its Guard in the same order, as with any torch group),
    bounded by ``timeout``: a rank that never arrives is named in a :class:`PeerFailureError`.

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
        self.group = _own_group(ranks, rank, backend_of, timeout)
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
