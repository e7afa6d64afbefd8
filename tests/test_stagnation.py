"""Update stagnation at runtime: bf16 weights whose Adam updates are below half
an ulp get AG175 naming the layers; bf16 weights with updates that fit, fp32 master weights and
skipped windows do not. Real bf16 weights, real Adam/SGD, real autocast on CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard.core.stagnation import StagnationProbe, lost_updates
from ampguard.testing import SyncCounter


def mlp(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(4.0)  # |w| ~ 0.1-0.7: a bf16 spacing of 2**-10..2**-8 there
    return model.to(dtype)


def train(guard: ag.Guard, model: nn.Module, steps: int, nan_at: int | None = None) -> None:
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
        with guard.autocast():
            out = model(x.to(next(model.parameters()).dtype))
            loss = F.mse_loss(out.float(), y)
        guard.backward(loss)
        if nan_at == i:
            model[2].weight.grad.view(-1)[0] = float("nan")
        guard.step()


def codes(guard: ag.Guard) -> list[str]:
    return [f.code for f in guard.findings()]


def test_bf16_weights_with_tiny_adam_updates_get_ag175_naming_the_layer():
    model = mlp()
    guard = ag.Guard(model, torch.optim.Adam(model.parameters(), lr=1e-5), precision="bf16")
    train(guard, model, 2)
    (finding,) = [f for f in guard.findings() if f.code == "AG175"]
    assert "'0'" in finding.title  # the first Linear, whose weights are large
    layer = finding.evidence["layers"]["0"]
    assert layer["dtype"] == "bfloat16" and layer["share"] >= 0.9
    assert "bf16_stochastic_round" in finding.fix and "fp32 master weights" in finding.fix


def test_bf16_weights_with_updates_above_half_an_ulp_are_silent():
    model = mlp()
    guard = ag.Guard(model, torch.optim.Adam(model.parameters(), lr=5e-2), precision="bf16")
    train(guard, model, 2)
    assert "AG175" not in codes(guard)
    shares = guard.stagnation.shares()  # measured, and low
    assert all(s.moving > 0 and s.share < 0.1 for s in shares)


def test_fp32_master_weights_are_not_watched():
    model = mlp(torch.float32)
    guard = ag.Guard(model, torch.optim.Adam(model.parameters(), lr=1e-5), precision="bf16")
    train(guard, model, 2)
    assert guard.stagnation is None
    with pytest.warns(RuntimeWarning, match="need a run log"):
        assert guard.findings() == []  # nothing is watched: no AG175, and no telemetry


def test_a_skipped_window_is_not_counted_as_stagnation():
    model = mlp()
    guard = ag.Guard(model, torch.optim.Adam(model.parameters(), lr=5e-2), precision="bf16")
    train(guard, model, 1, nan_at=0)  # window 1 (sampled) is skipped: nothing moved
    assert guard.skipped_steps == 1
    assert all(s.moving == 0 for s in guard.stagnation.shares())
    assert "AG175" not in codes(guard)


def test_fused_sampled_step_adds_no_host_sync_and_masks_a_lazy_skip():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5, fused=True)
    guard = ag.Guard(model, opt, precision="bf16")
    with SyncCounter() as syncs:
        train(guard, model, 1, nan_at=0)  # skipped, known only on the device
    assert syncs.count == 0
    assert all(s.moving == 0 for s in guard.stagnation.shares())
    train(guard, model, 49)  # window 50 is sampled again and applied
    assert "AG175" in codes(guard)


def test_lost_updates_counts_exactly_on_real_bf16_rounding():
    p = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.bfloat16)
    before = p.clone()
    grad = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.bfloat16)
    p.sub_(torch.tensor([1e-3, 1e-2, 0.0, 1e-3], dtype=torch.bfloat16))  # 1e-3 < ulp(1)/2
    assert lost_updates([p], [before], [grad]).tolist() == [[1, 3]]
    probe = StagnationProbe(nn.Linear(2, 2), [p])
    assert probe.layers == ["(not in model)"]


# ---------------------------------------------------------------- attach mode (ag.watch)
def watched_loop(tmp_path, lr: float, steps: int = 3, scaler=None, fused: bool = False):
    """A plain bf16-weight loop observed by ag.watch: the probe hooks the optimizer's step."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=lr, fused=fused)
    gen = torch.Generator().manual_seed(1)
    with ag.watch(scaler, model, opt, telemetry=tmp_path / "run", precision="bf16") as w:
        for _ in range(steps):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
            loss = F.mse_loss(model(x.bfloat16()).float(), y)
            w.record_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        found = w.findings()
    return w, found


def test_watch_names_bf16_weights_whose_updates_round_away(tmp_path):
    watch, found = watched_loop(tmp_path, lr=1e-5)
    (finding,) = [f for f in found if f.code == "AG175"]
    assert finding.evidence["samples"] == 1  # the first window is sampled, the next two are not
    assert finding.evidence["layers"]["0"]["share"] >= 0.9
    assert watch.stagnation is not None and watch.stagnation.layers[0] == "0"
    # and it reached findings.json, so `ampguard report` shows it
    assert "AG175" in (tmp_path / "run" / "findings.json").read_text()


def test_watch_is_silent_on_bf16_updates_that_fit_and_on_fp32_weights(tmp_path):
    _, found = watched_loop(tmp_path, lr=5e-2)
    assert "AG175" not in [f.code for f in found]
    model = mlp(torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    with ag.watch(None, model, opt, telemetry=tmp_path / "fp32", precision="fp32") as w:
        assert w.stagnation is None  # fp32 master weights: nothing is sampled, nothing costs


@pytest.mark.parametrize("overflow", [True, False])
def test_watch_counts_no_update_for_a_step_a_fused_optimizer_skipped(tmp_path, overflow):
    # GradScaler steps a fused optimizer even on an overflow (the kernel skips): the found_inf
    # flag it lends the optimizer keeps the untouched weights from reading as rounded away
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    with ag.watch(scaler, model, opt, telemetry=tmp_path / "run") as w:
        loss = model(torch.randn(16, 32).bfloat16()).float().pow(2).mean()
        scaler.scale(loss).backward()
        if overflow:
            model[2].weight.grad.view(-1)[0] = float("nan")  # the one sampled window overflows
        scaler.step(opt)
        scaler.update()
        assert w.stagnation is not None
        intended = sum(s.moving for s in w.stagnation.shares())
        assert (intended == 0) == overflow  # the applied window is counted, the skipped is not
        assert ("AG175" in [f.code for f in w.findings()]) == (not overflow)
