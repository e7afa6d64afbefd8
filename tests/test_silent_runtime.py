"""Silent precision failures at runtime: absorbed fp16 overflow counted by telemetry on
range-sampling steps (AG170), auto_fallback on a confirmed absorbed overflow, and fp16 without a
loss scaler losing gradient (AG171). Each with a firing and a silent case, on real fp16 autocast.
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_silent_locate import NormNet, batch, ce

import ampguard as ag
from ampguard import runlog
from ampguard.testing import count_syncs

W = 32


def train_guard(model, run_dir, steps=8, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    telemetry = ag.Telemetry(run_dir, range_every=4, flush_every=8)
    with ag.Guard(model, opt, precision="fp16", telemetry=telemetry, **kwargs) as guard:
        for _ in range(steps):
            with guard.autocast():
                loss = ce(model, (x, y))
            guard.backward(loss)
            guard.step()
        found = guard.findings()
        state = guard.state_dict()
    return found, state


def absorbed_events(run_dir):
    return [e for e in runlog.load_run(run_dir).events if e.get("kind") == "absorbed"]


def test_telemetry_counts_absorbed_overflow_on_range_steps(tmp_path):
    found, _ = train_guard(NormNet(gain=2000.0), tmp_path / "run")
    events = absorbed_events(tmp_path / "run")
    assert [e["step"] for e in events] == [1, 2, 4, 8]  # early windows 1, 2, 4, then every 4
    assert all(set(e["modules"]) == {"norm"} for e in events)
    ag170 = [f for f in found if f.code == "AG170"]
    assert len(ag170) == 1
    f = ag170[0]
    assert f.evidence["module"] == "norm" and f.evidence["steps"] == [1, 2, 4, 8]
    assert "keep_fp32=['norm']" in f.fix and "bf16" in f.fix
    assert "loss scale does not help" in f.fix
    assert not any(x.code in ("AG101", "AG103") for x in found)  # nothing skipped


def test_telemetry_absorbed_silent_when_values_fit(tmp_path):
    found, _ = train_guard(NormNet(gain=1.0), tmp_path / "run")
    assert absorbed_events(tmp_path / "run") == []
    assert not any(f.code == "AG170" for f in found)


def test_intentional_inf_mask_is_not_counted(tmp_path):
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(W, W)

        def forward(self, x):
            scores = self.fc(x)
            mask = torch.full_like(scores, float("-inf")).triu(1)  # a causal-style mask
            return torch.softmax(scores + mask, -1)

    torch.manual_seed(0)
    model = nn.Sequential(Masked(), nn.Linear(W, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(W, W), torch.randint(0, 4, (W,))
    with ag.Guard(
        model, opt, precision="fp16", telemetry=ag.Telemetry(tmp_path, range_every=1)
    ) as g:
        for _ in range(3):
            with g.autocast():
                loss = F.cross_entropy(model(x).float(), y)
            g.backward(loss)
            g.step()
    assert absorbed_events(tmp_path) == []


def test_counting_adds_no_host_sync_between_flushes(tmp_path):
    model = NormNet(gain=2000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    telemetry = ag.Telemetry(tmp_path, range_every=2, flush_every=100)
    with ag.Guard(model, opt, precision="fp16", telemetry=telemetry) as guard:

        def step():
            with guard.autocast():
                loss = ce(model, (x, y))
            guard.backward(loss)
            guard.step()

        step()  # warm: the first step may read things once
        sampled = [count_syncs(step, 1) for _ in range(4)]  # windows 2..5: 2 and 4 counted
        assert sampled[0] == sampled[1] == sampled[2] == sampled[3]
    assert [e["step"] for e in absorbed_events(tmp_path)] == [1, 2, 4]  # it did count them


def test_auto_fallback_keeps_a_confirmed_absorbed_overflow_in_fp32(tmp_path):
    found, state = train_guard(NormNet(gain=2000.0), tmp_path / "run", auto_fallback=True)
    assert state["forensics"]["keep_fp32"] == ["norm"]
    change = state["forensics"]["changes"][0]
    assert change["step"] == 1 and change["absorbed"] is True  # the first window is scanned
    codes = {f.code for f in found}
    assert {"AG360", "AG306"} <= codes
    # the state loads back into a new Guard
    model = NormNet(gain=2000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="fp16", auto_fallback=True)
    guard.load_state_dict(state)
    assert "norm" in guard.state_dict()["forensics"]["keep_fp32"]


def test_auto_fallback_silent_when_values_fit(tmp_path):
    found, state = train_guard(NormNet(gain=1.0), tmp_path / "run", auto_fallback=True)
    assert state["forensics"]["keep_fp32"] == []
    assert not any(f.code in ("AG360", "AG306") for f in found)


def tanh_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 4))


def watched_run(run_dir, loss_gain, precision="fp16", scaler=None, steps=8):
    model = tanh_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, W, generator=g), torch.randn(64, 4, generator=g)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    telemetry = ag.Telemetry(run_dir, range_every=2, flush_every=4)
    with ag.watch(scaler, model, opt, telemetry, precision=precision) as w:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(model(x).float(), y) * loss_gain
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        return w.findings()


def test_fp16_without_a_scaler_names_the_layer_and_the_loss(tmp_path):
    found = watched_run(tmp_path, loss_gain=1e-3)
    ag171 = [f for f in found if f.code == "AG171"]
    assert len(ag171) == 1
    f = ag171[0]
    assert f.evidence["layer"] in ("0", "2", "4")
    assert f"loses {f.evidence['underflow']:.1%} of layer {f.evidence['layer']!r}" in f.message
    assert "GradScaler" in f.fix and "bf16" in f.fix
    assert not any(x.code == "AG106" for x in found)  # AG106 presumes a scaler


def test_fp16_without_a_scaler_silent_with_ordinary_gradients(tmp_path):
    found = watched_run(tmp_path, loss_gain=1e3)
    assert not any(f.code in ("AG171", "AG106") for f in found)


def test_fp16_with_a_scaler_gets_no_ag171(tmp_path):
    scaler = torch.amp.GradScaler("cpu")
    found = watched_run(tmp_path, loss_gain=1e-3, scaler=scaler)
    assert not any(f.code == "AG171" for f in found)


def test_bf16_without_a_scaler_gets_no_ag171(tmp_path):
    found = watched_run(tmp_path, loss_gain=1e-3, precision="bf16")
    assert not any(f.code == "AG171" for f in found)


def _lightning_fit(tmp_path, precision, loss_gain):
    L = pytest.importorskip("lightning")

    from ampguard.integrations.lightning import AmpGuardCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tanh_mlp()

        def training_step(self, batch, _):
            x, y = batch
            return F.mse_loss(self.net(x).float(), y.float()) * loss_gain

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(256, W, generator=g), torch.randn(256, 4)),
        batch_size=64,
    )
    callback = AmpGuardCallback(ag.Telemetry(tmp_path / "run", range_every=1, flush_every=4))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), data)
    return {f.code for f in callback.findings()}


def test_lightning_16_true_without_a_scaler_gets_ag171(tmp_path):
    assert "AG171" in _lightning_fit(tmp_path, "16-true", loss_gain=1e-3)


def test_lightning_16_true_silent_with_ordinary_gradients(tmp_path):
    assert "AG171" not in _lightning_fit(tmp_path, "16-true", loss_gain=1e3)


def test_counting_is_invisible_to_the_guards_own_trace(tmp_path):
    # a coverage window that is also a range-sampled window: the counter's bookkeeping ops
    # must not show up as the model's ops in the Guard's trace
    coverage = {}
    for absorbed in (True, False):
        model = NormNet(gain=2000.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = batch()
        telemetry = ag.Telemetry(tmp_path / str(absorbed), range_every=2, absorbed=absorbed)
        with ag.Guard(model, opt, precision="fp16", coverage_step=2, telemetry=telemetry) as g:
            for _ in range(3):
                with g.autocast():
                    loss = ce(model, (x, y))
                g.backward(loss)
                g.step()
            coverage[absorbed] = g.coverage.to_dict()
    assert coverage[True] == coverage[False]
    assert [e["step"] for e in absorbed_events(tmp_path / "True")] == [1, 2]
    assert absorbed_events(tmp_path / "False") == []
