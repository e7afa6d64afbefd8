"""Guard(keep_fp32=, forensics=, auto_fallback=, coverage_step=): forensics while training."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

import ampguard as ag

W = 16


class Hazard(nn.Module):
    """'big' sums sigmoids with weights of 1e4: its output passes 65504 in every step."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.big = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)
        with torch.no_grad():
            self.big.weight.fill_(1e4)

    def forward(self, x):
        return self.fc2(torch.relu(self.big(torch.sigmoid(self.fc1(x)))))


class Healthy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)
        self.seen_modes = []

    def forward(self, x):
        self.seen_modes.append(_get_current_dispatch_mode())
        return self.fc2(torch.relu(self.fc1(x)))


def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def train(guard, model, steps, batch=None, replay=False):
    batch = batch or (torch.randn(32, W), torch.randn(32, W))
    overflows = []
    for _ in range(steps):
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        kwargs = {"batch": batch, "loss_fn": loss_fn} if replay else {}
        overflows.append(guard.step(**kwargs).overflow)
    return overflows


def make(model, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = ag.ScalerConfig(on_collapse="warn", **kwargs.pop("scaler", {}))
    return ag.Guard(model, opt, precision="fp16", scaler=scaler, **kwargs)


def test_keep_fp32_runs_the_module_in_fp32_under_guard_autocast():
    model = Hazard()
    guard = make(model, keep_fp32=["big", "fc2"])
    with guard.autocast():
        out = model(torch.randn(4, W))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_keep_fp32_unknown_pattern_fails_at_construction():
    with pytest.raises(ValueError, match="keep_fp32"):
        make(Hazard(), keep_fp32=["bigg"])


def test_forensics_diagnoses_a_recurring_forward_overflow():
    model = Hazard()
    guard = make(model, forensics=True)
    assert all(train(guard, model, 4))
    found = [f for f in guard.findings() if f.code == "AG301"]
    assert [(f.evidence["module"], f.evidence["phase"], f.evidence["op"]) for f in found] == [
        ("big", "forward", "aten.addmm")
    ]
    assert found[0].evidence["via"] == "trace"
    assert found[0].evidence["stats"]["max_abs_fp32"] > 65504
    assert guard.diagnostics()["fallbacks"] == []  # diagnosis only, no change


def test_unarmed_windows_are_not_traced():
    model = Healthy()
    guard = make(model, forensics=True)
    assert train(guard, model, 3) == [False, False, False]
    assert model.seen_modes == [None, None, None]
    assert guard.findings() == []


def test_armed_window_is_traced_and_leaves_no_hooks():
    model = Hazard()
    guard = make(model, forensics=True)
    train(guard, model, 3)
    assert guard._state.forensics._armed > 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_auto_fallback_keeps_overflowing_modules_in_fp32_until_overflows_stop():
    model = Hazard()
    guard = make(model, auto_fallback=True)
    overflows = train(guard, model, 14)
    assert overflows[:2] == [True, True]
    assert not any(overflows[-6:])
    kept = [c["module"] for c in guard.diagnostics()["fallbacks"]]
    assert kept[:2] == ["big", "fc2"]  # then the next module overflowing on the fp32 value
    assert {f.code for f in guard.findings()} >= {"AG301", "AG306"}


def test_scaler_probes_are_benign_and_change_nothing():
    model = Healthy()
    guard = make(model, auto_fallback=True, scaler={"init_scale": 2.0**24})
    overflows = train(guard, model, 10)
    assert overflows[0] and not any(overflows[-3:])
    assert guard.findings() == []
    assert guard._state.forensics.benign >= 1


def test_replay_of_the_captured_batch_uses_locate():
    model = Hazard()
    guard = make(model, forensics=True)
    train(guard, model, 3, replay=True)
    (found,) = [f for f in guard.findings() if f.code == "AG301"]
    assert (found.evidence["module"], found.evidence["via"]) == ("big", "replay")
    assert found.evidence["occurrences"] == 2  # the warm-up overflow of step 1 is not replayed


def test_coverage_step_records_that_window():
    model = Healthy()
    guard = make(model, coverage_step=2)
    train(guard, model, 1)
    assert guard.coverage is None
    train(guard, model, 2)
    assert guard.coverage.step == 2
    assert guard.coverage.modules[""]["heavy_forward"] == {"fp16": 2}
    assert model.seen_modes[0] is None and model.seen_modes[1] is not None


def test_coverage_step_reports_an_escaped_module():
    class Escapes(Healthy):
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return self.fc2(torch.relu(self.fc1(x)))

    model = Escapes()
    guard = make(model, coverage_step=1)
    train(guard, model, 1)
    assert [f.code for f in guard.findings()] == ["AG310"]


def test_fallbacks_survive_a_resume():
    model = Hazard()
    guard = make(model, auto_fallback=True)
    train(guard, model, 5)
    state = guard.state_dict()
    model2 = Hazard()
    guard2 = make(model2, auto_fallback=True)
    guard2.load_state_dict(state)
    assert guard2._state.forensics.islands.modules == guard._state.forensics.islands.modules
    with guard2.autocast():
        assert model2.big(torch.randn(2, W)).dtype == torch.float32


def test_telemetry_run_folder_gets_forensics_coverage_and_findings(tmp_path):
    model = Hazard()
    with make(model, auto_fallback=True, coverage_step=1, telemetry=tmp_path / "run") as guard:
        train(guard, model, 5)
    run = tmp_path / "run"
    forensics = json.loads((run / "forensics.json").read_text())
    assert forensics["changes"][0]["module"] == "big"
    assert json.loads((run / "coverage.json").read_text())["step"] == 1
    codes = {f["code"] for f in json.loads((run / "findings.json").read_text())}
    assert {"AG301", "AG306"} <= codes


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"forensics": "yes"}, TypeError),
        ({"auto_fallback": 1}, TypeError),
        ({"coverage_step": 0}, ValueError),
        ({"coverage_step": 1.5}, ValueError),
        ({"keep_fp32": [3]}, TypeError),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        make(Healthy(), **kwargs)


def test_step_with_batch_but_no_loss_fn_is_a_value_error():
    model = Healthy()
    guard = make(model, forensics=True)
    with guard.autocast():
        loss = loss_fn(model, (torch.randn(4, W), torch.randn(4, W)))
    guard.backward(loss)
    with pytest.raises(ValueError, match="loss_fn"):
        guard.step(batch=(torch.randn(4, W), torch.randn(4, W)))
