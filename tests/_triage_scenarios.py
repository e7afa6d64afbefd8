"""What each rank runs in tests/test_triage_distributed.py: 2 real gloo ranks, plain DDP, a
hardware fault planted on rank 1 only (ampguard.testing.inject_fault)."""

from __future__ import annotations

from typing import Any

import _distributed_scenarios as S
import torch
from torch.nn import functional as F

import ampguard as ag
from ampguard.testing import inject_fault

FAULT_STEP = 3


def _loss(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]).float(), b[1])


def _fault(rank: int, world: int, tmp: str, persistent: bool) -> dict[str, Any]:
    inner = S.make_model()
    model = S.ddp(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = ag.Guard(model, opt, precision="bf16", snapshot_every=1, audit_every=None)
    rec = ag.SignatureRecorder(inner, clock=lambda: guard.steps)
    inj = inject_fault(
        inner,
        module="4",
        bit="exponent_top",
        step=FAULT_STEP,
        rank=1,
        element=3,
        persistent=persistent,
        guard=guard,
    )
    for step in range(FAULT_STEP + 1):  # the fault strikes in the last window
        g = torch.Generator().manual_seed(100 * step + rank)
        b = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        with guard.autocast():
            loss = _loss(model, b)
        guard.backward(loss)
        guard.step(batch=b, loss_fn=_loss)
    events = ag.triage(guard, recorder=rec, step=FAULT_STEP)
    inj.remove()
    return {
        "events": [(e.step, e.cause, e.module, e.op, e.rank) for e in events],
        "reference": [e.evidence.get("reference") for e in events],
        "peer": [e.evidence.get("peer_replay") for e in events],
    }


def transient_on_rank1(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return _fault(rank, world, tmp, persistent=False)


def persistent_on_rank1(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return _fault(rank, world, tmp, persistent=True)


def audit_mismatch_on_rank1(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """A memory fault on rank 1 after window 2's update (one weight bit of module "2"): the
    audit at the end of window 3 finds the replicas apart, and ``ag.triage(guard)``, with no
    step named, makes that step an event: a transient fault on rank 1 at module "2"."""
    inner = S.make_model()
    model = S.ddp(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = ag.Guard(
        model,
        opt,
        precision="bf16",
        snapshot_every=1,
        signatures=1,
        audit_every=1,
        on_desync="warn",
    )
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        b = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        with guard.autocast():
            loss = _loss(model, b)
        guard.backward(loss)
        guard.step(batch=b, loss_fn=_loss)
        if step == 1 and rank == 1:
            with torch.no_grad():
                inner[2].weight.view(-1).view(torch.int32)[7] ^= 1 << 22  # a mantissa bit
    mismatches = [dict(m) for m in guard.distributed.mismatches]
    events = ag.triage(guard)
    return {
        "mismatches": mismatches,
        "events": [(e.step, e.cause, e.module, e.rank, e.evidence.get("trigger")) for e in events],
        "codes": [f.code for f in guard.findings() if f.code.startswith("AG38")],
    }


SCENARIOS = {
    f.__name__: f for f in (transient_on_rank1, persistent_on_rank1, audit_mismatch_on_rank1)
}


def rank_main(rank, world, port, scenarios, queue, tmp, pg_timeout=30.0) -> None:
    """The per-rank body for ``S.run_ranks``: this module's scenarios (``S.serve``)."""
    S.serve(SCENARIOS, rank, world, port, scenarios, queue, tmp, pg_timeout)
