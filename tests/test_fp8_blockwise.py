"""Block-wise fp8 ("fp8_blockwise", DeepSeek-V3 / TransformerEngine block scaling): an fp32 scale
per 1x128 tile of an input or gradient and per 128x128 block of a weight, e4m3 values; a format
of the plan, of recipes and a Guard precision (emulated)."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard import precisions
from ampguard.fp8._emulate import EmulatedLinear
from ampguard.fp8._formats import FORMATS
from ampguard.fp8._operand import Operand
from ampguard.fp8._quant import CASTS

pytestmark = pytest.mark.filterwarnings("ignore:precision='fp8_blockwise' is emulated")
FMT = "fp8_blockwise"


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(a=nn.Linear(128, 256), act=nn.Tanh(), b=nn.Linear(256, 128), out=nn.Tanh())
    )


def test_the_weight_shares_a_scale_per_128x128_block_the_input_per_1x128_tile():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=gen)
    w[3, 200] = 1e3  # one outlier: it sets the scale of block (0, 1) only
    cast = CASTS[FMT](Operand(w), "weight")
    scale = cast.scale.squeeze(-1)  # (rows, column blocks)
    assert torch.equal(scale[:128, 1], scale[:1, 1].expand(128))  # one scale for the block
    assert float(scale[0, 1]) == pytest.approx(1e3 / 448)
    assert float(scale[128, 1]) < 0.02 and float(scale[0, 0]) < 0.02  # the others unharmed
    x = torch.randn(4, 256, generator=gen)
    x[0, 5] = 1e3
    xs = CASTS[FMT](Operand(x), "input").scale.squeeze(-1)
    assert float(xs[0, 0]) == pytest.approx(1e3 / 448) and float(xs[1, 0]) < 0.02
    assert float(xs[0, 1]) < 0.02  # a 1x128 tile: the row's other tile keeps its own scale


def test_the_plan_measures_it_and_recipes_can_pick_it():
    pytest.importorskip("torchao")
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    plan = ag.fp8_plan(
        model, lambda m, b: m(b).float().pow(2).mean(), torch.randn(128, 128), formats=(FMT,)
    )
    figs = plan.layers["1"]["formats"][FMT]
    assert figs["ready"] and figs["sqnr_db"] > 25  # e4m3's rounding: about 28.5 dB
    assert plan.recipe() == {"0": "bf16", "1": FMT, "2": FMT, "3": "bf16"}
    small = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    plan = ag.fp8_plan(small, lambda m, b: m(b).float().sum(), torch.randn(8, 64), formats=(FMT,))
    assert "multiples of 128" in plan.layers["0"]["formats"][FMT]["reason"]


def test_a_guard_trains_in_it_and_computes_in_it():
    model = _model()
    plain = copy.deepcopy(model)
    guard = ag.Guard(model, torch.optim.Adam(model.parameters(), lr=1e-2), precision=FMT)
    assert guard.fp8.layers == ["a", "b"] and type(model.a) is EmulatedLinear
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 128, generator=gen)
    y = torch.tanh(x @ torch.randn(128, 128, generator=gen) / 128**0.5)
    with guard.autocast(), torch.no_grad():
        out = model.a(x)
    w, b = plain.a.weight.detach(), plain.a.bias.detach()
    q = CASTS[FMT](Operand(x), "input").q.clone() @ CASTS[FMT](Operand(w), "weight").q.T
    torch.testing.assert_close(out, (q + b).to(torch.bfloat16), rtol=0, atol=0)
    losses = []
    for _ in range(15):
        with guard.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        guard.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_registry_entry_and_a_shape_it_cannot_take():
    entry = precisions.REGISTRY[FMT]
    assert entry.load_hook().format == FMT and precisions.by_audit_code(6) == FMT
    assert FORMATS[FMT].shape_ok(256, 128) and not FORMATS[FMT].shape_ok(128, 96)
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.warns(RuntimeWarning, match="no Linear layer is converted"):
        guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=FMT)
    assert guard.precision == "bf16" and type(model[0]) is nn.Linear
