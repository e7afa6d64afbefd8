"""What a Guard keeps under torch.distributed: the consensus, the audit and the rank counters.

The package docstring (:mod:`ampguard.distributed`) describes the protocol; this module is the
:class:`DistributedState` that runs it for one Guard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ampguard.distributed._counters import RankCounters
from ampguard.distributed._errors import PeerFailureError
from ampguard.distributed._peers import Peers, failed_ranks, is_comm_error
from ampguard.distributed._topology import (
    Topology,
    consensus_redundant,
    fsdp_modules,
    has_dtensors,
)
from ampguard.distributed.hooks import hook_state
from ampguard.findings import Finding, make

__all__ = ["DistributedState"]


class _Pending:
    """An in-flight consensus all-reduce; :meth:`wait` returns the agreed flags."""

    __slots__ = ("state", "buf", "work", "n", "has_dropped", "step")

    def __init__(
        self,
        state: DistributedState,
        buf: torch.Tensor,
        work: Any,
        n: int,
        has_dropped: bool,
        step: int,
    ) -> None:
        self.state, self.buf, self.work, self.n = state, buf, work, n
        self.has_dropped, self.step = has_dropped, step

    def wait(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Agreed ``(found flags, dropped micro-batches or None)``. Cost: no host sync."""
        with self.state.collectives("the found_inf consensus", self.step):
            self.work.wait()
        return self.state.settle(self.buf, self.n, self.has_dropped, self.step)


class DistributedState:
    """What a Guard keeps for distributed training: topology, consensus, audit, counters.

    Counters live on the device (:class:`~ampguard.distributed._counters.RankCounters`):
    ``rank_overflows`` (windows in which each rank's own gradients were non-finite),
    ``rank_dropped`` (micro-batches each rank dropped), ``last_rows`` (the last consensus
    window's per-rank rows: the overflow origin), the first window each rank overflowed in.
    Read them with :meth:`summary` (one sync).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        topology: Topology,
        device: torch.device,
        audit_every: int | None,
        on_desync: str,
        *,
        peers: Peers | None = None,
        containment: bool = False,
        params: Sequence[torch.Tensor] = (),
    ) -> None:
        self.topology = topology
        self.peers = peers
        # ampguard's own collectives: on the group with timeout=peer_timeout when there is one
        self.group = peers.group if peers is not None else topology.group
        self._redundant = consensus_redundant(model, topology, containment, params)
        self.origin_audit_step: int | None = None  # last audit that gathered the local origin
        self.model = model
        self.audit_every = audit_every
        self.on_desync = on_desync
        self.device = device
        self._fsdp = fsdp_modules(model) if topology.kind == "fsdp2" else []
        self._dtensors = has_dtensors(model)
        self._sync_flag: bool | None = None
        self.counters = RankCounters(topology.world_size, topology.rank, device)  # origin
        self.last_rows: torch.Tensor | None = None
        self.audits = 0
        # the audits that found replicas apart: {"step", "ranks", "fields"} (ampguard.triage
        # replays each such step: an audit mismatch is a failed step)
        self.mismatches: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ accumulation
    def grad_sync_context(
        self, final: bool, containment: bool
    ) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on non-final micro-batches. Cost: no host sync.

        With micro-batch containment every micro-batch is synchronised, so each rank drops the
        same (all-reduced) non-finite micro-batch.
        """
        sync = final or containment
        kind = self.topology.kind
        if kind == "ddp" and not sync:
            return self.model.no_sync()  # type: ignore[operator]  # kind "ddp": a DDP model
        if kind == "fsdp2" and sync is not self._sync_flag:
            for m in self._fsdp:
                m.set_requires_gradient_sync(sync, recurse=False)  # type: ignore[operator]
            self._sync_flag = sync
        return contextlib.nullcontext()

    def local_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """DTensor gradients -> their local shards, so the overflow check is rank-local.

        (DTensor's own check would all-reduce once per call; the consensus does it once.)
        """
        if not self._dtensors:
            return grads
        from torch.distributed.tensor import DTensor

        # torch private (DTensor._local_tensor): the shard itself, no copy; to_local() is the
        # public spelling but goes through autograd
        return [g._local_tensor if isinstance(g, DTensor) else g for g in grads]

    def plain_tensor(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A DTensor (FSDP2's replicated grad norm) as a plain tensor. Cost: no host sync."""
        if not self._dtensors:
            return t
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) else t

    # ------------------------------------------------------------------ consensus
    @property
    def consensus_needed(self) -> bool:
        """False under plain DDP, where every rank's own found_inf provably agrees.

        A comm hook registered on the DDP model (any: it may change the reduction) brings the
        consensus back, checked every window (hooks may be registered after the Guard).
        """
        # torch private: DDP keeps its registered comm hooks in ``_comm_hooks`` (no public query)
        return not self._redundant or bool(getattr(self.model, "_comm_hooks", None))

    def note_loss(self, loss: torch.Tensor) -> None:
        """Without consensus: remember whether this rank's own loss was finite (the overflow
        origin a plain all-reduce hides). Cost: one tiny device op; no host sync."""
        if not self.consensus_needed:
            self.counters.note_loss(loss)

    def start_consensus(
        self, found: list[torch.Tensor], dropped: torch.Tensor | None, step: int
    ) -> _Pending | None:
        """Issue the one all-reduce(MAX) of this window's flags; returns the pending result.

        None where the consensus is redundant (plain DDP, :attr:`consensus_needed`): the local
        flags are the agreed ones. Cost: one collective of ``world * (n + 1)`` floats,
        asynchronous; no host sync (none at all without consensus).
        """
        if not self.consensus_needed:
            self.counters.end_window(step)
            return None
        n = len(found)
        top = self.topology
        buf = torch.zeros(top.world_size, n + 1, dtype=torch.float32, device=self.device)
        torch.stack(found, out=buf[top.rank, :n])
        if dropped is not None:
            buf[top.rank, n].copy_(dropped)
        try:
            work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise self.peer_failure("the found_inf consensus", step, exc) from exc
        return _Pending(self, buf, work, n, dropped is not None, step)

    def settle(
        self, buf: torch.Tensor, n: int, has_dropped: bool, step: int
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Agreed ``(found flags, dropped micro-batches or None)`` from a finished consensus
        all-reduce ``buf`` (``world x (n + 1)``); records every rank's row in the per-rank
        counters. Called by the pending consensus once its all-reduce is done. Cost: no host
        sync."""
        self.last_rows = buf
        self.counters.add_rows(buf, step)
        # column maxima: overflow anywhere -> every rank skips. With containment, DDP syncs
        # every micro-batch, so all ranks drop the same ones: the window's count is the largest
        # per-rank count (per-rank counts stay in rank_dropped)
        agreed = buf.amax(dim=0)
        return list(agreed[:n].unbind()), (agreed[n].long() if has_dropped else None)

    def origin_columns(self) -> torch.Tensor:
        """This rank's own (overflows, first overflow, dropped) for the audit to gather."""
        return self.counters.columns()

    def adopt_origin(self, table: torch.Tensor, step: int) -> None:
        """Take every rank's counters from an audit (only where no consensus shares them)."""
        if self._redundant:
            self.counters.adopt(table)
            self.origin_audit_step = step

    @property
    def rank_overflows(self) -> torch.Tensor:
        """Per rank: windows in which its own gradients were non-finite (device int64)."""
        return self.counters.overflows

    @property
    def rank_dropped(self) -> torch.Tensor:
        """Per rank: micro-batches it dropped under containment (device int64)."""
        return self.counters.dropped

    def peer_failure(self, what: str, step: int, exc: BaseException) -> PeerFailureError:
        """The :class:`PeerFailureError` for a failed collective, after the roll call.

        Cost: store round trips; up to ``min(peer_timeout, 10 s)`` waiting for the other
        survivors' names.
        """
        top = self.topology
        answers = self.peers.roll_call() if self.peers is not None else None
        who = (
            self.peers.describe(answers)
            if self.peers is not None
            else "another rank probably crashed, exited or stopped calling Guard.step()"
        )
        return PeerFailureError(
            f"{what} at step {step} failed on rank {top.global_rank} of {top.world_size} "
            f"({top.kind}): {who}. Cause: {exc}",
            ranks=failed_ranks(answers),
            step=step,
            what=what,
        )

    @contextlib.contextmanager
    def collectives(self, what: str, step: int) -> Iterator[None]:
        """Turn a failed collective inside the block (DDP's, FSDP2's, ampguard's) into a
        :class:`PeerFailureError`; any other exception passes through unchanged. While inside,
        a roll call started by another rank hears that this rank is alive and waiting."""
        waiting = self.peers.waiting(what) if self.peers is not None else contextlib.nullcontext()
        try:
            with waiting:
                yield
        except PeerFailureError:
            raise
        except Exception as exc:
            if not is_comm_error(exc):
                raise
            raise self.peer_failure(what, step, exc) from exc

    # ------------------------------------------------------------------ audit
    def maybe_audit(self, guard: Any) -> None:
        """Run :meth:`audit` when ``guard.steps`` is a multiple of ``audit_every``.

        Cost: nothing on other steps; an audit's host sync and all-reduce when it runs.
        """
        if self.audit_every and guard.steps % self.audit_every == 0:
            self.audit(guard)

    def audit(self, guard: Any, reason: str = "scheduled") -> dict[str, dict[int, Any]]:
        """Compare the Guard's state across ranks; act on a mismatch per ``on_desync``.

        Returns the differences (field -> {global rank: value}; empty when in sync).
        Cost: one host sync and one all-reduce of ``world * 11`` int64 (8 compared fields and
        3 overflow-origin counters), on the Guard's own group (bounded by ``peer_timeout``).
        """
        from ampguard.distributed._audit import run_audit

        return run_audit(self, guard, reason)

    def replicated_params(self) -> list[torch.Tensor]:
        """Parameters that must be identical on every rank (empty under FSDP2)."""
        if not self.topology.replicated:
            return []
        model = self.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
            return [p for name, p in model.module.named_parameters() if name not in ignored]
        return list(model.parameters())

    # ------------------------------------------------------------------ telemetry
    @property
    def is_writer(self) -> bool:
        """True on the rank that writes run logs (global rank 0 of the group)."""
        return self.topology.rank == 0

    def summary(self) -> dict[str, Any]:
        """Rank-aware counters as plain values. Cost: one host sync."""
        top = self.topology
        over, dropped, first = torch.stack(
            [self.rank_overflows, self.rank_dropped, self.counters.first_overflow]
        ).tolist()
        never = torch.iinfo(torch.int64).max
        hook = hook_state(self.model)
        return {
            "kind": top.kind,
            "rank": top.global_rank,
            "world_size": top.world_size,
            "ranks": list(top.ranks),
            "audits": self.audits,
            "rank_overflows": dict(zip(top.ranks, over, strict=True)),
            "rank_dropped_microbatches": dict(zip(top.ranks, dropped, strict=True)),
            # overflow origin: the first window in which each rank's own gradients overflowed
            "rank_first_overflow_step": {
                r: (None if f == never else f) for r, f in zip(top.ranks, first, strict=True)
            },
            "hook": hook.summary() if hook is not None else None,
            # where the per-rank counts come from (README: the overflow-origin trade)
            "origin": (
                "found_inf consensus"
                if not self._redundant
                else f"each rank's own loss, gathered at the audit of step {self.origin_audit_step}"
                if self.origin_audit_step is not None
                else "each rank's own loss, not gathered yet (no audit ran)"
            ),
        }

    def findings(self, step: int | None = None) -> list[Finding]:
        """AG131 when some ranks overflow much more often than others; the hook's AG132.

        Cost: one or two host syncs.
        """
        hook = hook_state(self.model)
        out = hook.findings(step) if hook is not None else []
        counts = self.summary()["rank_overflows"]
        top, low = max(counts.values(), default=0), min(counts.values(), default=0)
        if top == 0 or low * 2 > top:
            return out
        hot = sorted(r for r, c in counts.items() if c == top)
        return out + [
            make(
                "AG131",
                message=(
                    f"rank(s) {hot} had non-finite local gradients in {top} windows, other "
                    f"ranks in as few as {low}; every rank skipped those steps together"
                ),
                step=step,
                evidence={"rank_overflows": {str(r): c for r, c in counts.items()}},
                fix=(
                    "Inspect the data shard and the hardware of the named ranks (a corrupt sample, "
                    "a faulty device); ampguard.locate on one of their batches names the module."
                ),
            )
        ]
