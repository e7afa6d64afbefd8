"""Telemetry's flush: lines formatted from columns read back exactly as :func:`runlog.num`
values; samples of a window in progress survive a flush; the producer may skip ``on_grads``
until ``next_sample``; the range figures equal a plain per-layer reference. Real fp16 on CPU."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from _runfolders import step_records as _records
from _telemetry_runs import data, mlp, train
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ampguard as ag
from ampguard import runlog
from ampguard.rules import _ranges
from ampguard.telemetry import _device

# ------------------------------------------------------------------------ number formatting
SPECIAL = [
    0.0,
    -0.0,
    1.0,
    65536.0,
    2.0**-24,
    1e-45,
    3.4028234663852886e38,
    123456789.0,
    0.1,
    -2.5e-7,
    1e16,
    float("nan"),
    float("inf"),
    -float("inf"),
]


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(SPECIAL)))
@settings(max_examples=200, deadline=None)
def test_number_texts_read_back_as_num_values(values):
    texts = runlog.number_texts(values)
    assert len(texts) == len(values)
    for value, text in zip(values, texts, strict=True):
        back = json.loads(text)
        expected = runlog.num(value)
        assert back == expected and type(back) is type(expected)  # a float stays a float


def test_number_texts_takes_arrays_of_any_shape():
    table = np.array([[1.5, np.nan], [np.inf, 2.0]], dtype=np.float32)
    assert runlog.number_texts(table) == ["1.5", "null", "null", "2.0"]


# ------------------------------------------------------- a flush in the middle of a window
def _fused_guard(run_dir, flush_hook: bool, **telemetry):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tel = ag.Telemetry(run_dir, **telemetry)
    guard = ag.Guard(model, opt, precision="fp16", telemetry=tel, accumulation_steps=2)
    if flush_hook:
        # the fused step runs between on_grads and on_step: a flush there meets a window whose
        # gradients are sampled and whose step is not recorded yet
        opt.register_step_pre_hook(lambda *_: tel.flush())
    return model, guard


def test_a_flush_between_sampling_and_step_keeps_the_windows_samples(tmp_path):
    settings = {"flush_every": 3, "layer_every": 1, "range_every": 2}
    runs = []
    for name, hook in (("plain", False), ("flushed", True)):
        model, guard = _fused_guard(tmp_path / name, hook, **settings)
        with guard:
            train(guard, model, 7, amp=1e2)
        runs.append(_records(tmp_path / name))
    plain, flushed = runs
    assert [r["step"] for r in flushed] == list(range(1, 8))
    assert flushed == plain  # the same records, whatever the flush points
    assert all("layers" in r for r in flushed)
    assert [r["step"] for r in flushed if "range" in r] == [2, 4, 6]


def test_a_public_flush_between_micro_batches_keeps_the_windows_loss(tmp_path):
    model = mlp()
    tel = ag.Telemetry(tmp_path, flush_every=4)
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        precision="fp16",
        telemetry=tel,
        accumulation_steps=3,
    )
    x, y = data()
    expected = []
    with guard:
        for _ in range(5):
            losses = []
            for k in range(3):
                with guard.autocast():
                    loss = nn.functional.mse_loss(model(x[k::3]).float(), y[k::3])
                losses.append(loss.item())
                guard.backward(loss)
                tel.flush()  # mid-window: the window's losses so far are carried
            guard.step()
            expected.append(sum(losses) / 3)
    got = [r["loss"] for r in _records(tmp_path)]
    assert got == pytest.approx(expected, rel=1e-6)


def test_norms_written_early_under_memory_pressure_give_the_same_records(tmp_path, monkeypatch):
    def run(name):
        model, guard = _fused_guard(tmp_path / name, False, flush_every=8, layer_every=1)
        with guard:
            train(guard, model, 12, amp=1e2, inject={5})
        return _records(tmp_path / name)

    kept = run("kept")
    monkeypatch.setattr(_device, "_HOLD", 1)  # every sample's norms are written at once
    assert run("early") == kept


# ------------------------------------------------------------ skipping on_grads until due
def test_the_guard_calls_on_grads_only_when_a_sample_is_due(tmp_path):
    model = mlp()
    tel = ag.Telemetry(tmp_path, layer_every=3, range_every=4, flush_every=5)
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), telemetry=tel)
    calls = []
    hook = tel.on_grads
    tel.on_grads = lambda step, scaled: (calls.append(step), hook(step, scaled))[1]
    with guard:
        train(guard, model, 13)
    assert calls == [3, 4, 6, 8, 9, 12]
    recs = _records(tmp_path)
    assert [r["step"] for r in recs if "layers" in r] == [3, 6, 9, 12]
    assert [r["step"] for r in recs if "range" in r] == [4, 8, 12]


def test_after_a_resume_to_an_earlier_step_samples_are_due_from_there(tmp_path):
    model = mlp()
    tel = ag.Telemetry(tmp_path, layer_every=3, range_every=0, flush_every=4)
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), telemetry=tel)
    with guard:
        train(guard, model, 4)
        saved = guard.state_dict()
        train(guard, model, 5)  # steps 5-9: samples at 6 and 9
        assert tel.next_sample == 12
        guard.load_state_dict(saved)  # back to step 4
        assert tel.next_sample == 6
        train(guard, model, 3)  # steps 5-7 again: a sample at 6
    run = runlog.load_run(tmp_path)  # the re-run steps replace the superseded ones
    assert run.layer_steps.tolist() == [3, 6]


# ---------------------------------------------------------------- range figures, reference
def _reference(hist: np.ndarray, amax: np.ndarray, scale: float) -> dict[str, list[float]]:
    """The range figures from their definitions, one layer and one bin at a time."""
    out: dict[str, list[float]] = {k: [] for k in ("headroom", "underflow", "safe_lo", "safe_hi")}

    def lowest(counts: list[float]) -> float:
        total = sum(counts)
        if total == 0:
            return math.nan
        seen = 0.0
        for b, count in enumerate(counts):  # bin b holds 2**(E_MIN + b) <= |g| < twice that
            seen += count
            if seen > (1 - _ranges.KEEP_FRACTION) * total + 1e-9:
                return 2.0 ** (-14 - (_ranges.E_MIN + b))
        return 2.0 ** (-14 - (_ranges.E_MAX + 1))

    for row, peak in zip(hist, amax, strict=True):
        counts = list(row[1:])
        total = sum(counts)
        lost = sum(c for b, c in enumerate(counts) if 2.0 ** (_ranges.E_MIN + b) * scale < 2.0**-14)
        out["underflow"].append(lost / total if total else 0.0)
        out["safe_lo"].append(lowest(counts))
        if not math.isfinite(peak):
            out["safe_hi"].append(math.nan)
            out["headroom"].append(math.nan)
        else:
            out["safe_hi"].append(_ranges.FP16_MAX / peak if peak > 0 else math.inf)
            out["headroom"].append(
                math.log2(_ranges.FP16_MAX / (peak * scale)) if peak > 0 else math.inf
            )
    highest = float(np.min(out["safe_hi"])) if len(hist) else math.inf  # NaN if any is NaN
    out["window"] = [lowest(list(hist[:, 1:].sum(axis=0))), highest]
    return out


@given(
    layers=st.integers(0, 4),
    seed=st.integers(0, 2**31),
    scale=st.sampled_from([1.0, 2.0**-8, 1024.0, 65536.0, 2.0**24]),
)
@settings(max_examples=150, deadline=None)
def test_range_figures_equal_their_definitions(layers, seed, scale):
    rng = np.random.default_rng(seed)
    hist = rng.integers(0, 9, size=(layers, _ranges.BINS)) * (
        rng.random((layers, _ranges.BINS)) < rng.random()
    )
    amax = rng.choice([0.0, 1e-6, 0.5, 3e4, 1e9, np.inf, np.nan], size=layers)
    got = _ranges.summarize(hist.astype(float), amax, scale)
    want = _reference(hist.astype(float), amax, scale)
    for key, name in (
        ("headroom_bits", "headroom"),
        ("underflow", "underflow"),
        ("safe_lo", "safe_lo"),
        ("safe_hi", "safe_hi"),
    ):
        np.testing.assert_allclose(got[key], want[name], rtol=1e-12, equal_nan=True)
    np.testing.assert_allclose(got["window"], want["window"], rtol=1e-12, equal_nan=True)


# ----------------------------------------------- precision and scaler changes reach the log
def test_records_follow_a_load_that_undoes_a_fallback(tmp_path):
    # Telemetry reads precision and scaler at attach, on_fallback and on_resume only
    model = mlp()
    tel = ag.Telemetry(tmp_path, flush_every=3)
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        precision="fp16",
        telemetry=tel,
        scaler=ag.ScalerConfig(init_scale=4.0, min_scale=4.0, on_collapse="fallback"),
    )
    with guard, pytest.warns(RuntimeWarning, match="switched precision"):
        train(guard, model, 2)
        saved = guard.state_dict()
        train(guard, model, 2, inject={3})  # a collapse at step 3: fp16 -> bf16
        assert guard.precision == "bf16"
        guard.load_state_dict(saved)  # back to step 2, fp16 with its scaler
        train(guard, model, 2)
    run = runlog.load_run(tmp_path)
    assert run.steps.tolist() == [1, 2, 3, 4]
    assert run.precision == ["fp16", "fp16", "fp16", "fp16"]
    assert run.scale.tolist() == [4.0, 4.0, 4.0, 4.0]
