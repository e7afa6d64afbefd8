"""Training in MXFP8 / NVFP4 by emulation (torchao's quantisers on every matmul operand) and the
``mxfp8`` / ``nvfp4`` variants of ag.compare, judged against bf16."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import pytest
import torch
from _precisions import block_scaled
from torch import nn

import ampguard as ag
from ampguard.fp8._emulate import EmulatedLinear, emulate, restore
from ampguard.fp8._formats import FORMATS

pytest.importorskip("torchao")


def _layer(seed: int = 0, shape: tuple[int, int] = (64, 32)) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(*shape)


@pytest.mark.parametrize("fmt", block_scaled())
def test_emulated_forward_and_gradients_are_the_quantised_matmuls(fmt):
    m = FORMATS[fmt].multiple  # 64 x 32, or wider where the format needs it
    shape = (math.lcm(64, m), math.lcm(32, m))
    ref, lin = _layer(shape=shape), _layer(shape=shape)
    x = torch.randn(48, shape[0], requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    assert emulate(lin, fmt) == [""] and isinstance(lin, EmulatedLinear)
    y, y_ref = lin(x), ref(x2)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    q = FORMATS[fmt].quantize
    expect = q(x.detach(), "input")[0] @ q(ref.weight.detach(), "weight")[0].T + ref.bias
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    bits = FORMATS[fmt].bits
    for got, want in ((x.grad, x2.grad), (lin.weight.grad, ref.weight.grad)):
        err = (got - want).norm() / want.norm()
        assert 0 < err < (0.1 if bits == 8 else 0.4), (fmt, float(err))  # quantised, close
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_emulation_keeps_the_parameters_and_restores_exactly():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    assert emulate(model, "mxfp8") == ["0"]  # 10 outputs: not a multiple of 32
    assert type(model[2]) is nn.Linear and list(model.parameters()) == params
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    restore(model)
    assert all(type(m) is not EmulatedLinear for m in model.modules())
    assert not hasattr(model[0], "lowp_format")


def test_unknown_format_is_one_clear_error():
    with pytest.raises(ValueError, match="mxfp8"):
        emulate(nn.Linear(32, 32), "fp6")


def _factory(outlier: float):
    def make() -> ag.Experiment:
        model = nn.Sequential(OrderedDict(a=nn.Linear(32, 64), act=nn.Tanh(), b=nn.Linear(64, 32)))
        if outlier:
            with torch.no_grad():  # one heavy weight column: its block flushes the rest
                model.b.weight[:, 3] = outlier
        gen = torch.Generator().manual_seed(5)
        teacher = torch.randn(32, 32, generator=gen) / 4
        batches = [(x, x @ teacher) for x in torch.randn(4, 32, 32, generator=gen)]
        return ag.Experiment(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            batches,
            lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]),
        )

    return make


def test_compare_runs_the_block_scaled_variants_against_bf16():
    cmp = ag.compare(_factory(0.0), steps=30, variants=["mxfp8", "nvfp4"], progress=False)
    assert list(cmp.variants) == ["fp32", "bf16", "mxfp8", "nvfp4"]
    lowp = cmp.extra["lowp"]
    assert lowp["mxfp8"]["converted"] == ["a", "b"] and lowp["mxfp8"]["like_bf16"]
    assert lowp["nvfp4"]["gap_to_bf16"] is not None
    text = cmp.summary()
    assert "mxfp8 (emulated, 2 Linear layers): trains like bf16" in text
    json.dumps(cmp.to_dict())


def test_compare_rejects_unknown_variants_naming_the_block_scaled_ones():
    with pytest.raises(ValueError, match="nvfp4"):
        ag.compare(_factory(0.0), steps=2, variants=["fp4"], progress=False)
