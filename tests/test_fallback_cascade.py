"""auto_fallback stops at the cause of a backward overflow: keeping the module in fp32 only
moves the cast-down of the same large gradient upstream, and without the stop every matmul
module would go to fp32 one step at a time."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import ampguard as ag


def _loss(model, x):
    return model(x).float().sum() * 1e5  # a gradient of 1e5 flows in: beyond fp16 at any scale


def test_a_backward_overflow_does_not_cascade_through_every_module():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(5)]
    model = nn.Sequential(*blocks, nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    guard = ag.Guard(model, opt, precision="fp16", auto_fallback=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the collapse warning of a scale that cannot help
        for _ in range(14):
            with guard.autocast():
                loss = _loss(model, x)
            guard.backward(loss)
            guard.step(batch=x, loss_fn=_loss)
    state = guard.state_dict()["forensics"]
    assert state["keep_fp32"] == ["5"], state["keep_fp32"]  # the first fallback, no more
    stopped = [f for f in guard.findings() if "auto_fallback stopped" in f.message]
    assert stopped and "'5'" in stopped[0].message
