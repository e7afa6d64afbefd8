"""What ag.triage replays per cause: the passes are counted (the model's forward calls, the CPU
reference check), so the cost of an event cannot silently grow back."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampguard as ag
import ampguard.forensics._triage as triage_module
from ampguard.forensics import triage_step
from ampguard.replay import Preserved
from ampguard.testing import inject_fault


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def _loss(m: nn.Module, b: Any) -> torch.Tensor:
    return F.mse_loss(m(b[0]).float(), b[1])


def _log_zero(m: nn.Module, b: Any) -> torch.Tensor:
    return -torch.log(torch.relu(m(b[0]).float()) * 0).mean()


class _Hot(nn.Module):
    """fc1's output times 3000 leaves fp16's range: numerics, fine in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x) * 3000.0)


def _batch(seed: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g) * scale, torch.randn(16, 4, generator=g)


def _triaged(model, loss_fn, batch, precision="bf16", scale=1.0, monkeypatch=None):
    """Record the step once (signatures), then triage it counting the model's forward calls
    and the reference checks: ``(event, forwards, reference_checks)``."""
    keep = Preserved(model)
    rec = ag.SignatureRecorder(model, capacity=1)
    keep.reset()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with torch.autocast("cpu", dtype=dtype):
        loss = loss_fn(model, batch)
    (loss.float() * scale).backward()
    rec.remove()
    sig = rec.read(rec.steps[-1])
    rng = rec.rng_state(sig.step)
    keep.close()
    counts = {"forward": 0, "reference": 0}
    real = triage_module.reference_check

    def counted(*a: Any, **k: Any) -> Any:
        counts["reference"] += 1
        return real(*a, **k)

    assert monkeypatch is not None
    monkeypatch.setattr(triage_module, "reference_check", counted)

    def pre(*_a: Any) -> None:
        counts["forward"] += 1

    hook = model.register_forward_pre_hook(pre)
    try:
        ev = triage_step(
            model, loss_fn, batch, sig, precision=precision, scale=scale, rng_state=rng
        )
    finally:
        hook.remove()
    return ev, counts["forward"], counts["reference"]


def test_transient_fault_is_one_replay(monkeypatch) -> None:
    model = _mlp()
    with inject_fault(model, module="2", bit="exponent_top", element=3):
        ev, fwd, ref = _triaged(model, _loss, _batch(), monkeypatch=monkeypatch)
    assert ev.cause == "transient_fault" and (fwd, ref) == (1, 0)


def test_persistent_fault_is_one_replay_and_one_reference_check(monkeypatch) -> None:
    model = _mlp()
    with inject_fault(model, module="2", bit="exponent_top", element=3, persistent=True):
        ev, fwd, ref = _triaged(model, _loss, _batch(), monkeypatch=monkeypatch)
    assert (ev.cause, ev.module, ev.op) == ("persistent_fault", "2", "aten.addmm")
    assert (fwd, ref) == (1, 1)


@pytest.mark.parametrize("where", ["batch", "weights"])
def test_a_nan_the_batch_or_weights_hold_needs_no_reference_check(monkeypatch, where) -> None:
    model, batch = _mlp(), _batch()
    if where == "batch":
        batch[0][3, 2] = float("nan")
    else:
        with torch.no_grad():
            model[2].weight[0, 0] = float("inf")
    ev, fwd, ref = _triaged(model, _loss, batch, monkeypatch=monkeypatch)
    assert (ev.cause, ev.module, ev.phase) == (
        "model_or_data",
        "0" if where == "batch" else "2",
        "forward",
    )
    assert (fwd, ref) == (2, 0)  # the replay and the fp32 replay; no CPU reference
    assert ev.evidence["replays"] == 2 and ev.evidence["explained_by"] == where


def test_a_nan_the_loss_makes_is_reference_checked(monkeypatch) -> None:
    ev, fwd, ref = _triaged(_mlp(), _log_zero, _batch(), monkeypatch=monkeypatch)
    assert (ev.cause, ev.module) == ("model_or_data", None)
    assert (fwd, ref) == (2, 1) and ev.evidence["replays"] == 3
    assert "explained_by" not in ev.evidence


def test_numerics_event_passes(monkeypatch) -> None:
    torch.manual_seed(0)
    ev, fwd, ref = _triaged(
        _Hot(), _loss, _batch(scale=30.0), "fp16", 2.0**16, monkeypatch=monkeypatch
    )
    assert (ev.cause, ev.op) == ("numerics", "aten.mul") and ev.diagnosis is not None
    # the replay, the fp32 replay, then locate's low-precision and fp32 traced passes
    assert (fwd, ref) == (4, 1)


def test_a_nan_that_does_not_reach_the_step_is_checked_in_full(monkeypatch) -> None:
    model = _mlp()
    model.register_buffer("unused", torch.tensor([float("nan")]))  # read by nothing
    ev, _, ref = _triaged(model, _loss, _batch(), monkeypatch=monkeypatch)
    assert ev.cause == "model_or_data" and ev.evidence["reproduced"] is True
    assert ref == 1 and "explained_by" not in ev.evidence


def test_a_transient_fault_on_a_nan_batch_is_still_transient(monkeypatch) -> None:
    model, batch = _mlp(), _batch()
    batch[0][3, 2] = float("nan")
    with inject_fault(model, module="2", bit="mantissa", element=40):
        ev, fwd, ref = _triaged(model, _loss, batch, monkeypatch=monkeypatch)
    assert (ev.cause, ev.module, fwd, ref) == ("transient_fault", "2", 1, 0)


def test_the_reference_comparison_reads_equal_nans_as_equal_bits() -> None:
    from ampguard.forensics._faultcheck import deviates

    nan = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.bfloat16)
    assert not deviates(nan, nan.clone())  # the same bits: equal at once
    assert not deviates(nan, torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16))
    assert deviates(nan, torch.tensor([1.0, 2.0, 0.0], dtype=torch.bfloat16))


@pytest.mark.xfail(
    strict=True,
    reason="issue #32: numerics still runs locate's whole-model traced passes (its module and "
    "op are read from them); a module-only trace of the replay's first bad leaf names neither "
    "on any of the zoo's 7 numerics cases",
)
def test_numerics_runs_no_whole_model_traced_pass(monkeypatch) -> None:
    from ampguard.forensics import _optrace

    sessions: list[str] = []
    real = _optrace.OpTrace.session

    def counted(self: Any, phase: str) -> Any:
        if self.model is model:
            sessions.append(phase)
        return real(self, phase)

    monkeypatch.setattr(_optrace.OpTrace, "session", counted)
    torch.manual_seed(0)
    model = _Hot()
    ev, _, _ = _triaged(model, _loss, _batch(scale=30.0), "fp16", 2.0**16, monkeypatch=monkeypatch)
    assert ev.cause == "numerics" and (ev.module, ev.op) == ("", "aten.mul")
    assert sessions == []  # no traced pass over the whole model
