"""Small UX items: --version, a missing run folder, warnings that point
at the user's line, findings() without telemetry, a short run's heatmap, integer step ticks."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from _telemetry_runs import mlp, train

import ampguard as ag
from ampguard import runlog
from ampguard.cli import main
from ampguard.reporting import plots


def test_version_prints_the_package_version_without_torch():
    code = (
        "import sys; from ampguard.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ampguard {ag.__version__}"


def test_report_on_a_missing_folder_says_it_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["report", str(missing) + "/"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "not an ampguard run folder" not in err
    (tmp_path / "file").write_text("x")
    assert main(["report", str(tmp_path / "file")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def _guard(**kwargs):
    model = mlp()
    return model, ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), **kwargs)


def test_warnings_point_at_the_users_line():
    model, guard = _guard(precision="fp16", accumulation_steps=2)
    with guard.autocast():
        loss = model(torch.randn(4, 16)).float().pow(2).mean()
    guard.backward(loss)
    with pytest.warns(RuntimeWarning, match="mid-window") as got:
        guard.state_dict()  # the line the warning must name
    assert [w.filename for w in got] == [__file__]
    # a collapse under on_collapse="warn", reached through step() -> _settle -> _on_collapse
    model, guard = _guard(
        precision="fp16", scaler=ag.ScalerConfig(init_scale=1.0, on_collapse="warn")
    )
    with pytest.warns(RuntimeWarning, match="collapsed") as got:
        train(guard, model, 2, inject={1, 2})
    assert {w.filename for w in got} == {__file__.replace("test_ux_small", "_telemetry_runs")}


def test_findings_without_telemetry_return_what_forensics_found():
    model, guard = _guard(precision="fp16", forensics=True)
    assert guard.findings() == []  # forensics found nothing: no error
    model, guard = _guard(precision="fp16")
    with pytest.warns(RuntimeWarning, match="the AG1xx rules need a run log") as got:
        assert guard.findings() == []
    assert [w.filename for w in got] == [__file__]


def test_a_20_step_run_gets_a_column_per_step_and_says_what_white_means(tmp_path):
    model = mlp()
    with ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), precision="fp16", telemetry=tmp_path
    ) as guard:  # the default Telemetry: layer_every=10
        train(guard, model, 20)
    run = runlog.load_run(tmp_path)
    assert run.layer_steps.tolist() == list(range(1, 21))
    fig = plots.heatmap_figure(run)
    ax = fig.axes[0]
    assert ax.get_title(loc="right") == plots.HEATMAP_NOTE
    assert "white" in plots.HEATMAP_NOTE and "not recorded" in plots.HEATMAP_NOTE


def test_step_axes_have_integer_ticks(tmp_path):
    model = mlp()
    with ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), precision="fp16", telemetry=tmp_path
    ) as guard:
        train(guard, model, 5)
    run = runlog.load_run(tmp_path)
    for make in (plots.scale_figure, plots.loss_figure):
        fig = make(run)
        fig.canvas.draw()
        ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= 5]
        assert ticks and all(float(t).is_integer() for t in ticks), (make.__name__, ticks)


@pytest.mark.parametrize(
    ("layer_every", "expected"),
    [(None, [*range(1, 33), 40, 50, 60]), (10, [10, 20, 30, 40, 50, 60])],
)
def test_only_the_default_samples_a_short_runs_first_steps(tmp_path, layer_every, expected):
    model = mlp()
    tel = ag.Telemetry(tmp_path, layer_every=layer_every, range_every=0)
    with ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), precision="fp16", telemetry=tel
    ) as guard:
        train(guard, model, 60)
    steps = runlog.load_run(tmp_path).layer_steps.tolist()
    assert steps == expected  # an explicit layer_every is kept exactly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plots.heatmap_plot(runlog.load_run(tmp_path)).startswith(b"\x89PNG")
