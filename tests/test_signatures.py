"""SignatureRecorder: exact, sync-free bit-sum signatures of module outputs and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampguard as ag
from ampguard.forensics._signatures import bitsum, first_difference
from ampguard.testing import SyncCounter, inject_fault


def _setup(precision: str = "bf16"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision=precision, flight_recorder=False, on_spike=None)
    return model, guard


def _step(model, guard, x, y) -> None:
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    guard.step()


def test_bitsum_is_exact_and_sees_one_flipped_bit() -> None:
    t = torch.randn(1000)
    assert int(bitsum(t)) % 2**32 == int(t.view(torch.int32).long().sum()) % 2**32
    u = t.clone()
    u.view(torch.int32)[17] ^= 1  # the lowest mantissa bit
    assert int(bitsum(u)) - int(bitsum(t)) in (1, -1)
    assert int(bitsum(t.flip(0))) == int(bitsum(t))  # order independent


def test_recording_adds_no_host_sync() -> None:
    model, guard = _setup()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    _step(model, guard, x, y)
    with SyncCounter() as bare:
        _step(model, guard, x, y)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps)
    _step(model, guard, x, y)
    with SyncCounter() as recorded:
        _step(model, guard, x, y)
    assert recorded.count == bare.count
    assert rec.steps == [2, 3]


def test_same_state_and_batch_give_equal_signatures_and_a_fault_differs() -> None:
    model, guard = _setup()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps)
    _step(model, guard, x, y)
    model.load_state_dict(state)
    _step(model, guard, x, y)
    a, b = rec.read(0), rec.read(1)
    assert (a.forward, a.backward, a.grads) == (b.forward, b.backward, b.grads)
    assert first_difference(a, b) is None
    assert a.forward_order == ["0", "1", "2"] and a.backward_order == ["2", "1", "0"]
    model.load_state_dict(state)
    with inject_fault(model, module="1", bit="mantissa", element=2, step=2, guard=guard):
        _step(model, guard, x, y)
    c = rec.read(2)
    assert first_difference(a, c) == ("forward", "1", "output")


def test_every_samples_and_ring_wraps() -> None:
    model, guard = _setup()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps, every=2, capacity=2)
    for _ in range(7):
        _step(model, guard, x, y)
    assert rec.steps == [4, 6]
    with pytest.raises(KeyError, match="step 3 is not recorded"):
        rec.read(3)
    rec.remove()
    assert not model._forward_pre_hooks


def test_bad_steps_flags_nonfinite_outputs() -> None:
    model, guard = _setup()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps)
    _step(model, guard, x, y)
    _step(model, guard, x * float("inf"), y)
    assert rec.bad_steps() == [1]


def test_bad_arguments() -> None:
    model, _ = _setup()
    with pytest.raises(ValueError, match="every must be an int"):
        ag.SignatureRecorder(model, every=0)
    with pytest.raises(ValueError, match="capacity must be an int"):
        ag.SignatureRecorder(model, capacity=True)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ag.SignatureRecorder("model")


def test_guard_default_signatures_add_no_host_sync_recorded_or_not() -> None:
    """Guard(signatures=True): a recorded window (0, 32) and a sampled-out one (1) each cost
    the host syncs of the same Guard without signatures."""
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    counts = {}
    for sig in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = ag.Guard(model, opt, precision="bf16", flight_recorder=False, signatures=sig)
        per_step = []
        for _ in range(34):
            with SyncCounter() as c:
                _step(model, guard, x, y)
            per_step.append(c.count)
        counts[sig] = per_step
        if sig:
            assert guard.signatures.steps == [0, 32]
    assert counts[True] == counts[False]
