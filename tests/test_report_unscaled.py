"""Reports of runs without a loss scale show what ran instead of an fp16 scaler configuration
and a flat 2^0 scale panel; a block-scaled run names the layers that ran in the format; the loss
axis tells its ticks apart on a narrow range."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard import runlog

pytest.importorskip("matplotlib")


def _run(run_dir, precision: str, offset: float = 0.0, steps: int = 6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
    with ag.Guard(model, opt, precision=precision, telemetry=run_dir) as guard:
        for _ in range(steps):
            with guard.autocast():
                loss = F.mse_loss(model(x).float(), y) + offset
            guard.backward(loss)
            guard.step()
    return (run_dir / "report.html").read_text()


def test_a_bf16_report_says_no_loss_scale_instead_of_an_fp16_scaler(tmp_path):
    page = _run(tmp_path / "run", "bf16")
    assert "init_scale" not in page and "growth_interval" not in page
    assert "Loss scale: none" in page and "no loss scale" in page
    assert "bf16 has fp32&#x27;s exponent range" in page or "bf16 has fp32's exponent range" in page


def test_an_fp16_report_keeps_its_scaler_and_scale_panel(tmp_path):
    page = _run(tmp_path / "run", "fp16")
    assert "init_scale" in page and "Loss scale: none" not in page


def test_an_mxfp8_report_names_the_layers_that_ran_in_the_format(tmp_path):
    pytest.importorskip("torchao")
    page = _run(tmp_path / "run", "mxfp8", steps=2)
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["precision"] == "mxfp8", meta["precision"]
    assert meta["lowp"]["converted"] == ["0"]  # '2' (4 outputs) does not fit a block of 32
    assert "1 layer(s) ran in mxfp8: &#x27;0&#x27;" in page


def test_loss_axis_labels_do_not_repeat_on_a_narrow_range(tmp_path):
    from ampguard.reporting.plots import loss_figure

    _run(tmp_path / "run", "bf16", offset=10.0, steps=12)
    fig = loss_figure(runlog.load_run(tmp_path / "run"))
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
    shown = [s for s in labels if s]
    assert len(shown) >= 2 and len(shown) == len(set(shown)), shown
