"""``ampguard lint``: argument parsing and dispatch only (imports no torch)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["lint_args", "lint_run"]


def lint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "paths", nargs="+", metavar="PATH", help="files or folders (folders recurse into *.py)"
    )
    p.add_argument(
        "--format",
        default="text",
        choices=("text", "json", "sarif"),
        help="output format (default text: path:line:col: CODE [severity] message, "
        "then the fix on an indented line)",
    )
    p.add_argument(
        "--fail-on",
        default="warning",
        choices=("error", "warning", "info"),
        help="exit 1 when a finding is this severe or worse (default warning: an info hint "
        "such as AG213 is printed but never fails a pre-commit hook)",
    )
    p.add_argument(
        "--select",
        action="append",
        default=None,
        metavar="CODES",
        help="only these codes or prefixes, comma-separated (e.g. AG201,AG21)",
    )
    p.add_argument(
        "--ignore",
        action="append",
        default=None,
        metavar="CODES",
        help="skip these codes or prefixes, comma-separated",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip files/folders matching this glob (repeatable); .git, .venv, "
        "build, site-packages, ... are always skipped inside folders",
    )
    p.add_argument(
        "--fix",
        action="store_true",
        help="rewrite the files: the mechanical fixes for AG201, AG204, AG206, AG208 (minimal "
        "edits; the rest of each file is kept byte for byte), then report what is left",
    )
    p.add_argument(
        "--diff",
        action="store_true",
        help="print the fixes --fix would make as a unified diff and change nothing "
        "(exit 1 when there is something to fix)",
    )
    p.add_argument(
        "--torch-version",
        default=None,
        metavar="X.Y",
        help="torch version the code targets, for AG208 (default: the installed one)",
    )


def _codes(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [code for value in values for code in value.split(",")]


def _not_fixed(fixed: list) -> list:
    """One line per file that needs fixing but was not written; the ones that were."""
    for item in fixed:
        if item.error is not None:
            print(f"{item.path}: not fixed: {item.error} (the file is unchanged)", file=sys.stderr)
    return [item for item in fixed if item.error is None]


def _diff(fixed: list) -> int:
    from ampguard.lint import unified_diff_bytes

    shown = _not_fixed(fixed)
    sys.stdout.flush()
    for item in shown:  # the file's own bytes: a latin-1 file's diff applies to it
        sys.stdout.buffer.write(unified_diff_bytes(item))
    sys.stdout.buffer.flush()
    count = sum(len(f.fixed) for f in shown)
    print(f"would fix {count} finding(s) in {len(shown)} file(s)", file=sys.stderr)
    return 1 if fixed else 0


def lint_run(args: argparse.Namespace) -> int:
    """Exit code 0: nothing at ``--fail-on`` severity or worse; 1: such findings; 2: usage error
    (bad code, missing path). ``--fix`` writes the fixes first and judges what is left (a file
    it could not write is one ``path: not fixed: reason`` line on stderr and exit 1);
    ``--diff`` prints them and exits 1 when there is something to fix."""
    from ampguard.lint import failing, fix_paths, format_findings, lint_paths, summary_line

    unfixed = 0  # files --fix had to leave unchanged: never exit 0 over them
    try:
        if args.fix or args.diff:
            fixed = fix_paths(
                args.paths,
                write=not args.diff,
                select=_codes(args.select),
                ignore=_codes(args.ignore),
                exclude=args.exclude,
                torch_version=args.torch_version,
            )
            if args.diff:
                return _diff(fixed)
            written = _not_fixed(fixed)
            count = sum(len(f.fixed) for f in written)
            print(f"fixed {count} finding(s) in {len(written)} file(s)", file=sys.stderr)
            unfixed = len(fixed) - len(written)
        findings = lint_paths(
            args.paths,
            select=_codes(args.select),
            ignore=_codes(args.ignore),
            exclude=args.exclude,
            torch_version=args.torch_version,
        )
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"ampguard lint: error: {err}", file=sys.stderr)
        return 2
    output = format_findings(findings, args.format)
    if output and (findings or args.format != "text"):
        sys.stdout.write(output)
    if findings and args.format == "text":
        print(summary_line(findings, args.fail_on), file=sys.stderr)
    return 1 if failing(findings, args.fail_on) or unfixed else 0
