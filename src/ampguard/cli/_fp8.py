"""``ampguard inspect --fp8 pkg.mod:factory``: print the fp8 readiness plan of an experiment."""

from __future__ import annotations

import argparse
import json

__all__ = ["inspect_fp8", "demo_fp8"]


def inspect_fp8(args: argparse.Namespace) -> int:
    """Plan the factory's Experiment on its first batch; print the table and the findings.

    Exit code 0; 2 on a bad factory or argument (one line on stderr, no traceback); 1 when the
    user's own code (the factory, the model, the loss) raised: its traceback, shown as theirs
    (as plain ``inspect`` does).
    """
    from ampguard.cli._errors import failure
    from ampguard.cli._loader import load_factory, marked
    from ampguard.cli._types import fail
    from ampguard.experiments import Experiment, seed_all
    from ampguard.fp8 import fp8_plan

    try:
        formats = _formats(args.formats)
    except ValueError as exc:
        return fail("inspect", exc)
    raw = None
    try:
        raw = load_factory(args.factory)
        seed_all(args.seed)
        exp = marked(raw, args.factory)()
        if not isinstance(exp, Experiment):
            raise TypeError(
                f"inspect --fp8 needs a factory returning an ampguard.Experiment "
                f"(its model, loss_fn and first batch are traced), got "
                f"{type(exp).__name__}"
            )
        batch = next(iter(exp.batches), None)
        if batch is None:
            raise ValueError("the Experiment's batches are empty: the plan needs one batch")
        plan = fp8_plan(exp.model, exp.loss_fn, batch, recipe=args.recipe, formats=formats)
    except Exception as exc:  # noqa: BLE001 - sorted by failure: yours, a usage error, a bug
        return failure("inspect", args.factory, raw, exc)
    findings = plan.findings()
    if args.json:
        print(
            json.dumps(
                {"plan": plan.to_dict(), "findings": [f.to_dict() for f in findings]}, indent=2
            )
        )
        return 0
    print(plan.summary())
    print()
    for f in findings:
        print(f"{f}\n    fix: {f.fix}" if f.fix else str(f))
    return 0


def _formats(text: str) -> tuple[str, ...] | None:
    """``--formats``: "all" (every registered format), "none", or a comma-separated list."""
    from ampguard.fp8 import FORMATS

    if text.strip() == "all":
        return tuple(FORMATS)
    if text.strip() == "none":
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise ValueError(
            f"--formats: unknown format(s) {unknown or [text]}; allowed: "
            f"{', '.join(FORMATS)}, or 'all' / 'none'"
        )
    return names


def demo_fp8(args: argparse.Namespace) -> int:
    """``ampguard demo --precision fp8``; exit code 2 with one line when torchao is missing,
    ``--distributed`` is given, or ``--out`` cannot be a run folder (checked before any work, as
    the fp16 demo does)."""
    from ampguard.cli._types import fail, usable_out
    from ampguard.fp8 import Fp8UnavailableError
    from ampguard.runlog import RunFolderError

    if args.distributed:
        return fail("demo", "--precision fp8 runs in one process (no --distributed)")
    out = _out(args.out)
    try:
        usable_out(out)
    except ValueError as exc:
        return fail("demo", exc)
    try:
        from ampguard.demo.fp8 import run_fp8_demo

        run_fp8_demo(steps=args.steps, seed=args.seed, out=out, progress=not args.no_progress)
    except (Fp8UnavailableError, RunFolderError, OSError) as exc:  # OSError: the run folder
        return fail("demo", exc)
    return 0


def _out(out: str) -> str:
    # the default run folder of the fp16 demo gets an fp8 sibling, so the two runs coexist
    return "ampguard-runs/demo-fp8" if out == "ampguard-runs/demo" else out
