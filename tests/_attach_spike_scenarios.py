"""What each rank runs in tests/test_watch_spikes_distributed.py: 2 real gloo ranks, plain DDP
under ``ag.watch`` (the loop's own ``torch.amp.GradScaler``, or no scaler), a loss spike planted
in one rank's batch. Reuses the process plumbing of ``_distributed_scenarios``."""

from __future__ import annotations

from typing import Any

import _distributed_scenarios as S
import torch
from _spike_scenarios import SPIKE, _batch

import ampguard as ag


def _watched(rank: int, world: int, tmp: str, scaled: bool) -> dict[str, Any]:
    """Only the last rank's loss spikes at window SPIKE; ``on_spike="skip"``."""
    model = S.ddp(S.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
    tel = ag.Telemetry(f"{tmp}/{'scaler' if scaled else 'plain'}{rank}", flush_every=16)
    handle = ag.watch(
        scaler, model, opt, tel, precision=None if scaled else "fp32", on_spike="skip"
    )
    params = {}
    with handle:
        for step in range(1, SPIKE + 3):
            x, y = _batch(step, rank, spike=step == SPIKE and rank == world - 1)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                handle.record_loss(loss)
                loss.backward()
                opt.step()
            opt.zero_grad()
            if step >= SPIKE - 1:
                params[step] = S.flat(model)
    spikes = [e.step for e in handle.flight_recorder.events]
    return {"params": params, "spikes": spikes}


def attach_scaler(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return _watched(rank, world, tmp, True)


def attach_no_scaler(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return _watched(rank, world, tmp, False)


SCENARIOS = {f.__name__: f for f in (attach_scaler, attach_no_scaler)}


def rank_main(rank, world, port, scenarios, queue, tmp, pg_timeout=30.0) -> None:
    """The per-rank body for ``S.run_ranks``: this module's scenarios (``S.serve``)."""
    S.serve(SCENARIOS, rank, world, port, scenarios, queue, tmp, pg_timeout)
