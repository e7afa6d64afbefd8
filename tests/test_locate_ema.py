"""locate's optimizer phase sees weights the optimizer does not own: a bf16 EMA whose ``lerp_``
update at decay 0.999 rounds away entirely (AG365 on the EMA layers), measured on copies.
Real bf16 modules, real Adam, CPU autocast."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag


def mse(model: nn.Module, batch):
    x, y = batch
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen)


def pair():
    """An fp32 model (its optimizer healthy) and a bf16 EMA of it a little behind it."""
    model = mlp(0)
    ema = mlp(0).to(torch.bfloat16)
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            p.add_(torch.randn_like(p) * 1e-3 * p.abs().clamp_min(1e-2) * 8)
            e.copy_(e)  # the EMA lags the model by ~1% of each weight
    return model, ema


def test_bf16_ema_whose_lerp_rounds_away_is_precision_stagnation():
    model, ema = pair()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = [p.clone() for p in ema.parameters()]
    assert ag.locate(model, mse, data(), "bf16", optimizer=opt).kind == "none"  # blind before
    d = ag.locate(model, mse, data(), "bf16", optimizer=opt, ema=ema, ema_decay=0.999)
    assert (d.kind, d.phase, d.code, d.op) == (
        "precision_stagnation",
        "optimizer",
        "AG365",
        "ema.lerp_",
    )
    assert set(d.stats["ema_layers"]) == {"ema.0", "ema.2"}
    assert all(v == 1.0 for v in d.stats["ema_layers"].values())  # every update rounded away
    assert d.module in {"ema.0", "ema.2"} and d.stats["ema_decay"] == 0.999
    assert "lerp_" in d.explain() and "watch_ema" in d.to_finding().fix
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), before, strict=True))


def test_an_ema_watch_and_a_decay_whose_update_bf16_holds():
    model, ema = pair()
    watch = ag.watch_ema(ema, model)
    d = ag.locate(model, mse, data(), "bf16", ema=watch, ema_decay=0.5)
    assert d.kind == "none", d.explain()  # half the gap is far above half an ulp
    d = ag.locate(model, mse, data(), "bf16", ema=watch)
    assert d.stats["owner"] == "ema" and d.op == "ema.lerp_"
    assert watch.samples == 0  # measured on copies: the watch's own counts untouched


def test_kahan_rescued_ema_is_not_stagnant():
    model, ema = pair()
    d = ag.locate(model, mse, data(), "bf16", ema=ag.watch_ema(ema, model, rescue="kahan"))
    assert d.kind == "none", d.explain()


def test_bad_ema_arguments_name_the_argument():
    model, _ = pair()
    with pytest.raises(TypeError, match="ema must be"):
        ag.locate(model, mse, data(), "bf16", ema=3)
    with pytest.raises(ValueError, match="ema_decay"):
        ag.locate(model, mse, data(), "bf16", ema=mlp(0), ema_decay=1.5)
