"""The ``ampguard`` command: its parser, its subcommands and ``main``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from ampguard import precisions
from ampguard.cli import _compare, _lint, _postmortem, _report
from ampguard.cli._types import Parser, fail, positive_int, seed, usable_out

__all__ = ["main", "build_parser"]

# Each subcommand: (name, help, add_arguments(parser), run(args) -> exit code).
_Subcommand = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=300, help="training steps (default 300)")
    p.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    p.add_argument(
        "--out", default="ampguard-runs/demo", help="run folder (default ampguard-runs/demo)"
    )
    p.add_argument(
        "--precision",
        default="fp16",
        choices=precisions.requests(by_name=True),
        help="precision (default fp16, the one with a loss scaler; fp8: plan, then torchao "
        "float8 on a model with an outlier-feature layer)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--distributed",
        nargs="?",
        const="ddp",
        default=None,
        choices=("ddp", "fsdp2"),
        help="train on every torchrun rank with DDP (default) or FSDP2: "
        "torchrun --nproc-per-node 2 -m ampguard demo --distributed [ddp|fsdp2]",
    )


def _fp8_demo(args: argparse.Namespace) -> int:
    from ampguard.cli._fp8 import demo_fp8  # one process, needs torchao

    return demo_fp8(args)


# Precisions with a demo of their own; every other one trains the standard demo model. fp8's
# plans first and trains a model with an outlier-feature layer (the plan keeps it in bf16).
_OWN_DEMOS: dict[str, Callable[[argparse.Namespace], int]] = {"fp8": _fp8_demo}


def _demo_run(args: argparse.Namespace) -> int:
    from ampguard.runlog import RunFolderError, TelemetryError

    if args.precision in _OWN_DEMOS:
        return _OWN_DEMOS[args.precision](args)

    try:
        usable_out(args.out)
    except ValueError as exc:
        return fail("demo", exc)
    try:
        if args.distributed:
            return _demo_distributed(args)
        from ampguard.demo import run_demo

        run_demo(
            steps=args.steps,
            seed=args.seed,
            out=args.out,
            precision=args.precision,
            progress=not args.no_progress,
        )
    except (RunFolderError, TelemetryError, OSError) as exc:  # the run folder given with --out
        return fail("demo", exc)
    return 0


def _demo_distributed(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return fail(
            "demo",
            "--distributed runs one process per rank; launch it with torchrun, "
            "e.g.: torchrun --nproc-per-node 2 -m ampguard demo --distributed "
            f"{args.distributed}",
        )
    from ampguard.demo.distributed import run_distributed_demo

    run_distributed_demo(
        args.distributed,
        steps=args.steps,
        seed=args.seed,
        out=args.out,
        precision=args.precision,
        progress=not args.no_progress,
    )
    return 0


_SUBCOMMANDS: list[_Subcommand] = [
    ("demo", "train the built-in model in fp16 on CPU through a Guard", _demo_args, _demo_run),
    (
        "compare",
        "A/B-train a factory's experiment in fp32/fp16/bf16 and give a verdict",
        _compare.compare_args,
        _compare.compare_run,
    ),
    (
        "inspect",
        "static AMP checks and an fp32 range probe of a factory's model",
        _compare.inspect_args,
        _compare.inspect_run,
    ),
    (
        "lint",
        "check training scripts for AMP mistakes (static, imports no torch)",
        _lint.lint_args,
        _lint.lint_run,
    ),
    (
        "report",
        "summarise a run folder (findings first) and write its report.html",
        _report.report_args,
        _report.report_run,
    ),
    (
        "postmortem",
        "merge a run folder's flight-recorder dumps into one timeline (first rank, step, layer)",
        _postmortem.postmortem_args,
        _postmortem.postmortem_run,
    ),
]


_DESCRIPTION = (
    "robust, observable and debuggable mixed-precision (AMP) training for PyTorch: "
    "run the demo, summarise a run, lint scripts, compare and inspect models"
)


def build_parser() -> argparse.ArgumentParser:
    """The ``ampguard`` argument parser with every subcommand."""
    from ampguard._version import __version__  # the ground floor: no torch, no metadata lookup

    parser = Parser(prog="ampguard", description=_DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"ampguard {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, add_args, run in _SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ampguard`` console script; returns the exit code.

    Output piped into a reader that stops early (``ampguard lint src | head``) ends the command
    quietly with status 1 instead of a ``BrokenPipeError`` traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit flush
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
