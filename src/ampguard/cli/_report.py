"""``ampguard report RUN_DIR``: arguments and dispatch (the work is in ampguard.reporting)."""

from __future__ import annotations

import argparse

from ampguard.cli._types import fail

__all__ = ["report_args", "report_run"]

_LEVELS = {"warning": ("warning", "error"), "error": ("error",), "never": ()}


def report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder written by ampguard.Telemetry")
    p.add_argument(
        "--fail-on",
        choices=tuple(_LEVELS),
        default="never",
        help="exit with status 1 when a finding of this severity or worse exists (default never)",
    )
    p.add_argument("--no-html", action="store_true", help="print the summary only")


def report_run(args: argparse.Namespace) -> int:
    from ampguard.reporting import analyse, need_matplotlib

    try:
        if not args.no_html:
            need_matplotlib()  # before the analysis: fail fast, and in one line
        analysis = analyse(args.run_dir)  # read the log once
        found = analysis.found
        print(analysis.summary())
        if not args.no_html:
            print(f"report: {analysis.write()}")
    except (ValueError, ImportError) as exc:
        return fail("report", exc)
    except OSError as exc:  # e.g. a read-only run folder: report.html cannot be written
        return fail(
            "report",
            f"cannot write into {args.run_dir}: {exc.strerror or exc}"
            + (f" ({exc.filename})" if exc.filename else ""),
        )
    return 1 if any(f.severity in _LEVELS[args.fail_on] for f in found) else 0
