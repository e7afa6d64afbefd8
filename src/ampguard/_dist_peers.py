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

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["DEFAULT_PEER_TIMEOUT", "ROLL_CALL_CAP", "check_peer_timeout", "is_comm_error",
           "Peers"]

DEFAULT_PEER_TIMEOUT = 600.0  # seconds; the contract says "at most 10 minutes"
_CREATE = 1800.0  # seconds the ranks may take to all build their Guard (torch's gloo default)
ROLL_CALL_CAP = 10.0  # seconds a survivor waits for the others' names, at most

# torch raises gloo's failures as plain RuntimeErrors; these say "communication", not "your code"
_MARKERS = ("gloo", "Connection closed by peer", "Connection reset by peer", "Timed out waiting",
            "NCCL", "ProcessGroup", "monitoredBarrier", "DistBackendError")


def check_peer_timeout(value: Any) -> float:
    """``peer_timeout`` as float seconds; ``ValueError`` naming the argument otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
        raise ValueError(f"peer_timeout must be a number of seconds > 0 and <= 86400, got "
                         f"{value!r}")
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
    group = dist.new_group(ranks=list(ranks), timeout=timedelta(seconds=max(timeout, _CREATE)),
                           backend=dist.get_backend(backend_of), use_local_synchronization=True)
    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timedelta(seconds=timeout), group)
    return group


class Peers:
    """The Guard's own process group (``timeout=peer_timeout``) and the roll call.

    ``group`` has the ranks and backend of the training group. Creating it is a collective of
    those ranks only (every rank builds its Guard in the same order, as with any torch group).
    """

    def __init__(self, ranks: tuple[int, ...], rank: int, backend_of: Any,
                 timeout: float) -> None:
        self.ranks = ranks
        self.rank = rank  # global rank of this process
        self.timeout = timeout
        self.wait = min(timeout, ROLL_CALL_CAP)
        self.group = _own_group(ranks, backend_of, timeout)
        self._name = str(getattr(self.group, "group_name", id(self.group)))
        self._calls = 0

    def roll_call(self) -> list[int] | None:
        """The ranks that did not answer within ``wait`` seconds; None if the store is gone.

        Every survivor of a failure calls this once; the n-th call of each rank meets the n-th
        call of the others under the same store keys. Cost: store round trips, at most ``wait``
        seconds.
        """
        self._calls += 1
        prefix = f"ampguard/rollcall/{self._name}/{self._calls}/"
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(prefix + str(self.rank), "1")
            deadline = time.monotonic() + self.wait
            while True:
                missing = [r for r in self.ranks if not store.check([prefix + str(r)])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store itself is unreachable (its host died)
            return None

    def describe(self, missing: list[int] | None) -> str:
        """The sentence of the error message that names the failed ranks."""
        if missing is None:
            return ("the rendezvous store did not answer either, so the failed rank could not be "
                    "named (under tcp:// or env:// init without torchrun it lives on rank "
                    f"{self.ranks[0]}: that rank probably died)")
        if not missing:
            return ("every rank answered the roll call afterwards: the others stopped waiting "
                    "for THIS rank (it was slower than peer_timeout, e.g. a long pause on this "
                    "rank)")
        return (f"rank(s) {', '.join(map(str, missing))} did not answer within "
                f"{self.wait:g} s (crashed, exited or hung; see their logs)")
