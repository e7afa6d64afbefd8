"""``ampguard report RUN_DIR``: arguments and dispatch (the work is in ampguard.reporting)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["report_args", "report_run"]

_LEVELS = {"warning": ("warning", "error"), "error": ("error",), "never": ()}


def report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder written by ampguard.Telemetry")
    p.add_argument("--fail-on", choices=tuple(_LEVELS), default="never",
                   help="exit with status 1 when a finding of this severity or worse exists "
                        "(default never)")
    p.add_argument("--no-html", action="store_true", help="print the summary only")


def report_run(args: argparse.Namespace) -> int:
    from ampguard.reporting import _analyse, report, summary_text  # matplotlib: only for the HTML

    try:
        run, found, _causes, facts = _analyse(args.run_dir, None)
        print(summary_text(run, found, facts))
        if not args.no_html:
            print(f"report: {report(args.run_dir)}")
    except ValueError as exc:
        print(f"ampguard report: {exc}", file=sys.stderr)
        return 2
    return 1 if any(f.severity in _LEVELS[args.fail_on] for f in found) else 0
