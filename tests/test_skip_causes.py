"""Skip causes use the loss: a skipped step whose loss was NaN/inf is a
non-finite forward, never a warm-up overflow or a gradient overflow, in ``Guard.diagnostics()``,
the rules (AG101, AG103) and the report."""

from __future__ import annotations

import torch
from torch import nn

import ampguard as ag
from ampguard import reporting, rules, runlog

BAD = set(range(13, 21))  # after 12 clean steps (warm-up over), 8 steps with an inf forward


def _train(bad: set[int], steps: int = 20, telemetry=None, precision: str = "fp16") -> ag.Guard:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        precision=precision,
        scaler=ag.ScalerConfig(init_scale=2.0**10),
        telemetry=telemetry,
    )
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    big = 1e5 if precision == "fp16" else float("inf")  # bf16 has fp32's range
    for step in range(1, steps + 1):
        with guard.autocast():  # 1e5 * x: the first Linear's fp16 output passes 65504
            out = model(x * (big if step in bad else 1.0))
            loss = nn.functional.mse_loss(out.float(), y)
        guard.backward(loss)
        result = guard.step()
        assert result.loss_nonfinite == (step in bad)
    return guard


def test_diagnostics_counts_a_nan_loss_skip_as_a_nonfinite_forward():
    guard = _train(BAD)
    d = guard.diagnostics()
    assert d["skipped_steps"] == len(BAD)
    assert d["skipped_by_cause"] == {
        "overflow": 0,
        "collapse": 0,
        "nonfinite": 0,
        "nonfinite_forward": len(BAD),
    }


def test_a_gradient_overflow_with_a_finite_loss_stays_an_overflow():
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), precision="fp16")
    with guard.autocast():
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    guard.backward(loss)
    model.weight.grad.view(-1)[0] = float("inf")
    result = guard.step()
    assert not result.applied and not result.loss_nonfinite
    assert guard.diagnostics()["skipped_by_cause"]["overflow"] == 1


def test_without_a_loss_scaler_a_nan_loss_skip_stays_a_nonfinite_skip():
    guard = _train({2, 3}, steps=4, precision="bf16")  # AG109's count: nothing to overflow
    by_cause = guard.diagnostics()["skipped_by_cause"]
    assert by_cause["nonfinite"] == 2 and by_cause["nonfinite_forward"] == 0


def test_the_rules_and_the_report_name_a_nonfinite_forward(tmp_path):
    with _train(BAD, telemetry=tmp_path):
        pass
    run = runlog.load_run(tmp_path)
    causes = rules.skip_causes(run)
    assert causes[rules.NONFINITE_FORWARD] == sorted(BAD)
    assert not causes["warm-up overflow"] and not causes["overflow"]
    found = {f.code: f for f in rules.evaluate(run)}
    ag101 = found["AG101"]
    assert "gradients keep overflowing" not in ag101.message
    assert "NaN/inf loss" in ag101.message and "forward" in ag101.fix
    assert ag101.evidence["nonfinite_loss_steps"] == len(BAD)
    page = (tmp_path / runlog.REPORT).read_text(encoding="utf-8")
    assert rules.NONFINITE_FORWARD in page
    assert f"{rules.NONFINITE_FORWARD} {len(BAD)}" in reporting.summary(tmp_path)


def test_a_nan_loss_in_warm_up_is_not_warm_up_probing(tmp_path):
    with _train({1, 2}, steps=4, telemetry=tmp_path):
        pass
    causes = rules.skip_causes(runlog.load_run(tmp_path))
    assert causes[rules.NONFINITE_FORWARD] == [1, 2] and not causes["warm-up overflow"]
