"""Telemetry's hot path: the integer-bit exponent histogram equals the frexp definition, and a
plain step (no statistics, no flush) moves no data on the CPU and copies one value on a device."""

import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampguard as ag
from ampguard.rules import _ranges
from ampguard.telemetry import _layers
from ampguard.telemetry._device import host_view
from ampguard.telemetry._range_sample import range_keys


def _frexp_keys(x: torch.Tensor) -> torch.Tensor:
    mant, expo = torch.frexp(x)
    return torch.where(mant == 0, 0, (expo - _ranges.E_MIN).clamp(1, _ranges.BINS - 1))


def test_bit_keys_match_frexp_on_every_kind_of_value():
    tiny = torch.finfo(torch.float32).tiny
    special = [
        0.0,
        -0.0,
        tiny / 8,
        tiny,
        2.0**-61,
        2.0**-60,
        2.0**-59,
        2.0**-60 * 1.5,
        2.0**-14,
        6.1e-5,
        0.5,
        1.0,
        1.5,
        2.0,
        65504.0,
        2.0**15,
        2.0**16,
        3e38,
        -1.0,
        -(2.0**-40),
    ]
    x = torch.cat(
        [torch.tensor(special), torch.randn(4000) * 10.0 ** torch.randint(-25, 8, (4000,))]
    )
    layout = _layers.Layout(["a"], [x], [0], [x.numel()], [1])
    (chunk,) = _layers.plan_chunks(layout, torch.device("cpu"), 1 << 20)
    bits = x.clone().view(torch.int32).bitwise_and_(0x7FFFFFFF)
    keys = range_keys(bits, torch.zeros(1, dtype=torch.int32), chunk)
    assert torch.equal(keys.long(), _frexp_keys(x))
    inf_keys = range_keys(
        torch.tensor([float("inf"), float("nan")]).view(torch.int32).bitwise_and(0x7FFFFFFF),
        torch.zeros(1, dtype=torch.int32),
        _layers.plan_chunks(
            _layers.Layout(["a"], [torch.zeros(2)], [0], [2], [1]), torch.device("cpu"), 8
        )[0],
    )
    assert inf_keys.tolist() == [_ranges.BINS - 1] * 2  # the top bin


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _plain_step_ops(tmp_path) -> list[str]:
    """The torch ops inside telemetry's hooks during a plain step (no sample, no flush)."""
    model = torch.nn.Linear(8, 8)
    tel = ag.Telemetry(tmp_path, layer_every=1000, range_every=0)
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", telemetry=tel
    )
    seen = _Ops()
    for name in ("on_backward", "on_grads", "on_step"):
        hook = getattr(tel, name)

        def traced(*a, _hook=hook, **k):
            with seen:
                return _hook(*a, **k)

        setattr(tel, name, traced)
    for _ in range(3):
        with guard.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        before = len(seen.ops)
        guard.backward(loss)
        guard.step()
    ops = seen.ops[before:]
    tel.close()  # and the gathered values reach the log
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    steps = [r for r in records if "scale" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["applied"] and r["scale"] == 65536.0 for r in steps)
    return ops


def test_a_plain_cpu_step_moves_no_data(tmp_path):
    # the loss is kept by reference (a detached alias, no data moves), the scale is read from
    # host memory; flags, loss and norm are gathered at the flush
    assert _plain_step_ops(tmp_path) == ["aten.detach.default"]


def test_a_plain_device_step_costs_one_copy(tmp_path, monkeypatch):
    # where the scale lives on a device (no host view), the step copies it: one op
    monkeypatch.setattr("ampguard.telemetry._telemetry.host_view", lambda t: None)
    assert _plain_step_ops(tmp_path) == ["aten.detach.default", "aten.copy_.default"]


def test_host_view_follows_in_place_updates_of_cpu_fp32_scalars():
    for t in (torch.tensor(2.0), torch.full((1,), 3.0)):
        view = host_view(t)
        assert view is not None and view[0] == t.item()
        t.mul_(4)
        assert view[0] == t.item()
    assert host_view(torch.tensor(2.0, dtype=torch.float64)) is None
    assert host_view(torch.zeros(2)) is None
