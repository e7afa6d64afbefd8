"""Can a numerics event's module and op come from its first bad module alone?

Issue #32 wants numerics triaged in at most 3 step-equivalents; ``locate``'s whole-model traced
passes cost most of it. This checks the cheap alternative on the fault zoo's numerics cases:
from the triage's own low-precision replay (every leaf's inputs captured), take the first leaf
whose output held a NaN/inf (``first_bad_module``), re-run only that leaf on its captured inputs
and name the first op whose output went non-finite from finite inputs. It prints, per case,
``locate``'s answer, the module-only answer, whether they agree, and the CPU time of each.

    PYTHONPATH=src python benchmarks/triage_module_op.py
"""

from __future__ import annotations

import time
from typing import Any

import torch
from fault_zoo import _numerics_cases
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ampguard.core.policy import device_of, resolve_precision
from ampguard.forensics._locate import locate
from ampguard.forensics._optrace import op_name
from ampguard.forensics._replay import Preserved
from ampguard.forensics._triage_runs import first_bad_module, run


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _floats(value))


class _FirstNonfinite(TorchDispatchMode):
    """The first op whose output holds a NaN/inf while its inputs are finite."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.op is None and _finite((args, kwargs)) and not _finite(out):
            self.op = op_name(func)
        return out


def main() -> None:
    agree = total = 0
    for name, model, loss_fn, batch, precision, scale, want, opt in _numerics_cases():
        if want != "numerics":
            continue
        policy = resolve_precision(precision, device_of(model.parameters()))
        keep = Preserved(model)
        try:
            keep.reset()
            t0 = time.process_time()
            low = run(model, loss_fn, batch, policy, scale, capture=True)
            t1 = time.process_time()
            module, op = first_bad_module(low), None
            if module is not None and low.captures is not None:
                cap = low.captures.caps[module]
                if _finite(cap.args):
                    with torch.no_grad(), policy.autocast(), _FirstNonfinite() as mode:
                        model.get_submodule(module)(*cap.args)
                    op = mode.op
            t2 = time.process_time()
            keep.reset()
            opt_used = opt if not low.bad else None
            diag = locate(model, loss_fn, batch, precision, scale, optimizer=opt_used)
            t3 = time.process_time()
        finally:
            keep.close()
        same = (diag.module, diag.op) == (module, op)
        agree += same
        total += 1
        print(
            f"{name:22s} failed={low.bad!s:5} locate=({diag.kind}, {diag.phase}, "
            f"{diag.module!r}, {diag.op}) module-only=({module!r}, {op}) agree={same} "
            f"cpu s: replay {t1 - t0:.4f} module-only {t2 - t1:.4f} locate {t3 - t2:.4f}"
        )
    print(f"module-only agrees with locate on {agree}/{total} numerics cases")


if __name__ == "__main__":
    main()
