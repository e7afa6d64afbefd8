"""The non-finite-skip bound with fused optimizers (its message, and its lazy
read after a fallback), and two Guards on one model with overlapping windows."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from _precisions import plain
from torch import nn

import ampguard as ag


def _poisoned_run(
    precision: str, cfg: ag.ScalerConfig, steps: int = 400
) -> tuple[int, str, ag.Guard]:
    """Fused AdamW; every window's gradient holds an inf. (step it raised at, message, guard)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    guard = ag.Guard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), precision, scaler=cfg
    )
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's own warning
        for step in range(1, steps + 1):
            with guard.autocast():
                loss = model(x).float().sum()
            guard.backward(loss)
            model.weight.grad.view(-1)[0] = float("inf")
            try:
                guard.step()
            except ag.ScaleCollapseError as exc:
                return step, str(exc), guard
    raise AssertionError("the bound never fired")


def test_the_fused_bound_names_the_count_at_the_step_it_was_crossed():
    seen, msg, _ = _poisoned_run("bf16", ag.ScalerConfig(max_nonfinite_skips=16))
    assert seen <= 16 + 100  # the lazy read: at most 100 windows late
    assert "16 consecutive windows up to step 16" in msg, msg
    assert f"seen at step {seen}" in msg


def test_after_a_late_read_fallback_the_bound_fires_within_100_windows_of_being_crossed():
    cfg = ag.ScalerConfig(
        init_scale=2.0**4, min_scale=1.0, on_collapse="fallback", max_nonfinite_skips=16
    )
    seen, msg, guard = _poisoned_run("fp16", cfg)
    fallback = guard.fallback
    assert fallback is not None and fallback["from"] == "fp16"
    crossed = int(re.search(r"16 consecutive windows up to step (\d+)", msg).group(1))
    assert crossed == fallback["step"] + 16  # every window after the collapse made no progress
    assert seen - crossed <= 100, (seen, crossed)
    assert seen - fallback["step"] <= 100 + 16, (seen, fallback)


def test_the_unfused_bound_still_fires_at_the_crossing_step():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        "bf16",
        scaler=ag.ScalerConfig(max_nonfinite_skips=3),
    )
    x = torch.randn(4, 8)
    for step in range(1, 4):
        with guard.autocast():
            loss = model(x).float().sum()
        guard.backward(loss)
        model.weight.grad.view(-1)[0] = float("nan")
        if step < 3:
            guard.step()
    with pytest.raises(ag.ScaleCollapseError) as info:
        guard.step()
    assert "3 consecutive windows up to step 3 under bf16" in str(info.value)
    assert "seen at step" not in str(info.value)


# ---------------------------------------------------------------------- two Guards, one model
@pytest.mark.parametrize("precision", plain())
def test_a_second_guard_whose_window_overlaps_never_reports_an_update_it_did_not_make(precision):
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    first = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision)
    second = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision)
    x = torch.randn(4, 8)
    for guard in (first, second):
        with guard.autocast():
            loss = model(x).float().pow(2).mean()
        guard.backward(loss)
    assert first.step().applied
    weight = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="every gradient of the Guard's optimizers is None"):
        second.step()
    assert torch.equal(model.weight, weight)
    assert second.applied_steps == 0
    # the window was discarded: the second Guard goes on with its next window
    with second.autocast():
        loss = model(x).float().pow(2).mean()
    second.backward(loss)
    assert second.step().applied


def test_zero_grad_between_backward_and_step_is_the_same_clear_error():
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, "bf16")
    guard.backward(model(torch.randn(2, 8)).sum())
    opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="optimizer.zero_grad\\(\\) ran between"):
        guard.step()
