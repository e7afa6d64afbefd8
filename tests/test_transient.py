"""A confirmed overflow on a few isolated steps that never recurs is a warning that explains
itself, not an error demanding a change."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.demo import run_demo
from ampguard.forensics._transient import MIN_QUIET, is_transient


@pytest.mark.parametrize(
    ("steps", "last", "now", "expected"),
    [
        ([120, 121, 122], 122, 300, True),  # the demo: a burst, then 178 quiet steps
        ([120, 121, 122], 122, 130, False),  # too soon to say it does not recur
        ([120, 121, 122], 200, 300, False),  # something else was diagnosed after it
        ([10, 40, 70], 70, 300, False),  # spread out: a pattern
        (list(range(10, 16)), 15, 300, False),  # too many steps
        ([7], 7, 7 + MIN_QUIET, True),
    ],
)
def test_is_transient(steps, last, now, expected):
    assert is_transient(steps, last, now) is expected


def _run(bad: set[int], steps: int) -> list[ag.Finding]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        precision="fp16",
        scaler=ag.ScalerConfig(init_scale=2.0**8),
        forensics=True,
    )
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def loss_fn(m, batch):
        return nn.functional.mse_loss(m(batch[0]).float(), batch[1])

    for step in range(1, steps + 1):
        batch = (x * (1e5 if step in bad else 1.0), y)  # an fp16 forward overflow, finite in fp32
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=loss_fn)
    return [f for f in guard.findings() if f.code == "AG301"]


def test_a_burst_that_does_not_recur_is_a_warning_that_says_so():
    (f,) = _run({5, 6}, 30)
    assert f.severity == "warning" and f.evidence["transient"] is True
    assert "steps 5-6 only" in f.message and "did not recur in the 24 steps since" in f.message
    assert f.fix.startswith("Nothing to change") and "keep_fp32" in f.fix


def test_an_overflow_that_keeps_coming_back_stays_an_error():
    (f,) = _run({5, 12, 19, 26}, 30)
    assert f.severity == "error" and "transient" not in f.evidence


def test_the_demo_story_and_its_finding_agree(tmp_path):
    result = run_demo(steps=60, out=tmp_path, progress=False, quiet=True)
    found = json.loads((tmp_path / "findings.json").read_text())
    errors = [f for f in found if f["severity"] == "error"]
    assert not errors, errors  # the burst was skipped and absorbed: nothing demands a change
    (ag301,) = [f for f in found if f["code"] == "AG301"]
    assert ag301["severity"] == "warning" and "skipping absorbed" in ag301["message"]
    assert any("[warning]" in line and "transient" in line for line in result.extra_lines)
