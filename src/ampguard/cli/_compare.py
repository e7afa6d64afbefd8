"""``ampguard compare`` and ``ampguard inspect``: argument parsing and dispatch only.

torch and the heavy modules are imported inside the handlers, so building the parser stays fast.
"""

from __future__ import annotations

import argparse
import json

from ampguard.cli._errors import failure
from ampguard.cli._types import fail, positive_int, seed, usable_out

__all__ = ["compare_args", "compare_run", "inspect_args", "inspect_run"]


def compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "factory", help="pkg.module:factory (or file.py:factory) returning an ampguard.Experiment"
    )
    p.add_argument(
        "--steps", type=positive_int, default=300, help="training steps per variant (default 300)"
    )
    p.add_argument(
        "--out", default=None, help="folder for comparison.html and comparison.json (default: none)"
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of fp32,fp16_dynamic,fp16_fixed,bf16,"
        "fp16_noscaler (default: all), or the opt-in fp8,fp8_planned "
        "(need torchao)",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed before each variant (default 0)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def compare_run(args: argparse.Namespace) -> int:
    from ampguard.cli._loader import load_factory, marked
    from ampguard.experiments import compare

    variants = (
        None
        if args.variants is None
        else [v.strip() for v in args.variants.split(",") if v.strip()]
    )
    raw = None
    try:
        if args.out is not None:
            usable_out(args.out)  # before minutes of training, not after
        raw = load_factory(args.factory)
        cmp = compare(
            marked(raw, args.factory),
            steps=args.steps,
            variants=variants,
            progress=not args.no_progress,
            seed=args.seed,
        )
    except Exception as exc:  # noqa: BLE001 - sorted below: yours, a usage error, or a bug
        return failure("compare", args.factory, raw, exc)
    print(cmp.summary())
    if args.out is not None:
        try:
            path = cmp.save(args.out)
        except OSError as exc:
            return fail(
                "compare", f"cannot write the comparison into {args.out!r}: {exc.strerror or exc}"
            )
        print(f"\nreport: {path}")
    return 0


def inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "factory",
        help="pkg.module:factory (or file.py:factory) returning a model, "
        "or an ampguard.Experiment (then its first batch is probed)",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument(
        "--seed", type=seed, default=0, help="seed before calling the factory (default 0)"
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="print the fp8 readiness plan of the "
        "factory's Experiment (ag.fp8_plan on its first batch)",
    )
    p.add_argument(
        "--recipe",
        default="tensorwise",
        choices=("tensorwise", "rowwise"),
        help="fp8 scaling recipe for --fp8 (default tensorwise)",
    )
    p.add_argument(
        "--formats",
        default="all",
        help="comma-separated low-precision formats the --fp8 plan measures per layer, or "
        "'all' (default: every registered format; 'none': the recipe alone)",
    )


def inspect_run(args: argparse.Namespace) -> int:
    """Exit code 1 when any finding is an error, else 0."""
    if args.fp8:
        from ampguard.cli._fp8 import inspect_fp8

        return inspect_fp8(args)
    from ampguard.cli._loader import load_factory, marked
    from ampguard.experiments import seed_all
    from ampguard.experiments.advisor import inspect_model

    raw = None
    try:
        raw = load_factory(args.factory)
        seed_all(args.seed)
        findings = inspect_model(marked(raw, args.factory)())
    except Exception as exc:  # noqa: BLE001 - sorted by failure
        return failure("inspect", args.factory, raw, exc)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            print(f"{f}\n    fix: {f.fix}" if f.fix else str(f))
        if not findings:
            print("no AMP hazards found")
    return 1 if any(f.severity == "error" for f in findings) else 0
