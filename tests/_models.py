"""The tiny model and batches that the Guard, step and checkpoint tests share (real torch, CPU).

``make_model(seed)`` is an 8 -> 16 -> 4 MLP seeded by ``seed``; ``batch(i)`` the fixed batch
``i`` (4 rows; its own generator, so the global RNG does not move), with one NaN input when
``bad`` (every gradient of that micro-batch becomes NaN). ``small_mlp()`` is the 8 -> 8 -> 2 MLP
(seed 0) of the diagnostics and resume tests, and ``train_steps(model, guard, steps, bad)`` runs
``steps`` guarded steps on random batches, writing an inf into the first weight's gradient on
the (1-based) steps in ``bad``, so exactly those steps overflow. ``OUTLIER_FACTORY`` is the
source of a factory file for ``ampguard inspect --fp8`` (``experiment``: an ``ag.Experiment``
around the demo's ``OutlierNet``; ``bare``: the model alone).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

__all__ = ["make_model", "batch", "small_mlp", "train_steps", "OUTLIER_FACTORY"]


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(i: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
    if bad:
        x[0, 0] = float("nan")  # a corrupt sample: every gradient of this micro-batch is NaN
    return x, y


def small_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def train_steps(model: nn.Sequential, guard: Any, steps: int, bad: Collection[int] = ()) -> None:
    for i in range(1, steps + 1):
        with guard.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        guard.backward(loss)
        if i in bad:
            model[0].weight.grad.view(-1)[0] = float("inf")  # this step overflows
        guard.step()


OUTLIER_FACTORY = (
    "import torch, ampguard as ag\n"
    "from ampguard.demo.fp8_model import OutlierNet, make_task, loss_fn\n"
    "def experiment():\n"
    "    m = OutlierNet()\n"
    "    return ag.Experiment(m, torch.optim.SGD(m.parameters(), lr=0.1),\n"
    "                         list(make_task(steps=1).batches()), loss_fn)\n"
    "def bare():\n"
    "    return OutlierNet()\n"
)
