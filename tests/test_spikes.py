"""Loss spikes end to end on real CPU training runs: the flight recorder, on_spike's actions,
the detector's statistic across a resume, bad input, and the autopsy.

A spike is planted deterministically: the batch of one chosen window has a few samples scaled
by a large factor (an outlier batch), or one window's LR is raised (an update outlier).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import ampguard as ag
from ampguard.core import results

SPIKE = 80  # the planted spike's window (after the detector's 50-window warm-up)


def _loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


class _Data:
    """A fixed, learnable classification task; batch ``step`` is the same on every call."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(256, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).argmax(dim=1)

    def batch(self, step: int, spike_at: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        idx = torch.randint(0, 256, (32,), generator=g)
        x, y = self.x[idx].clone(), self.y[idx].clone()
        if step == spike_at:
            x[:3] *= 50.0  # three confidently wrong outlier samples carry the loss
            y[:3] = (y[:3] + 1) % 4
        return x, y


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _train(guard: ag.Guard, data: _Data, steps: range, spike_at: int | None = SPIKE, **kw):
    out = {}
    for step in steps:
        batch = data.batch(step, spike_at)
        with guard.autocast():
            loss = _loss_fn(guard.model, batch)
        guard.backward(loss)
        out[step] = guard.step(batch=batch, loss_fn=_loss_fn, **kw)
    return out


def _guard(model, opt=None, **kw) -> ag.Guard:
    opt = opt or torch.optim.AdamW(model.parameters(), lr=3e-3)
    return ag.Guard(model, opt, precision="bf16", **kw)


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------- on_spike
def test_skip_leaves_the_spike_out_of_the_weights_and_the_schedule() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.999)
    guard = ag.Guard(model, opt, precision="bf16", schedulers=[sched], on_spike="skip")
    calls = []
    guard.on_applied(lambda r: calls.append(r.step))
    data = _Data()
    _train(guard, data, range(1, SPIKE))
    before, lr = _weights(model), opt.param_groups[0]["lr"]
    result = _train(guard, data, range(SPIKE, SPIKE + 1))[SPIKE]
    assert result.skip_cause == "loss_spike" and result.loss_spike and not result.applied
    assert not result.nonfinite and not result.overflow
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert opt.param_groups[0]["lr"] == lr and SPIKE not in calls
    clean = _train(guard, data, range(SPIKE + 1, SPIKE + 20))
    assert all(r.applied for r in clean.values())  # one spike, one skip
    d = guard.diagnostics()
    assert d["skipped_steps"] == 1
    with pytest.warns(RuntimeWarning, match="AG1xx rules need a run log"):  # AG180 still comes
        found = guard.findings()
    (finding,) = [f for f in found if f.code == "AG180"]
    assert finding.step == SPIKE and finding.evidence["action"] == "skip"
    assert finding.evidence["ratio"] > 10  # the size: the loss over its running level


def test_warn_is_the_default_and_applies_the_step() -> None:
    model = _model()
    guard = _guard(model)
    data = _Data()
    _train(guard, data, range(1, SPIKE))
    with pytest.warns(RuntimeWarning, match=f"loss spike at step {SPIKE}"):
        result = _train(guard, data, range(SPIKE, SPIKE + 1))[SPIKE]
    assert result.applied and result.loss_spike and result.skip_cause is None


def test_warn_on_a_step_skipped_for_another_cause_says_skipped_not_applied() -> None:
    model = _model()
    guard = _guard(model)
    data = _Data()
    _train(guard, data, range(1, SPIKE))
    batch = data.batch(SPIKE, SPIKE)
    with guard.autocast():
        loss = _loss_fn(model, batch)
    guard.backward(loss)
    model[0].weight.grad.view(-1)[0] = float("inf")  # the same window: non-finite gradients
    with pytest.warns(RuntimeWarning, match="skipped anyway \\(non-finite gradients\\)"):
        result = guard.step(batch=batch, loss_fn=_loss_fn)
        assert not result.applied and result.loss_spike
    (finding,) = [f for f in guard.findings() if f.code == "AG180"]
    assert "skipped anyway" in finding.message and "applied" not in finding.message


def test_raise_skips_then_raises_loss_spike_error() -> None:
    model = _model()
    guard = _guard(model, on_spike="raise")
    data = _Data()
    _train(guard, data, range(1, SPIKE))
    before = _weights(model)
    with pytest.raises(ag.LossSpikeError, match=f"step {SPIKE}") as info:
        _train(guard, data, range(SPIKE, SPIKE + 1))
    assert info.value.step == SPIKE and info.value.loss > info.value.bound
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert all(p.grad is None for p in model.parameters())  # nothing leaks into the next window


def test_rewind_restores_weights_optimizer_and_schedule_from_the_snapshot() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
    guard = ag.Guard(
        model, opt, precision="bf16", schedulers=[sched], on_spike="rewind", snapshot_every=10
    )
    data = _Data()
    _train(guard, data, range(1, 71))  # snapshots after 60 and 70; 70 == SPIKE - 10
    at_70 = (_weights(model), copy.deepcopy(opt.state_dict()), opt.param_groups[0]["lr"])
    _train(guard, data, range(71, SPIKE))
    with pytest.warns(RuntimeWarning, match="rewound to the snapshot after step 70"):
        result = _train(guard, data, range(SPIKE, SPIKE + 1))[SPIKE]
    assert result.skip_cause == "loss_spike"
    assert all(torch.equal(a, b) for a, b in zip(at_70[0], _weights(model), strict=True))
    assert opt.param_groups[0]["lr"] == at_70[2]
    state = opt.state_dict()["state"]
    assert all(torch.equal(state[k]["exp_avg"], at_70[1]["state"][k]["exp_avg"]) for k in state)
    (f,) = [f for f in guard.findings() if f.code == "AG180"]
    assert f.evidence["snapshot_step"] == 70
    after = _train(guard, data, range(SPIKE + 1, SPIKE + 5))  # and training carries on
    assert all(r.applied for r in after.values())


def test_fused_optimizer_skips_on_the_device_and_acts_when_flags_are_read() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    guard = _guard(model, opt, on_spike="skip")
    data = _Data()
    _train(guard, data, range(1, SPIKE))
    before = _weights(model)
    result = _train(guard, data, range(SPIKE, SPIKE + 1))[SPIKE]
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert result.skip_cause == "loss_spike"  # reading it settles the lazy flags


def test_fp16_spike_skip_leaves_the_loss_scale_alone() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = ag.ScalerConfig(init_scale=8.0, max_scale=8.0)  # the outlier's grads stay finite
    guard = ag.Guard(model, opt, precision="fp16", scaler=config, on_spike="skip")
    data = _Data()
    _train(guard, data, range(1, SPIKE))
    scale = guard.scale
    result = _train(guard, data, range(SPIKE, SPIKE + 1))[SPIKE]
    assert result.skip_cause == "loss_spike" and not result.overflow
    assert guard.scale == scale
    assert guard.diagnostics()["skipped_by_cause"]["overflow"] == 0


def test_a_clean_run_with_a_fast_falling_loss_never_triggers() -> None:
    model = _model(1)
    guard = _guard(model, on_spike="raise")
    data = _Data(1)
    results_ = _train(guard, data, range(1, 301), spike_at=None)
    losses = [r["loss"] for r in guard.flight_recorder.ring.rows()]
    assert all(r.applied for r in results_.values())
    assert guard.flight_recorder.events == []
    assert max(losses) > 0  # recorded


def test_packed_flags_keep_the_dropped_count_next_to_the_spike_bits() -> None:
    found = [torch.zeros(()), torch.zeros(())]
    status = results.pack(found, torch.tensor(3.0), None, (torch.ones(()), True))
    flags = results.decode(float(status), 2, scaled=False)
    assert flags.spike and flags.spike_only and flags.dropped == 3
    assert flags.skip_cause == "loss_spike" and not flags.nonfinite
    status = results.pack([torch.ones(()), torch.zeros(())], None, None, (torch.ones(()), True))
    flags = results.decode(float(status), 2, scaled=False)
    assert flags.skip_cause == "nonfinite" and flags.spike  # non-finite grads come first


# ---------------------------------------------------------------------- recorder, state
def test_recorder_rows_hold_loss_lr_flags_and_grad_norms() -> None:
    model = _model()
    guard = _guard(model, flight_recorder=32)
    _train(guard, _Data(), range(1, 41), spike_at=None)
    rows = guard.flight_recorder.ring.rows()
    assert [r["step"] for r in rows] == list(range(9, 41))  # the last 32 windows
    assert rows[-1]["lr"] == [3e-3] and rows[-1]["status"] == 0.0
    assert len(rows[-1]["grad_norm"]) == 4 and all(v > 0 for v in rows[-1]["grad_norm"])
    sampled = [r for r in rows if r["step"] % 16 == 0]
    assert sampled and all(v is not None and v > 0 for v in sampled[0]["update_ratio"])
    mem = guard.flight_recorder.memory()
    assert 0 < mem["ring"] < 10_000 and mem["snapshots"] == 0  # none before window 100


def test_recording_adds_no_host_sync() -> None:
    def run(**kw) -> int:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        guard = _guard(model, opt, snapshot_every=5, **kw)
        data = _Data()
        _train(guard, data, range(1, 4), spike_at=None)
        with ag.SyncCounter() as sc:
            _train(guard, data, range(4, 24), spike_at=None)
        return sc.count

    assert run() == run(flight_recorder=False, on_spike=None) == 0


def test_resume_keeps_the_detector_statistic() -> None:
    data = _Data()
    model = _model()
    guard = _guard(model, on_spike="skip")
    _train(guard, data, range(1, SPIKE), spike_at=None)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), guard.optimizers[0].state_dict()
    state = guard.state_dict()
    assert state["spikes"]["count"] == SPIKE - 1
    model2 = _model(5)
    model2.load_state_dict(saved_model)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=3e-3)
    opt2.load_state_dict(saved_opt)
    resumed = _guard(model2, opt2, on_spike="skip")
    resumed.load_state_dict(state)
    assert (
        resumed.flight_recorder.detector.state_dict() == guard.flight_recorder.detector.state_dict()
    )
    result = _train(resumed, data, range(SPIKE, SPIKE + 1))[SPIKE]  # armed at once: no warm-up
    assert result.skip_cause == "loss_spike"


def test_malformed_detector_state_is_refused_and_changes_nothing() -> None:
    guard = _guard(_model())
    _train(guard, _Data(), range(1, 10), spike_at=None)
    state = guard.state_dict()
    state["spikes"] = {"mean": float("nan"), "spread": 0.1, "count": 3}
    before = guard.flight_recorder.detector.state_dict()
    with pytest.raises(ValueError, match="spikes.mean"):
        guard.load_state_dict(state)
    assert guard.flight_recorder.detector.state_dict() == before


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"on_spike": "ignore"}, ValueError, "on_spike must be None, 'warn'"),
        ({"flight_recorder": 0}, ValueError, r"flight_recorder must be .* \[8, 65536\]"),
        ({"flight_recorder": -5}, ValueError, "flight_recorder"),
        ({"flight_recorder": 10**9}, ValueError, "flight_recorder"),
        ({"flight_recorder": "256"}, TypeError, "flight_recorder must be an int"),
        ({"snapshot_every": 0}, ValueError, "snapshot_every must be in"),
        ({"snapshot_every": 10**12}, ValueError, "snapshot_every"),
        ({"snapshot_every": 2.5}, TypeError, "snapshot_every must be an int"),
        ({"snapshot": 3}, TypeError, "snapshot must be True"),
        ({"on_spike": "rewind", "snapshot": False}, ValueError, "rewind. needs snapshots"),
    ],
)
def test_bad_arguments_name_themselves_and_touch_nothing(kw, exc, match) -> None:
    model = _model()
    before = _weights(model)
    with pytest.raises(exc, match=match):
        _guard(model, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))


def test_an_optimizer_without_state_dict_is_refused_when_snapshotting() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state_dict = None  # type: ignore[method-assign,assignment]
    with pytest.raises(TypeError, match="optimizer: a SGD has no state_dict"):
        ag.Guard(model, opt, precision="bf16")
    ag.Guard(model, opt, precision="bf16", snapshot=False)  # without snapshots it is fine


def test_autopsy_without_a_recorder_names_the_arguments() -> None:
    guard = _guard(_model(), flight_recorder=False, on_spike=None)
    assert guard.flight_recorder is None
    with pytest.raises(ValueError, match="flight_recorder=False and on_spike=None"):
        ag.autopsy(guard)


# ---------------------------------------------------------------------- the autopsy
def test_autopsy_verifies_an_outlier_batch() -> None:
    model = _model()
    guard = _guard(model, on_spike="skip", snapshot_every=20)
    data = _Data()
    _train(guard, data, range(1, SPIKE + 30))  # snapshots move on; the one before is kept
    live = _weights(model)
    rng = torch.get_rng_state()
    (d,) = ag.autopsy(guard)
    assert isinstance(d, ag.SpikeDiagnosis) and d.step == SPIKE
    assert d.mechanism == "outlier_batch" and d.verified and d.layer is None
    assert d.evidence["replayed_loss"] == pytest.approx(d.evidence["loss"], rel=1e-3)
    assert d.evidence["removed_by"] == "drop_outliers" and d.fix
    assert all(torch.equal(a, b) for a, b in zip(live, _weights(model), strict=True))
    assert torch.equal(rng, torch.get_rng_state())


def test_autopsy_without_batches_says_so_and_is_not_verified() -> None:
    model = _model()
    guard = _guard(model, on_spike="skip", snapshot_every=20)
    data = _Data()
    for step in range(1, SPIKE + 1):
        batch = data.batch(step, SPIKE)
        with guard.autocast():
            loss = _loss_fn(model, batch)
        guard.backward(loss)
        guard.step()  # no batch= / loss_fn=
    (d,) = ag.autopsy(guard)
    assert not d.verified and d.mechanism in ag.guard._autopsy.MECHANISMS
    assert "no batch recorded" in d.evidence["replay"]


def test_autopsy_verifies_an_update_outlier_in_a_layer() -> None:
    """One window's update of the output layer is blown up (a planted bad LR for that layer's
    group): the loss spikes on the next window, and clipping that layer's update removes it."""
    model = _model()
    head = list(model[2].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = torch.optim.SGD([{"params": body, "lr": 0.05}, {"params": head, "lr": 0.05}])
    guard = ag.Guard(model, opt, precision="bf16", on_spike="skip", snapshot_every=20)
    data = _Data()

    def bump(step: int) -> None:
        opt.param_groups[1]["lr"] = 40.0 if step == SPIKE - 1 else 0.05

    for step in range(1, SPIKE + 5):
        bump(step)
        batch = data.batch(step)
        with guard.autocast():
            loss = _loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=_loss_fn)
    events = [e.step for e in guard.flight_recorder.events]
    assert events and events[0] == SPIKE
    d = ag.autopsy(guard)[0]
    assert d.verified, d.evidence
    assert d.layer == "2" and d.mechanism == "output_logit_divergence"


# ---------------------------------------------------------------------- dumps and postmortem
def test_a_spike_dumps_the_ring_and_postmortem_names_step_and_rank(tmp_path, capsys) -> None:
    from ampguard.cli._main import main

    run = tmp_path / "run"
    guard = _guard(_model(), on_spike="skip", telemetry=run)
    _train(guard, _Data(), range(1, SPIKE + 3))
    guard.close()
    dump = run / "flight_recorder" / "rank0.json"
    assert dump.is_file() and not list(dump.parent.glob("*.tmp"))
    assert main(["postmortem", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"first: rank 0, step {SPIKE}: loss spike" in out and f">{SPIKE:>5}" in out


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "no flight-recorder dumps"),
        ("{oops", "unreadable dump"),
        ('{"kind": "other"}', "not an ampguard flight-recorder dump"),
        (
            '{"kind": "ampguard.flight_recorder", "version": 1, "rank": 0, "step": 3, '
            '"names": [], "rows": [{"step": "x"}]}',
            r"rows\[0\].step is missing or malformed",
        ),
        ('{"kind": "ampguard.flight_recorder", "version": 9}', "dump version 9"),
    ],
)
def test_postmortem_on_missing_or_corrupt_dumps_is_one_line_exit_2(
    tmp_path, capsys, content, match
) -> None:
    from ampguard.cli._main import main

    (tmp_path / "flight_recorder").mkdir()
    if content is not None:
        (tmp_path / "flight_recorder" / "rank0.json").write_text(content)
    assert main(["postmortem", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ampguard postmortem: error:") and err.count("\n") == 1
    assert re.search(match, err)


def test_a_failed_dump_warns_once_and_keeps_the_update(tmp_path) -> None:
    run = tmp_path / "run"
    model = _model()
    guard = _guard(model, on_spike="warn", telemetry=run)
    _train(guard, _Data(), range(1, SPIKE))
    (run / "flight_recorder").write_text("a file where the folder should be")
    before = _weights(model)
    with pytest.warns(RuntimeWarning) as seen:
        result = _train(guard, _Data(), range(SPIKE, SPIKE + 1))[SPIKE]
    assert result.applied  # on_spike="warn": the update went in, dump or no dump
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert any("could not write" in str(w.message) for w in seen)
    guard.close()


@pytest.mark.slow  # a subprocess
@pytest.mark.timeout(120)
def test_sigterm_dumps_the_ring_then_ends_the_process(tmp_path) -> None:
    import json
    import os
    import signal
    import subprocess
    import sys

    script = f"""
import os, signal, torch, ampguard as ag
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16",
                 telemetry={str(tmp_path / "run")!r})
for step in range(1, 8):
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    guard.backward(loss)
    guard.step()
os.kill(os.getpid(), signal.SIGTERM)
print("not reached")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=env
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "not reached" not in proc.stdout
    dump = json.loads((tmp_path / "run" / "flight_recorder" / "rank0.json").read_text())
    assert dump["trigger"] == "SIGTERM" and dump["step"] == 7
    assert [r["step"] for r in dump["rows"]] == list(range(1, 8))


def test_snapshots_on_disk_rewind_and_keep_only_what_is_needed(tmp_path) -> None:
    model = _model()
    folder = tmp_path / "snaps"
    guard = _guard(model, on_spike="rewind", snapshot_every=10, snapshot=folder)
    data = _Data()
    _train(guard, data, range(1, 71))
    at_70 = _weights(model)
    assert sorted(p.name for p in folder.iterdir()) == ["step_60.pt", "step_70.pt"]
    assert guard.flight_recorder.memory()["snapshots"] == 0  # nothing held in memory
    with pytest.warns(RuntimeWarning, match="rewound to the snapshot after step 70"):
        _train(guard, data, range(71, SPIKE + 1))
    assert all(torch.equal(a, b) for a, b in zip(at_70, _weights(model), strict=True))
    _train(guard, data, range(SPIKE + 1, SPIKE + 31), spike_at=None)
    # the live two, and the one pinned for the spike's autopsy
    assert sorted(p.name for p in folder.iterdir()) == ["step_100.pt", "step_110.pt", "step_70.pt"]
    assert not list(folder.glob("*.tmp"))


def test_rewind_restores_the_loss_scale_its_growth_tracker_and_hysteresis() -> None:
    """fp16 with hysteresis 2: an overflow after the snapshot spends one unit of the budget and
    resets the growth tracker without moving the scale; the rewind to the snapshot must bring
    back all three (the scale, the tracker, the budget), not the scale alone."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = ag.ScalerConfig(init_scale=8.0, max_scale=8.0, hysteresis=2, growth_interval=1000)
    guard = ag.Guard(
        model, opt, precision="fp16", scaler=config, on_spike="rewind", snapshot_every=10
    )
    data = _Data()
    _train(guard, data, range(1, 71))
    at_70 = {k: v for k, v in guard.state_dict()["scaler"].items() if k != "config"}
    assert at_70 == {"scale": 8.0, "growth_tracker": 70, "hysteresis_tracker": 2}
    for step in range(71, SPIKE):
        batch = data.batch(step)
        with guard.autocast():
            loss = _loss_fn(model, batch)
        guard.backward(loss)
        if step == 75:  # an overflow: the budget goes 2 -> 1, the tracker back to 0
            model[0].weight.grad.view(-1)[0] = float("inf")
        guard.step(batch=batch, loss_fn=_loss_fn)
    before = {k: v for k, v in guard.state_dict()["scaler"].items() if k != "config"}
    assert before == {"scale": 8.0, "growth_tracker": 4, "hysteresis_tracker": 1}
    with pytest.warns(RuntimeWarning, match="rewound to the snapshot after step 70"):
        result = _train(guard, data, range(SPIKE, SPIKE + 1))[SPIKE]
    assert result.skip_cause == "loss_spike"
    after = {k: v for k, v in guard.state_dict()["scaler"].items() if k != "config"}
    assert after == at_70


def test_a_tensor_lr_is_recorded_on_the_device_without_a_host_sync() -> None:
    """torch.optim takes ``lr=torch.tensor(...)``; reading it with ``float()`` would be a host
    sync on an accelerator. The recorder copies it into the ring's row instead: the same syncs
    as without a recorder, and the rows hold the scheduled LRs."""

    def run(**kw) -> tuple[int, ag.Guard]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3), fused=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        guard = ag.Guard(model, opt, precision="bf16", schedulers=[sched], **kw)
        data = _Data()
        _train(guard, data, range(1, 4), spike_at=None)
        with ag.SyncCounter() as sc:
            _train(guard, data, range(4, 9), spike_at=None)
        return sc.count, guard

    plain, _ = run(flight_recorder=False, on_spike=None)
    count, guard = run()
    assert count == plain  # (the scheduler's own reads of a tensor LR are in both)
    rows = guard.flight_recorder.ring.rows()
    lrs = [r["lr"][0] for r in rows]
    assert all(isinstance(v, float) for v in lrs)
    assert lrs == pytest.approx([3e-3 * 0.9 ** (s - 1) for s in range(1, 9)], rel=1e-6)


def test_output_amax_is_recorded_on_sampled_windows_only() -> None:
    """Per layer, the largest |output| of the sampled window's training forward (an eval
    forward under no_grad does not count); the other windows run without the hooks."""
    model = _model()
    seen: dict[int, dict[str, float]] = {}
    window = [1]

    def probe(name: str):
        def hook(mod, args, out) -> None:
            if torch.is_grad_enabled():
                seen.setdefault(window[0], {})[name] = out.detach().abs().max().item()

        return hook

    for name in ("0", "2"):
        model.get_submodule(name).register_forward_hook(probe(name))
    guard = _guard(model, flight_recorder=32)
    data = _Data()
    for step in range(1, 41):
        window[0] = step
        if step == 16:  # an evaluation forward before the sampled window's: not recorded
            with torch.no_grad():
                model(data.x * 100.0)
        batch = data.batch(step)
        with guard.autocast():
            loss = _loss_fn(model, batch)
        guard.backward(loss)
        guard.step()
        if step == 20:  # not a sampled window: no hook of the recorder's
            assert all(len(m._forward_hooks) == 1 for m in (model[0], model[2]))
    ring = guard.flight_recorder.ring
    assert ring.modules == ["0", "2"]
    rows = {r["step"]: r for r in ring.rows()}
    for step in (16, 32):
        assert rows[step]["amax"] == pytest.approx([seen[step]["0"], seen[step]["2"]])
    assert all(rows[s]["amax"] == [None, None] for s in rows if s % 16)
    guard.close()


def test_the_clip_reuses_the_recorded_gradient_norms_bitwise() -> None:
    """With clipping the recorder's per-parameter norms give the clip's total norm (the
    gradients are read once): the run is bitwise the run without a recorder."""

    def run(**kw) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        guard = _guard(model, opt, clip_grad_norm=0.5, **kw)
        norms = [r.grad_norm for r in _train(guard, _Data(), range(1, 31), spike_at=None).values()]
        return _weights(model), norms

    (w_on, n_on), (w_off, n_off) = run(), run(flight_recorder=False, on_spike=None)
    assert all(torch.equal(a, b) for a, b in zip(w_on, w_off, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(n_on, n_off, strict=True))


def test_grad_norms_are_recorded_unscaled_when_a_fused_step_unscales_inside_its_kernel() -> None:
    """fp16 with a fused optimizer and no clip: the gradients are still scaled when the
    recorder reads them, so their row is unscaled on the device; it must read what a plain
    optimizer's (unscaled first) window reads."""

    def first_row(fused: bool) -> list[float]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused)
        guard = ag.Guard(model, opt, precision="fp16", scaler=ag.ScalerConfig(init_scale=1024.0))
        _train(guard, _Data(), range(1, 2), spike_at=None)
        return guard.flight_recorder.ring.rows()[0]["grad_norm"]

    fused, plain = first_row(True), first_row(False)
    assert all(v is not None and v > 0 for v in fused)
    assert fused == pytest.approx(plain, rel=1e-5)


def test_a_copy_of_the_model_made_while_sampling_does_not_write_the_amax() -> None:
    """A deep copy of the model taken between the windows (a replay, the autopsy's) carries the
    sampling hooks; its forward passes must not count as the live window's."""
    model = _model()
    guard = _guard(model, flight_recorder=32)
    data = _Data()
    _train(guard, data, range(1, 16), spike_at=None)  # the hooks for window 16 are armed now
    twin = copy.deepcopy(model)
    twin(data.x * 1000.0).sum().backward()  # a huge forward on the copy
    batch = data.batch(16)
    with torch.no_grad():
        want = [model[0](batch[0]).abs().max().item()]
    with guard.autocast():
        loss = _loss_fn(model, batch)
    guard.backward(loss)
    guard.step()
    row = next(r for r in guard.flight_recorder.ring.rows() if r["step"] == 16)
    assert row["amax"][0] == pytest.approx(want[0], rel=2e-2)  # bf16 autocast vs fp32


def _shifted_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    """A loss whose level jumps for good at window SPIKE (its batches carry the shift): no
    update, skipped or applied, brings the old level back."""
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    return loss * 4.0 if bool(x[0, 0] > 1e3) else loss


def test_a_lasting_level_shift_is_skipped_a_few_windows_then_taken_as_the_new_level() -> None:
    """A skip cannot undo what raised the loss: a loss that stays high must not be skipped for
    ever (every later update lost). After SPIKE_RUN flagged windows in a row the detector takes
    the new level, the updates are applied again, and the finding says so."""
    from ampguard.replay import SPIKE_RUN

    model, data = _model(), _Data()
    guard = _guard(model, on_spike="skip")
    results_ = {}
    for step in range(1, SPIKE + 40):
        x, y = data.batch(step)
        if step >= SPIKE:
            x = x.clone()
            x[0, 0] = 1e4  # the marker the loss reads: the level is 4x from here on
        with guard.autocast():
            loss = _shifted_loss_fn(guard.model, (x, y))
        guard.backward(loss)
        results_[step] = guard.step()
    skipped = [s for s, r in results_.items() if r.skip_cause == "loss_spike"]
    assert skipped == list(range(SPIKE, SPIKE + SPIKE_RUN))
    assert all(results_[s].applied for s in range(SPIKE + SPIKE_RUN, SPIKE + 40))
    codes = [f for f in guard.findings() if f.code == "AG180"]
    assert len(codes) == SPIKE_RUN
    assert "new level" in codes[-1].message and "rewind" in codes[-1].message
