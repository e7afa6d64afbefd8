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


def _calls_into_recorder(fn) -> list[str]:
    """The recorder's own Python functions ``fn`` ran (its ``window`` left out: the Guard's
    integer compare as a window begins)."""
    import sys

    from ampguard.forensics import _signatures

    seen: list[str] = []

    def prof(frame, event, _arg) -> None:
        code = frame.f_code
        if (
            event == "call"
            and code.co_filename == _signatures.__file__
            and code.co_name != "window"
        ):
            seen.append(code.co_name)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("flight_recorder", [False, True])
def test_a_window_left_out_runs_no_hook_and_adds_no_sync(flight_recorder) -> None:
    """Guard(signatures=4): windows 1-3 of each 4 run none of the recorder's hooks (with a
    flight recorder, only the pre-hook keeping their RNG state, for a loss-only replay), no
    hook is on the model, and every window costs the syncs of the Guard without signatures."""
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    kw = {} if flight_recorder else {"flight_recorder": False, "on_spike": None}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="bf16", signatures=4, **kw)
    torch.manual_seed(0)
    model0 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.1)
    guard0 = ag.Guard(model0, opt0, precision="bf16", **kw)
    modules = [model, *model.children()]
    calls, syncs = [], []
    for _ in range(9):
        hooked = any(m._forward_pre_hooks or m._forward_hooks for m in modules)
        calls.append((hooked, _calls_into_recorder(lambda: _step(model, guard, x, y))))
        with SyncCounter() as c:
            _step(model, guard, x, y)  # a second window, to count its syncs
        with SyncCounter() as c0:
            _step(model0, guard0, x, y)
        syncs.append((c.count, c0.count))
        _step(model, guard, x, y)  # the recorded windows stay at 0, 4, 8, ...
        _step(model, guard, x, y)
    assert guard.signatures.steps == list(range(0, 36, 4))[-16:]
    for hooked, seen in calls:  # windows 0, 4, 8, ...: recorded
        assert hooked and "_output_hook" in seen and "_output_grad" in seen
    for c, c0 in syncs:
        assert c == c0
    # the windows in between (1, 5, 9, ...): counted directly
    for step in range(3):
        hooked = any(m._forward_pre_hooks or m._forward_hooks for m in modules)
        seen = _calls_into_recorder(lambda: _step(model, guard, x, y))
        if step == 0:
            assert hooked and "_output_hook" in seen
        elif flight_recorder:  # the RNG state of a window whose loss the flight recorder keeps
            assert sorted(seen) == ["_keep_rng", "_now"] and model._forward_pre_hooks
            assert not any(m._forward_hooks for m in modules[1:])
        else:
            assert seen == [] and not hooked
    assert guard.signatures.steps[-1] == 36


def test_every_window_recorded_adds_no_host_sync() -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    counts = {}
    for sig in (False, 1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = ag.Guard(model, opt, precision="bf16", flight_recorder=False, signatures=sig)
        per_step = []
        for _ in range(4):
            with SyncCounter() as c:
                _step(model, guard, x, y)
            per_step.append(c.count)
        counts[sig] = per_step
    assert counts[1] == counts[False]


def test_the_step_counter_set_by_restore_counts_moves_the_recorded_windows() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(
        model, opt, precision="bf16", flight_recorder=False, on_spike=None, signatures=4
    )
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    _step(model, guard, x, y)
    guard.restore_counts(steps=8, applied=8, skipped=0)  # window 8 begins: recorded
    _step(model, guard, x, y)
    guard.restore_counts(steps=13, applied=13, skipped=0)  # window 13: left out
    assert not model._forward_pre_hooks
    _step(model, guard, x, y)
    assert guard.signatures.steps == [0, 8]
    guard.signatures.remove()
    guard.restore_counts(steps=16, applied=16, skipped=0)  # removed: stays off
    assert not model._forward_pre_hooks


def test_a_recorder_left_to_itself_still_samples_by_its_clock() -> None:
    """Without window() calls (a recorder made directly), its pre-hook decides per forward."""
    model, guard = _setup()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps, every=3)
    for _ in range(7):
        _step(model, guard, x, y)
    assert rec.steps == [0, 3, 6]
    assert rec.rng_state(5)["cpu"].dtype == torch.uint8  # an unrecorded step's RNG state


def test_word_sums_of_half_precision_outputs_see_one_flipped_bit() -> None:
    from ampguard.forensics._signatures import _wordsum

    t = torch.randn(64, 32).bfloat16()
    base = int(_wordsum(t))
    assert int(_wordsum(t.clone())) == base
    for element in (0, 5, 2047):
        for bit in (0, 7, 14, 15):
            u = t.clone()
            u.view(torch.int16).view(-1)[element] ^= 1 << bit if bit < 15 else -(1 << 15)
            assert int(_wordsum(u)) != base, (element, bit)
    odd = torch.randn(3, 5).half()  # an odd last dimension: summed element by element
    assert int(_wordsum(odd)) == int(bitsum(odd))
    f = torch.randn(6, 4)  # 4-byte elements: bitsum itself
    assert int(_wordsum(f)) == int(bitsum(f))


def test_a_recorded_forward_that_raised_leaves_no_hook_on_the_next_window() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(
        model, opt, precision="bf16", flight_recorder=False, on_spike=None, signatures=4
    )
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 3))  # window 0 (recorded): the first Linear raises
    assert model[2]._forward_hooks  # still in: the model's post-hook never ran
    guard.restore_counts(steps=1, applied=1, skipped=0)  # window 1 begins: left out
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in [model, *model])
