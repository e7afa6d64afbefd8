"""One planted fault judged: inject it, run the judge on the failed step, take it out.

Shared by the fault zoo's MLP events (``fault_zoo.run_fault``) and its HF GPT-2 events
(``_fault_gpt2.run_gpt2``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampguard.testing import inject_fault

__all__ = ["judged"]


def judged(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    batch: Any,
    event: dict[str, Any],
    judge: Callable[..., dict[str, Any]],
    want_op: str,
    precision: str = "bf16",
    scale: float = 1.0,
) -> dict[str, Any]:
    """``event``'s fault (bit, phase, persistent, module, op, element) planted in ``model``;
    the first forward is the recorded step, so a transient fault has fired before the replays
    and does not come back. The row: the event, the verdict wanted, whether it fired and the
    judge's verdicts."""
    inj = inject_fault(
        model,
        module=event["module"],
        op=event["op"],
        bit=event["bit"],
        phase=event["phase"],
        persistent=event["persistent"],
        element=event["element"],
    ).__enter__()
    try:
        res = judge(model, loss_fn, batch, precision, scale)
    finally:
        inj.remove()
    want = "persistent_fault" if event["persistent"] else "transient_fault"
    return {"event": event, "want": want, "want_op": want_op, "fired": inj.fired, **res}
