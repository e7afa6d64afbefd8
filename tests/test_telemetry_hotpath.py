"""Telemetry's hot path: the integer-bit exponent histogram equals the frexp definition, and a
plain step (no statistics, no flush) costs one device op."""

import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampguard as ag
from ampguard.rules import _ranges
from ampguard.telemetry import _layers, _range_keys


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
    keys = _range_keys(bits, torch.zeros(1, dtype=torch.int32), chunk)
    assert torch.equal(keys.long(), _frexp_keys(x))
    inf_keys = _range_keys(
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


def test_a_plain_step_costs_one_device_op(tmp_path):
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
    for _ in range(3):  # step 0 has statistics (0 % layer_every == 0): count steps 1 and 2
        with guard.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        guard.backward(loss)
        before = len(seen.ops)
        guard.step()
    ops = seen.ops[before:]
    assert ops == ["aten.copy_.default"]  # the scale copy; flags, loss, norm are gathered later
    tel.close()  # and the gathered values reach the log
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    steps = [r for r in records if "scale" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["applied"] for r in steps)
