"""What each rank runs in tests/test_spikes_distributed.py: 2 real gloo ranks, plain DDP, a loss
spike planted in one rank's batch. Reuses the process plumbing of ``_distributed_scenarios``."""

from __future__ import annotations

from typing import Any

import _distributed_scenarios as S
import torch

import ampguard as ag

SPIKE = 60  # after the detector's 50-window warm-up


def _batch(step: int, rank: int, spike: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 16, generator=g)
    y = x.sum(dim=1, keepdim=True)
    if spike:
        x[:2] *= 40.0
        y[:2] *= -40.0
    return x, y


def spike_on_one_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Only the last rank's loss spikes at window SPIKE: every rank skips that window, every
    rank dumps its ring into the shared run folder."""
    model = S.ddp(S.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = ag.Guard(
        model, opt, precision="bf16", on_spike="skip", telemetry=f"{tmp}/run", audit_every=None
    )
    causes = {}
    for step in range(1, SPIKE + 3):
        x, y = _batch(step, rank, spike=step == SPIKE and rank == world - 1)
        with guard.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        r = guard.step()
        if step >= SPIKE - 1:
            causes[step] = r.skip_cause
    guard.close()
    return {"causes": causes, "params": S.flat(model)}


def autopsy_under_ddp(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The same spike, with the batches recorded (``step(batch=, loss_fn=)``) and snapshots:
    each rank's autopsy says that it does not replay a distributed model."""
    model = S.ddp(S.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = ag.Guard(
        model, opt, precision="bf16", on_spike="skip", snapshot_every=20, audit_every=None
    )

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(batch[0]).float(), batch[1])

    for step in range(1, SPIKE + 1):
        batch = _batch(step, rank, spike=step == SPIKE and rank == world - 1)
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=loss_fn)
    return {
        "diagnoses": [
            {"step": d.step, "verified": d.verified, "replay": d.evidence.get("replay")}
            for d in ag.autopsy(guard)
        ]
    }


SCENARIOS = {f.__name__: f for f in (spike_on_one_rank, autopsy_under_ddp)}


def rank_main(rank, world, port, scenarios, queue, tmp, pg_timeout=30.0) -> None:
    """The per-rank body for ``S.run_ranks``: this module's scenarios (``S.serve``)."""
    S.serve(SCENARIOS, rank, world, port, scenarios, queue, tmp, pg_timeout)
