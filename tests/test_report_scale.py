"""The report at scale and verbatim layer names (item 2): the log is streamed
into compact columns, the plots draw a bounded number of points, spikes stay visible, and a
'$...$' in a layer name is text, not math."""

from __future__ import annotations

import tracemalloc
import warnings

import numpy as np
import pytest
from _runfolders import LAYERS, step, steps, write

import ampguard as ag
from ampguard import runlog
from ampguard.reporting import _thin, plots


def long_run(tmp_path, n: int, oscillate: bool = False):
    recs = []
    for i in range(1, n + 1):
        scale = 2.0 ** (10 + (i % 2 if oscillate else (i // 5000) % 3))
        recs.append(step(i, scale=scale, applied=i % 97 != 0, layers=i % 10 == 0, rng=i % 100 == 0))
    recs[n // 2]["loss"] = 1e4  # one spike the envelope must keep
    return write(tmp_path / "run", recs)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return long_run(tmp_path_factory.mktemp("big"), 30_000)


def drawn(monkeypatch, make, run) -> dict[str, int]:
    """The largest number of points any artist of the figure ``make(run)`` draws."""
    figs = []
    original = plots._png
    monkeypatch.setattr(plots, "_png", lambda fig: figs.append(fig) or original(fig))
    assert make(run) is not None
    sizes = {"lines": 0, "markers": 0, "polys": 0, "image_columns": 0}
    for ax in figs[0].axes:
        for line in ax.lines:
            sizes["lines"] = max(sizes["lines"], len(line.get_xdata()))
        for coll in ax.collections:
            if hasattr(coll, "get_paths") and type(coll).__name__ in (
                "FillBetweenPolyCollection",
                "PolyCollection",
            ):
                sizes["polys"] = max(sizes["polys"], max(len(p.vertices) for p in coll.get_paths()))
            else:
                sizes["markers"] = max(sizes["markers"], len(coll.get_offsets()))
        for image in ax.images:
            sizes["image_columns"] = max(sizes["image_columns"], image.get_array().shape[1])
    return sizes


@pytest.mark.parametrize("oscillate", [False, True])
def test_long_run_plots_draw_a_bounded_number_of_points(tmp_path, monkeypatch, oscillate):
    run = runlog.load_run(long_run(tmp_path, 30_000, oscillate))
    for make in (plots.scale_plot, plots.loss_plot, plots.heatmap_plot):
        sizes = drawn(monkeypatch, make, run)
        assert sizes["lines"] <= _thin.MAX_POINTS + 2, (make.__name__, sizes)
        assert sizes["markers"] <= _thin.MAX_MARKERS, (make.__name__, sizes)
        assert sizes["polys"] <= 4 * _thin.MAX_POINTS + 8, (make.__name__, sizes)
        assert sizes["image_columns"] <= _thin.MAX_POINTS, (make.__name__, sizes)


def test_a_step_wise_scale_keeps_every_change_exactly():
    scale = np.repeat([1024.0, 512.0, 1024.0, 2048.0], 10_000)
    keep = _thin.changes(scale)
    assert keep.tolist() == [0, 10_000, 20_000, 30_000, 39_999]
    assert scale[keep].tolist() == [1024.0, 512.0, 1024.0, 2048.0, 2048.0]


def test_the_envelope_keeps_a_single_spike():
    y = np.ones(1_000_000)
    y[123_457] = 1e4
    y[5] = np.nan
    env = _thin.envelope(np.arange(len(y)), y)
    assert len(env.x) <= _thin.MAX_POINTS and env.hi.max() == 1e4 and env.lo.min() == 1.0
    assert np.isfinite(env.mean).all()


def test_reading_streams_into_compact_columns(big):
    """tracemalloc peak of load_run over 30,000 steps: the columns (~3 MB), far below the ~50 MB
    that holding each line's dict costs."""
    tracemalloc.start()
    try:
        run = runlog.load_run(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(run.steps) == 30_000 and run.layer_norm.shape == (3000, 3)
    assert peak < 15 * 2**20, peak


def test_a_long_run_report_renders(big):
    page = ag.report(big).read_text()
    assert page.count("data:image/png;base64,") == 4 and "30000" in page.replace(",", "")


def test_layer_names_with_dollar_signs_are_shown_verbatim(tmp_path, monkeypatch):
    run = runlog.load_run(write(tmp_path / "run", steps(30)))
    figs = []
    original = plots._png
    monkeypatch.setattr(plots, "_png", lambda fig: figs.append(fig) or original(fig))
    for make in (plots.heatmap_plot, plots.range_plot):
        assert make(run) is not None  # 'a$b^$' is not valid math text: this raised before
    labels = [t for fig in figs for ax in fig.axes for t in ax.get_yticklabels()]
    shown = {t._preprocess_math(t.get_text())[0] for t in labels}  # what matplotlib draws
    assert set(LAYERS) <= shown


def test_plain_text_escapes_only_dollars():
    assert _thin.plain_text("a$b^$") == r"a\$b^\$" and _thin.plain_text("x_1") == "x_1"


def test_hostile_values_in_a_long_log_still_render(tmp_path):
    recs = steps(40)
    recs[10]["scale"] = None
    recs[11]["loss"] = float("inf")
    recs[12]["scale_before"] = 0.0
    resumes = [{"kind": "resume", "step": 40 + i} for i in range(200)]
    folder = write(tmp_path / "run", recs + resumes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert ag.report(folder).exists()
