"""ag.report, the terminal summary and ``ampguard report``: self-contained HTML that renders in
a real browser."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from _telemetry_runs import mlp, resumed, run, train

import ampguard as ag
from ampguard import cli
from ampguard.reporting import summary

CHROMIUM = shutil.which("chromium")
_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=5000",
]


@pytest.fixture(scope="module")
def reset_run(tmp_path_factory) -> Path:
    """A resume without scaler state: warm-up skips twice and an AG107 finding."""
    path = tmp_path_factory.mktemp("reset")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        resumed(path, restore_guard=False, before=24, after=16, range_every=4)
    return path


@pytest.fixture(scope="module")
def reset_page(reset_run) -> Path:
    return ag.report(reset_run)


@pytest.fixture(scope="module")
def underflow_page(tmp_path_factory) -> Path:
    """Three AG106 findings; findings.json removed before the report writes it again."""
    path = tmp_path_factory.mktemp("underflow")
    run(path, mlp(), 20, scaler=ag.ScalerConfig(init_scale=1.0, dynamic=False), amp=1e-4)
    (path / "findings.json").unlink()
    return ag.report(path)


def images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


# ---------------------------------------------------------------------- the HTML
def test_report_writes_a_self_contained_page(reset_run, reset_page):
    assert reset_page == reset_run / "report.html"
    page = reset_page.read_text(encoding="utf-8")
    pngs = images(page)
    assert len(pngs) == 4 and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    assert not re.search(r"https?://|<script|<link|src=\"(?!data:)", page)


def test_report_lists_findings_with_their_fixes(underflow_page):
    page = underflow_page.read_text(encoding="utf-8")
    assert page.count('class="finding warning"') == 3
    assert "AG106" in page and "gradient underflow" in page
    assert "Use a larger loss scale" in page


def test_report_tables_skip_causes_and_metadata(reset_page):
    page = reset_page.read_text(encoding="utf-8")
    assert "<td>warm-up overflow</td>" in page
    assert torch.__version__ in page and "&quot;scale_reset&quot;: true" in page


def test_report_of_a_run_with_no_steps_yet(tmp_path):
    model = mlp()
    ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", telemetry=tmp_path
    )
    page = ag.report(tmp_path).read_text(encoding="utf-8")
    assert images(page) == [] and page.count("Not recorded in this run.") == 4


def test_report_needs_a_run_folder(tmp_path):
    with pytest.raises(ValueError, match="not an ampguard run folder"):
        ag.report(tmp_path)


def test_report_writes_findings_json(underflow_page):
    assert (underflow_page.parent / "findings.json").read_text().count('"AG106"') == 3


# ---------------------------------------------------------------------- terminal and CLI
def test_summary_prints_findings_before_the_numbers(reset_run):
    text = summary(reset_run)
    lines = text.splitlines()
    assert lines[1] == "findings (1):" and lines[2].startswith("  AG107 [warning]")
    assert any(line.startswith("      fix: Lower the learning rate") for line in lines)
    assert text.index("AG107") < text.index("steps 1-40:")
    assert "resumed at step 24: scale 65536.0" in text


def test_summary_of_a_healthy_run(tmp_path):
    model = mlp()
    with ag.Guard(
        model, torch.optim.AdamW(model.parameters()), precision="fp16", telemetry=tmp_path
    ) as guard:
        train(guard, model, 5)
    assert "findings: none" in summary(tmp_path)


def test_cli_report_prints_the_summary_and_writes_the_page(underflow_page, capsys):
    folder = underflow_page.parent
    underflow_page.unlink()
    assert cli.main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == "findings (3):"
    assert out.rstrip().endswith(f"report: {underflow_page}")
    assert underflow_page.exists()


@pytest.mark.parametrize("level,code", [("never", 0), ("warning", 1), ("error", 0)])
def test_cli_report_fail_on(reset_run, capsys, level, code):
    assert cli.main(["report", str(reset_run), "--no-html", "--fail-on", level]) == code


def test_cli_report_on_a_folder_without_a_run(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "not an ampguard run folder" in capsys.readouterr().err


# ---------------------------------------------------------------------- a real browser
def chromium(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run(
        [CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.timeout(200)
@pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed "
    "(apt-get install -y chromium); the report is not rendered in a browser",
)
def test_report_renders_in_headless_chromium_without_console_errors(reset_page, tmp_path):
    page = reset_page
    shot = tmp_path / "shot.png"
    done = chromium(tmp_path, page.as_uri(), f"--screenshot={shot}", "--window-size=1000,2400")
    assert done.returncode == 0, done.stderr[-2000:]
    assert ":CONSOLE" not in done.stderr  # the page logs nothing: no errors, no warnings
    assert shot.read_bytes().startswith(b"\x89PNG")
    # A copy with a probe script: every figure decoded to a real bitmap.
    probe = tmp_path / "probe.html"
    probe.write_text(
        page.read_text(encoding="utf-8").replace(
            "</body>",
            "<script>addEventListener('load', () => { document.title = 'decoded ' + "
            "[...document.images].filter(i => i.complete && i.naturalWidth > 400).length; });"
            "</script></body>",
        ),
        encoding="utf-8",
    )
    dom = chromium(tmp_path, probe.as_uri(), "--dump-dom")
    assert "<title>decoded 4</title>" in dom.stdout
    assert "loss scale gap after resume" in dom.stdout


def test_importing_the_reporting_module_keeps_ag_report_callable(tmp_path):
    import ampguard.reporting  # noqa: F401  (a submodule import must not shadow ag.report)

    assert callable(ag.report)
    assert ag.report is ampguard.reporting.report


class _Escapes(torch.nn.Module):
    """A block whose linear runs outside autocast: the census must name it (AG310)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.escaper = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = self.inner(x)
        with torch.autocast("cpu", enabled=False):
            return self.escaper(x.float())


def test_report_shows_the_autocast_coverage_of_the_chosen_step(tmp_path):
    model = _Escapes()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ag.Guard(model, opt, precision="fp16", telemetry=tmp_path, coverage_step=2) as guard:
        for _ in range(3):
            with guard.autocast():
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            guard.backward(loss)
            guard.step()
    page = ag.report(tmp_path).read_text()
    assert "Autocast coverage (step 2, fp16)" in page
    assert "escaped autocast (AG310): escaper" in page
