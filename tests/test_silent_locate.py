"""ag.locate on silent failures: the loss and the gradients are finite, the step is not fine.

Absorbed overflow (an fp16 intermediate overflows inside a module whose output is finite) and
partial gradient underflow (a share of a layer's gradient flushed or left as coarse
subnormals at the loss scale the loop really uses), each with a firing and a silent case.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard as ag
from ampguard.forensics import CODES, KINDS
from ampguard.forensics._silent import UNDERFLOW_SHARE

W = 16


class HandNorm(nn.Module):
    """A hand-written layer norm: the square overflows fp16 once |x - u| passes 256."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        v = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - u) / torch.sqrt(v + 1e-5) + self.bias


class NormNet(nn.Module):
    def __init__(self, gain):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(W, W)
        self.norm = HandNorm(W)
        self.head = nn.Linear(W, 4)
        with torch.no_grad():
            self.fc.weight.mul_(gain)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, W, generator=g), torch.randint(0, 4, (8,), generator=g)


def test_kind_and_code_are_registered():
    assert "fp16_overflow_absorbed" in KINDS
    assert CODES["fp16_overflow_absorbed"] == "AG360"


def test_absorbed_overflow_names_module_op_and_consumer():
    model = NormNet(gain=2000.0)
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model.norm(model.fc(x))
    assert torch.isfinite(out).all()  # the module's output is finite: nothing skips
    diag = ag.locate(model, ce, (x, y))
    assert diag.kind == "fp16_overflow_absorbed"
    assert diag.code == "AG360"
    assert (diag.phase, diag.module, diag.op) == ("forward", "norm", "aten.pow")
    assert diag.stats["absorbed_by"] == {"module": "norm", "op": "aten.div"}
    assert diag.stats["max_abs_fp32"] > 65504
    assert diag.stats["inf_count"] > 0
    text = diag.explain()
    assert "aten.div" in text and "keep_fp32=['norm']" in text
    assert "loss scale does not help" in text  # never advise raising the scale for this
    f = diag.to_finding()
    assert f.code == "AG360" and f.title.startswith("fp16 overflow absorbed inside a module")


def test_absorbed_overflow_silent_when_values_fit():
    diag = ag.locate(NormNet(gain=1.0), ce, batch())
    assert diag.kind == "none"


def test_absorbed_overflow_silent_in_bf16():
    # bf16 has fp32's range: the same square fits, so there is nothing to report
    diag = ag.locate(NormNet(gain=2000.0), ce, batch(), precision="bf16")
    assert diag.kind == "none"


def test_absorbed_overflow_round_trips_as_dict():
    diag = ag.locate(NormNet(gain=2000.0), ce, batch())
    again = ag.Diagnosis.from_dict(diag.to_dict())
    assert again.kind == diag.kind and again.stats["absorbed_by"] == diag.stats["absorbed_by"]


def tanh_mlp(width=32):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
    )


def small_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y) * 1e-3  # gradients of order 1e-6: fp16 subnormals


def regression_batch(width=32):
    g = torch.Generator().manual_seed(2)
    return torch.randn(64, width, generator=g), torch.randn(64, 4, generator=g)


def test_partial_underflow_without_a_scaler_names_the_layer():
    diag = ag.locate(tanh_mlp(), small_loss, regression_batch(), scale=1.0)
    assert diag.kind == "fp16_underflow" and diag.code == "AG302"
    assert diag.phase == "backward"
    assert diag.module in ("0", "2")
    share = diag.stats["underflow_share"]
    assert UNDERFLOW_SHARE < share < 1.0  # partial: the layer is not dead
    assert diag.stats["flushed"] + diag.stats["lossy_subnormal"] > 0
    text = diag.explain()
    assert "without a loss scaler" in text and f"{share:.1%}" in text
    assert "GradScaler" in diag.to_finding().fix and "bf16" in diag.to_finding().fix


def test_partial_underflow_silent_at_the_scalers_scale():
    # the same loop with GradScaler's start scale keeps the gradients normal
    diag = ag.locate(tanh_mlp(), small_loss, regression_batch())
    assert diag.kind == "none"


def test_partial_underflow_silent_with_ordinary_gradients():
    def loss(model, b):
        return F.mse_loss(model(b[0]).float(), b[1])

    diag = ag.locate(tanh_mlp(), loss, regression_batch(), scale=1.0)
    assert diag.kind == "none", diag.stats


@pytest.mark.parametrize("scale", [1.0, 2.0**16])
def test_partial_underflow_silent_in_bf16(scale):
    diag = ag.locate(tanh_mlp(), small_loss, regression_batch(), precision="bf16", scale=scale)
    assert diag.kind == "none"
