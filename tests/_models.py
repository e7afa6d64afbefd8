"""The tiny model and batches that the Guard, step and checkpoint tests share (real torch, CPU).

``make_model(seed)`` is an 8 -> 16 -> 4 MLP seeded by ``seed``; ``batch(i)`` the fixed batch
``i`` (4 rows; its own generator, so the global RNG does not move), with one NaN input when
``bad`` (every gradient of that micro-batch becomes NaN). ``OUTLIER_FACTORY`` is the source of
a factory file for ``ampguard inspect --fp8`` (``experiment``: an ``ag.Experiment`` around the
demo's ``OutlierNet``; ``bare``: the model alone).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["make_model", "batch", "OUTLIER_FACTORY"]


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(i: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
    if bad:
        x[0, 0] = float("nan")  # a corrupt sample: every gradient of this micro-batch is NaN
    return x, y


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
