"""What a user trips over in the report: a Guard's run gets its report.html at close, plain
tick labels on log axes, evidence that wraps, one heatmap column per sampled step."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from _telemetry_runs import mlp, train

import ampguard as ag
from ampguard import runlog
from ampguard.reporting import plots


def _guarded(run_dir, steps: int = 6, **telemetry) -> None:
    model = mlp()
    tel = ag.Telemetry(run_dir, **telemetry) if telemetry else run_dir
    with ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), precision="fp16", telemetry=tel
    ) as guard:
        train(guard, model, steps)


def test_leaving_a_guard_block_writes_the_report(tmp_path):
    _guarded(tmp_path)
    page = (tmp_path / runlog.REPORT).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64," in page
    assert (tmp_path / runlog.FINDINGS).exists()


def test_without_matplotlib_the_guard_notes_the_missing_report_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with pytest.warns(RuntimeWarning, match=r"no report.html written .*ampguard\[report\]"):
        _guarded(tmp_path, steps=3)
    assert (tmp_path / runlog.FINDINGS).exists() and not (tmp_path / runlog.REPORT).exists()


def test_log_axis_tick_labels_are_plain_numbers():
    fig = plots._figure()
    ax = fig.add_subplot()
    ax.plot(np.arange(20), np.linspace(6.9, 7.3, 20))
    ax.set_yscale("log")
    plots._plain_log_labels(ax)
    plots._png(fig)  # draws: the labels exist only then
    labels = [t.get_text() for t in ax.get_yticklabels(minor=True) + ax.get_yticklabels()]
    assert "7" in labels and "6.9" in labels
    assert not [t for t in labels if "times" in t or "^" in t]


def test_a_short_run_gets_a_heatmap_column_per_sampled_step():
    edges = plots._column_edges(np.arange(1, 21))
    assert len(edges) == 21 and np.allclose(np.diff(edges), 1.0)  # 20 equal columns
    irregular = plots._column_edges(np.array([1, 2, 3, 10]))
    assert irregular.tolist() == [0.5, 1.5, 2.5, 6.5, 13.5]  # each sample is its own column
    assert plots._column_edges(np.array([7])).tolist() == [6.5, 7.5]


def test_the_heatmap_of_a_short_run_renders_every_sampled_step(tmp_path):
    _guarded(tmp_path, steps=20, layer_every=1, range_every=0)
    run = runlog.load_run(tmp_path)
    assert len(run.layer_steps) == 20
    assert plots.heatmap_plot(run).startswith(b"\x89PNG")


def test_finding_evidence_wraps_inside_its_card(tmp_path):
    _guarded(tmp_path, steps=3)
    page = (tmp_path / runlog.REPORT).read_text(encoding="utf-8")
    css = page[page.index("<style>") : page.index("</style>")]
    assert "white-space:pre-wrap" in css and "overflow-wrap:anywhere" in css


def test_the_range_panel_draws_each_layers_safe_window_from_safe_lo_to_safe_hi(tmp_path):
    _guarded(tmp_path, steps=4, layer_every=1, range_every=2)
    run = runlog.load_run(tmp_path)
    k = int(np.flatnonzero(run.range_applied)[-1])
    lo, hi = run.safe_lo[k], run.safe_hi[k]
    assert np.isfinite(lo).all() and np.isfinite(hi).all() and (hi > 2 * lo).all()
    fig = plots.range_figure(run)
    bars = sorted(fig.axes[0].patches, key=lambda b: b.get_y())  # one bar per layer, top down
    assert len(bars) == len(run.layers)
    left = np.array([b.get_x() for b in bars])
    right = np.array([b.get_x() + b.get_width() for b in bars])
    assert np.allclose(left, lo) and np.allclose(right, hi)  # not lo + hi / lo
    assert plots.range_plot(run).startswith(b"\x89PNG")
