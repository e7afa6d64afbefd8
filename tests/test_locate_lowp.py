"""ag.locate(..., precision="fp8" | "mxfp8" | "nvfp4" | "fp8_blockwise"): the low-precision replay
trains every fitting Linear layer in the format (emulated, bf16 autocast around it) and gives the
same module / op / phase / kind answer as fp16 gives for the same planted fault."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampguard as ag

FORMATS = ("fp8", "mxfp8", "nvfp4", "fp8_blockwise")


class Log(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(h.float().abs())


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(128, 128, bias=False), Log())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(128))  # exact in every format
    return model


def _batch(small: float) -> torch.Tensor:
    x = torch.full((4, 128), 0.5)
    x[:, 0] = 1000.0  # shares a scale with feature 1 in every format
    x[:, 1] = small  # flushed to zero by the cast: log(0) downstream
    return x


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).mean()


def _answer(d: ag.Diagnosis) -> tuple:
    return d.kind, d.phase, d.module, d.op


@pytest.mark.parametrize("precision", FORMATS)
def test_a_value_the_format_flushes_is_located_as_fp16_locates_it(precision):
    model = _model()
    before = copy.deepcopy(model.state_dict())
    fp16 = ag.locate(model, _loss, _batch(1e-8), precision="fp16")  # fp16 flushes 1e-8 too
    low = ag.locate(model, _loss, _batch(1e-8), precision=precision)
    assert _answer(low) == _answer(fp16) == ("fp16_overflow", "forward", "1", "aten.log")
    assert low.precision == precision and precision in low.explain()
    fmt = "tensorwise" if precision == "fp8" else precision
    assert low.stats["emulated"] == {"format": fmt, "layers": ["0"]}
    assert type(model[0]) is nn.Linear and not hasattr(model[0], "lowp_format")  # put back
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("precision", FORMATS)
def test_a_value_only_the_format_flushes_fails_only_in_the_format(precision):
    model = _model()
    assert ag.locate(model, _loss, _batch(1e-3), precision="bf16").ok
    assert ag.locate(model, _loss, _batch(1e-3), precision="fp16").ok
    low = ag.locate(model, _loss, _batch(1e-3), precision=precision)
    assert _answer(low) == ("fp16_overflow", "forward", "1", "aten.log")


def test_a_healthy_batch_is_ok_and_a_failing_loss_fn_leaves_the_model_as_it_was():
    model = _model()
    assert ag.locate(model, _loss, torch.full((4, 128), 0.5), precision="nvfp4").ok

    def boom(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ag.locate(model, boom, _batch(1e-3), precision="mxfp8")
    assert type(model[0]) is nn.Linear


def test_an_unknown_precision_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"precision must be one of .*'nvfp4'.*got 'fp4'"):
        ag.locate(_model(), _loss, _batch(1e-3), precision="fp4")
