"""Shared benchmark pieces: the MLP, the bare and Guard training steps, interleaved timing, and
ampguard.testing's host-sync counter."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ampguard.testing import SyncCounter, count_syncs

__all__ = [
    "SyncCounter",
    "count_syncs",
    "syncs_per_step",
    "mlp",
    "bare_step",
    "guard_step",
    "Timing",
    "interleaved_rounds",
    "medians",
    "interleaved_medians",
]


def mlp(
    width: int,
    depth: int,
    activation: type[torch.nn.Module] = torch.nn.ReLU,
    layer_norm: bool = False,
) -> torch.nn.Sequential:
    """``depth`` x (Linear(width, width), activation[, LayerNorm]) and a Linear(width, 8) head,
    seeded with 0 so every copy starts from the same weights."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), activation()]
        if layer_norm:
            layers.append(torch.nn.LayerNorm(width))
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))


def bare_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    clip: bool = False,
) -> None:
    """One step of the plain torch loop: fp16 autocast on CPU + ``GradScaler`` (clip at 1.0)."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def guard_step(model: torch.nn.Module, guard: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """The same step through an :class:`ampguard.Guard`."""
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    guard.step()


def syncs_per_step(step: Callable[[], None], steps: int) -> list[int]:
    """Host syncs of each of ``steps`` calls of ``step``."""
    counts = []
    for _ in range(steps):
        with SyncCounter() as counter:
            step()
        counts.append(counter.count)
    return counts


class Timing(NamedTuple):
    """Seconds per step in one round: wall clock and this process's CPU time."""

    wall: float
    cpu: float


def interleaved_rounds(
    loops: dict[str, Callable[[], None]], rounds: int, steps_per_round: int, *, warmup: int = 0
) -> list[dict[str, Timing]]:
    """Per round, each loop's seconds per step; loops timed round-robin to cancel machine noise,
    after ``warmup`` untimed steps of each (allocations, first fp16 kernels, first flush).

    CPU time leaves out time spent descheduled or waiting (e.g. in a collective for a peer rank);
    on an idle machine it equals the wall time.
    """
    for step in loops.values():
        for _ in range(warmup):
            step()
    out = []
    for _ in range(rounds):
        took = {}
        for name, step in loops.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps_per_round):
                step()
            took[name] = Timing(
                (time.perf_counter() - w0) / steps_per_round,
                (time.process_time() - c0) / steps_per_round,
            )
        out.append(took)
    return out


def medians(per_round: list[dict[str, Timing]], clock: str = "wall") -> dict[str, float]:
    """Median over rounds of each loop's ``clock`` ("wall" or "cpu") seconds per step."""
    return {
        name: statistics.median(getattr(r[name], clock) for r in per_round) for name in per_round[0]
    }


def interleaved_medians(
    loops: dict[str, Callable[[], None]], rounds: int, steps_per_round: int, *, warmup: int = 0
) -> dict[str, float]:
    """Median wall seconds per step of each loop (see :func:`interleaved_rounds`)."""
    return medians(interleaved_rounds(loops, rounds, steps_per_round, warmup=warmup))
