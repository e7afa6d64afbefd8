"""ampguard.testing.inject_fault: real bit flips in real modules' and ops' outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampguard.testing import BITS, bit_position, flip_bit, inject_fault, on_reference_device


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _x() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bit", BITS)
def test_flip_bit_changes_exactly_that_bit(dtype: torch.dtype, bit: str) -> None:
    t = torch.full((3, 2), 1.5, dtype=dtype)
    before = t.clone()
    flip_bit(t, 4, bit)
    changed = (t != before).nonzero().tolist()
    assert changed == [[2, 0]]
    value = float(t[2, 0])
    if bit == "exponent_low":
        assert value in (0.75, 3.0)
    elif bit == "mantissa":
        assert value == 1.0  # 1.5 has the top mantissa bit set
    else:
        assert not abs(value) < 6e4  # 1.5 -> NaN (exponent all ones, mantissa set)
    flip_bit(t, 4, bit)
    assert torch.equal(t, before)


def test_flip_bit_on_non_contiguous_tensor() -> None:
    t = torch.ones(4, 3).t()
    flip_bit(t, 1, "exponent_low")
    assert (t != 1).sum() == 1 and float(t.reshape(-1)[1]) == 0.5


def test_bit_positions() -> None:
    assert bit_position(torch.float32, "exponent_top") == 30
    assert bit_position(torch.float16, "exponent_low") == 10
    assert bit_position(torch.bfloat16, "mantissa") == 6


def test_transient_forward_fault_fires_once_at_its_step() -> None:
    model, x = _model(), _x()
    clean = [model(x).detach() for _ in range(3)]
    inj = inject_fault(model, module="2", bit="exponent_low", step=1)
    try:
        outs = [model(x).detach() for _ in range(4)]
    finally:
        inj.remove()
    assert torch.equal(outs[0], clean[0]) and not torch.equal(outs[1], clean[1])
    assert torch.equal(outs[2], clean[0]) and torch.equal(outs[3], clean[0])
    assert inj.fired_at == [1]
    assert torch.equal(model(x), clean[0])  # removed: no hook left


def test_persistent_fault_fires_every_call_but_not_on_reference_device() -> None:
    model, x = _model(), _x()
    clean = model(x).detach()
    with inject_fault(model, module="2", bit="mantissa", persistent=True) as inj:
        assert not torch.equal(model(x), clean) and not torch.equal(model(x), clean)
        with on_reference_device():
            assert torch.equal(model(x), clean)
    assert inj.fired == 2


def test_backward_module_fault_corrupts_upstream_gradients_only() -> None:
    model, x = _model(), _x()
    model(x).sum().backward()
    clean = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with inject_fault(model, module="2", phase="backward", bit="exponent_low", element=3):
        out = model(x)
        out.sum().backward()
    assert torch.equal(model[2].weight.grad, clean["2.weight"])  # its own wgrad is right
    assert not torch.equal(model[0].weight.grad, clean["0.weight"])  # its dgrad was wrong


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # torch: no input needs grad
def test_backward_fault_on_first_layer_flips_its_weight_gradient() -> None:
    model, x = _model(), _x()
    model(x).sum().backward()
    clean = model[0].weight.grad.clone()
    model.zero_grad()
    with inject_fault(model, module="0", phase="backward", bit="exponent_top"):
        model(x).sum().backward()
    assert (model[0].weight.grad != clean).sum() == 1


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_op_fault_in_a_module(phase: str) -> None:
    model, x = _model(), _x()
    out = model(x)
    out.sum().backward()
    clean_out = out.detach()
    clean = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    op = "aten.addmm" if phase == "forward" else "aten.mm"  # Linear's backward is two mm
    persistent = phase == "backward"  # then both its dgrad and its wgrad mm flip
    with inject_fault(
        model, op=op, module="2", phase=phase, bit="exponent_low", persistent=persistent
    ) as inj:
        out = model(x)
        out.sum().backward()
    assert inj.fired == (1 if phase == "forward" else 2)
    if phase == "forward":
        assert (out != clean_out).sum() == 1
    else:
        assert torch.equal(out, clean_out)
        assert (
            sum(not torch.equal(p.grad, c) for p, c in zip(model.parameters(), clean, strict=True))
            >= 1
        )


def test_op_fault_under_autocast_bf16() -> None:
    model, x = _model(), _x()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        clean = model(x).detach()
        with inject_fault(model, op="aten.addmm", bit="exponent_top", persistent=True) as inj:
            bad = model(x).detach()
    assert inj.fired == 2 and not torch.equal(bad, clean)  # both Linears' addmm


def test_fault_on_other_rank_never_fires() -> None:
    model, x = _model(), _x()
    clean = model(x).detach()
    with inject_fault(model, module="0", rank=1, persistent=True) as inj:
        assert torch.equal(model(x), clean)
    assert inj.fired == 0


def test_bad_arguments_name_the_argument() -> None:
    model = _model()
    with pytest.raises(ValueError, match="module='fc9'"):
        inject_fault(model, module="fc9")
    with pytest.raises(ValueError, match="bit must be one of"):
        inject_fault(model, module="0", bit="sign")
    with pytest.raises(ValueError, match="phase must be one of"):
        inject_fault(model, module="0", phase="optimizer")
    with pytest.raises(ValueError, match="module= .*or op="):
        inject_fault(model)
    with pytest.raises(ValueError, match="op must name an aten op"):
        inject_fault(model, op="addmm")
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        inject_fault(model, module="0", step=-1)

    class Clock:
        steps = 7

    with pytest.raises(ValueError, match="step=3 is in the past: the guard's next step is 7"):
        inject_fault(model, module="0", step=3, guard=Clock())
    assert not model._forward_hooks and not model._forward_pre_hooks  # nothing armed


def test_fault_with_a_guard_strikes_at_the_guard_step() -> None:
    import ampguard as ag

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="bf16")
    x, y = _x(), torch.randn(5, 4)
    with inject_fault(model, module="0", bit="exponent_top", step=2, guard=guard) as inj:
        for _ in range(4):
            with guard.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            guard.backward(loss)
            guard.step()
    assert inj.fired_at == [2]
