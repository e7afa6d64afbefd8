"""fp8 rescue during training: under Guard(precision="fp8", auto_fallback=True) a converted layer
that drifts out of fp8's window (an outlier feature appears mid-run) goes back to bf16 on the
fly; the move is recorded (diagnostics, run log, report, AG113) and resumes from a checkpoint."""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.demo.fp8_model import MassiveActivation
from ampguard.reporting import summary

pytest.importorskip("torchao")

DRIFT_AT = 4  # the step after which the outlier feature appears


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            a=nn.Linear(32, 64),
            act=nn.ReLU(),
            massive=MassiveActivation(64, value=0.0),
            b=nn.Linear(64, 16),
        )
    )
    with torch.no_grad():
        model.b.weight[:, 3] = 0.0  # the feature only sets the scale, as in LLMs
    channel = torch.tensor([3])
    model.b.weight.register_hook(lambda g: g.index_fill(1, channel, 0.0))  # and stays so
    return model


def _train(guard: ag.Guard, model: nn.Module, steps: int, drift: bool) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        if drift and guard.steps == DRIFT_AT:
            model.massive.spike[3] = 1e6  # an outlier feature appears during training
        x = torch.randn(16, 32, generator=gen)
        with guard.autocast():
            loss = model(x).float().pow(2).mean()
        guard.backward(loss)
        guard.step()
        losses.append(loss.item())
    return losses


def _guard(model: nn.Module, tmp_path, name: str = "run", **kw) -> ag.Guard:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    tel = ag.Telemetry(tmp_path / name, range_every=1, flush_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated fp8 on CPU
        return ag.Guard(model, opt, precision="fp8", telemetry=tel, **kw)


def test_a_drifting_layer_moves_to_bf16_and_training_continues(tmp_path):
    model = _model()
    with _guard(model, tmp_path, auto_fallback=True) as guard:
        assert type(model.b).__name__ == "Float8Linear"
        b, weight = model.b, model.b.weight
        losses = _train(guard, model, 24, drift=True)
        found = guard.findings()
        fallbacks = guard.diagnostics()["fallbacks"]
    assert type(model.b) is nn.Linear and model.b is b and model.b.weight is weight
    assert type(model.a).__name__ == "Float8Linear"  # the healthy layer stays in fp8
    assert guard.fp8.layers == ["a"] and "b" in guard.fp8.kept
    assert all(torch.isfinite(torch.tensor(losses)))
    rescue = [f for f in fallbacks if f.get("reason") == "fp8_rescue"]
    assert len(rescue) == 1 and rescue[0]["module"] == "b" and rescue[0]["step"] > DRIFT_AT
    ag113 = [f for f in found if f.code == "AG113"]
    assert len(ag113) == 1 and ag113[0].evidence["module"] == "b" and "bf16" in ag113[0].message
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    moved = [e for e in events if e.get("kind") == "fp8_rescue"]
    assert len(moved) == 1 and moved[0]["module"] == "b" and moved[0]["field"] == "input_flushed"
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["fp8"]["rescued"][0]["module"] == "b"
    assert "b: moved to bf16 at step" in summary(tmp_path / "run")


def test_no_rescue_without_drift_or_without_auto_fallback(tmp_path):
    model = _model()
    with _guard(model, tmp_path, "calm", auto_fallback=True) as guard:
        _train(guard, model, 12, drift=False)
        assert not [f for f in guard.diagnostics()["fallbacks"] if f.get("reason") == "fp8_rescue"]
    assert type(model.b).__name__ == "Float8Linear"
    model = _model()
    with _guard(model, tmp_path, "off") as guard:
        _train(guard, model, 12, drift=True)
        found = guard.findings()
    assert type(model.b).__name__ == "Float8Linear"  # only reported (AG111), not moved
    assert any(f.code == "AG111" for f in found) and not any(f.code == "AG113" for f in found)


def test_a_rescue_resumes_from_the_guard_state(tmp_path):
    model = _model()
    with _guard(model, tmp_path, auto_fallback=True) as guard:
        _train(guard, model, 16, drift=True)
        state = guard.state_dict()
    assert state["fp8"]["rescued"][0]["module"] == "b"
    fresh = _model()
    with _guard(fresh, tmp_path, "resumed", auto_fallback=True) as again:
        assert type(fresh.b).__name__ == "Float8Linear"
        again.load_state_dict(state)
        assert type(fresh.b) is nn.Linear and again.fp8.layers == ["a"]
        assert [f["module"] for f in again.diagnostics()["fallbacks"]] == ["b"]


def test_a_state_naming_unknown_fp8_layers_is_refused_and_changes_nothing(tmp_path):
    model = _model()
    with _guard(model, tmp_path, auto_fallback=True) as guard:
        state = guard.state_dict()
        state["fp8"] = {"rescued": [{"module": "nope", "step": 3}]}
        with pytest.raises(ValueError, match="nope"):
            guard.load_state_dict(state)
        assert type(model.b).__name__ == "Float8Linear" and guard.fp8.layers == ["a", "b"]


def test_auto_fallback_without_telemetry_rescues_on_its_own_schedule():
    from ampguard.fp8._convert import OWN_SAMPLE_EVERY

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated fp8 on CPU
        guard = ag.Guard(model, opt, precision="fp8", auto_fallback=True)  # no telemetry
    with guard:
        _train(guard, model, OWN_SAMPLE_EVERY * 9, drift=True)
        fallbacks = guard.diagnostics()["fallbacks"]
        found = guard.findings()
    assert type(model.b) is nn.Linear and guard.fp8.layers == ["a"]
    rescue = [f for f in fallbacks if f.get("reason") == "fp8_rescue"]
    assert len(rescue) == 1 and rescue[0]["module"] == "b"
    assert any(f.code == "AG113" for f in found)
    assert len(guard.fp8.monitor.samples) <= guard.fp8.monitor.max_samples
