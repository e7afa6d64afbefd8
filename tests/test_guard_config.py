"""The Guard's arguments are checked in one place (``ampguard.guard._config``), in one order.

Two bad arguments: the one checked first is named, whatever else is wrong. The checked
arguments are a frozen ``GuardConfig``; a failed check creates nothing (no run folder).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.guard import _config


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"accumulation_steps": 0, "signatures": "often"}, "accumulation_steps"),
        ({"scaler": "fp16", "on_spike": "panic"}, "scaler"),
        ({"skip_nonfinite": "yes", "restore_buffers_on_skip": "yes"}, "skip_nonfinite"),
        ({"on_desync": "shrug", "flight_recorder": -1}, "on_desync"),
        ({"snapshot_every": 0, "signatures": "often"}, "snapshot_every"),
    ],
)
def test_of_two_bad_arguments_the_first_checked_is_named(tmp_path, kwargs, named):
    model, opt = _model_and_optimizer()
    with pytest.raises((TypeError, ValueError), match=named):
        ag.Guard(model, opt, precision="bf16", telemetry=tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()  # nothing created before every argument passed


def test_the_checked_arguments_are_a_frozen_config():
    model, opt = _model_and_optimizer()
    guard = ag.Guard(model, opt, precision="bf16", clip_grad_norm=1, accumulation_steps=2)
    defaults = {
        name: p.default
        for name, p in inspect.signature(ag.Guard.__init__).parameters.items()
        if name != "self"
    }
    args = {**defaults, "model": model, "optimizer": opt, "precision": "bf16"}
    config = _config.check(**{**args, "clip_grad_norm": 1, "accumulation_steps": 2})
    assert config.optimizers == guard.optimizers and config.params == guard.params
    assert config.clip_grad_norm == 1.0 and isinstance(config.clip_grad_norm, float)
    assert config.policy.precision == guard.precision == "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.accumulation_steps = 3  # type: ignore[misc]
