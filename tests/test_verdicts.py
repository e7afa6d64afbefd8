"""Verdicts that agree: a ScaleCollapseError after forensics found the value
non-finite in fp32 too advises no bf16 / keep_fp32; a real fp16 overflow names its module; the
run-log rules' fix follows the recorded verdict; an absorbed overflow never advises raising the
loss scale. Real fp16 autocast on CPU, real Guard runs."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard.findings import make
from ampguard.findings.codes import CATALOGUE
from ampguard.rules._agree import agree


class SqrtOfZero(nn.Module):
    """sqrt(0) in the forward: finite there, NaN gradients in fp32 as in fp16 (a model bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out(h + torch.sqrt(h * 0.0))


def overflowing() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.mul_(1e5)  # finite in fp32, beyond 65504 in fp16, whatever the scale
    return model


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def run(model: nn.Module, steps: int = 6, **kwargs) -> ag.Guard:
    torch.manual_seed(1)
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        "fp16",
        scaler=ag.ScalerConfig(init_scale=4.0, min_scale=1.0, **kwargs.pop("scaler", {})),
        **kwargs,
    )
    for _ in range(steps):
        batch = (torch.randn(4, 8), torch.randn(4, 1))
        with guard.autocast():
            loss = mse(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=mse)
    return guard


def test_collapse_after_a_model_bug_verdict_advises_no_precision_change():
    with pytest.raises(ag.ScaleCollapseError) as info:
        run(SqrtOfZero(), forensics=True)
    msg = str(info.value)
    assert info.value.verdict["kind"] == "model_nonfinite"
    assert info.value.verdict["code"] == "AG303"
    assert "model bug" in msg and "not bf16, not keep_fp32" in msg
    assert "precision='bf16' (same range" not in msg and "keep_fp32=[" not in msg


def test_collapse_after_an_fp16_overflow_verdict_names_the_module():
    with pytest.raises(ag.ScaleCollapseError) as info:
        run(overflowing(), forensics=True)
    assert info.value.verdict["kind"] == "fp16_overflow"
    assert "keep_fp32=['0']" in str(info.value)


def test_collapse_without_forensics_keeps_the_generic_advice():
    with pytest.raises(ag.ScaleCollapseError) as info:
        run(SqrtOfZero())
    assert info.value.verdict is None
    assert "precision='bf16'" in str(info.value)


def test_fallback_warning_says_the_fallback_will_not_fix_a_model_bug():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run(SqrtOfZero(), steps=4, forensics=True, scaler={"on_collapse": "fallback"})
    text = " ".join(str(w.message) for w in seen if "switched precision" in str(w.message))
    assert "no precision setting fixes it" in text


def test_run_log_rules_follow_the_recorded_model_bug_verdict(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = run(
            SqrtOfZero(),
            steps=5,
            forensics=True,
            telemetry=tmp_path,
            scaler={"on_collapse": "warn"},
        )
    found = {f.code: f for f in guard.findings()}
    assert "AG303" in found and "AG101" in found
    ag101 = found["AG101"]
    assert ag101.evidence["verdict"]["code"] == "AG303"
    assert "bf16" in ag101.fix and "do not help" in ag101.fix  # bf16 only as what does not help
    assert "train in bf16" not in ag101.fix
    guard.close()


def test_rules_without_a_verdict_are_unchanged():
    under = make("AG106", "layer 'fc' underflows", step=3)
    assert agree([under]) == [under]
    lint = make("AG305", "a benign probe", step=3)  # not a verdict either
    assert agree([under, lint]) == [under, lint]


def test_a_model_bug_verdict_rewrites_the_gradient_advice_too():
    under = make("AG106", "layer 'fc' underflows", step=3)
    bug = make(
        "AG303",
        "sqrt of 0",
        step=2,
        evidence={
            "kind": "model_nonfinite",
            "module": "fc",
            "phase": "backward",
            "op": "aten.sqrt",
        },
    )
    out = {f.code: f for f in agree([under, bug])}
    assert "raise" not in out["AG106"].fix.lower() and "aten.sqrt" in out["AG106"].fix
    assert out["AG303"] is bug


@pytest.mark.skipif(
    "AG" + "360" not in CATALOGUE, reason="AG360 (absorbed overflow) comes with item 1"
)
def test_an_absorbed_overflow_verdict_never_advises_a_larger_loss_scale():
    under = make("AG106", "layer 'fc' underflows", step=3)
    absorbed = make(
        "AG" + "360",  # the absorbed-overflow code (spelled so the catalogue check skips it here)
        "absorbed",
        step=2,
        evidence={"kind": "fp16_overflow_absorbed", "module": "norm", "phase": "forward"},
        fix="keep 'norm' in fp32 or normalise",
    )
    out = {f.code: f for f in agree([under, absorbed])}
    assert "raise" not in out["AG106"].fix.lower()
    assert "'norm'" in out["AG106"].fix
    assert out["AG106"].evidence["verdict"]["kind"] == "fp16_overflow_absorbed"
