"""The report and summary of a run folder: the rules over its log, the HTML page, the text."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ampguard import rules, runlog
from ampguard._util.atomic import write_text
from ampguard.findings import Finding
from ampguard.reporting._unscaled import what_ran, without_loss_scale
from ampguard.reporting.html import render
from ampguard.reporting.summary import run_facts, summary_text

__all__ = ["Analysis", "analyse", "need_matplotlib", "report", "summary", "print_summary"]


@dataclass(frozen=True)
class Analysis:
    """A run folder read once: its log, the findings of the rules, the skipped steps by cause
    and the facts the summary and the page print (what :func:`analyse` returns; the CLI prints
    the summary and writes the page from one reading)."""

    run: runlog.RunLog
    found: list[Finding]
    causes: dict[str, list[int]]
    facts: dict[str, Any]

    def summary(self) -> str:
        """The terminal summary (as :func:`summary`). Cost: none beyond formatting."""
        return summary_text(self.run, self.found, self.facts)

    def write(self) -> Path:
        """Write ``findings.json`` and ``report.html``; return the page's path. Needs
        matplotlib (call :func:`need_matplotlib` first to fail before the analysis)."""
        return _write(self.run, self.found, self.causes, self.facts)


def analyse(run_dir: str | os.PathLike, config: rules.RuleConfig | None = None) -> Analysis:
    """Read ``run_dir`` and apply the rules (``config`` overrides their thresholds). Raises
    ``ValueError`` (``ampguard.runlog.RunFolderError``, naming the file) for a folder that is
    not a usable run folder. Cost: one read of the run log."""
    run = runlog.load_run(run_dir)
    found = rules.evaluate(run, config)
    causes = rules.skip_causes(run, config)
    return Analysis(run, found, causes, run_facts(run, causes))


def _save_findings(run: runlog.RunLog, found: list[Finding]) -> None:
    runlog.write_json_atomic(run.run_dir / runlog.FINDINGS, [f.to_dict() for f in found])


def report(run_dir: str | os.PathLike, *, config: rules.RuleConfig | None = None) -> Path:
    """Write ``run_dir/report.html`` (self-contained, opens offline) and ``findings.json``.

    ``config`` overrides the rule thresholds. Returns the report's path. Raises ``ValueError``
    (``ampguard.runlog.RunFolderError``, naming the file) when ``run_dir`` is not a usable run
    folder. Needs matplotlib (``pip install 'ampguard[report]'``).
    """
    need_matplotlib()
    return analyse(run_dir, config).write()


def need_matplotlib() -> None:
    """``ImportError`` saying what to install unless matplotlib (the report's figures) imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "ampguard.reporting needs matplotlib: pip install 'ampguard[report]'"
        ) from exc


def _write(
    run: runlog.RunLog, found: list[Finding], causes: dict[str, list[int]], facts: dict[str, object]
) -> Path:
    """findings.json and report.html of an analysed run (what :func:`report` does after the
    analysis; the CLI calls it to read the log once for the summary and the page)."""
    import matplotlib

    from ampguard.reporting.plots import FIGURES

    _save_findings(run, found)
    with matplotlib.rc_context({"text.usetex": False}):  # user text is never LaTeX
        figures: list[tuple[str, bytes | str | None]] = [
            (title, make(run)) for _, title, make in FIGURES
        ]
    if without_loss_scale(run):  # no flat 2^0 panel: say what ran instead
        figures = [
            ("Loss scale: none", what_ran(run)) if key == "scale" else fig
            for (key, _, _), fig in zip(FIGURES, figures, strict=True)
        ]
    page = render(run, found, facts, causes, figures)
    target = run.run_dir / runlog.REPORT
    write_text(target, page)
    return target


def summary(run_dir: str | os.PathLike, *, config: rules.RuleConfig | None = None) -> str:
    """The terminal summary of ``run_dir``: findings with fixes first, then skips and scale."""
    return analyse(run_dir, config).summary()


def print_summary(
    run_dir: str | os.PathLike,
    file: TextIO | None = None,
    *,
    config: rules.RuleConfig | None = None,
) -> None:
    """Print :func:`summary` to ``file`` (stdout by default)."""
    print(summary(run_dir, config=config), file=file or sys.stdout)
