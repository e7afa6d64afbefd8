"""ag.locate gives the right answer where a simpler reading of the replays gives a wrong one:
a benign scaler probe in the same batch as a real finding, at any scale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_silent_locate import NormNet, batch
from torch import nn

import ampguard as ag


def big_ce(model, b):
    x, y = b
    return F.cross_entropy(model(x).float(), y) * 200  # backward overflows fp16 above ~2**3


@pytest.mark.parametrize("scale", [32.0, 2.0**10, 2.0**16, 2.0**20])
def test_benign_probe_never_hides_an_absorbed_overflow(scale):
    diag = ag.locate(NormNet(gain=2000.0), big_ce, batch(), scale=scale)
    assert (diag.kind, diag.code, diag.module, diag.op) == (
        "fp16_overflow_absorbed",
        "AG360",
        "norm",
        "aten.pow",
    )
    assert not diag.benign and not diag.ok
    probe = diag.stats.get("scaler_probe")
    if probe is not None:  # the probe is said, next to the finding, never instead of it
        assert probe["scale"] == scale and probe["module"] == "head"
        assert "probing" in diag.explain()


def test_benign_probe_alone_stays_benign():
    diag = ag.locate(NormNet(gain=1.0), big_ce, batch())
    assert diag.benign and diag.code == "AG305"


# ---------------------------------------------------------------- gradients wrong, none zero
def _weighted_head():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 16, generator=g).abs() * 1000
    w = torch.full((64, 1), 2.5e-8)  # 63 samples' output gradients flush to zero in fp16
    w[0] = 2.0e-7

    def loss_fn(m, b):
        return (m(b).float() * w).sum()

    return model, loss_fn, x


def test_a_layer_far_off_fp32_with_no_zero_element_is_underflow():
    model, loss_fn, x = _weighted_head()
    diag = ag.locate(model, loss_fn, x, scale=1.0)  # a loop without a loss scaler
    assert diag.kind == "fp16_underflow" and diag.code == "AG302", diag.stats
    assert diag.module == "0" and diag.phase == "backward"
    assert diag.stats["rel_error"] > 0.8  # about 93% off fp32
    assert diag.stats["grad_rel_error"]["0"] == diag.stats["rel_error"]
    assert diag.stats["flushed_by"] == {"module": "0", "op": "aten._to_copy"}
    text = diag.explain()
    assert "wrong" in text and "underflow" in text and "GradScaler" in text


def test_the_same_batch_under_a_loss_scaler_is_fine_and_says_its_errors():
    model, loss_fn, x = _weighted_head()
    diag = ag.locate(model, loss_fn, x)  # GradScaler's start scale: nothing flushes
    assert diag.kind == "none" and not diag.benign
    assert diag.stats["grad_rel_error"]["0"] < 0.01


# ---------------------------------------------------------------- dropout and the global RNG
def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Dropout(0.5), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].weight[0, 0] = 1.0  # unit 0 = x[:, 0] = 40000: fp16 holds it...
        model[2].weight.zero_()
        model[2].weight[0, 0] = 2.0  # ... but not the head's 80000 (nor dropout's x2)
    return model


def _dropout_loss(model, b):
    return model(b).float().pow(2).mean()


def test_standalone_locate_with_dropout_is_stable_over_seeds_and_says_its_mask():
    x = torch.zeros(1, 4)
    x[0, 0] = 40000.0
    answers, stable = set(), []
    for seed in range(6):
        torch.manual_seed(seed)
        diag = ag.locate(_dropout_model(), _dropout_loss, x)
        answers.add((diag.kind, diag.phase, diag.module, diag.op))
        info = diag.stats["dropout"]
        assert info["modules"] == ["1"] and "disabled" in info["mask"]
        stable.append(info["stable"])
    assert answers == {("fp16_overflow", "forward", "2", "aten.addmm")}
    assert not all(stable)  # some masks give another answer: said, not returned


def test_a_failure_only_a_mask_makes_says_it_depends_on_the_mask():
    x = torch.zeros(1, 4)
    x[0, 0] = 40000.0
    model = _dropout_model()
    with torch.no_grad():
        model[2].weight[0, 0] = 0.5  # 20000 at the head: only dropout's x2 overflows (at '1')
    seen = {}
    for seed in range(6):
        torch.manual_seed(seed)
        diag = ag.locate(model, lambda m, b: m(b).float().mean(), x)
        seen[diag.kind] = diag.stats["dropout"]
    assert "fp16_overflow" in seen and seen["fp16_overflow"]["stable"] is False
    assert seen["fp16_overflow"]["without_dropout"]["kind"] == "none"
    assert "global RNG" in seen["fp16_overflow"]["mask"]


# ---------------------------------------------------------------- an op in the loss code
def _squared_loss(model, x):
    h = model(x)
    return (h * 300.0).pow(2).mean().float()  # fp16 under autocast: 300^2 * |h|^2 > 65504


def test_an_overflow_in_the_loss_code_names_the_op_and_the_line():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 4
    diag = ag.locate(model, _squared_loss, x)
    assert diag.kind == "fp16_overflow" and diag.module is None, diag.stats
    source = diag.stats["source"]
    assert source.endswith(f"{__file__}:{_squared_loss.__code__.co_firstlineno + 2}")
    fix = diag.to_finding().fix
    assert "<module>" not in fix and "keep_fp32=[" not in fix
    assert diag.op in fix and source in fix and ".float()" in fix
    assert source in diag.explain()


# ---------------------------------------------------------------- an op in the root's own code
class _RootScaled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.full((8, 8), 300.0))

    def forward(self, x):
        return (self.fc(x) @ self.gain).pow(2)  # the root's own matmul and square


def test_an_overflow_in_the_root_names_the_op_and_its_parameter():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 4
    diag = ag.locate(_RootScaled(), lambda m, b: m(b).float().mean(), x)
    assert diag.kind == "fp16_overflow" and diag.module == "", diag.stats
    assert diag.stats["root_parameters"] == ["gain"]
    text, fix = diag.explain(), diag.to_finding().fix
    assert "'gain'" in text and diag.op in text
    assert "keep_fp32=['']" not in fix.replace("keep_fp32=[''] would", "")
    assert ".float()" in fix and "submodule" in fix
