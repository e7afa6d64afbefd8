"""Attach mode keeps the Guard's flight recorder and spike policy: real CPU loops under
``ag.watch`` (a ``torch.amp.GradScaler`` loop and a scaler-free bf16/fp32 loop) with a planted
loss spike (one batch with a few outlier samples scaled up), checking that the spike is
detected (AG180), skipped where asked (the weights are those of the step before), warned
otherwise, dumped into the run folder and read by ``ampguard postmortem``; bad ``on_spike``
values get the Guard's errors; ``ag.triage`` on an attached run.

The framework integrations (HF Trainer, Lightning, Accelerate, DeepSpeed) are in
``tests/test_integrations_spikes.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ampguard as ag
from ampguard.telemetry import Telemetry

SPIKE = 60  # the planted spike's window (after the detector's 50-window warm-up)
STEPS = 64


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def batch_of(step: int, spike_at: int | None = SPIKE) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed learnable task; window ``spike_at``'s batch has three outlier samples."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    y = (x @ torch.linspace(-1, 1, 64).reshape(16, 4)).argmax(dim=1)
    if step == spike_at:
        x[:3] *= 50.0
        y[:3] = (y[:3] + 1) % 4
    return x, y


def model_of() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _telemetry(run) -> Telemetry:
    return Telemetry(run, flush_every=16)


def _loop(run, *, scaled=True, fused=False, spike_at=SPIKE, steps=STEPS, batches=False, **kw):
    """Train ``steps`` windows under ``ag.watch``; returns (handle, weights after each window)."""
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
    precision = None if scaled else "bf16"
    handle = ag.watch(scaler, model, opt, _telemetry(run), precision=precision, **kw)
    weights = {0: [p.detach().clone() for p in model.parameters()]}
    with handle:
        for step in range(1, steps + 1):
            batch = batch_of(step, spike_at)
            if batches:
                handle.record_batch(batch, loss_fn)
            with torch.autocast("cpu", dtype=torch.float16 if scaled else torch.bfloat16):
                loss = loss_fn(model, batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                handle.record_loss(loss)
                loss.backward()
                opt.step()
            opt.zero_grad()
            weights[step] = [p.detach().clone() for p in model.parameters()]
    return handle, weights


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _spikes(handle) -> list[int]:
    return [f.step for f in handle.findings() if f.code == "AG180"]


@pytest.mark.parametrize(
    ("scaled", "fused"),
    [(True, False), (True, True), (False, False), (False, True)],
    ids=["scaler", "fused", "bf16", "bf16-fused"],
)
def test_skip_keeps_the_spiked_step_out_of_the_weights(tmp_path, scaled, fused) -> None:
    handle, weights = _loop(tmp_path / "run", scaled=scaled, fused=fused, on_spike="skip")
    assert _spikes(handle) == [SPIKE]
    assert _same(weights[SPIKE], weights[SPIKE - 1])  # the spiked update was not applied
    assert not _same(weights[SPIKE + 1], weights[SPIKE])  # training went on
    event = handle.flight_recorder.events[0]
    assert event.step == SPIKE and event.action == "skip" and event.ratio > 1.3
    from _runfolders import step_records

    rec = {r["step"]: r for r in step_records(tmp_path / "run")}
    assert not rec[SPIKE]["applied"] and rec[SPIKE - 1]["applied"] and rec[SPIKE + 1]["applied"]
    if scaled:  # a spike is not an overflow: the scale did not back off for it
        assert rec[SPIKE + 1]["scale"] == rec[SPIKE]["scale"]


def test_warn_applies_the_step_and_says_so(tmp_path) -> None:
    with pytest.warns(RuntimeWarning, match=f"loss spike at step {SPIKE}.*the step was applied"):
        handle, weights = _loop(tmp_path / "run")  # on_spike="warn" is the default
    assert _spikes(handle) == [SPIKE]
    assert not _same(weights[SPIKE], weights[SPIKE - 1])


def test_clean_run_detects_nothing(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        handle, _ = _loop(tmp_path / "run", spike_at=None, on_spike="skip")
    assert _spikes(handle) == []
    assert not (tmp_path / "run" / "flight_recorder").exists()


def test_raise_stops_at_the_spike_with_the_step_skipped(tmp_path) -> None:
    with pytest.raises(ag.LossSpikeError) as err:
        _loop(tmp_path / "run", on_spike="raise")
    assert err.value.step == SPIKE


def test_rewind_is_checked_as_the_guard_does_and_skips_with_a_warning(tmp_path) -> None:
    with pytest.warns(RuntimeWarning, match="attach mode cannot rewind"):
        handle, weights = _loop(tmp_path / "run", on_spike="rewind")
    assert _same(weights[SPIKE], weights[SPIKE - 1])
    assert handle.flight_recorder.events[0].action == "skip"


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"on_spike": "ignore"}, ValueError, "on_spike must be None, 'warn', 'skip', 'rewind'"),
        ({"flight_recorder": 3}, ValueError, r"flight_recorder must be a number of windows"),
        ({"flight_recorder": "yes"}, TypeError, "flight_recorder must be an int"),
        ({"snapshot_every": 0}, ValueError, r"snapshot_every must be in \[1,"),
        ({"signatures": -1}, ValueError, "signatures must be True"),
    ],
)
def test_bad_options_get_the_guards_errors_and_change_nothing(tmp_path, kw, exc, match) -> None:
    model = model_of()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(exc, match=match):
        ag.watch(scaler, model, opt, tmp_path / "run", **kw)
    assert not (tmp_path / "run").exists()
    with ag.watch(scaler, model, opt, tmp_path / "ok"):  # nothing was left attached
        pass


def test_dump_is_in_the_run_folder_and_postmortem_reads_it(tmp_path, capsys) -> None:
    from ampguard.cli._main import main

    run = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="loss spike"):
        _loop(run)
    dump = run / "flight_recorder" / "rank0.json"
    assert dump.is_file() and not list(dump.parent.glob("*.tmp"))
    assert main(["postmortem", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"first: rank 0, step {SPIKE}: loss spike" in out


def test_the_recorder_adds_no_host_sync_per_step(tmp_path) -> None:
    from ampguard.testing import SyncCounter

    def run(**kw) -> int:
        model = model_of()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with ag.watch(scaler, model, opt, Telemetry(tmp_path / str(kw), flush_every=1000), **kw):
            for step in range(1, 20):
                scaler.scale(loss_fn(model, batch_of(step, None))).backward()
                with SyncCounter() as counter:
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
        return counter.count

    assert run(on_spike="skip") == run(flight_recorder=False, on_spike=None)


def test_a_fused_optimizer_without_scaler_skips_on_the_device(tmp_path) -> None:
    """Without a scaler a fused optimizer gets the spike flag as its found_inf: no host sync."""
    from ampguard.testing import SyncCounter

    counts = {}
    for name, kw in (("skip", {"on_spike": "skip"}), ("off", {"flight_recorder": False})):
        model = model_of()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        tel = Telemetry(tmp_path / name, flush_every=1000)
        with ag.watch(None, model, opt, tel, precision="fp32", **kw) as handle:
            for step in range(1, 20):
                loss = loss_fn(model, batch_of(step, None))
                handle.record_loss(loss)
                loss.backward()
                with SyncCounter() as counter:
                    opt.step()
                opt.zero_grad()
        counts[name] = counter.count
    assert counts["skip"] == counts["off"] == 0


def test_triage_needs_signatures_and_batches_and_says_which(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle, _ = _loop(tmp_path / "a", steps=4, spike_at=None)
    with pytest.raises(ValueError, match=r"ag.watch\(\.\.\., signatures=True\)"):
        ag.triage(handle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle, _ = _loop(tmp_path / "b", steps=4, spike_at=None, signatures=True)
    with pytest.raises(ValueError, match=r"handle.record_batch\(batch, loss_fn\)"):
        ag.triage(handle)


@pytest.mark.parametrize("scaled", [True, False], ids=["fp16", "bf16"])
def test_triage_of_a_skipped_spike_on_an_attached_loop(tmp_path, scaled) -> None:
    handle, _ = _loop(
        tmp_path / "run", scaled=scaled, steps=SPIKE, on_spike="skip", signatures=True, batches=True
    )
    events = ag.triage(handle)
    assert [e.step for e in events] == [SPIKE - 1]  # numbered by handle.steps at its forward
    assert events[0].cause == "model_or_data"  # the outlier batch spikes in fp32 as well
    assert (tmp_path / "run" / "triage" / "rank0.json").is_file()


@pytest.mark.parametrize("scaled", [True, False], ids=["scaler", "bf16"])
def test_skip_mode_changes_no_number_on_a_clean_run(tmp_path, scaled) -> None:
    """Armed to skip, a run without a spike is bitwise the bare loop's (the fold and the
    wrapper call through unchanged)."""

    def bare() -> list[torch.Tensor]:
        model = model_of()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
        for step in range(1, STEPS + 1):
            batch = batch_of(step, None)  # outside autocast, as _loop makes it
            with torch.autocast("cpu", dtype=torch.float16 if scaled else torch.bfloat16):
                loss = loss_fn(model, batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()]

    _, weights = _loop(tmp_path / "run", scaled=scaled, spike_at=None, on_spike="skip")
    assert _same(weights[STEPS], bare())


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_a_closure_step_is_run_once_and_skipped_at_the_spike(tmp_path, keyword) -> None:
    model = model_of()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    calls = []
    after = {}
    with ag.watch(None, model, opt, _telemetry(tmp_path / "run"), precision="fp32",
                  on_spike="skip") as handle:  # fmt: skip
        for step in range(1, STEPS + 1):

            def closure(step=step):
                calls.append(step)
                opt.zero_grad()
                loss = loss_fn(model, batch_of(step))
                handle.record_loss(loss)
                loss.backward()
                return loss

            out = opt.step(closure=closure) if keyword else opt.step(closure)
            assert isinstance(out, torch.Tensor)  # the closure's loss, as optimizers return it
            after[step] = [p.detach().clone() for p in model.parameters()]
    assert calls == list(range(1, STEPS + 1))  # each closure ran once
    assert _same(after[SPIKE], after[SPIKE - 1]) and _spikes(handle) == [SPIKE]
    assert "step" not in opt.__dict__  # the wrapper is gone after close


def test_a_loop_that_records_no_loss_leaves_the_ring_empty(tmp_path) -> None:
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ag.watch(None, model, opt, _telemetry(tmp_path / "run"), precision="fp32") as handle:
        for step in range(1, 12):
            loss_fn(model, batch_of(step, None)).backward()  # record_loss never called
            opt.step()
            opt.zero_grad()
    assert handle.steps == 11 and handle.flight_recorder.ring.rows() == []
    with pytest.raises(ValueError, match="needs the flight recorder"):
        with ag.watch(None, model, opt, tmp_path / "b", precision="fp32", on_spike=None,
                      flight_recorder=False, signatures=True) as off:  # fmt: skip
            pass
        ag.triage(off)
