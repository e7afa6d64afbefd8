"""Built-in data for ``ampguard demo``: a deterministic teacher-student regression task.

Inputs are standard normal; targets come from a fixed random "teacher" MLP. A short burst of
outlier batches (inputs scaled by ``spike_factor``) overflows fp16 in the forward pass: the kind of
data spike that silently kills fp16 runs, and that the Guard skips and recovers from.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["DemoData", "make_data"]


@dataclass(frozen=True)
class DemoData:
    """Training batches (a generator), a fixed eval set and the steps that carry outliers."""

    seed: int
    steps: int
    batch_size: int
    in_dim: int
    out_dim: int
    spike_steps: tuple[int, ...]
    spike_factor: float
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    teacher: torch.nn.Module

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``steps`` batches, deterministic for ``seed``; outliers at ``spike_steps`` (1-based)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        for step in range(1, self.steps + 1):
            x = torch.randn(self.batch_size, self.in_dim, generator=gen)
            with torch.no_grad():
                y = self.teacher(x)
            if step in self.spike_steps:
                x = x * self.spike_factor  # corrupted sensor values; targets stay as they were
            yield x, y


def make_data(
    seed: int = 0, steps: int = 300, batch_size: int = 64, in_dim: int = 32, out_dim: int = 8
) -> DemoData:
    """Build the demo data. A 3-batch outlier burst sits at 40% of the run."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(in_dim, 64), torch.nn.Tanh(), torch.nn.Linear(64, out_dim)
    )
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        eval_x = torch.randn(512, in_dim, generator=gen)
        eval_y = teacher(eval_x)
    first = max(2, int(steps * 0.4))
    spikes = tuple(s for s in range(first, first + 3) if s <= steps)
    return DemoData(
        seed,
        steps,
        batch_size,
        in_dim,
        out_dim,
        spikes,
        4096.0,
        eval_x,
        eval_y,
        teacher.requires_grad_(False),
    )
