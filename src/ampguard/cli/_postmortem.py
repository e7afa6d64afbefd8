"""``ampguard postmortem RUN_DIR [--autopsy]``: arguments and dispatch (the work is in
``ampguard.reporting.postmortem``)."""

from __future__ import annotations

import argparse

from ampguard.cli._types import fail

__all__ = ["postmortem_args", "postmortem_run"]


def postmortem_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder of a Guard(telemetry=RUN_DIR)")
    p.add_argument(
        "--autopsy",
        action="store_true",
        help="also name each spike's mechanism and layer from the recorded signals",
    )
    p.add_argument(
        "--around", type=int, default=5, help="windows shown either side of the first (default 5)"
    )


def postmortem_run(args: argparse.Namespace) -> int:
    from ampguard.reporting.postmortem import PostmortemError, load, text

    try:
        pm = load(args.run_dir)
    except PostmortemError as exc:
        return fail("postmortem", exc)
    print(text(pm, around=max(args.around, 0), autopsy=args.autopsy))
    return 0
