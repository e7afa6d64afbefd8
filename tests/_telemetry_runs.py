"""Planted training scenarios for the telemetry, rules and report tests (real fp16 on CPU).

Each scenario trains a tiny model through a Guard with telemetry into ``run_dir`` and closes it,
so the folder holds a complete run log. Models stay at width <= 32: fp16 matmuls are slow here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import ampguard as ag

IN, OUT = 16, 4


def data(seed: int = 0, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def mlp(width: int = 32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, OUT)
    )


class DeadBranch(nn.Module):
    """A main path plus a branch whose weights start at zero: the branch's first layer never
    gets a gradient (the second layer's zero weights block it), while the loss keeps moving."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = nn.Linear(IN, OUT)
        self.branch_in = nn.Linear(IN, 16)
        self.branch_out = nn.Linear(16, OUT)
        for layer in (self.branch_in, self.branch_out):
            nn.init.zeros_(layer.weight)
        nn.init.zeros_(self.branch_in.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x) + self.branch_out(torch.relu(self.branch_in(x)))


class SaturatedGate(nn.Module):
    """``main(x) * sigmoid(gate(x))`` with the gate's bias at 30: sigmoid rounds to exactly 1 in
    fp16, so its derivative is 0 and the gate layer learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = nn.Linear(IN, OUT)
        self.gate = nn.Linear(IN, OUT)
        nn.init.constant_(self.gate.bias, 30.0)
        nn.init.normal_(self.gate.weight, std=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x) * torch.sigmoid(self.gate(x))


class WideRange(nn.Module):
    """fp16 matmul path plus two fp32 elementwise parameters whose gradients are ``small`` and
    ``big`` times the input: together wider than fp16 can hold at any one scale."""

    def __init__(self, small: float, big: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = nn.Linear(IN, OUT)
        self.tiny = nn.Linear(IN, 1)
        self.huge = nn.Linear(IN, 1)
        self.small, self.big = small, big

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiny = (self.tiny.weight * x * self.small).sum(-1, keepdim=True)
        huge = (self.huge.weight * x * self.big).sum(-1, keepdim=True)
        return self.main(x) + tiny + huge


def train(
    guard: ag.Guard,
    model: nn.Module,
    steps: int,
    *,
    amp: float = 1.0,
    seed: int = 0,
    inject: set[int] | None = None,
) -> list[ag.StepResult]:
    """``steps`` windows on fixed data; ``amp`` multiplies the loss; ``inject`` lists the
    (1-based) steps whose first gradient is set to inf after backward."""
    x, y = data(seed)
    out = []
    for _ in range(steps):
        for _micro in range(guard.accumulation_steps):
            with guard.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y) * amp
            guard.backward(loss)
        if inject and guard.steps + 1 in inject:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float(
                "inf"
            )
        out.append(guard.step())
    return out


def run(
    run_dir: Path,
    model: nn.Module,
    steps: int,
    *,
    scaler: ag.ScalerConfig | None = None,
    amp: float = 1.0,
    inject: set[int] | None = None,
    lr: float = 1e-3,
    layer_every: int = 1,
    range_every: int = 5,
    **guard_kwargs,
) -> Path:
    """Train ``model`` in fp16 with telemetry into ``run_dir``; returns ``run_dir``."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tel = ag.Telemetry(run_dir, flush_every=16, layer_every=layer_every, range_every=range_every)
    with ag.Guard(
        model, opt, precision="fp16", scaler=scaler, telemetry=tel, **guard_kwargs
    ) as guard:
        train(guard, model, steps, amp=amp, inject=inject)
    return run_dir


def resumed(
    run_dir: Path, *, restore_guard: bool, before: int = 30, after: int = 20, range_every: int = 100
) -> Path:
    """Train, checkpoint (with or without the Guard's state), then resume in a new process-like
    setup (new model, optimizer, Guard, Telemetry on the same folder) and train on."""
    scaler = ag.ScalerConfig(growth_interval=1000)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = run_dir / "ckpt.pt"
    with ag.Guard(
        model,
        opt,
        precision="fp16",
        scaler=scaler,
        telemetry=ag.Telemetry(run_dir, flush_every=8, range_every=range_every),
    ) as guard:
        train(guard, model, before, amp=1e3)  # the scale backs off from 65536
        ag.save_checkpoint(ckpt, model=model, optimizer=opt, guard=guard if restore_guard else None)
    model = mlp(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ag.Guard(
        model,
        opt,
        precision="fp16",
        scaler=scaler,
        telemetry=ag.Telemetry(run_dir, flush_every=8, range_every=range_every),
    ) as guard:
        ag.load_checkpoint(ckpt, model=model, optimizer=opt, guard=guard)
        train(guard, model, after, amp=1e3)
    return run_dir


def codes(findings: list[ag.Finding]) -> set[str]:
    return {f.code for f in findings}
