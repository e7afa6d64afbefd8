"""A small transformer-like model with one planted outlier-feature layer, and its data.

Two pre-norm residual MLP blocks (LayerNorm -> up -> GELU -> down) between an embedding and a
head, all Linear shapes multiples of 16. Before the ``head`` a :class:`MassiveActivation` adds a
constant ``value`` (default 1e5, about 1.5e5x the median input) to one channel, as the "massive
activations" of LLMs do (a few channels 10^3-10^5x the median). The head's weight column for the
channel is zero and stays zero (its gradient is masked), so the channel changes nothing in bf16 or
fp32; in fp8 it sets the layer's per-tensor scale and pushes the ordinary inputs down to e4m3's
subnormals (coarse) or below the smallest one (zero).
Used by ``ampguard demo --precision fp8``, ``benchmarks/bench_fp8.py`` and the tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "MassiveActivation",
    "Block",
    "OutlierNet",
    "OutlierTask",
    "make_task",
    "loss_fn",
    "OUTLIER_LAYER",
]

OUTLIER_LAYER = "head"


class MassiveActivation(nn.Module):
    """Adds ``value`` to channel ``channel`` of the last dimension (a fixed outlier feature)."""

    def __init__(self, width: int, channel: int = 3, value: float = 1e5) -> None:
        super().__init__()
        spike = torch.zeros(width)
        spike[channel] = value
        self.channel = channel
        self.spike: torch.Tensor
        self.register_buffer("spike", spike)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.spike.to(x.dtype)


class Block(nn.Module):
    """Pre-norm residual MLP block: x + down(GELU(up(LayerNorm(x))))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class OutlierNet(nn.Module):
    """embed -> 2 blocks -> LayerNorm -> outlier feature -> head (the planted layer)."""

    def __init__(
        self,
        in_dim: int = 32,
        width: int = 64,
        hidden: int = 128,
        out_dim: int = 16,
        outlier: float | None = 1e5,
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList([Block(width, hidden), Block(width, hidden)])
        self.norm = nn.LayerNorm(width)
        self.massive = MassiveActivation(width, value=outlier) if outlier else None
        self.head = nn.Linear(width, out_dim)
        if self.massive is not None:
            k = self.massive.channel
            with torch.no_grad():
                self.head.weight[:, k] = 0.0
            # the outlier channel stays out of the output in every precision
            self.head.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([k]), 0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        if self.massive is not None:
            h = self.massive(h)
        return self.head(h)


@dataclass(frozen=True)
class OutlierTask:
    """Teacher-student regression batches for :class:`OutlierNet` (deterministic per seed)."""

    seed: int
    steps: int
    batch_size: int
    teacher: nn.Module
    eval_x: torch.Tensor
    eval_y: torch.Tensor

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed + 1)
        for _ in range(self.steps):
            x = torch.randn(self.batch_size, self.eval_x.shape[1], generator=gen)
            with torch.no_grad():
                y = self.teacher(x)
            yield x, y  # outside no_grad: the consumer trains between the yields


def make_task(
    seed: int = 0, steps: int = 200, batch_size: int = 64, in_dim: int = 32, out_dim: int = 16
) -> OutlierTask:
    """A fixed random tanh-MLP teacher and a 512-sample eval set."""
    gen = torch.Generator().manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(in_dim, 64), nn.Tanh(), nn.Linear(64, out_dim))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        eval_x = torch.randn(512, in_dim, generator=gen)
        eval_y = teacher(eval_x)
    return OutlierTask(seed, steps, batch_size, teacher.requires_grad_(False), eval_x, eval_y)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """MSE in fp32 on the model's (autocast) output."""
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)
