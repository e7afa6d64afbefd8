"""A Guard whose constructor raises changes nothing.

Every argument is validated and every resource (run folder, peer group) is created before the
model is touched (fp8 conversion, keep_fp32 hooks); a constructor that raises leaves the model's
module types, parameters and hooks exactly as they were, and the next Guard trains as asked.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.runlog import load_run

pytest.importorskip("torchao")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def _fingerprint(model: nn.Module) -> list[tuple]:
    """Module types, parameter identities and values, and every hook, per module."""
    out = []
    for name, m in model.named_modules():
        hooks = tuple(
            len(getattr(m, attr))
            for attr in (
                "_forward_hooks",
                "_forward_pre_hooks",
                "_backward_hooks",
                "_backward_pre_hooks",
                "_state_dict_hooks",
                "_load_state_dict_pre_hooks",
            )
        )
        params = tuple(
            (n, id(p), p.dtype, p.detach().clone()) for n, p in m.named_parameters(recurse=False)
        )
        out.append((name, type(m), hooks, params))
    return out


def _same(a: list[tuple], b: list[tuple]) -> bool:
    if len(a) != len(b):
        return False
    for (n1, t1, h1, p1), (n2, t2, h2, p2) in zip(a, b, strict=True):
        if (n1, t1, h1) != (n2, t2, h2) or len(p1) != len(p2):
            return False
        for (pn1, i1, d1, v1), (pn2, i2, d2, v2) in zip(p1, p2, strict=True):
            if (pn1, i1, d1) != (pn2, i2, d2) or not torch.equal(v1, v2):
                return False
    return True


def _unwritable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    return blocker / "run"


BAD = {
    "peer_timeout": (dict(peer_timeout=-1), ValueError, "peer_timeout"),
    "on_desync": (dict(on_desync="explode"), ValueError, "on_desync"),
    "audit_every": (dict(audit_every=0), ValueError, "audit_every"),
    "telemetry": (dict(telemetry=5), TypeError, "telemetry"),
    "keep_fp32": (dict(keep_fp32=["no_such_layer"]), ValueError, "keep_fp32"),
    "run_folder": (None, ag.TelemetryError, "run"),
    "coverage_step": (dict(coverage_step=-3), ValueError, "coverage_step"),
    "scaler": (dict(scaler="big"), TypeError, "scaler"),
}


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_guard_that_raises_leaves_the_model_as_it_was(case, precision, tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs, error, named = BAD[case]
    if kwargs is None:
        kwargs = dict(telemetry=_unwritable(tmp_path))
    # keep_fp32 on a real layer too, so a half-built Guard would leave hooks behind
    if case != "keep_fp32":
        kwargs = dict(kwargs, keep_fp32=["0"])
    before = _fingerprint(model)
    with warnings.catch_warnings(), pytest.raises(error, match=named):
        warnings.simplefilter("ignore")  # fp8 on CPU: the emulation warning
        ag.Guard(model, opt, precision=precision, **kwargs)
    assert _same(before, _fingerprint(model)), f"{case}: the failed Guard changed the model"
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())

    # the next Guard on the same model trains as it says: bf16, plain Linear layers
    guard = ag.Guard(model, opt, precision="bf16")
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        with guard.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        assert guard.step().applied
    assert guard.precision == "bf16"
    assert all(not torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())


def test_a_failed_guard_leaves_no_run_folder_lock(tmp_path):
    """A Guard that failed after its run folder was created releases it: the next one may write."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="keep_fp32"):
        ag.Guard(model, opt, precision="bf16", telemetry=run, keep_fp32=["nope"])
    with ag.Guard(model, opt, precision="bf16", telemetry=run) as guard:
        with guard.autocast():
            loss = model(torch.randn(4, 32)).float().pow(2).mean()
        guard.backward(loss)
        guard.step()
    assert load_run(run).steps.tolist() == [1]


def test_under_a_process_group_a_failed_guard_leaves_the_model_as_it_was(world_of_one, tmp_path):
    """The peer group and the run folder come before the model: a folder that cannot be
    created fails after the group exists, and still nothing of the model changed."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _fingerprint(model)
    with warnings.catch_warnings(), pytest.raises(ag.TelemetryError, match="run"):
        warnings.simplefilter("ignore")
        ag.Guard(
            model,
            opt,
            precision="fp8",
            keep_fp32=["0"],
            peer_timeout=5,
            telemetry=_unwritable(tmp_path),
        )
    assert _same(before, _fingerprint(model))
    guard = ag.Guard(model, opt, precision="bf16", peer_timeout=5)
    with guard.autocast():
        loss = model(torch.randn(4, 32)).float().pow(2).mean()
    guard.backward(loss)
    assert guard.step().applied and guard.precision == "bf16"
