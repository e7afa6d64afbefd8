"""Telemetry: device-side step records, deferred flush, JSONL/TensorBoard sinks, crash safety,
resume marks. Real fp16 training on CPU with tiny models."""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _telemetry_runs import DeadBranch, data, mlp, resumed, train
from torch import nn

import ampguard as ag
from ampguard import runlog
from ampguard.rules import _ranges
from ampguard.testing import SyncCounter


def make_guard(
    run_dir: Path | None,
    model: nn.Module | None = None,
    *,
    fused: bool = False,
    flush_every: int = 8,
    layer_every: int = 1,
    range_every: int = 4,
    **kwargs,
):
    model = model if model is not None else mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    tel = (
        None
        if run_dir is None
        else ag.Telemetry(
            run_dir, flush_every=flush_every, layer_every=layer_every, range_every=range_every
        )
    )
    return model, opt, ag.Guard(model, opt, precision="fp16", telemetry=tel, **kwargs)


def capture_grads(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list:
    """The gradients each optimizer.step sees (clones), in ``params`` order."""
    seen: list = []
    opt.register_step_pre_hook(
        lambda *_: seen.append(
            [None if p.grad is None else p.grad.detach().clone() for p in params]
        )
    )
    return seen


# ---------------------------------------------------------------------- what is recorded
def test_every_step_is_recorded_with_the_guards_flags(tmp_path):
    model, opt, guard = make_guard(tmp_path)
    with guard:
        results = train(guard, model, 20, amp=1e3, inject={12})
    run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == list(range(1, 21))
    assert run.applied.tolist() == [r.applied for r in results]
    assert run.overflow[11] and not run.applied[11]
    assert (run.scale_before[1:] == run.scale[:-1]).all()  # one continuous scale sequence


def test_scale_record_matches_guard_scale(tmp_path):
    model, opt, guard = make_guard(tmp_path)
    scales = []
    with guard:
        for _ in range(12):
            train(guard, model, 1, amp=1e3)
            scales.append(guard.scale)
    assert runlog.load_run(tmp_path).scale.tolist() == scales


@pytest.mark.parametrize(
    "fused,clip",
    [(False, None), (True, None), (False, 1.0)],
    ids=["foreach", "fused-scaled-grads", "clipped"],
)
def test_layer_norms_are_unscaled_and_match_the_gradients(tmp_path, fused, clip):
    model, opt, guard = make_guard(tmp_path, fused=fused, clip_grad_norm=clip)
    params = list(model.parameters())
    seen = capture_grads(opt, params)
    with guard:
        results = train(guard, model, 6)
    run = runlog.load_run(tmp_path)
    for k in range(6):
        grads = seen[k]
        if fused:  # the fused kernel unscales internally: the hook saw scaled gradients
            grads = [g / run.scale_before[k] for g in grads]
        per_layer = [
            math.sqrt(sum(float(g.double().square().sum()) for g in grads[i : i + 2]))
            for i in range(0, len(grads), 2)
        ]
        if clip is None:
            np.testing.assert_allclose(run.layer_norm[k], per_layer, rtol=1e-5)
        else:  # recorded before clipping: the total equals the Guard's pre-clip norm
            np.testing.assert_allclose(run.grad_norm[k], float(results[k].grad_norm), rtol=1e-5)


def test_zero_fraction_counts_exact_zeros_and_missing_gradients(tmp_path):
    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x * (torch.arange(16) % 2))  # odd input columns: weight grads 0

    model, opt, guard = make_guard(tmp_path, Partial(), range_every=1)
    with guard:
        train(guard, model, 3)
    run = runlog.load_run(tmp_path)
    assert run.layers == ["a", "unused"] and run.range_steps.tolist() == [1, 2, 3]
    # layer a: 64 weights (half of them see a zero input column) + 4 biases
    np.testing.assert_allclose(run.zero_frac[:, 0], 32 / 68, rtol=1e-6)
    np.testing.assert_allclose(run.zero_frac[:, 1], 1.0)  # never got a gradient
    np.testing.assert_allclose(run.layer_norm[:, 1], 0.0)


def test_loss_is_the_mean_over_the_windows_micro_batches(tmp_path):
    model, opt, guard = make_guard(tmp_path, accumulation_steps=2)
    x, y = data()
    losses = []
    with guard:
        for half in (x[:32], x[32:]):
            with guard.autocast():
                loss = nn.functional.mse_loss(model(half).float(), y[:32])
            losses.append(float(loss.detach()))
            guard.backward(loss)
            guard.step()
    assert runlog.load_run(tmp_path).loss[0] == pytest.approx(sum(losses) / 2, rel=1e-6)


def test_range_stats_match_a_direct_computation(tmp_path):
    model, opt, guard = make_guard(tmp_path, range_every=1)
    params = list(model.parameters())
    seen = capture_grads(opt, params)
    with guard:
        train(guard, model, 2, amp=1e-3)
    run = runlog.load_run(tmp_path)
    scale = run.range_scale[1]
    for j in range(len(run.layers)):
        g = torch.cat([t.reshape(-1) for t in seen[1][2 * j : 2 * j + 2]]).double().abs()
        nz = g[g > 0]
        assert run.amax[1, j] == pytest.approx(float(g.max()), rel=1e-6)
        assert run.headroom_bits[1, j] == pytest.approx(
            math.log2(_ranges.FP16_MAX / (float(g.max()) * scale)), rel=1e-5
        )
        below = float((nz * scale < _ranges.FP16_MIN_NORMAL).double().mean())
        assert run.underflow[1, j] == pytest.approx(below, abs=1e-6)
        lo = run.safe_lo[1, j]  # 99.9% of nonzeros normal at lo, not at lo / 2
        assert float((nz * lo < _ranges.FP16_MIN_NORMAL).double().mean()) <= 0.001
        assert float((nz * lo / 2 < _ranges.FP16_MIN_NORMAL).double().mean()) > 0.001
        assert run.safe_hi[1, j] == pytest.approx(_ranges.FP16_MAX / float(g.max()), rel=1e-6)


def test_dropped_micro_batches_are_recorded(tmp_path):
    model, opt, guard = make_guard(
        tmp_path, accumulation_steps=2, contain_nonfinite_microbatches=True
    )
    x, y = data()
    with guard:
        for amp in (1.0, float("inf")):  # the window's second micro-batch is non-finite
            with guard.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y) * amp
            guard.backward(loss)
            guard.step()
        counts = guard.telemetry.summary()
    run = runlog.load_run(tmp_path)
    assert run.dropped.tolist() == [1] and run.applied.tolist() == [True]
    assert counts["microbatches_dropped"] == 0  # summary reflects flushed steps only
    assert guard.telemetry.summary()["microbatches_dropped"] == 1


def test_fallback_is_recorded_as_an_event(tmp_path):
    model, opt, guard = make_guard(
        tmp_path, scaler=ag.ScalerConfig(init_scale=4.0, min_scale=4.0, on_collapse="fallback")
    )
    with guard, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        train(guard, model, 4, inject={1})
    run = runlog.load_run(tmp_path)
    assert run.fallbacks == [{"kind": "fallback", "step": 1, "from": "fp16", "to": "bf16"}]
    assert run.precision == ["fp16", "bf16", "bf16", "bf16"]
    assert run.scale[1:].tolist() == [1.0, 1.0, 1.0]


def test_skip_counts_and_recent_scales_come_from_flushed_records(tmp_path):
    model, opt, guard = make_guard(tmp_path)
    with guard:
        train(guard, model, 10, inject={3, 4})
        guard.telemetry.flush()
        tel = guard.telemetry
        assert tel.skip_counts() == {
            "overflow": 2,
            "dropped_microbatches": 0,
            "collapse": 0,
            "nonfinite": 0,
        }
        assert tel.recent_scales(3) == [(8, 16384.0), (9, 16384.0), (10, 16384.0)]
        assert tel.summary()["consecutive_skips"] == 0
        assert tel.summary()["scale_changes"] == 2


# ---------------------------------------------------------------------- no numerics, no syncs
@pytest.mark.parametrize(
    "fused,accumulation,clip", [(False, 1, None), (True, 1, None), (False, 2, 1.0)]
)
def test_parameters_are_bitwise_identical_with_and_without_telemetry(
    tmp_path, fused, accumulation, clip
):
    finals = []
    for run_dir in (None, tmp_path):
        model, opt, guard = make_guard(
            run_dir,
            fused=fused,
            range_every=1,
            accumulation_steps=accumulation,
            clip_grad_norm=clip,
        )
        train(guard, model, 12, amp=1e3, inject={5})
        guard.close()
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_telemetry_adds_no_host_sync_per_step(tmp_path, fused):
    counts = []
    for run_dir in (None, tmp_path):
        model, opt, guard = make_guard(run_dir, fused=fused, flush_every=5, range_every=3)
        per_step = []
        for _ in range(12):
            with SyncCounter() as c:
                train(guard, model, 1)
            per_step.append(c.count)
        counts.append(per_step)
        if run_dir is not None:
            assert guard.telemetry.flushes == 2  # steps 5 and 10 only
    assert counts[0] == counts[1]


def test_nothing_is_written_between_flushes(tmp_path):
    model, opt, guard = make_guard(tmp_path, flush_every=5)
    sizes = []
    for _ in range(12):
        train(guard, model, 1)
        sizes.append(len((tmp_path / "events.jsonl").read_text().splitlines()))
    assert sizes == [0, 0, 0, 0, 5, 5, 5, 5, 5, 10, 10, 10]
    guard.close()
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 12


# ---------------------------------------------------------------------- sinks and files
def test_meta_json_describes_the_run(tmp_path):
    model, opt, guard = make_guard(tmp_path, clip_grad_norm=1.0)
    with guard:
        train(guard, model, 2)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["layers"]["names"] == ["0", "2", "4"]
    assert meta["model"]["class"] == "Sequential" and meta["precision"] == "fp16"
    assert meta["torch_version"] == torch.__version__ and "start_time" in meta
    assert meta["scaler"]["init_scale"] == 65536.0 and meta["guard"]["clip_grad_norm"] == 1.0
    assert "end_time" in meta
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_every_line_is_strict_json(tmp_path):
    model, opt, guard = make_guard(tmp_path, range_every=1)
    with guard:
        train(guard, model, 6, inject={2})  # an overflow: non-finite norms become null
    for line in (tmp_path / "events.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))


def test_tensorboard_scalars_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    tel = ag.Telemetry(tmp_path, flush_every=4, layer_every=2, tensorboard=True)
    with ag.Guard(model, opt, precision="fp16", telemetry=tel) as guard:
        train(guard, model, 10, inject={3})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {
        "ampguard/scale",
        "ampguard/skip_rate",
        "ampguard/loss",
        "ampguard/grad_norm",
        "ampguard/layer_grad_norm/0",
    } <= set(tags)
    run = runlog.load_run(tmp_path)
    scale = acc.Scalars("ampguard/scale")
    assert [e.step for e in scale] == run.steps.tolist()
    assert [e.value for e in scale] == run.scale.tolist()
    assert acc.Scalars("ampguard/skip_rate")[2].value == pytest.approx(1 / 3)
    assert [e.step for e in acc.Scalars("ampguard/layer_grad_norm/0")] == [2, 4, 6, 8, 10]


# ---------------------------------------------------------------------- crash safety
_WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import ampguard as ag
    from _telemetry_runs import mlp, train
    torch.set_num_threads(1)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    guard = ag.Guard(model, opt, precision="fp16",
                     telemetry=ag.Telemetry({run_dir!r}, flush_every=5, range_every=2))
    while True:
        train(guard, model, 1)
        print(guard.telemetry.flushes, flush=True)
""")


@pytest.mark.slow  # SIGKILL of a writer process
@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_flushes", [1, 4])
def test_sigkill_mid_run_keeps_everything_up_to_the_last_flush(tmp_path, after_flushes):
    script = _WRITER.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
            line = proc.stdout.readline() if ready else ""
            if not line:
                pytest.fail("writer exited or hung before flushing")
            if int(line) >= after_flushes:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a torn last line is allowed
        run = runlog.load_run(tmp_path)
    n = len(run.steps)
    assert n >= 5 * after_flushes
    assert n % 5 == 0 or run.bad_lines == 1  # only a torn last line may be lost
    assert run.steps.tolist() == list(range(1, n + 1))
    assert run.range_steps.tolist() == list(range(2, n + 1, 2))


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    model, opt, guard = make_guard(tmp_path)
    with guard:
        train(guard, model, 8)
    events = tmp_path / "events.jsonl"
    data_ = events.read_bytes()
    events.write_bytes(data_[: len(data_) - 40])  # the last line loses its end
    with pytest.warns(RuntimeWarning, match="torn last line"):
        run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == list(range(1, 8)) and run.bad_lines == 1


def test_resuming_cuts_a_torn_tail_before_appending(tmp_path):
    resumed(tmp_path, restore_guard=True, before=8, after=0)
    events = tmp_path / "events.jsonl"
    events.write_bytes(events.read_bytes() + b'{"step": 9, "sca')  # killed mid-append
    model, opt, guard = make_guard(tmp_path, scaler=ag.ScalerConfig(growth_interval=1000))
    with pytest.warns(RuntimeWarning, match="torn last line"):
        ag.load_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, guard=guard)
    with guard:
        train(guard, model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == list(range(1, 11))


# ---------------------------------------------------------------------- resume
def test_resume_with_guard_state_continues_the_log(tmp_path):
    resumed(tmp_path, restore_guard=True, before=12, after=6)
    run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == list(range(1, 19))
    (mark,) = run.resumes
    assert mark["step"] == 12 and not mark["scale_reset"]
    assert mark["scale"] == mark["previous_scale"] == run.scale[11] == run.scale_before[12]


def test_resume_without_scaler_state_continues_the_step_count(tmp_path):
    with pytest.warns(RuntimeWarning, match="no loss-scaler state"):
        resumed(tmp_path, restore_guard=False, before=12, after=6)
    run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == list(range(1, 19))
    (mark,) = run.resumes
    assert mark["scale_reset"] and mark["scale"] == 65536.0 and run.scale_before[12] == 65536.0
    assert mark["previous_scale"] == run.scale[11] < 65536.0


def test_resume_drops_steps_logged_after_the_checkpoint(tmp_path):
    model, opt, guard = make_guard(tmp_path)
    with guard:
        train(guard, model, 5)
        ag.save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, guard=guard)
        train(guard, model, 4)  # steps 6-9 are lost with the crash and re-run
    model, opt, guard = make_guard(tmp_path)
    ag.load_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, guard=guard)
    with guard:
        train(guard, model, 6)
    run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == list(range(1, 12))
    assert [r["step"] for r in run.resumes] == [5]


def test_a_new_run_in_the_same_folder_starts_a_new_log(tmp_path):
    model, opt, guard = make_guard(tmp_path)
    with guard:
        train(guard, model, 6)
    model, opt, guard = make_guard(tmp_path)
    with guard:
        train(guard, model, 3)
    run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == [1, 2, 3] and run.resumes == []
    assert len((tmp_path / "events.jsonl.prev").read_text().splitlines()) == 6


def test_the_context_manager_flushes_when_training_raises(tmp_path):
    model, opt, guard = make_guard(tmp_path, scaler=ag.ScalerConfig(init_scale=2.0, min_scale=2.0))
    with pytest.raises(ag.ScaleCollapseError), guard:
        train(guard, model, 5, inject={3})
    run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == [1, 2, 3] and bool(run.collapse[2])
    assert json.loads((tmp_path / "findings.json").read_text())[0]["code"] == "AG101"


# ---------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"flush_every": 0}, "flush_every"),
        ({"layer_every": 1.5}, "layer_every"),
        ({"range_every": -1}, "range_every"),
        ({"flush_every": True}, "flush_every"),
    ],
)
def test_bad_numbers_name_the_argument(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ag.Telemetry(tmp_path, **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"layer_stats": 1}, "layer_stats"),
        ({"tensorboard": "yes"}, "tensorboard"),
        ({"resume": None}, "resume"),
    ],
)
def test_bad_flags_name_the_argument(tmp_path, kwargs, match):
    with pytest.raises(TypeError, match=match):
        ag.Telemetry(tmp_path, **kwargs)


def test_run_dir_must_be_a_path():
    with pytest.raises(TypeError, match="run_dir"):
        ag.Telemetry(42)


def test_guard_rejects_a_telemetry_of_the_wrong_type():
    model = mlp()
    with pytest.raises(TypeError, match="telemetry must be"):
        ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), telemetry=42)


def test_a_telemetry_serves_one_guard(tmp_path):
    tel = ag.Telemetry(tmp_path)
    model = mlp()
    ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), telemetry=tel)
    with pytest.raises(ValueError, match="already attached"):
        ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), telemetry=tel)


def test_findings_without_telemetry_say_the_rules_need_it():
    model, opt, guard = make_guard(None)  # without telemetry: no error, an empty list and a warning
    with pytest.warns(RuntimeWarning, match="telemetry=RUN_DIR"):
        assert guard.findings() == []


def test_layer_stats_off_keeps_the_total_norm_only(tmp_path):
    model = DeadBranch()
    opt = torch.optim.AdamW(model.parameters())
    tel = ag.Telemetry(tmp_path, layer_stats=False, layer_every=2, range_every=0)
    with ag.Guard(model, opt, precision="fp16", telemetry=tel) as guard:
        train(guard, model, 4)
    lines = [json.loads(s) for s in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [("grad_norm" in r, "layers" in r, "range" in r) for r in lines] == [
        (False, False, False),
        (True, False, False),
    ] * 2


def test_bf16_runs_are_recorded_without_a_scaler(tmp_path):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    tel = ag.Telemetry(tmp_path, layer_every=1, range_every=2)
    with ag.Guard(model, opt, precision="bf16", telemetry=tel) as guard:
        train(guard, model, 4, amp=1e-4)  # tiny gradients: fp16 would underflow, bf16 does not
        assert guard.findings() == []  # the fp16 range rules judge fp16 steps only
    run = runlog.load_run(tmp_path)
    assert run.precision == ["bf16"] * 4 and run.scale.tolist() == [1.0] * 4
    assert run.applied.all() and run.range_steps.tolist() == [2, 4]
    assert (run.underflow > 0.5).all()  # what fp16 at scale 1 would do to them


# ---------------------------------------------------------------------- the producer contract
def test_guard_and_watch_are_telemetry_sources_and_telemetry_never_writes_them(tmp_path):
    from ampguard.integrations.watch import WatchSource
    from ampguard.telemetry.source import ScalerDescription, ScaleSource, TelemetrySource

    model = nn.Linear(4, 4)
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        telemetry=tmp_path / "g",
    )
    assert isinstance(guard, TelemetrySource)
    assert isinstance(guard.loss_scaler, ScaleSource)
    assert isinstance(guard.scaler_config, ScalerDescription)
    assert guard.params == list(model.parameters()) and guard.device == torch.device("cpu")
    assert guard.requested_precision == "fp16"
    scaler = torch.amp.GradScaler("cpu")
    with ag.watch(
        scaler, model, torch.optim.SGD(model.parameters(), lr=0.1), telemetry=tmp_path / "w"
    ) as handle:
        assert isinstance(handle.source, WatchSource)
        assert isinstance(handle.source, TelemetrySource)
        assert isinstance(handle.source.loss_scaler, ScaleSource)
    # on_resume hands the step count back instead of setting it on the producer
    tel = guard.telemetry
    resumed = tel.on_resume(7, False, None)
    assert resumed.step == 7 and guard.steps == 0
    guard.close()
