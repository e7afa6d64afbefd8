"""The flight recorder in the run folder's report: the postmortem timeline as a panel of
``report.html`` (first rank, step and layer, the windows around it, the sampled output amax),
the dumps schema-checked as the other run-folder files are (a malformed dump is one line in the
panel, the rest of the report is written), and the amax in ``ampguard postmortem``'s text.
Real CPU training runs, real files."""

from __future__ import annotations

import html
import json
import warnings

import pytest
from test_spikes import SPIKE, _Data, _guard, _model, _train

import ampguard as ag
from ampguard.reporting.postmortem import PostmortemError, load

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def spiked_run(tmp_path_factory):
    """A bf16 run whose window SPIKE (a sampled window: 80 = 5 x 16) spikes and is skipped."""
    run = tmp_path_factory.mktemp("spiked") / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        guard = _guard(_model(), on_spike="skip", telemetry=run)
        _train(guard, _Data(), range(1, SPIKE + 3))
        guard.close()
    return run


def test_the_report_has_the_postmortem_timeline_panel(spiked_run) -> None:
    page = ag.report(spiked_run).read_text(encoding="utf-8")
    assert "Flight recorder: the postmortem timeline" in page
    assert f"<b>rank 0, step {SPIKE}</b>: loss spike" in page
    marked = f'<tr style="background:#fde2e2"><td>{SPIKE}</td>'
    row = page.split(marked)[1].split("</tr>")[0]
    assert "loss spike" in row  # the first bad window, marked in the table
    panel = page.split("Flight recorder: the postmortem timeline")[1]
    assert all(f"<tr><td>{s}</td>" in panel for s in range(SPIKE - 5, SPIKE))  # before it
    assert f"Output amax (rank 0, sampled step {SPIKE})" in page
    assert f"rank 0, step {SPIKE}: loss" in page and "skip</li>" in page  # the spikes list


def test_postmortem_text_shows_the_sampled_output_amax(spiked_run, capsys) -> None:
    from ampguard.cli._main import main

    assert main(["postmortem", str(spiked_run)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("output amax"))
    assert f"sampled step {SPIKE}" in line and ("'0'" in line or " 0 " in line or "2 " in line)
    pm = load(spiked_run)
    assert pm.ranks[0]["modules"] == ["0", "2"]


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        (lambda d: d["rows"][0].update(amax="big"), "rows[0].amax"),
        (lambda d: d["rows"][1].update(lr=[True]), "rows[1].lr"),
        (lambda d: d["rows"][2].update(scale="1"), "rows[2].scale"),
        (lambda d: d.update(modules=[3]), "'modules'"),
        (lambda d: d.update(spikes=[{"step": "80"}]), "'spikes'"),
    ],
)
def test_a_malformed_dump_is_one_line_in_the_panel_and_the_report_is_written(
    spiked_run, tmp_path, damage, field
) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(spiked_run, run)
    dump = run / "flight_recorder" / "rank0.json"
    data = json.loads(dump.read_text())
    damage(data)
    dump.write_text(json.dumps(data))
    with pytest.raises(PostmortemError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load(run)
    page = ag.report(run).read_text(encoding="utf-8")
    panel = page.split("Flight recorder: the postmortem timeline")[1]
    assert "The dumps cannot be used" in panel and html.escape(field) in panel
    assert "Run metadata" in page  # the rest of the report is there


def test_a_run_without_dumps_has_no_panel(tmp_path) -> None:
    run = tmp_path / "run"
    guard = _guard(_model(), telemetry=run)
    _train(guard, _Data(), range(1, 6), spike_at=None)
    guard.close()
    assert "Flight recorder" not in ag.report(run).read_text(encoding="utf-8")
