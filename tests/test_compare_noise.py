"""ag.compare's fp8 verdict when bf16's run-to-run noise cannot be measured: a factory that
reseeds itself makes the two bf16 runs bitwise equal. compare says that no noise was measured
and why, and never judges fp8 against a tolerance below fp8's own rounding cost."""

from __future__ import annotations

import pytest
import torch
from test_fp8 import NOISY, _compare_factory

import ampguard as ag

pytest.importorskip("torchao")


def _reseeding(value: float):
    inner = _compare_factory(value, **NOISY)

    def make() -> ag.Experiment:
        torch.manual_seed(0)  # the factory seeds itself: compare's seed + 1 changes nothing
        return inner()

    return make


def test_identical_reference_runs_are_detected_and_said():
    cmp = ag.compare(_reseeding(0.0), steps=40, variants=["fp8"], progress=False)
    info = cmp.extra["fp8"]
    assert info["bf16_noise"] is None and info["noise_measured"] is False
    assert "bitwise equal" in info["noise_reason"] and "seed" in info["noise_reason"]
    assert "no run-to-run noise was measured" in cmp.summary()
    assert info["tolerance"] >= info["rounding_floor"] > 0


def test_a_healthy_model_passes_when_no_noise_was_measured():
    cmp = ag.compare(_reseeding(0.0), steps=40, variants=["fp8"], progress=False)
    assert cmp.extra["fp8"]["verdict"] == "fp8_ok", cmp.summary()
    assert "Train in bf16" not in cmp.fix


def test_a_planted_outlier_still_fails_when_no_noise_was_measured():
    cmp = ag.compare(_reseeding(1e5), steps=40, variants=["fp8", "fp8_planned"], progress=False)
    assert cmp.extra["fp8"]["verdict"] == "fp8_keep_layers", cmp.summary()
