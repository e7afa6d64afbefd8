"""`ampguard demo` end to end (short setting)."""

import json

import pytest
import torch

import ampguard as ag
from ampguard.cli import main
from ampguard.demo import build_model, run_demo
from ampguard.demo.data import make_data


def test_demo_skips_the_outlier_burst_and_learns(tmp_path):
    result = run_demo(steps=60, out=tmp_path / "run", progress=False, quiet=True)
    assert result.precision == "fp16"
    assert result.spike_steps == (24, 25, 26)
    assert set(result.spike_steps) <= set(result.skipped)
    assert result.scale_min < result.scale_start  # the scale backed off
    assert result.loss_after < result.loss_before
    assert result.checkpoint.is_file()
    assert result.report is not None and result.report.is_file()
    for name in ("events.jsonl", "meta.json", "findings.json"):
        assert (tmp_path / "run" / name).is_file()
    # the forensics diagnosis survives ag.report re-deriving findings.json from the run log
    codes = [f["code"] for f in json.loads((tmp_path / "run" / "findings.json").read_text())]
    assert "AG301" in codes
    assert "AG301" in result.report.read_text()


@pytest.mark.slow  # the demo end to end, twice
def test_demo_checkpoint_resumes(tmp_path):
    result = run_demo(steps=30, out=tmp_path, progress=False, quiet=True)
    data = make_data(steps=30)
    model = build_model(data, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = ag.Guard(model, opt, precision="fp16", scaler=ag.ScalerConfig(growth_interval=50))
    extra = ag.load_checkpoint(result.checkpoint, model=model, optimizer=opt, guard=guard)
    assert extra == {"seed": 0}
    assert guard.steps == 30
    assert guard.scale == result.scale_end


@pytest.mark.slow  # the demo end to end through the CLI
def test_cli_demo_prints_summary_ending_with_outputs(tmp_path, capsys):
    assert main(["demo", "--steps", "40", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "skipped steps:" in out
    assert "outlier batch" in out
    assert "AG301" in out  # forensics replayed the overflowing step and named the module
    assert out.rstrip().splitlines()[-1].strip().startswith(("report:", "checkpoint:"))


def test_cli_demo_rejects_a_bad_step_count_as_a_usage_error(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", "0"])
    assert exit_info.value.code == 2
    assert "--steps: must be an integer >= 1" in capsys.readouterr().err


def test_a_precision_without_a_loss_scale_prints_no_scale_history(tmp_path):
    # bf16 (and mxfp8, nvfp4) have no loss scale: the summary says so instead of "1 -> 1" and an
    # empty list of recent scales, and a skip is not "scale backed off"
    from ampguard.demo._run import DemoResult, summary

    common = dict(
        steps=10,
        spike_steps=(4,),
        scale_start=1.0,
        scale_end=1.0,
        scale_min=1.0,
        loss_before=1.0,
        loss_after=0.5,
        seconds=1.0,
        run_dir=tmp_path,
        checkpoint=tmp_path / "c.pt",
        diagnostics={
            "scale_changes": 0,
            "consecutive_skips": 0,
            "microbatches_dropped": 0,
            "fallbacks": [],
            "last_scales": [],
        },
    )
    text = summary(DemoResult(precision="bf16", skipped=[4], **common))
    assert "loss scale:        none (bf16 needs no loss scale)" in text
    assert (
        "step 4: outlier batch (inputs x4096): non-finite gradients in bf16; step skipped\n" in text
    )
    assert "last scales" not in text and "backed off" not in text and "1 -> 1" not in text
    scaled = summary(DemoResult(precision="fp16", skipped=[4], **common))
    assert "loss scale:        1 -> 1 (lowest after a skip: 1)" in scaled
    assert "last scales (step: scale)" in scaled and "scale backed off" in scaled
