"""The loss scale as one interface: no-op, static and dynamic, and the Guard's one step over it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _precisions import plain
from torch.utils._python_dispatch import TorchDispatchMode

import ampguard as ag
from ampguard import precisions
from ampguard.core import policy
from ampguard.core.loss_scale import (
    NoOpLossScale,
    StaticLossScale,
    check_grads,
    make_loss_scale,
)
from ampguard.core.scaler import LossScaler, ScaledLossScale, ScalerConfig

CPU = torch.device("cpu")


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_no_op_scale_runs_no_kernel_outside_the_check():
    scale = NoOpLossScale(CPU)
    loss = torch.tensor(3.0)
    found = [torch.zeros(())]
    with _CountOps() as counted:
        assert scale.scale_loss(loss) is loss
        assert scale.update_window(found, None) is None
        assert scale.scale() == 1.0
        assert scale.state_dict() is None
    assert counted.ops == []


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_the_no_op_unscale_only_checks(bad):
    grads = [torch.tensor([1.0, bad]), torch.tensor([2.0], dtype=torch.bfloat16)]
    before = [g.clone() for g in grads]
    found = NoOpLossScale(CPU).unscale_(grads)
    assert found.item() > 0
    for g, b in zip(grads, before, strict=True):
        torch.testing.assert_close(g, b, equal_nan=True)
    assert check_grads([torch.ones(3)], CPU).item() == 0


def test_make_picks_the_implementation_from_the_kind_and_the_config():
    cfg = ScalerConfig()
    assert isinstance(make_loss_scale("none", cfg, CPU), NoOpLossScale)
    assert type(make_loss_scale("dynamic", cfg, CPU)) is LossScaler
    assert isinstance(make_loss_scale("static", cfg, CPU), StaticLossScale)
    fixed = dataclasses.replace(cfg, dynamic=False)
    assert isinstance(make_loss_scale("dynamic", fixed, CPU), StaticLossScale)
    with pytest.raises(ValueError, match="loss_scale must be one of"):
        make_loss_scale("adaptive", cfg, CPU)


def test_the_static_scale_never_moves_and_saves_the_dynamic_fields():
    scale = StaticLossScale(ScalerConfig(init_scale=256.0), CPU)
    assert scale.update_window([torch.ones(())], None) is None
    assert scale.update_window([torch.zeros(())], torch.ones(())) is None
    state = scale.state_dict()
    assert state is not None and state["scale"] == 256.0
    assert set(state) == set(LossScaler(ScalerConfig(), CPU).state_dict())


def test_the_static_and_dynamic_scales_are_siblings():
    # as jmp's: both multiply the loss and keep the same state; neither is a kind of the other
    assert not issubclass(StaticLossScale, LossScaler)
    assert not issubclass(LossScaler, StaticLossScale)
    assert issubclass(StaticLossScale, ScaledLossScale) and issubclass(LossScaler, ScaledLossScale)
    assert not hasattr(StaticLossScale, "update")  # nothing moves a fixed scale


def _train(guard: ag.Guard, model: torch.nn.Module, poison: set[int], steps: int) -> list[bool]:
    applied = []
    for step in range(1, steps + 1):
        x = torch.randn(4, 8)
        if step in poison:
            x[0, 0] = float("inf")
        with guard.autocast():
            loss = model(x).float().pow(2).mean()
        guard.backward(loss)
        applied.append(guard.step().applied)
    return applied


def test_a_static_scale_skips_an_overflow_and_keeps_its_scale():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="fp16", scaler=ScalerConfig(dynamic=False))
    assert isinstance(guard.loss_scaler, StaticLossScale)
    assert _train(guard, model, {2}, 4) == [True, False, True, True]
    assert guard.scale == ScalerConfig().init_scale
    assert guard.state_dict()["scaler"]["scale"] == ScalerConfig().init_scale


def test_a_precision_added_as_one_registry_entry_trains_with_its_loss_scale(monkeypatch):
    entry = dataclasses.replace(
        precisions.REGISTRY["fp16"], name="fp16static", loss_scale="static", audit_code=90
    )
    # what editing precisions.py does: the entry, and the request tuple read from the registry
    monkeypatch.setitem(precisions.REGISTRY, "fp16static", entry)
    monkeypatch.setattr(policy, "PRECISIONS", precisions.requests())
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="fp16static", scaler=ScalerConfig(init_scale=64.0))
    assert guard.precision == "fp16static" and guard.uses_scaler
    assert isinstance(guard.loss_scaler, StaticLossScale)
    assert _train(guard, model, {3}, 5) == [True, True, False, True, True]
    assert guard.scale == 64.0
    other = torch.nn.Linear(8, 4)
    resumed = ag.Guard(
        other,
        torch.optim.SGD(other.parameters(), lr=0.01),
        precision="fp16static",
        scaler=ScalerConfig(init_scale=64.0),
    )
    resumed.load_state_dict(guard.state_dict())
    assert resumed.steps == 5 and resumed.scale == 64.0


@pytest.mark.parametrize("precision", plain(scaled=False))
def test_without_a_scale_the_guard_holds_the_no_op_scale(precision):
    model = torch.nn.Linear(8, 4)
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), precision=precision)
    assert guard.loss_scaler is None and not guard.uses_scaler and guard.scale == 1.0
    assert _train(guard, model, {2}, 3) == [True, False, True]
    assert guard.state_dict()["scaler"] is None
