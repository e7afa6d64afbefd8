"""compare's silent_stall verdict: fp16 finite throughout, its loss far above
fp32's at the same applied steps, the per-layer evidence from locate; healthy and loud runs keep
their verdicts. Real training runs with real fp16 autocast on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard.experiments import VariantResult
from ampguard.experiments._verdict import judge


class HandNorm(nn.Module):
    """A hand-written norm: (x - u)^2 overflows fp16 for |x - u| > 256, then x / sqrt(inf) = 0,
    so the block outputs only its bias in fp16 while fp32 normalises and learns."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        u = h.mean(-1, keepdim=True)
        var = (h - u).pow(2).mean(-1, keepdim=True)
        return (h - u) / torch.sqrt(var + 1e-5) + self.bias


def batches(n: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(16, 16, generator=g) * 2000.0  # finite in fp16, (x-u)^2 is not
        out.append((x, torch.randn(16, 1, generator=g)))
    return out


def mse(model: nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]).float(), batch[1])


def stalling() -> ag.Experiment:
    model = nn.Sequential(HandNorm(16), nn.Linear(16, 1))
    return ag.Experiment(model, torch.optim.Adam(model.parameters(), lr=3e-2), batches(), mse)


def healthy() -> ag.Experiment:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    data = [(x / 2000.0, y) for x, y in batches()]
    return ag.Experiment(model, torch.optim.Adam(model.parameters(), lr=3e-2), data, mse)


def test_fp16_finite_but_far_above_fp32_is_a_silent_stall_with_per_layer_evidence():
    cmp = ag.compare(stalling, steps=30, variants=["fp16_dynamic"], progress=False)
    dyn = cmp.variants["fp16_dynamic"]
    assert all(torch.isfinite(torch.tensor(dyn.losses))) and dyn.skipped == 0
    assert cmp.verdict == "silent_stall", cmp.summary()
    assert cmp.finding().code == "AG367"
    assert "silent stall" in cmp.explanation and "same 30 applied steps" in cmp.explanation
    assert cmp.diagnosis is not None and not cmp.diagnosis.ok
    assert cmp.diagnosis.module is not None and "Per-layer evidence" in cmp.explanation
    assert cmp.extra["stall"]["variant"] == "fp16_dynamic"
    assert "values leave fp16's range" not in cmp.explanation.lower()
    assert "silent_stall (AG367)" in cmp.summary()


def test_a_healthy_run_is_not_a_stall():
    cmp = ag.compare(healthy, steps=20, variants=["fp16_dynamic"], progress=False)
    assert cmp.verdict == "amp_ok", cmp.summary()


def variant(name: str, losses: list[float], skipped: int = 0, **kw) -> VariantResult:
    return VariantResult(name, name, list(losses), skipped=skipped, **kw)


FP32 = [1.0 - 0.03 * i for i in range(30)]  # learns from 1.0 to 0.13


def test_losses_compared_at_the_same_applied_steps():
    # skipped 6 steps: its loss at step 30 matches fp32's after 24 applied steps: not a stall
    lagging = [1.0] * 6 + FP32[:24]
    results = {"fp32": variant("fp32", FP32), "fp16_dynamic": variant("fp16_dynamic", lagging, 6)}
    verdict, _, _ = judge(results, 30)
    assert verdict != "silent_stall"
    flat = [1.0 - 0.001 * i for i in range(30)]
    results = {"fp32": variant("fp32", FP32), "fp16_dynamic": variant("fp16_dynamic", flat)}
    verdict, text, fix = judge(results, 30)
    assert verdict == "silent_stall" and "AG175" in fix and "AG106" in fix


def test_loud_failures_keep_their_verdicts():
    nan_tail = FP32[:20] + [float("nan")] * 10
    results = {"fp32": variant("fp32", FP32), "fp16_dynamic": variant("fp16_dynamic", nan_tail)}
    assert judge(results, 30)[0] == "fp16_range"
    skipping = [1.0] * 30
    results = {
        "fp32": variant("fp32", FP32),
        "fp16_dynamic": variant("fp16_dynamic", skipping, skipped=20, final_scale=1.0),
        "fp16_fixed": variant("fp16_fixed", FP32),
    }
    assert judge(results, 30)[0] == "dynamic_scale_conflict"
