"""The attach-mode seam: any object that implements ``WatchableScaler`` is watched like a
``GradScaler`` (real fp16 autocast on CPU; the scaler here is a user's own, written only
against the protocol, with a host-float scale and host-bool skips)."""

from __future__ import annotations

import math

import pytest
import torch
from _runfolders import step_records as _records

import ampguard as ag
from ampguard.integrations import _seam
from ampguard.integrations._seam import ScaleView, StepOutcome, WatchableScaler
from ampguard.integrations._tap import TorchScaler
from ampguard.telemetry import Telemetry

INIT = 2.0**10


class HandScaler:
    """A loop's own static-backoff loss scale, written only against the seam: the scale is a host
    float, the skip a host bool (the loop's own finiteness check), the unscale its own."""

    name = "HandScaler"
    scaled = True
    correctable = False

    def __init__(self, init: float = INIT) -> None:
        self.value = init
        self.listener = None
        self.ids: set[int] = set()

    @property
    def watched(self) -> bool:
        return self.listener is not None

    def scale(self) -> float:
        return self.value

    def grad_params(self):
        return None

    def attach(self, listener, watched) -> None:
        self.listener, self.ids = listener, watched

    def detach(self) -> None:
        self.listener = None

    def describe(self) -> dict:
        return {"init_scale": self.value, "backoff_factor": 0.5}

    def guard_tensors(self):
        raise AssertionError("not correctable: never asked")

    # -- the loop's API -----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.listener is not None:
            self.listener.on_scaler_loss(loss.detach())
        return loss * self.value

    def step(self, opt: torch.optim.Optimizer) -> bool:
        if self.listener is not None:
            self.listener.on_scaler_grads(True)
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        found = not all(bool(torch.isfinite(g).all()) for g in grads)  # the loop's own sync
        before = self.value
        if not found:
            for g in grads:
                g.div_(self.value)
            opt.step()
        else:
            self.value /= 2
        if self.listener is not None:
            self.listener.on_scaler_update(StepOutcome({i: found for i in self.ids}, found, before))
        return not found


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _loop(scaler: HandScaler, model, opt, steps: int, inf_at=(), reference=None) -> None:
    torch.manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale_loss(loss).backward()
        if i in inf_at:
            model[0].weight.grad[0, 0] = float("inf")
        if reference is not None:
            reference(i + 1, model, scaler.value, loss)
        scaler.step(opt)
        opt.zero_grad()


def test_a_protocol_scaler_passes_the_seam_unchanged():
    scaler = HandScaler()
    assert isinstance(scaler, WatchableScaler)
    assert _seam.adapt(scaler) is scaler
    assert _seam.adapt(None) is None


def test_grad_scaler_is_one_implementation_and_a_disabled_one_is_no_scaler():
    assert isinstance(_seam.adapt(torch.amp.GradScaler("cpu")), TorchScaler)
    assert _seam.adapt(torch.amp.GradScaler("cpu", enabled=False)) is None
    with pytest.raises(TypeError, match="scaler must be"):
        _seam.adapt(torch.nn.Linear(2, 2))  # a torch object that is not a scaler
    with pytest.raises(TypeError, match="scaler must be"):
        _seam.adapt(object())


def test_a_float_scale_is_mirrored_in_place_and_a_tensor_handed_through():
    scaler = HandScaler(8.0)
    view = ScaleView(scaler, torch.device("cpu"))
    mirror = view.scale_tensor
    assert mirror.tolist() == [8.0] and mirror.dtype == torch.float32
    scaler.value = 4.0
    assert view.scale_tensor is mirror and mirror.tolist() == [4.0]
    assert view.inv_scale().tolist() == [0.25]
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    grad_scaler.scale(torch.ones(()))  # makes the scale tensor
    tensor_view = ScaleView(TorchScaler(grad_scaler), torch.device("cpu"))
    assert tensor_view.scale_tensor is grad_scaler._scale


def test_watch_records_steps_skips_scale_and_unscaled_norms_through_the_protocol(tmp_path):
    expected = {}

    def reference(step, model, scale, loss):
        norm = math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in model.parameters()))
        expected[step] = (norm / scale, float(loss.detach()))

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = HandScaler()
    tel = Telemetry(tmp_path, flush_every=3, layer_every=1)
    with ag.watch(scaler, model, opt, telemetry=tel) as handle:
        assert scaler.watched and handle.precision == "fp16" and handle.scaler is scaler
        _loop(scaler, model, opt, 5, inf_at=(2,), reference=reference)
        assert handle.steps == 5 and handle.skipped_steps == 1
    assert not scaler.watched  # detached on close
    recs = _records(tmp_path)
    assert [r["applied"] for r in recs] == [True, True, False, True, True]
    assert [r["scale_before"] for r in recs] == [INIT, INIT, INIT, INIT / 2, INIT / 2]
    assert [r["scale"] for r in recs] == [INIT, INIT, INIT / 2, INIT / 2, INIT / 2]
    for rec in recs:
        if rec["applied"]:
            norm, loss = expected[rec["step"]]
            assert rec["grad_norm"] == pytest.approx(norm, rel=1e-4)
            assert rec["loss"] == pytest.approx(loss, rel=1e-6)
    meta = __import__("json").loads((tmp_path / "meta.json").read_text())
    assert meta["scaler"]["scaler_class"] == "HandScaler"
    assert meta["scaler"]["init_scale"] == INIT and meta["scaler"]["backoff_factor"] == 0.5
    assert "hysteresis" not in meta["scaler"]  # a scaler ampguard cannot correct: no policy


def test_guard_features_are_refused_for_a_scaler_that_keeps_its_own(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="min_scale.*HandScaler keeps its own"):
        ag.watch(HandScaler(), model, opt, telemetry=tmp_path, min_scale=1.0)
    assert not (tmp_path / "meta.json").exists()


def test_a_watched_scaler_is_refused_a_second_time(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = HandScaler()
    with ag.watch(scaler, model, opt, telemetry=tmp_path / "a"):
        with pytest.raises(ValueError, match="already watched"):
            ag.watch(scaler, model, opt, telemetry=tmp_path / "b")
