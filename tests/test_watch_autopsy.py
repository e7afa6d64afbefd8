"""``ag.autopsy(handle)`` on an attached run and a resume that keeps the spike statistics.

Real CPU loops under ``ag.watch`` with a planted outlier batch (``tests/test_watch_spikes.py``'s
task): with snapshots and recorded batches the Guard's counterfactual replay runs and verifies
the mechanism; without a snapshot, a batch or a replayable framework the diagnosis is the
signal read with ``verified=False`` and the reason. A run resumed from a checkpoint
(``handle.state_dict()`` saved with the model and optimizer) flags the same spike at the same
step as the uninterrupted run.
"""

from __future__ import annotations

import json

import pytest
import torch

import ampguard as ag
from ampguard.telemetry import Telemetry

pytestmark = pytest.mark.filterwarnings("ignore:loss spike at step:RuntimeWarning")

SPIKE = 60
STEPS = 62


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    y = (x @ torch.linspace(-1, 1, 64).reshape(16, 4)).argmax(dim=1)
    if step == SPIKE:
        x[:3] *= 50.0
        y[:3] = (y[:3] + 1) % 4
    return x, y


def model_of() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _train(handle, model, opt, steps, *, record=True, start=1) -> None:
    for step in range(start, steps + 1):
        batch = batch_of(step)
        if record:
            handle.record_batch(batch, loss_fn)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        handle.record_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _run(run, *, record=True, steps=STEPS, **kw):
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = ag.watch(None, model, opt, Telemetry(run, flush_every=16), precision="bf16", **kw)
    _train(handle, model, opt, steps, record=record)
    return handle, model, opt


# ---------------------------------------------------------------------- the autopsy
def test_autopsy_replays_an_attached_loop_and_verifies_the_batch(tmp_path) -> None:
    handle, model, _ = _run(tmp_path / "run", snapshot_every=25)
    live = [p.detach().clone() for p in model.parameters()]
    (d,) = ag.autopsy(handle)
    assert d.step == SPIKE and d.verified, d.evidence
    assert d.mechanism == "outlier_batch" and d.evidence["removed_by"] == "drop_outliers"
    assert d.evidence["reproduced"] is True
    assert abs(d.evidence["replayed_loss"] - d.evidence["loss"]) <= 1e-3 * d.evidence["loss"]
    assert all(torch.equal(a, b) for a, b in zip(live, model.parameters(), strict=True))
    handle.close()


def test_autopsy_replays_a_grad_scaler_loop(tmp_path) -> None:
    # fp16 under torch.amp.GradScaler: the replay takes the loss scale from the snapshot
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    handle = ag.watch(scaler, model, opt, Telemetry(tmp_path / "run", flush_every=16),
                      snapshot_every=25)  # fmt: skip
    with handle:
        for step in range(1, STEPS + 1):
            batch = batch_of(step)
            handle.record_batch(batch, loss_fn)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    (d,) = ag.autopsy(handle)
    assert d.step == SPIKE and d.evidence.get("reproduced") is True, d.evidence
    assert d.verified and d.mechanism == "outlier_batch", d.evidence


def test_autopsy_without_snapshots_says_why(tmp_path) -> None:
    with _run(tmp_path / "run")[0] as handle:
        (d,) = ag.autopsy(handle)
    assert d.step == SPIKE and not d.verified
    assert d.mechanism and d.fix  # the signal read: a mechanism and its fix, not verified
    assert "snapshot_every=N" in d.evidence["replay"]


def test_autopsy_without_batches_says_how_to_record_them(tmp_path) -> None:
    with _run(tmp_path / "run", record=False, snapshot_every=25)[0] as handle:
        (d,) = ag.autopsy(handle)
    assert not d.verified and d.evidence["loss"] is not None
    assert "no batch recorded for step 51" in d.evidence["replay"]
    assert "handle.record_batch(batch, loss_fn)" in d.evidence["replay"]


def test_autopsy_takes_a_batch_provider(tmp_path) -> None:
    with _run(tmp_path / "run", record=False, snapshot_every=25)[0] as handle:
        (d,) = ag.autopsy(handle, batches=batch_of, loss_fn=loss_fn)
    assert d.verified and d.mechanism == "outlier_batch", d.evidence


def test_a_loop_that_clips_by_itself_is_not_verified_and_the_evidence_says_why(tmp_path) -> None:
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = ag.watch(None, model, opt, Telemetry(tmp_path / "run", flush_every=16),
                      precision="bf16", snapshot_every=25)  # fmt: skip
    with handle:
        for step in range(1, STEPS + 1):
            batch = batch_of(step)
            handle.record_batch(batch, loss_fn)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
            handle.record_loss(loss)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # unseen by ampguard
            opt.step()
            opt.zero_grad()
    (d,) = ag.autopsy(handle)
    assert d.step == SPIKE and not d.verified
    assert "did not reproduce step" in d.evidence["replay"]
    assert "a loop's own gradient clipping" in d.evidence["replay"]


def test_autopsy_without_a_recorder_names_the_arguments(tmp_path) -> None:
    with _run(tmp_path / "run", steps=2, flight_recorder=False, on_spike=None)[0] as handle:
        with pytest.raises(ValueError, match="flight_recorder=False / on_spike=None"):
            ag.autopsy(handle)


# ---------------------------------------------------------------------- resume
def test_a_resumed_run_flags_the_same_spike_at_the_same_step(tmp_path) -> None:
    whole, _, _ = _run(tmp_path / "whole", record=False)
    expected = [f.step for f in whole.findings() if f.code == "AG180"]
    whole.close()
    assert expected == [SPIKE]

    handle, model, opt = _run(tmp_path / "first", record=False, steps=40)
    ckpt = tmp_path / "ckpt.pt"
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "ampguard": handle.state_dict()},
        ckpt,
    )
    handle.close()
    json.dumps(handle.state_dict())  # plain data: any checkpoint format keeps it

    saved = torch.load(ckpt)
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    resumed = ag.watch(
        None, model, opt, Telemetry(tmp_path / "second", flush_every=16), precision="bf16"
    )
    resumed.load_state_dict(saved["ampguard"])
    _train(resumed, model, opt, STEPS, record=False, start=41)
    assert [f.step for f in resumed.findings() if f.code == "AG180"] == expected
    resumed.close()


def test_a_fresh_detector_misses_what_the_resumed_one_flags(tmp_path) -> None:
    # the control: without the statistic, the resumed run is still warming up at SPIKE
    handle, model, opt = _run(tmp_path / "first", record=False, steps=40)
    handle.close()
    fresh = ag.watch(
        None, model, opt, Telemetry(tmp_path / "second", flush_every=16), precision="bf16"
    )
    _train(fresh, model, opt, STEPS, record=False, start=41)  # its windows 1..22: warming up
    assert fresh.steps == STEPS - 40
    assert [f for f in fresh.findings() if f.code == "AG180"] == []
    fresh.close()


def test_load_state_dict_refuses_bad_input_and_changes_nothing(tmp_path) -> None:
    with _run(tmp_path / "run", steps=3, record=False)[0] as handle:
        state = handle.state_dict()
        with pytest.raises(ValueError, match="before the first step"):
            handle.load_state_dict(state)
        with pytest.raises(ValueError, match="Watch.state_dict"):
            handle.load_state_dict({"steps": 3})
        bad = dict(state, spikes=dict(state["spikes"], spread=-1.0))
        with pytest.raises(ValueError, match="spread"):
            handle.load_state_dict(bad)
        assert handle.steps == 3
