"""The advisor probes the loss code: an fp16 exp / pow in a loss function, outside every module,
that overflows or underflows is AG363, named with its op and source line and the fix that
applies there (fp32, rescale); the same loss computed from ``.float()`` is not. Real fp16 CPU
autocast, real modules."""

import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag


def model_and_batch(gain: float = 1.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[2].weight.mul_(gain)
    gen = torch.Generator().manual_seed(1)
    return model, (torch.randn(32, 8, generator=gen) * 4, torch.randn(32, 4, generator=gen))


def exp_loss(model, batch):
    x, y = batch
    out = model(x)
    return (torch.exp(out * 16) - y).abs().mean()  # exp on the fp16 output: past 65504


def exp_loss_fp32(model, batch):
    x, y = batch
    out = model(x).float()
    return (torch.exp(out * 16) - y).abs().mean()


def pow_loss(model, batch):
    x, y = batch
    out = model(x)
    return (out * 1e-3).pow(4).mean() + F.mse_loss(out.float(), y)  # 1e-12 scale: flushed


def by_code(findings, code):
    return [f for f in findings if f.code == code]


def test_fp16_exp_in_the_loss_overflows_and_is_named_with_its_line():
    model, batch = model_and_batch()
    found = by_code(ag.inspect_model(model, batch, exp_loss), "AG363")
    assert len(found) == 1, [f.code for f in ag.inspect_model(model, batch, exp_loss)]
    f = found[0]
    assert f.evidence["op"] == "aten.exp" and f.evidence["kind"] == "overflow"
    assert f.evidence["source"].endswith(
        f"test_advisor_loss.py:{exp_loss.__code__.co_firstlineno + 3}"
    )
    assert "keep_fp32 cannot reach" in f.message and ".float()" in f.fix
    assert "logsumexp" in f.fix and "keep_fp32=[" not in f.fix
    assert f.evidence["max_abs_fp32"] > 65504


def test_the_same_loss_on_float_outputs_is_quiet():
    model, batch = model_and_batch()
    assert not by_code(ag.inspect_model(model, batch, exp_loss_fp32), "AG363")


def test_fp16_pow_in_the_loss_underflows():
    model, batch = model_and_batch()
    found = by_code(ag.inspect_model(model, batch, pow_loss), "AG363")
    assert found and found[0].evidence["kind"] == "underflow"
    assert found[0].evidence["op"] == "aten.pow" and "scale the values up" in found[0].fix
