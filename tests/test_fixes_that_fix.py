"""Fixes that fix: locate checks the keep_fp32 it advises, names an eps that
fp16 cannot hold, and the advisor claims only what it probed."""

from __future__ import annotations

import torch
from torch import nn

import ampguard as ag
from ampguard.forensics._fixcheck import FP16_SUBNORMAL, tiny_eps


def _loss(m, b):
    return nn.functional.mse_loss(m(b[0]).float(), b[1])


def _hot() -> nn.Module:
    """A Linear whose fp16 output passes 65504 (finite in fp32): keep_fp32 on it works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    with torch.no_grad():
        model[0].weight.mul_(1e6)
    return model


def test_a_keep_fp32_that_works_is_said_to_be_checked():
    batch = (torch.randn(4, 8), torch.randn(4, 2))
    diag = ag.locate(_hot(), _loss, batch)
    assert (diag.kind, diag.phase, diag.module) == ("fp16_overflow", "forward", "0")
    assert diag.stats["keep_fp32_check"]["finite"] is True
    assert diag.stats["tiny_eps"] == []
    fix = diag.to_finding().fix
    assert "keep_fp32=['0']" in fix and "checked: with it this batch is finite" in fix
    assert "not enough" not in fix


def test_tiny_eps_finds_eps_like_attributes_below_fp16s_subnormal():
    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.eps, self.variance_epsilon, self.scale = 1e-12, 1e-6, 1e-12

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(Norm()))
    assert FP16_SUBNORMAL < 6e-8
    assert tiny_eps(model, "1", "fp16") == [{"module": "1.0", "attribute": "eps", "value": 1e-12}]
    assert tiny_eps(model, "1", "bf16") == []  # bf16 holds 1e-12
    assert tiny_eps(model, "0", "fp16") == [] and tiny_eps(model, None, "fp16") == []


def test_locate_leaves_the_model_and_rng_as_they_were():
    model = _hot()
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    ag.locate(model, _loss, (torch.ones(4, 8), torch.zeros(4, 2)))
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_the_advisor_claims_only_what_it_probed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    batch = (torch.randn(4, 8), torch.randn(4, 2))
    (plan,) = [f for f in ag.inspect_model(model, batch, _loss) if f.code == "AG331"]
    assert "no probed value" not in plan.message
    assert "no probed module output or gradient leaves fp16's range" in plan.message
    assert "inside a module" in plan.message
